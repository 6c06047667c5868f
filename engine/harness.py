"""The harness: one prompt through every method and protocol, the suites' prompts, the methods by
name and the options of a run (evaluate.py is the entry point that drives it, writes the run
folder and the summary; docs/protocol.md says what a fair comparison here means).

- The method names: every --methods name and the method it builds (FullKV, each rule of
  baselines.RULES, PyramidKV, the head-wise allocations, PolyKV's rows from a calibrated policy,
  GraceKV's rows), the default rows, the baselines a policy is compared with.
- One sample: `run_item` runs every protocol of a prompt from one shared observation
  (engine/observe.observe_prefixes) and teacher-forces / decodes each method against FullKV
  through the same numerical path, at equal memory.
- The suites: `build_items` makes the fidelity, RULER and LongBench prompts of a run.
- The options: `parse`, the checks done before any model is loaded, the run's decode allowance.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

import baselines as BL
import calibrate
import model as M
import polykv as P
from engine import longbench as LB
from engine import gracekv_fast, gracekv_variants, metrics, policy_cache
from engine import observe as OB
from engine import protocols as PR
from support import checkpoint, cli
from support import tasks as TK
from support.errors import UsageError
from support.files import writable_folder


# ----------------------------------------------------------------------------- the method names
# Computed from the rule table (baselines.RULES), so a rule added there is a method, a baseline
# and a pool rule at once.

def uniform_methods() -> tuple:
    """The standalone methods: FullKV, every rule of baselines.RULES (a rule that also names
    an allocation, as kvzip, runs at one budget per head as RULE-uniform), PyramidKV's schedule and
    the head-wise allocations (baselines.ALLOCATIONS: adakv, kvzip); random last."""
    rules = uniform_names(n for n in BL.RULES if n != "random")
    return (
        ("full",)
        + rules
        + ("pyramidkv",)
        + tuple(BL.ALLOCATIONS)
        + (("random",) if "random" in BL.RULES else ())
    )


def uniform_names(rules) -> tuple:
    """Each rule's --methods name at one budget per (layer, head): its own, or RULE-uniform where
    the rule's name is taken by its allocation (kvzip)."""
    return tuple(f"{n}-uniform" if n in BL.ALLOCATIONS else n for n in rules)


def baselines() -> tuple:
    """The standalone methods a calibrated policy is compared with: the pool rules, PyramidKV and
    the head-wise allocations."""
    return uniform_names(P.pool(BL.RULES)) + ("pyramidkv",) + tuple(BL.ALLOCATIONS)


def all_methods() -> tuple:
    """Every --methods name: the uniform methods, AdaKV over each other pool rule, PolyKV's rows
    and GraceKV's rows."""
    ada = tuple(f"adakv-{r}" for r in P.pool(BL.RULES) if r != BL.ALLOCATIONS["adakv"][0])
    return uniform_methods() + ada + tuple(policy_cache.VARIANTS) + tuple(gracekv_variants.VARIANTS)


def default_methods(suite: str = "default") -> tuple:
    """The default rows; the reference suite adds the joint calibration and its ablations."""
    extra = (
        ("polykv-joint", "polykv-joint-pattern", "polykv-joint-budget")
        if suite == "reference"
        else ()
    )
    return uniform_methods() + ("polykv",) + extra + ("gracekv",)


def family(name: str) -> str:
    """"polykv" or "gracekv" for those papers' rows (their variant tables), else "uniform"."""
    return (
        "polykv"
        if name in policy_cache.VARIANTS
        else "gracekv" if gracekv_variants.is_row(name) else "uniform"
    )


def method(name: str, budget: int, n_layers: int, settings=None, decode=None,
           memo=None) -> P.Method:
    """A method that needs no calibration, by its --methods name: FullKV or a registered rule
    (its own decode form, or `decode`), PyramidKV, a GraceKV row. settings: polykv.RuleSettings;
    memo: GraceKV's per-prompt steps, shared by its rows (engine.gracekv_fast.context_memo)."""
    s = settings or P.RuleSettings()
    if name == "pyramidkv":
        return P.Pyramid(budget, s)
    alloc = BL.allocation(name)
    if alloc:
        rule, scope, alpha = alloc
        return BL.Headwise(rule, budget, scope, alpha, s)
    if name.endswith("-uniform") and name[:-8] in BL.ALLOCATIONS:
        name = name[:-8]                  # the rule at one budget per (layer, head)
    if gracekv_variants.is_row(name):
        return gracekv_variants.variant(name, budget, memo)
    if name in uniform_methods():
        return P.Policy.uniform(name, budget, n_layers, decode, s, BL.RULES)
    raise UsageError(f"unknown method {name!r}; choose from {', '.join(all_methods())}")
