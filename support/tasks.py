"""Evaluation data: RULER-style synthetic tasks and natural text (scored in engine/metrics.py).

The data side of `evaluate.py` (docs/protocol.md). Everything here is a pure function of its
arguments: no download, no global random state, one `random.Random` per sample.

1. RULER-style generators (Hsieh et al., "RULER", 2024; NVIDIA/RULER `scripts/data/synthetic/`
   `niah.py`, `variable_tracking.py`, `freq_words_extraction.py`, `common_words_extraction.py`,
   templates from `constants.py`, task settings from `scripts/synthetic.yaml`). Each one is
   `gen(tokenizer, target_tokens, seed, index) -> Sample`; its prompt is RULER's template followed
   by RULER's answer prefix (`prepare.py` appends it), for a base model (no chat template).
   Departures from RULER, all **[choice]**:
   - length: the *prompt* holds at most `target_tokens` tokens (RULER fits prompt + the tokens to
     generate to `max_seq_length`). The haystack is counted in words (one noise/essay word, one
     coded word, one listed word; one whole line for the needle haystack), so the binary search
     lands within a word of the target, not within one 18-word noise line as in RULER;
   - text: RULER's Paul Graham essays are replaced by Python's own `pydoc_data.topics`, and the
     `wonderwords` word lists by the words of that text; sentences are split by a regex, not NLTK;
   - needle depths are drawn once per sample as fractions, so growing the haystack during the
     search moves nothing else (RULER redraws everything at every size).
2. Natural text for the fidelity suite and for calibration, from `pydoc_data.topics`: topics in
   sorted key order, even positions = the *test* split (the reported tables), odd positions =
   the *dev* split (calibration and the choice of every default): calibrate.py never sees a
   passage that a test run scores. That module is the running
   Python's own documentation, so prompts are reproducible for one Python version (3.11 here).
LongBench files (the official prompts, lengths and loader) are in engine/longbench.py.
"""
from __future__ import annotations

import functools
import math
import random
import re
import string
import uuid
import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

from support.errors import UsageError


@dataclass
class Sample:
    """One evaluation item: what to feed the model, how long to generate, how to score it."""
    task: str                  # RULER task name or LongBench dataset name
    index: int
    # the whole text given to the model (RULER: ends with the answer prefix)
    prompt: str
    answers: list              # reference strings
    metric: str                # a key of metrics.METRICS
    max_new_tokens: int        # RULER tokens_to_generate / LongBench dataset2maxlen
    gold: str = ""             # one correct continuation of the prompt (answer-fidelity suite)
    n_tokens: int = 0          # prompt length with the tokenizer it was built with
    all_classes: Optional[list] = None   # LongBench classification datasets (trec)
    chat_template: bool = False  # LongBench pred.py wraps this dataset in the chat template
    stop_at_newline: bool = False  # LongBench pred.py: samsum also stops at "\n"
    templated: bool = False    # prompt was rendered by the chat template: it holds its own
                               # special tokens (encode with add_special_tokens=False)
    prefix: str = ""           # prompt = prefix + context + question (engine/protocols.py):
    question: str = ""         # the instruction before the context and the query after it
    asks: tuple = ()           # later questions on the same context (Ask): multi-question reuse
    unsplit: str = ""          # why the prompt cannot be split at its question (protocols.split
                               # refuses it): a LongBench middle truncation that cut into it


@dataclass(frozen=True)
class Ask:
    """A later question on a sample's context: prefix + context + question is its own prompt."""
    question: str
    answers: list
    gold: str


# ----------------------------------------------------------------------------- text source

SPLITS = ("dev", "test")