# the default suite on the embedded CPU model: RULER tasks the 4-bit 135M model solves with the
# full cache at the default length (docs/results.md, "The default suite": FullKV's scores)
DEFAULT_RULER = ("niah_single_1",)


# ----------------------------------------------------------------------------- one sample

@dataclass
class Item:
    """One prompt of a suite: tokens (1, T) and what to do with them."""
    task: str
    index: int
    length: int                 # the target length (task column)
    tokens: torch.Tensor        # (1, T)
    sample: TK.Sample = None    # RULER / LongBench: answers, metric, max_new_tokens, gold
    # (1, n) tokens to teacher-force: the continuation or the gold answer
    target: torch.Tensor = None
    split: tuple = None         # (n_prefix, n_question) tokens (protocols.split); None: no question
    # later questions on the same context: [(tokens (1, q), Sample, gold (1, n))]
    turns: list = ()


def compare(ref_lp, lp, target) -> tuple:
    """KL(FullKV ‖ method), ΔNLL and top-1 agreement (%) over the n teacher-forced positions."""
    tgt = target[0].to(lp.device)
    kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1).clamp_min(0).mean()    # Σ p (log p − log q)
    nll = -lp.gather(1, tgt[:, None]).mean()
    ref_nll = -ref_lp.gather(1, tgt[:, None]).mean()
    top1 = (lp.argmax(-1) == ref_lp.argmax(-1)).float().mean()
    return float(kl), float(nll - ref_nll), 100 * float(top1)


@dataclass
class Row:
    """One result: a method at a budget on one prompt, a line of OUT/samples*.jsonl. The fields
    past prefill_s are set by what the prompt measures (teacher forcing: kl, dnll, top1 and the
    decoding peaks; a task: pred, score) and left out of the line otherwise."""
    key: str
    method: str
    budget: int
    task: str
    length: int
    index: int
    n_tokens: int
    kv_fraction: float          # prompt-cache entries / FullKV's
    # the method's compression after the shared prefill (+ its own extra pass)
    compress_s: float
    prefill_s: float            # the shared prefill + every method's statistics (no extra pass)
    # fidelity: KL(FullKV ‖ method), mean over the teacher-forced tokens
    kl: Optional[float] = None
    dnll: Optional[float] = None
    top1: Optional[float] = None
    protocol: str = "prompt"    # what is compressed and charged (engine/protocols.py)
    turn: Optional[int] = None  # a multi-question prompt: which question (0: the prompt's own)
    peak_fraction: Optional[float] = None   # most entries while decoding / FullKV's
    alloc_fraction: Optional[float] = None  # the same for allocated slots (padding included)
    pred: Optional[str] = None
    score: Optional[float] = None

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


class Methods:
    """Turns a method name + budget into a polykv.Method (built once, then reused)."""

    def __init__(self, model, tok, args):
        self.model, self.tok, self.args = model, tok, args
        self.L = model.config.n_layers
        self.policies, self.made = {}, {}
        self.memo = gracekv_fast.context_memo()     # GraceKV's steps of the prompt at hand
        # KVzip's prompt in this vocabulary
        self.settings = calibrate.with_prompt(P.RuleSettings(), tok)

    def calibrated(self, budget, procedure="paper"):
        """--policy FILE (rescaled to each budget; every PolyKV row runs it), else one
        calibration per (procedure, budget), cached."""
        key = "file" if self.args.policy else (procedure, budget)
        if key not in self.policies:
            if self.args.policy:
                self.policies[key] = self.policy_file()
            else:
                T = self.args.calibration_length
                self.check_calibration(budget, T)
                self.policies[key] = self.calibration(budget, procedure, T)
        pol = self.policies[key]
        return pol if pol.budget == budget else pol.rescaled(budget)

    def policy_file(self) -> P.Policy:
        """--policy: its layer count the model's, and the model it names (if any) this run's."""
        pol = P.Policy.load(self.args.policy, n_layers=self.L, rules=BL.RULES)
        said = pol.meta.get("model")
        if said is not None and said != self.args.model_name:
            raise UsageError(f"--policy {self.args.policy!r} was calibrated for model {said!r}, "
                             f"this run's is {self.args.model_name!r} (python calibrate.py "
                             "--model DIR --out FILE calibrates one for it)")
        return pol

    def calibration(self, budget: int, procedure: str, T: int) -> P.Policy:
        """The policy of (procedure, budget) calibrated on T-token prompts: from --cache-dir, else
        (embedded model) the repository's policies/, else calibrated once into --cache-dir
        (policy_cache.policy_for); --recalibrate: calibrated whatever exists."""
        args = self.args
        # the repository's policies: the embedded model's, calibrated in fp32
        embedded = args.model is None and self.model.dtype == torch.float32
        shipped = policy_cache.SHIPPED if embedded else None
        path = policy_cache.policy_path(args.model_name, budget, args.seed, args.cache_dir,
                                     procedure, T)
        kept = policy_cache.policy_path(args.model_name, budget, args.seed, shipped, procedure, T) \
            if shipped is not None else None
        if args.recalibrate or not (path.exists() or (kept is not None and kept.exists())):
            writable_folder(path.parent, "--cache-dir")        # before minutes of calibration
            where = (f"calibrating on {T}-token prompts into {path} (2 CPU cores: about 4-9 min "
                     "at 2,048 tokens, 4x that at 8,000)")
        else:
            where = str(path if path.exists() else kept)
        print(f"polykv ({procedure}): policy for budget {budget}: {where}", flush=True)

        def log(line):
            print(f"polykv {procedure} calibration B={budget}: {line}", flush=True)
        return policy_cache.policy_for(self.model, self.tok, args.model_name, budget, args.seed,
                                    Path(args.cache_dir), log=log, procedure=procedure,
                                    shipped=shipped, recalibrate=args.recalibrate, prompt_len=T)

    def check_calibration(self, budget: int, T: int):
        """A calibration on T-token prompts is possible at `budget` in this model's window, checked
        before it is announced (calibrate.py checks again where it runs)."""
        if T <= budget:
            raise UsageError(f"calibration prompts ({T} tokens, --calibration-length) must be "
                             f"longer than the budget {budget}")
        if T + calibrate.CONT_LEN > self.model.config.max_seq_len:
            raise UsageError(f"calibration prompts of {T} (+{calibrate.CONT_LEN}) tokens exceed "
                             f"the model's maximum {self.model.config.max_seq_len}")

    def get(self, name, budget) -> P.Method:
        if (name, budget) not in self.made:
            self.made[name, budget] = self.make(name, budget)
        return self.made[name, budget]

    def make(self, name, budget) -> P.Method:
        """The method; under --memory equal a policy's decode budgets grow by the allowance."""
        if name not in policy_cache.VARIANTS:
            pol = method(name, budget, self.L, self.settings, memo=self.memo)
            if not isinstance(pol, P.Policy):
                return pol
        else:
            procedure, transform = policy_cache.VARIANTS[name]
            pol = transform(self.calibrated(budget, procedure))
        return pol.with_allowance(self.args.allowance) if self.args.memory == "equal" else pol


def run_item(
    model, tok, methods: Methods, names, budgets, item: Item, done: set, protocols=("prompt",)
):
    """All (method, budget, protocol) results of one item not in done, as JSON rows (`Row`). An
    item without a question (fidelity) is run once, under `prompt`, and its rows stand for every
    protocol: there the three coincide (engine/protocols.py)."""
    asked = {
        p: [(n, b) for b in budgets for n in names if not set(keys(n, b, item, p)) <= done]
        for p in protocols
    }
    # one prefill observes for every protocol: prompt and context read the whole prompt,
    # agnostic its prefix + context, rows and keys before the question
    # (engine/observe.observe_prefixes)
    if item.split is not None:
        T = item.tokens.shape[1]
        ends = (T,) * any(asked.get(p) for p in ("prompt", "context")) \
            + (T - item.split[1],) * bool(asked.get("agnostic"))
        shared = {"for": [nb for todo in asked.values() for nb in todo], "ends": ends}
        return [
            r
            for p, todo in asked.items()
            if todo
            for r in run_protocol(model, tok, methods, item, p, todo, shared)
        ]
    rows = run_protocol(model, tok, methods, item, "prompt",
                        list(dict.fromkeys(nb for v in asked.values() for nb in v)))
    return [{**r, "key": result_key(r["method"], r["budget"], item, p), "protocol": p}
            for p, todo in asked.items() for r in rows if (r["method"], r["budget"]) in todo]