@functools.lru_cache(maxsize=None)
def source_text(split: str) -> str:
    """`pydoc_data.topics` as one text: 'test' = topics at even positions of the sorted keys,
    'dev' = odd positions (calibration and every choice of a default read only 'dev'; the
    reported tables read 'test'). Some paragraphs are repeated across topics: 'dev' leaves out
    every paragraph that also occurs in 'test' (22 % of its characters), so no test passage is
    ever seen while calibrating. reST heading underlines (`*****`, `=====`) are dropped."""
    from pydoc_data.topics import topics
    keys = sorted(topics)

    def clean(ks):
        """The topics ks joined by blank lines, reST heading underlines dropped."""
        return re.sub(r"(?m)^[ \t]*([*=\-~^])\1{2,}[ \t]*\n", "",
                      "\n\n".join(topics[k].strip() for k in ks))
    test = clean(keys[0::2])
    if split == "test":
        return test
    seen = set(test.split("\n\n"))
    return "\n\n".join(p for p in clean(keys[1::2]).split("\n\n") if p not in seen)


def word_pool() -> list:
    """Distinct lowercase words of 4-12 letters in all of `pydoc_data.topics`, sorted (~2,500):
    our stand-in for RULER's `wonderwords` noun/adjective/verb lists (vocabulary, not passages)."""
    from pydoc_data.topics import topics
    return sorted(set(re.findall(r"\b[a-z]{4,12}\b", " ".join(topics[k] for k in sorted(topics)))))


def _split_bos(tok, ids: list):
    """(prefix, rest) of token ids: the tokenizer's leading BOS if it adds one (Llama-3 does)."""
    bos = getattr(tok, "bos_id", None)
    return (ids[:1], ids[1:]) if bos is not None and ids[:1] == [bos] else ([], ids)


def _body(tok, text: str):
    """(prefix, ids) of a text: its leading BOS if the tokenizer adds one, and the rest."""
    return _split_bos(tok, tok.encode(text))


def _window(tok, split, prompt_tokens, cont_tokens, seed, index):
    prefix, ids = _body(tok, source_text(split))
    n_body = prompt_tokens - len(prefix)                 # the prompt holds exactly prompt_tokens
    need = n_body + cont_tokens
    if n_body < 1 or cont_tokens < 0 or need > len(ids):
        raise UsageError(f"cannot cut {prompt_tokens}+{cont_tokens} tokens from the {split} text "
                         f"of pydoc_data.topics ({len(ids)} tokens with this tokenizer)")
    # consecutive indexes take consecutive windows from a seeded offset, so one pass through the
    # text (index < len(ids) // need) gives disjoint passages; later indexes wrap around, shifted
    start = (random.Random(f"{split}/{seed}").randrange(len(ids)) + index * need) % (
        len(ids) - need + 1
    )
    window = ids[start:start + need]
    return prefix + window[:n_body], window[n_body:]


def fidelity_text(tok, prompt_tokens: int, cont_tokens: int, seed: int = 0, index: int = 0,
                  split: str = "test"):
    """(prompt_ids, continuation_ids) from one split of `pydoc_data.topics`: a passage of exactly
    `prompt_tokens` tokens (BOS included when the tokenizer adds one) and the `cont_tokens`
    tokens of real text that follow it, for teacher forcing (docs/protocol.md, fidelity)."""
    return _window(tok, split, prompt_tokens, cont_tokens, seed, index)


def calibration_texts(tok, n: int, prompt_tokens: int, cont_tokens: int, seed: int = 0) -> list:
    """n (prompt_ids, continuation_ids) pairs like `fidelity_text` from the *dev* half (odd
    sorted topics): disjoint from every test passage (docs/protocol.md: calibration set, dev and
    test)."""
    return [_window(tok, "dev", prompt_tokens, cont_tokens, seed, i) for i in range(n)]