def run_protocol(model, tok, methods: Methods, item: Item, protocol: str, todo: list, shared=None):
    """The rows of (method, budget) pairs `todo` on one item under one protocol. Keys a..b−1 are
    compressed and charged (prompt: all; agnostic: all but the question, which the observation
    does not see and which is fed afterwards to every cache, FullKV's included; context: the
    context alone, cut from the whole prompt's prefill and joined back between the exact prefix
    and question). kv_fraction = compressed entries / (L·G·(b − a)).

    Multi-question reuse (item.turns): each later question is fed to a fork of what the protocol
    keeps of the context — the compressed prompt, first question and its gold answer included
    (prompt: a follow-up turn); the exact prefix and the compressed context (context, agnostic) —
    and scored like the first, against FullKV given the same tokens.

    shared (the protocols of one item): {"for": the (method, budget) pairs of all of them,
    "ends": the prompt lengths observed, T for prompt and context, b for agnostic}; the one
    observation (engine/observe.observe_prefixes) and the FullKV references of the first question,
    made
    by the first protocol run, are kept there for the others. prefill_s is that one pass, the
    same in every protocol's rows of the item."""
    T = item.tokens.shape[1]
    n_pre, n_q = item.split if protocol != "prompt" else (0, 0)
    a, b = (n_pre if protocol == "context" else 0), T - n_q
    # what the observation reads
    seen = item.tokens[:, :b] if protocol == "agnostic" else item.tokens
    made = {nb: methods.get(*nb) for nb in todo}      # policies resolved outside the timers
    L, G = model.config.n_layers, model.config.n_kv_heads
    shared = {} if shared is None else shared
    if "observed" not in shared:
        t0 = time.perf_counter()
        needs = OB.union([methods.get(*nb).needs(model) for nb in shared.get("for", todo)], L)
        ends = shared.get("ends", (seen.shape[1],))
        observed = OB.observe_prefixes(model, item.tokens[:, :max(ends)], needs, ends)
        extra_s = sum(sum(o.seconds.values()) for _, o in observed.values())
        shared["observed"] = observed, needs, time.perf_counter() - t0 - extra_s
    # t_p: the prefill (extra passes: their methods' cost, own_pass)
    observed, needs, t_p = shared["observed"]
    full, obs = observed[seen.shape[1]]
    if not bool(torch.isfinite(full.last_logits).all()):
        why = checkpoint.rebuild(methods.args.model_dir)
        raise UsageError(f"{item.task} #{item.index}: the model's logits are not finite "
                         f"({model.dtype}): damaged weights ({why}) or an overflow of the "
                         "dtype (try --dtype float32); nothing written for it")
    part, part_obs = PR.cut(full, obs, needs, a, b) if protocol == "context" else (full, obs)

    # a question arrives: fed to the cache and appended, as decoding would
    def ask(cache, q):
        M.decode(model, q, cache)
        return cache

    # the first question's cache, from the protocol's cache `cache` of a method (its compressed
    # part `comp`): the whole prompt is already in it, or the question is fed (agnostic)
    def first(cache, comp):
        if protocol == "agnostic":
            return ask(cache, item.tokens[:, b:])
        return cache

    # the cache a later question is fed to: a follow-up turn of the whole conversation
    # (prompt), or the exact prefix and compressed context (context, agnostic)
    def base(cache, comp):
        if protocol == "prompt":
            return cache.fork()
        if protocol == "context":
            return PR.join(full, comp, a, b, question=False)
        return comp.fork()

    def later(q, cache, comp):
        return ask(base(cache, comp), q)

    # the questions: (the cache a method's answer starts from; tokens no method is charged for;
    # what is teacher-forced; the sample scored)
    questions = [(first, T - (b - a), item.target, item.sample)]
    # prompt: a later question follows the first one's gold answer (the conversation so far)
    prior = item.target if protocol == "prompt" and item.target is not None else item.tokens[:, :0]
    for q, smp, gold in item.turns:
        asked = torch.cat((prior, q), 1)
        questions.append((functools.partial(later, asked), a + asked.shape[1], gold, smp))
    refs = []
    for turn, (make, free, target, _) in enumerate(questions):
        ref = None
        if target is not None:
            n = target.shape[1]
            stepwise = any(m.evicts_within(b - a, n + free) for m in made.values())
            # the first question: the whole prompt's FullKV (agnostic: its question fed after)
            key = ("first", protocol == "agnostic", stepwise) if turn == 0 else None
            ref = shared.get(key) or (
                stepwise,
                *M.teacher_force(model, make(full.fork(), part), target, None, stepwise),
            )
            if key:
                shared[key] = ref
        refs.append(ref)
    out = []
    # what FullKV measured at the first budget asked: its cache and decoding do not depend on the
    # budget, so its rows at the other budgets repeat that decoding's results, not its work
    decoded_full = {}
    for (name, budget), method in made.items():
        t0 = time.perf_counter()
        comp = method.compress(model, part, part_obs)
        kept = comp.entries()
        # prefix and question back, exact
        cache = PR.join(full, comp, a, b) if protocol == "context" else comp
        t_c = time.perf_counter() - t0 + own_pass(model, method, obs)
        for turn, ((make, free, target, sample), ref) in enumerate(zip(questions, refs)):
            r = Row(result_key(name, budget, item, protocol, turn), name, budget, item.task,
                    item.length, item.index, T, kv_fraction=kept / (L * G * (b - a)),
                    compress_s=round(t_c, 4), prefill_s=round(t_p, 4), protocol=protocol,
                    turn=turn if item.turns else None)
            if keeps_everything(method) and turn in decoded_full:
                for field, value in decoded_full[turn].items():
                    setattr(r, field, value)
                out.append(r.to_json())
                continue
            here = make(cache.fork(), comp)
            if ref is not None:
                stepwise, ref_lp, (ref_entries, ref_slots) = ref
                lp, (entries, slots) = M.teacher_force(model, here.fork(), target,
                                                     method.decoder if stepwise else None, stepwise)
                r.kl, r.dnll, r.top1 = compare(ref_lp, lp, target)
                # memory while decoding, vs FullKV after the same tokens: real entries and allocated
                # slots (padding included; bytes = slots × 2·D·element size for both)
                r.peak_fraction, r.alloc_fraction = entries / ref_entries, slots / ref_slots
            if sample is not None and (
                methods.args.greedy is None or item.task in methods.args.greedy
            ):
                n_new = min(sample.max_new_tokens, methods.args.max_new_tokens)
                # a decoder that cannot evict within the answer would only cost time per step
                ids = M.greedy(
                    model,
                    here,
                    n_new,
                    stop_ids(tok, sample),
                    method.decoder if method.evicts_within(b - a, n_new + free) else None,
                    answer_done(tok, sample),
                )
                r.pred = tok.decode(ids)
                r.score = metrics.score(sample, r.pred)
            if keeps_everything(method):
                decoded_full[turn] = {k: v for k, v in r.to_json().items() if k in DECODED}
            out.append(r.to_json())
    methods.memo.clear()                     # GraceKV's steps of this prompt: not held past it
    return out