def calibration_needles(tok, n: int, prompt_tokens: int, seed: int = 0) -> list:
    """n (prompt_ids, gold_answer_ids) pairs of *dev* `niah_single_1` prompts (RULER seed =
    `seed`; the test split's needles use seed + 1,000), for a calibration that sees retrieval
    (calibrate.py --needles)."""
    out = []
    for i in range(n):
        s = RULER_TASKS["niah_single_1"](tok, prompt_tokens, ruler_seed("dev", seed), i)
        ids = tok.encode(s.prompt)
        out.append((ids, tok.encode(s.prompt + s.gold)[len(ids):]))
    return out


FACT = "The special magic number for {key} is: {value}."
FACT_QUESTION = ("\n\nWhat is the special magic number for {key} mentioned in the provided text? "
                 "The special magic number for {key} mentioned in the provided text is")


def calibration_facts(tok, n: int, prompt_tokens: int, seed: int = 0, n_facts: int = 4,
                      first_index: int = 2) -> list:
    """n retrieval probes (prompt_ids, answer_ids) made of *dev* text only: a dev passage (the
    windows `calibration_texts` would take next, index first_index, first_index + 1, ...; the
    calibration texts take 0, 1) with n_facts keyed facts (FACT: a word-pair key, a 7-digit
    value, as RULER's niah_single_1 needle) planted at line boundaries drawn from the seed, then
    a question about one of them in RULER's wording (FACT_QUESTION); the answer is " {value}.".
    Each prompt holds at most prompt_tokens tokens; the passage is cut to fit."""
    pool, out = word_pool(), []
    for i in range(n):
        rng = random.Random(f"facts/{seed}/{i}")
        keys = [f"{rng.choice(pool)}-{rng.choice(pool)}" for _ in range(n_facts)]
        values = [str(rng.randint(10 ** 6, 10 ** 7 - 1)) for _ in keys]
        asked = rng.randrange(n_facts)
        fractions = [rng.random() for _ in keys]
        question = FACT_QUESTION.format(key=keys[asked])
        n_body = prompt_tokens
        while True:
            prefix, body = _split_bos(tok, _window(tok, "dev", n_body, 0, seed, first_index + i)[0])
            lines = tok.decode(body).split("\n")
            facts = [FACT.format(key=k, value=v) for k, v in zip(keys, values)]
            ids = prefix + _body(tok, "\n".join(_insert(lines, facts, fractions)) + question)[1]
            if len(ids) <= prompt_tokens:
                break
            n_body -= len(ids) - prompt_tokens
        full = tok.encode(tok.decode(ids) + f" {values[asked]}.")
        answer = full[len(ids):] if full[:len(ids)] == ids else _body(tok, f" {values[asked]}.")[1]
        out.append((ids, answer))
    return out


def ruler_seed(split: str, seed: int) -> int:
    """RULER-style samples: dev uses the seed as given, test the seed + 1000 (other needles,
    keys and depths than any dev run with seeds below 1000)."""
    return seed if split == "dev" else seed + 1000


# ----------------------------------------------------------------------------- fitting

def fit(tok, target: int, build: Callable, task: str, n_min: int = 1, n_max: int = None):
    """Largest haystack size n with len(encode(build(n)[0])) <= target, by doubling then
    bisection (RULER `generate_samples`). build(n) -> (prompt, answers, gold, (prefix, question));
    returns (n, n_tokens)."""
    def length(n):
        return len(tok.encode(build(n)[0]))
    if length(n_min) > target:
        raise UsageError(
            f"{task}: {target} tokens is too short, the smallest prompt has {length(n_min)}"
        )
    lo, hi = n_min, n_min * 2                        # double hi until it overflows the target,
    # then bisect: length(lo) <= target < length(hi)
    while length(hi) <= target:
        if n_max is not None and hi >= n_max:
            raise UsageError(f"{task}: its word pool fills only {length(n_max)} of {target} tokens")
        lo, hi = hi, hi * 2 if n_max is None else min(hi * 2, n_max)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if length(mid) <= target else (lo, mid)
    return lo, length(lo)


def _sample(task, index, tok, target, build, metric, max_new, **kw) -> Sample:
    """build(n) -> (prompt, answers, gold, (prefix, question)): the fitted Sample."""
    n, n_tokens = fit(tok, target, build, task, **kw)
    prompt, answers, gold, (prefix, question) = build(n)
    assert prompt.startswith(prefix) and prompt.endswith(question)
    return Sample(task, index, prompt, answers, metric, max_new, gold=gold, n_tokens=n_tokens,
                  prefix=prefix, question=question)


def around(template: str, **fields) -> tuple:
    """(prefix, question) of a template: its text before and after `{context}`, filled."""
    return tuple(template.format(context="\0", **fields).split("\0"))


# ----------------------------------------------------------------------------- RULER: needles

# RULER scripts/data/synthetic/constants.py (TASKS['niah']); prepare.py appends the answer prefix.
NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure "
    "to memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
    "What are all the special magic {type_needle_v} for {query} mentioned in the provided "
    "text? The special magic {type_needle_v} for {query} mentioned in the provided text are"
)
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."       # niah.py
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DEPTHS = [round(100 * i / 39) for i in range(40)]    # niah.py: np.round(np.linspace(0, 100, 40))

# RULER scripts/synthetic.yaml; k/v/q = num_needle_k/v/q
NIAH = {
    "niah_single_1": dict(haystack="noise", key="words", value="numbers", k=1, v=1, q=1),
    "niah_multikey_3": dict(haystack="needle", key="uuids", value="uuids", k=1, v=1, q=1),
    "niah_multivalue": dict(haystack="essay", key="words", value="numbers", k=1, v=4, q=1),
    "niah_multiquery": dict(haystack="essay", key="words", value="numbers", k=4, v=1, q=4),
    # multi-question reuse (ours, SCBench's setting): the keys asked one at a time, each a question
    # of its own on the same context; the prompt holds the first, Sample.asks the others
    "niah_multiquery_turns": dict(
        haystack="essay", key="words", value="numbers", k=4, v=1, q=4, turns=True
    ),
    "niah_multineedle_turns": dict(
        haystack="noise", key="words", value="numbers", k=6, v=1, q=4, turns=True
    ),
}