# a row's fields that its decoding measured (teacher forcing and the greedy answer)
DECODED = ("kl", "dnll", "top1", "peak_fraction", "alloc_fraction", "pred", "score")


def keeps_everything(method) -> bool:
    """FullKV, at any budget: every layer keeps the whole prompt (rule `full`) and appends, so
    its compressed cache is the FullKV cache itself and its decoding evicts nothing."""
    return isinstance(method, P.Policy) and all(
        lp.prefill.rule == "full" and lp.decode.rule == "append" for lp in method.layers)


def own_pass(model, method, obs) -> float:
    """Seconds of the extra passes of the shared observation that `method` reads (KVzip's
    reconstruction): part of its compression cost, not of the shared prefill."""
    used = method.needs(model).used
    return sum(t for name, t in obs.seconds.items() if name in used)


# ----------------------------------------------------------------------------- where an answer ends

def stop_ids(tok, sample) -> set:
    """Where greedy decoding stops: EOS, and for samsum the newline token too (LongBench
    pred.py: eos_token_id=[eos, encode("\\n")[-1]])."""
    if sample.stop_at_newline:
        return set(tok.eos_ids) | {tok.encode("\n", add_special_tokens=False)[-1]}
    return set(tok.eos_ids)


def answer_done(tok, sample):
    """When a greedy answer is complete, before the token cap: for the tasks scored on their
    first line (RULER's needles, LongBench's FIRST_LINE_TASKS), once a newline follows text
    other than whitespace; None (run to the cap or EOS) for the others.

    LongBench's first-line tasks: exact (the scored line is complete at that newline).
    RULER: our choice — its scorer (scripts/eval/evaluate.py postprocess_pred + string_match)
    searches the whole prediction; the answers are one short line, and on the reference run's
    1,280 needle predictions no answer appeared after the first non-blank line. The cap stays
    RULER's 128 tokens (24 on CPU, evaluate.py --max-new-tokens)."""
    if not (sample.metric.startswith("string_match") or sample.task in metrics.FIRST_LINE_TASKS):
        return None
    def done(ids):                         # a newline after some text: the first line is complete
        return "\n" in tok.decode(ids).lstrip()
    return done


def result_key(name, budget, item, protocol="prompt", turn=0) -> str:
    """name|budget|task|length|index, then |protocol for the protocols other than `prompt` and
    |q{turn} for a later question."""
    return (
        f"{name}|{budget}|{item.task}|{item.length}|{item.index}"
        + ("" if protocol == "prompt" else f"|{protocol}")
        + (f"|q{turn}" if turn else "")
    )


def keys(name, budget, item, protocol) -> list:
    """Every row key of (method, budget, protocol) on an item: one per question."""
    return [result_key(name, budget, item, protocol, t) for t in range(1 + len(item.turns))]


# ----------------------------------------------------------------------------- suites

def build_items(tok, args, model):
    """The suite, deterministic from args.seed: fidelity prompts, RULER tasks, LongBench; each
    prompt with a question carries its (prefix, question) split when a protocol needs it."""
    dev = model.device

    def as_t(ids):                          # (1, n) token ids on the model's device
        return torch.tensor([ids], device=dev)
    cut = args.protocol != ["prompt"]         # a protocol reads where the question sits
    items = []
    for length in args.fidelity_length:
        for i in range(args.fidelity_samples):
            p, c = TK.fidelity_text(tok, length, args.cont_len, args.seed, i, args.split)
            items.append(Item("fidelity", i, length, as_t(p), target=as_t(c)))
    for length in args.length:
        for task in args.tasks:
            for i in range(args.samples):
                s = TK.RULER_TASKS[task](tok, length, TK.ruler_seed(args.split, args.seed), i)
                ids = tok.encode(s.prompt)
                gold = tok.encode(s.prompt + s.gold)[len(ids):] if s.gold else None
                split = PR.split(tok, ids, s) if cut or s.asks else None
                items.append(
                    Item(task, i, length, as_t(ids), s, as_t(gold) if gold else None, split,
                         [(as_t(q), smp, as_t(g)) for q, smp, g in PR.turns(tok, ids, s, split)])
                )
    if args.data:
        for i, s in enumerate(LB.load_longbench(args.data, tok, model.config.max_seq_len - 256)):
            ids = tok.encode(s.prompt, add_special_tokens=not s.templated)
            items.append(
                Item(s.task, s.index, 0, as_t(ids), s, split=PR.split(tok, ids, s) if cut else None)
            )
    if not items:
        raise UsageError("nothing to run: no prompt was built (--tasks, --samples, "
                         "--fidelity-samples and --data give none)")
    for it in items:
        if it.tokens.shape[1] > model.config.max_seq_len:
            option = "--fidelity-length" if it.task == "fidelity" else "--length"
            raise UsageError(f"{it.task} prompt of {it.tokens.shape[1]} tokens is longer than the "
                             f"model's maximum ({model.config.max_seq_len}); lower {option}")
    return items


# ----------------------------------------------------------------------------- the options