def _random_needle_part(rng, kind, pool):
    if kind == "numbers":                            # niah.py generate_random_number: 7 digits
        return str(rng.randint(10 ** 6, 10 ** 7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return f"{rng.choice(pool)}-{rng.choice(pool)}"  # RULER: f"{adjective}-{noun}"


def _insert(lines: list, items: list, fractions: list) -> list:
    """Insert items before lines[int(u·len)] (RULER: random.sample of line indexes), in order."""
    out = list(lines)
    for item, u in sorted(zip(items, fractions), key=lambda p: -p[1]):   # back to front
        out.insert(int(u * len(lines)), item)
    return out


def _noise_lines(n_words: int) -> list:
    """The first n_words of NOISE repeated, one repetition per line (RULER: [NOISE] * n)."""
    words = NOISE.split()
    return [" ".join(words[j % len(words)] for j in range(i, min(i + len(words), n_words)))
            for i in range(0, n_words, len(words))]


def _essay_with(needles: list, depths: list, n_words: int, essay_words: list) -> str:
    """niah.py 'essay' haystack: the first n_words (repeated if needed), split into sentences,
    needle i inserted at sentence int(len · depth_i/100), all joined by spaces."""
    text = " ".join(essay_words[j % len(essay_words)] for j in range(n_words))
    sents = re.split(r"(?<=[.!?])\s+", text)
    cuts = [0] + sorted(int(len(sents) * d / 100) for d in depths) + [len(sents)]
    parts = []
    for i in range(1, len(cuts)):
        parts.append(" ".join(sents[cuts[i - 1]:cuts[i]]))
        if i - 1 < len(needles):
            parts.append(needles[i - 1])
    return " ".join(parts)


def niah(task: str, tok, target: int, seed: int = 0, index: int = 0) -> Sample:
    """RULER needle-in-a-haystack `task` (a key of NIAH), niah.py `generate_input_output`."""
    c = NIAH[task]
    rng, pool = random.Random(f"{task}/{seed}/{index}"), word_pool()
    n_keys = max(c["k"], c["q"])                     # niah.py: num_needle_k = max(k, q)
    keys = [_random_needle_part(rng, c["key"], pool) for _ in range(n_keys)]
    values = [[_random_needle_part(rng, c["value"], pool) for _ in range(c["v"])] for _ in keys]
    needles = [NEEDLE.format(type_needle_v=c["value"], key=k, value=v)
               for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    fractions = [rng.random() for _ in needles]      # where each needle goes, drawn once
    depths = rng.sample(DEPTHS, len(needles))
    asked = rng.sample(range(n_keys), c["q"])
    answers = [v for i in asked for v in values[i]]
    query = keys[asked[0]]
    if c["q"] > 1 and not c.get("turns"):            # "a, b, c, and d"
        query = ", ".join(keys[i] for i in asked[:-1]) + ", and " + keys[asked[-1]]
    if c.get("turns"):                               # one key per question: its own value
        answers = values[asked[0]]
    template, type_v = NIAH_TEMPLATE, c["value"]
    if c["v"] == 1 and (c["q"] == 1 or c.get("turns")):   # niah.py: singular wording for one answer
        for a, b in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            template = template.replace(a, b)
        type_v = type_v[:-1]
    # needle haystack: grown on demand, prefix-stable
    distractors = []
    essay_words = source_text("test").split() if c["haystack"] == "essay" else None

    def build(n):
        if c["haystack"] == "essay":
            context = _essay_with(needles, depths, n, essay_words)
        else:
            if c["haystack"] == "noise":
                lines = _noise_lines(n)
            else:
                while len(distractors) < n:
                    distractors.append(
                        NEEDLE.format(type_needle_v=c["value"],
                                      key=_random_needle_part(rng, c["key"], pool),
                                      value=_random_needle_part(rng, c["value"], pool))
                    )
                lines = distractors[:n]
            context = "\n".join(_insert(lines, needles, fractions))
        prompt = template.format(type_needle_v=type_v, context=context, query=query)
        return (prompt, answers, " " + ", ".join(answers),
                around(template, type_needle_v=type_v, query=query))
    if not c.get("turns"):
        return _sample(task, index, tok, target, build, "string_match_all", 128)
    later = [
        Ask(around(template, type_needle_v=type_v, query=keys[i])[1], values[i], " " + values[i][0])
        for i in asked[1:]
    ]
    # fitted so that every question's prompt fits too
    for short in range(0, target, 4):
        s = _sample(task, index, tok, target - short, build, "string_match_all", 128)
        head = s.prompt[:len(s.prompt) - len(s.question)]
        if all(len(tok.encode(head + a.question)) <= target for a in later):
            return dataclasses.replace(s, asks=tuple(later))
    raise UsageError(f"{task}: {target} tokens is too short for its questions")


# ----------------------------------------------------------------------------- RULER: vt, fwe, cwe

# RULER constants.py TASKS['variable_tracking'], template + answer prefix
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    "{context}\nQuestion: Find all variables that are assigned the value {query} in the text "
    "above. Answer: According to the chain(s) of variable assignment in the text above, "
    "{num_v} variables are assigned the value {query}, they are: "
)
VT_HOPS = 4                 # synthetic.yaml vt: num_chains 1, num_hops 4
# [choice] the one-shot example's noise: 10 lines (RULER fits it to 500 tokens)
VT_EXAMPLE_WORDS = 180


def _vt_chain(rng, var_len: int):
    """One chain `VAR A = 12345`, `VAR B = VAR A `, ... (variable_tracking.py generate_chains)
    hidden in order at random lines of the noise haystack -> (text(n_words), variables)."""
    names = []
    while len(names) < VT_HOPS + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=var_len))
        names += [name] if name not in names else []
    value = str(rng.randint(10000, 99998))           # np.random.randint(10000, 99999)
    chain = [f"VAR {names[0]} = {value}"] + [
        f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(VT_HOPS)
    ]
    fractions = sorted(rng.random() for _ in chain)

    def text(n):
        lines = _noise_lines(n)
        for j, (line, u) in enumerate(zip(chain, fractions)):    # insert_pi + j keeps the order
            lines.insert(int(u * (len(lines) - j)) + j, line)
        return VT_TEMPLATE.format(context="\n".join(lines), query=value, num_v=VT_HOPS + 1)
    return text, names, around(VT_TEMPLATE, query=value, num_v=VT_HOPS + 1)


def vt(tok, target: int, seed: int = 0, index: int = 0) -> Sample:
    """RULER variable tracking with its one-shot example (variable_tracking.py `add_fewshot`:
    3-letter variables, then the example's answer, then the task with 5-letter variables)."""
    rng = random.Random(f"vt/{seed}/{index}")
    example, example_vars, _ = _vt_chain(rng, 3)
    shot = example(VT_EXAMPLE_WORDS) + " " + " ".join(example_vars) + "\n"
    text, names, (pre, question) = _vt_chain(rng, 5)

    def build(n):
        """(prompt, answers, answer text, (prompt before the question, question)) at size n."""
        return shot + "\n" + text(n), names, " ".join(names), (shot + "\n" + pre, question)
    return _sample("vt", index, tok, target, build, "string_match_all", 30)


# RULER constants.py TASKS['freq_words_extraction'], template + answer prefix
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the "
    "three most frequently appeared coded words. {context}\nQuestion: Do not provide any "
    "explanation. Please ignore the dots '....'. What are the three most frequently appeared "
    "words in the above coded text? Answer: According to the coded text above, the three "
    "most frequently appeared words are:"
)


def fwe(tok, target: int, seed: int = 0, index: int = 0) -> Sample:
    """RULER frequent-words extraction (freq_words_extraction.py): coded words of 6 letters with
    Zipf counts c_k = int(N·k^-α/ζ(α)), α = 2; rank 1 becomes '...' (noise), ranks 2-4 are the
    answer. The haystack size is N."""
    rng = random.Random(f"fwe/{seed}/{index}")
    vocab_size, alpha = max(target // 50, 10), 2.0   # RULER: vocab_size = max_seq_length // 50
    vocab = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=6)))
    vocab = sorted(vocab)
    rng.shuffle(vocab)
    vocab[0] = "..."
    zeta = math.pi ** 2 / 6                          # ζ(2) (RULER: scipy.special.zeta(alpha))
    shuffle_seed = rng.random()                      # RULER shuffles with one fixed seed at every N

    def build(n):
        words = [w for k, w in enumerate(vocab, 1) for _ in range(int(n * k ** -alpha / zeta))]
        random.Random(shuffle_seed).shuffle(words)
        return (FWE_TEMPLATE.format(context=" ".join(words)), vocab[1:4],
                " " + " ".join(vocab[1:4]), around(FWE_TEMPLATE))
    return _sample("fwe", index, tok, target, build, "string_match_all", 50)


# RULER constants.py TASKS['common_words_extraction'], template + answer prefix
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most "
    "common words in the above list? Answer: The top 10 words that appear most often in the "
    "list are:"
)