def parse(argv):
    ap = cli.ArgumentParser(description="KV-cache compression methods against FullKV.")
    ap.add_argument(
        "--budget",
        type=cli.int_list,
        default=None,
        help="average entries per (layer, KV head); comma list sweeps (default 512; reference: "
             "64,128,512,1024)",
    )
    ap.add_argument(
        "--suite",
        choices=("default", "reference"),
        default="default",
        help="reference: 32 fidelity + 32 niah_single_1 prompts, budgets 64, 128, 512, 1024 "
        "(about 40 min on 2 CPU cores with torchrun --nproc_per_node 2)",
    )
    ap.add_argument(
        "--split",
        choices=TK.SPLITS,
        default="test",
        help="test: the reported tables; dev: where defaults are chosen (other passages and seeds)",
    )
    ap.add_argument(
        "--memory",
        choices=("equal", "budget"),
        default="equal",
        help="equal: every method may grow by the generated tokens (evicting decode rules evict "
             "only "
        "beyond that), so peaks are equal; budget: evicting decode rules hold their prompt budget",
    )
    ap.add_argument(
        "--protocol",
        default="prompt",
        help="comma list of prompt (the whole prompt compressed and charged), context (only the "
        "context; prefix and question exact and free), agnostic (compressed before the "
        "question, which is then appended): engine/protocols.py",
    )
    ap.add_argument(
        "--methods",
        default=None,
        help=f"comma list (default {','.join(default_methods())}; --suite reference adds the "
             f"joint PolyKV rows)",
    )
    ap.add_argument(
        "--model", default=None, help="HF checkpoint folder (default: embedded SmolLM2-135M)"
    )
    ap.add_argument("--device", default=None)
    ap.add_argument(
        "--dtype", default=None, choices=[None, "float32", "bfloat16", "float16", "float64"]
    )
    ap.add_argument(
        "--tasks", default=",".join(DEFAULT_RULER), help="RULER-style tasks (empty: none)"
    )
    ap.add_argument("--length", type=cli.int_list, default=None,
                    help="RULER prompt lengths in tokens")
    ap.add_argument("--samples", type=int, default=None, help="samples per RULER task and length")
    ap.add_argument("--fidelity-length", type=cli.int_list, default=None)
    ap.add_argument("--fidelity-samples", type=int, default=None)
    ap.add_argument("--cont-len", type=int, default=64, help="teacher-forced continuation tokens")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="cap on generated tokens (default: the task's own on GPU, 24 on CPU)")
    ap.add_argument(
        "--greedy",
        default=None,
        help="comma list of the tasks whose answers are generated and scored (default: all; "
        "the others get the gold answer's ΔNLL and KL only, e.g. where FullKV cannot answer)",
    )
    ap.add_argument("--data", default=None, help="folder of LongBench *.jsonl files")
    ap.add_argument(
        "--policy", default=None, help="PolyKV policy JSON (default: calibrate once, cached)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cache-dir", default=str(M.default_model_dir().parent / "policies"))
    ap.add_argument("--recalibrate", action="store_true",
                    help="calibrate PolyKV's policies again even where --cache-dir or, for the "
                         "embedded model, the repository's policies/ holds them")
    ap.add_argument(
        "--calibration-length",
        type=int,
        default=calibrate.PROMPT_LEN,
        help="tokens per PolyKV calibration prompt (default 2,048 whatever --length is: "
        "at 8K the paper's procedure did better calibrated at 8K, docs/results-8k.md)",
    )
    ap.add_argument("--plot", action="store_true", help="budget-vs-score PNG (needs matplotlib)")
    ap.add_argument(
        "--report",
        action="store_true",
        help="run nothing: summarize the prompts of --out whose every row is finished (a "
        "resumable run stopped part way), into summary.json / summary.md (+ --plot)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's; 1 is faster on a CPU shared with other jobs)",
    )
    args = ap.parse_args(argv)
    if args.report and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("--report runs in one process (no torchrun)")
    if args.methods is None:
        args.methods = ",".join(default_methods(args.suite))
    args.methods = method_list(args.methods)
    if not args.methods:
        raise UsageError(f"--methods is empty; choose from {', '.join(all_methods())}")
    bad = [m for m in args.methods if m not in all_methods() and not gracekv_variants.is_row(m)]
    for m in args.methods:
        if gracekv_variants.is_row(m) and m not in gracekv_variants.VARIANTS:
            # its settings checked before any work
            gracekv_variants.variant(m, 1)
    if bad:
        raise UsageError(f"unknown method {bad[0]!r}; choose from {', '.join(all_methods())}")
    if args.policy and not any(family(n) == "polykv" for n in args.methods):
        # refused, not ignored: its hash would go into run.json and bind later reruns to it
        raise UsageError(f"--policy is read by the PolyKV rows only (polykv, polykv-...), and "
                         f"--methods has none ({','.join(args.methods)}): add one, or leave "
                         "--policy out")
    args.tasks = list(dict.fromkeys(t for t in args.tasks.split(",") if t))
    bad = [t for t in args.tasks if t not in TK.RULER_TASKS]
    if bad:
        raise UsageError(f"unknown task {bad[0]!r}; choose from {', '.join(TK.RULER_TASKS)}")
    if args.greedy is not None:
        args.greedy = sorted({t for t in args.greedy.split(",") if t})
        bad = [t for t in args.greedy if t not in args.tasks and not args.data]
        if bad:
            raise UsageError(f"--greedy {bad[0]!r} is not among --tasks ({','.join(args.tasks)})")
    args.protocol = list(dict.fromkeys(p for p in args.protocol.split(",") if p))
    bad = [p for p in args.protocol if p not in PR.PROTOCOLS] or ([] if args.protocol else [""])
    if bad:
        raise UsageError(f"unknown protocol {bad[0]!r}; choose from {', '.join(PR.PROTOCOLS)}")
    if args.memory == "budget" and args.protocol != ["prompt"]:
        raise UsageError(
            "--memory budget runs the prompt protocol only (its evicting decoders would evict "
            "the free entries)"
        )
    ref = args.suite == "reference"
    args.budget = args.budget or ([64, 128, 512, 1024] if ref else [512])
    if min(args.budget) < 1:
        raise UsageError(f"budget must be >= 1, got {min(args.budget)}")
    check_numbers(args)
    check_files(args)
    try:
        torch.device(args.device or "cpu")
    except RuntimeError:
        raise UsageError(f"--device {args.device!r}: not a device; use cpu, cuda or cuda:N") \
            from None
    if args.device and args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(
            f"--device {args.device}: no CUDA device is available here (use --device cpu)"
        )
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib (pip install matplotlib), or leave --plot out")
    gpu = args.model is not None and torch.cuda.is_available()
    # defaults: CPU + embedded model -> sized to run in ~10 min on 2 cores; GPU -> long prompts
    # reference (CPU): 32 + 32 prompts; fidelity at 1,792 tokens so that its 32 passages (+64
    # continuation tokens each) are disjoint within the test text (61K tokens)
    if args.length is None:
        args.length = [4096, 8192, 16384] if gpu else [2048]
    if args.fidelity_length is None:
        args.fidelity_length = [4096, 8192, 16384] if gpu else [1792] if ref else [2048]
    args.samples = args.samples if args.samples is not None else (50 if gpu else 32 if ref else 6)
    args.fidelity_samples = args.fidelity_samples if args.fidelity_samples is not None else \
        (20 if gpu else 32 if ref else 4)
    # RULER lets niah generate 128 tokens; the 7-digit answers need ~10, and on a CPU every
    # token costs one decoding step per method
    if args.max_new_tokens is None:
        args.max_new_tokens = 10**6 if gpu else 24
    if not ((args.tasks and args.samples) or args.fidelity_samples or args.data):
        raise UsageError("nothing to run: no RULER prompts (--tasks, --samples), no fidelity "
                         "prompts (--fidelity-samples) and no --data")
    # equal memory: what any item may add after its prompt (continuation or generated answer)
    args.allowance = max(args.cont_len, min(args.max_new_tokens, 1024))
    args.model_name = Path(args.model).name if args.model else M.default_model_dir().name
    return args