def cwe(tok, target: int, seed: int = 0, index: int = 0) -> Sample:
    """RULER common-words extraction (common_words_extraction.py): 10 common words repeated
    freq_cw times among words repeated freq_ucw times, numbered `1. w 2. w ...`, after one solved
    example. RULER's short-context setting (< 4096 tokens): example (20 words, 3×, 1×), task
    (6×, 1×); otherwise example (40, 10×, 3×), task (30×, 3×). The haystack size is the number
    of distinct words."""
    rng, pool = random.Random(f"cwe/{seed}/{index}"), word_pool()
    (n_ex, ex_cw, ex_ucw), (cw, ucw) = (
        ((20, 3, 1), (6, 1)) if target < 4096 else ((40, 10, 3), (30, 3))
    )

    def numbered(ws):
        """The words ws as '1. w 2. w ...'."""
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(ws))

    def listing(words, f_cw, f_ucw, shuffle_seed):
        listed = words[:10] * f_cw + words[10:] * f_ucw
        random.Random(shuffle_seed).shuffle(listed)
        return CWE_TEMPLATE.format(context=numbered(listed))
    ex_words = rng.sample(pool, n_ex)
    shot = listing(ex_words, ex_cw, ex_ucw, rng.random()) + " " + numbered(ex_words[:10])
    order, shuffle_seed = rng.sample(pool, len(pool)), rng.random()
    pre, question = around(CWE_TEMPLATE)

    def build(n):
        """(prompt, answers, answer text, (prompt before the question, question)) at n words."""
        return (shot + "\n" + listing(order[:n], cw, ucw, shuffle_seed), order[:10],
                " " + numbered(order[:10]), (shot + "\n" + pre, question))
    return _sample(
        "cwe", index, tok, target, build, "string_match_all", 120, n_min=10, n_max=len(pool)
    )


# name -> gen(tokenizer, target_tokens, seed, index) -> Sample
RULER_TASKS = {**{name: functools.partial(niah, name) for name in NIAH}, "vt": vt, "fwe": fwe,
               "cwe": cwe}


# ----------------------------------------------------------------------------- KVzip's prompt

def reconstruction_prompt(tok) -> tuple:
    """KVzip's reconstruction prompt as ids (kvpress `KVzipPress.prepare`): the instruction for
    the first chunk, the one for later chunks, and the suffix (the chat template's text after
    the user turn; a newline for a tokenizer without one)."""
    suffix = "\n"
    if getattr(tok, "has_chat_template", False):
        mark = "dummy context\n" + "#" * 13
        suffix = tok.chat(mark).split(mark)[1]
    return _repeat_ids(tok, suffix)


def _repeat_ids(tok, suffix: str) -> tuple:
    """(first instruction, later instruction, suffix) as ids, no special tokens added."""
    def enc(t):
        """The ids of text t, no special tokens added."""
        return tuple(tok.encode(t, add_special_tokens=False))
    return (enc("\n\nRepeat the previous context exactly."),
            enc("\n\nRepeat the part of the previous context exactly, starting with"), enc(suffix))


def kvpress_reconstruction(tok) -> tuple:
    """(repeat, start): KVzip's reconstruction prompt (as `reconstruction_prompt`) and the first
    prompt position it reconstructs, as kvpress 0.5.5's `KVzipPress.__call__` builds them from
    the chat template transformers reads for the folder (`tok.hf_chat_template`, the embedded
    model's chat_template.jinja included). With a template: rendered around one user turn
    "dummy context" + "\n" + 13 "#" with the generation prompt and enable_thinking=False, the
    text after that separator is the suffix and the text before "dummy context" the prefix,
    whose token count is `start` (kvpress takes every prompt to open with the template's
    prefix, as its pipeline builds it, and reconstructs from there); without one, the suffix
    "\n" and start 0 (then this is `reconstruction_prompt`)."""
    template = getattr(tok, "hf_chat_template", None)
    if not template:
        return _repeat_ids(tok, "\n"), 0
    dummy = "dummy context"
    separator = "\n" + "#" * len(dummy)
    context, suffix = tok.chat(dummy + separator, template, enable_thinking=False).split(separator)
    prefix = context.split(dummy)[0]
    return _repeat_ids(tok, suffix), len(tok.encode(prefix, add_special_tokens=False))