def check_numbers(args):
    """Counts and lengths in range, before any work (a budget is checked with the methods)."""
    cli.at_least(1, threads=args.threads, max_new_tokens=args.max_new_tokens,
                 cont_len=args.cont_len, calibration_length=args.calibration_length)
    cli.at_least(0, samples=args.samples, fidelity_samples=args.fidelity_samples)
    cli.at_least(1, length=min(args.length or [1]),
                 fidelity_length=min(args.fidelity_length or [1]))


def check_files(args):
    """The paths a run reads or writes, before the model is loaded: --data a folder of LongBench
    files, --policy a file, --out a writable folder or a path one can be made at (without --out:
    runs/; --report: an existing folder, which it never creates)."""
    if args.data:
        LB.dataset_files(args.data)
    if args.policy and not Path(args.policy).is_file():
        raise UsageError(f"--policy {args.policy!r}: no such file")
    out = Path(args.out or "runs")            # without --out: a folder made in runs/
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {str(out)!r} is a file, not a folder")
    if args.report and args.out and not out.is_dir():
        raise UsageError(f"--out {str(out)!r}: no such run folder (--report summarizes the rows "
                         "of a run; it creates no folder)")
    writable_folder(out, "--out")


def method_list(text: str) -> list:
    """--methods split at commas, except inside a GraceKV row's [settings]
    (gracekv_variants.variant);
    duplicates dropped (the first kept), as --protocol does."""
    return cli.split_names(text, "--methods")


def run_allowance(args, items) -> int:
    """args.allowance grown for equal memory under context / agnostic / later questions: every
    cache also holds the exact prefix and questions, so by the most tokens a prompt with a
    question holds exact (its prefix, question, first answer if later questions follow it, and
    its longest later question)."""
    def free(it):
        gold = it.target.shape[1] if it.target is not None and it.turns else 0
        return sum(it.split) + gold + max([q.shape[1] for q, _, _ in it.turns] or [0])
    return args.allowance + max([free(it) for it in items if it.split] or [0])


# what a summary.json from before run.json leaves out at its default (engine/run_folder.py)
