"""PolyKV offline calibration: one static per-layer, per-phase policy from a small text sample.

Implements the calibration of Fei & Kalnis, "PolyKV: Heterogeneous Retention and Allocation for
KV Cache Compression" (arXiv 2606.15157, 2026; the paper's eviction-preference and
budget-sensitivity signals). A policy Π gives every layer l and
phase φ ∈ {prefill, decode} an eviction pattern r_{l,φ} and a budget b_{l,φ}, Σ_l b_{l,φ} = L·B.
It is built once from layer-specific signals, then only executed (polykv.Policy).

Read top to bottom: the calibration set, the signals (one FullKV reference pass, then one probe
per layer and rule), the construction (pattern choice, budget allocation), the file a run keeps,
the ablations as a table (`VARIANTS`), and, clearly marked, the joint calibration that is *not*
the paper's (`calibrate_joint`, `--procedure joint`). It sits in this file, after the paper's
procedure, because it reuses every piece of it (the reference pass, the pool, the allocation)
and differs in one idea: score each choice with the other layers already compressed (its
objective: the calibration text's score under a retrieval constraint, `Objective`). Last, the
placement control of the paper's later version (`placement_control`, `--shuffle N`); the
tables and plots of a policy file are in support/policy_tables.py.

Notation: B the average budget, T prompt tokens, n continuation tokens, H query heads,
D head dim, L layers, s_l a layer's budget-sensitivity signal.

Probe (l, r): compress *only* layer l with rule r at budget B, every other layer FullKV, reusing
the prompt's one FullKV prefill (polykv.observe + Policy.compress), then teacher-force the
continuation. Signals, averaged over the calibration prompts:
  eviction preference   cos_{l,φ}(r)  = mean_i cos(o_i^probe, o_i^full), o_i = layer l's attention
                                        output (H·D) at continuation token i   (higher = better)
                        ΔPPL_{l,φ}(r) = PPL_probe − PPL_full of the continuation (lower = better)
  budget sensitivity    entropy_l     = mean_{h,i} −Σ_j A[h,i,j] log A[h,i,j], continuation queries
                                        under FullKV (diffuse attention needs more budget)
                        ppl_{l,φ}     = max(0, max_r ΔPPL_{l,φ}(r)) (worst case over the pool)
Construction: r_{l,φ} = the pool rule with the best preference (ties: earlier in the pool);
b_{l,φ} = b_min + (L·B − L·b_min)·s_l/Σs, water-filled under b ≤ T, largest-remainder rounded.

[choices] (the paper leaves them open; docs/polykv.md has the measurements behind them):
- Calibration set: `tasks.calibration_texts`, passages of the *dev* split of Python's
  `pydoc_data.topics` (odd positions of the sorted topic keys, minus every paragraph that also
  occurs at an even position); the test split uses the even ones, so none is scored later.
  Defaults: 2 passages of T = 2,048 tokens (`PROMPT_LEN`; at 8K the paper's procedure needs 8K
  prompts, docs/results-8k.md) + n = 64 held-out tokens; the seed picks the offset. Cost: 2 prefills
  + L·(|pool| + 3)·2 single-layer probes (600 with the 7-rule pool) + |pool|·2 uniform runs (4x at
  8K).
- CLI threads: one by default. The probes are 64-row matmuls; on the shared 2-core machine two
  intra-op threads made them about 4x *slower* (prefill probes 140 s -> over 9 min).
- Pool: every registered rule but the random floor (`polykv.pool()`: streaming, h2o, tova,
  snapkv, knorm, expected, kvzip, and any rule registered later), all probed at the same budget B.
  Not
  pyramidkv: at a fixed layer budget it *is* snapkv; its schedule belongs to the allocation side.
- Decode: probed after the prefill rules are chosen. Layer l's prompt is compressed to B by its
  chosen prefill rule, then the n continuation tokens run with decode rule d ∈ {streaming, h2o,
  tova} at decode budget B, so d evicts once per token (n evictions). `append` is not a rule at
  a fixed budget and is never chosen. Every layer keeps its chosen decode rule, even where its
  decode budget exceeds its prefill budget by more than the n calibration tokens (it then
  evicts only later): so the decode total stays L·B however long the generation. With the
  entropy signal both phases get the same budgets, so every layer evicts from the first
  generated token on and never exceeds b_l.
- Uniform baselines (the best single rule, for the budget-only ablation): every rule compresses
  the prompt to B, then *appends* the n tokens, so all hold the same L·G·(B + n) entries
  (`uniform_run`, equal memory as in the harness).
- b_min = ⌊B/4⌋; budgets capped at T (the calibration prompt length).
- Fast path: a probe leaves layers < l untouched, so it starts from the continuation's FullKV
  input to layer l (kept from one reference pass), runs layer l (token by token when its decode
  rule evicts, as model.decode does) and layers > l in one step. The tests compare it with the
  naive full-model probe (polykv.prefill + model.decode).
"""
from __future__ import annotations

import functools
import inspect
import json
import math
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import baselines  # noqa: F401  (K-norm, Expected Attention, KVzip: rules of the pool)
import model as M
import polykv
from model import Hooks
from polykv import LayerPolicy, Policy, RuleSettings, largest_remainder
from support import cli, tasks
from support.errors import UsageError
from support.files import write_atomic
from support.policy_tables import describe, placement, plot

# the calibration text; a cached policy calibrated on another text is never reused (file name)
TEXT = "pydoc_data.topics, dev split: odd sorted topics minus paragraphs repeated in test"
TEXT_VERSION = "dev2"
# calibration prompt and held-out continuation tokens, by default
PROMPT_LEN, CONT_LEN = 2048, 64


# ----------------------------------------------------------------------------- the calibration set

def check_args(budget: int, n_prompts: int, prompt_len: int, cont_len: int, b_min=None):
    """User mistakes, caught before any model is loaded."""
    if budget < 1:
        raise UsageError(f"budget must be >= 1, got {budget}")
    if n_prompts < 1 or cont_len < 2:
        raise UsageError(f"need n_prompts >= 1 and cont_len >= 2, got {n_prompts}, {cont_len}")
    if prompt_len <= budget:
        raise UsageError(
            f"calibration prompts ({prompt_len} tokens) must be longer than the budget {budget}"
        )
    if b_min is not None and not 0 <= b_min <= budget:
        raise UsageError(f"b_min must be in [0, B={budget}], got {b_min}")


def calibration_set(tok, budget: int, n_prompts: int, prompt_len: int, cont_len: int, seed: int,
                    b_min=None, needles: int = 0) -> list:
    """[(prompt_ids, cont_ids)]: n_prompts dev passages (tasks.calibration_texts) and `needles`
    dev-split niah_single_1 prompts with their gold answer as the continuation
    (tasks.calibration_needles); arguments checked before any probe runs."""
    check_args(budget, n_prompts, prompt_len, cont_len, b_min)
    return (tasks.calibration_texts(tok, n_prompts, prompt_len, cont_len, seed)
            + tasks.calibration_needles(tok, needles, prompt_len, seed))


def with_prompt(settings: RuleSettings, tok) -> RuleSettings:
    """settings with KVzip's reconstruction prompt in tok's vocabulary, if it has none yet."""
    return settings if settings.repeat or tok is None else \
        RuleSettings(**{**settings.__dict__, "repeat": tasks.reconstruction_prompt(tok)})


def set_meta(
    model, tok, texts, budget: int, seed: int, model_name: str, needles: int, b_min=None
) -> tuple:
    """(T, n, meta) of a calibration set, checked: the shortest prompt and continuation, and what
    a policy file records about the set."""
    T, n = min(len(p) for p, _ in texts), min(len(c) for _, c in texts)
    check_args(budget, len(texts), T, n, b_min)
    # one line, before any probe
    if max(len(p) + len(c) for p, c in texts) > model.config.max_seq_len:
        raise UsageError(
            f"calibration prompts of {T} (+{n}) tokens exceed the model's maximum "
            f"{model.config.max_seq_len}"
        )
    return T, n, {"model": model_name, "seed": seed, "calibration": {
        "source": TEXT if tok else "given", "n_prompts": len(texts), "prompt_len": T, "cont_len": n,
        "needles": needles, "pool": list(polykv.pool())}}


# ----------------------------------------------------------------------------- signals

def cosine(out, out_ref) -> float:
    """The paper's preference signal: mean over continuation tokens of the cosine between two
    attention outputs (1, H, n, D) of one layer, over H·D."""
    return float(F.cosine_similarity(out.transpose(1, 2).flatten(2).double(),
                                     out_ref.transpose(1, 2).flatten(2).double(), dim=-1).mean())


def _nll(model, x, cont) -> float:
    """Σ −log p(cont_{i+1} | ≤ i) from the last hidden states x (B, n, dim); cont_0 is predicted
    by the prompt's last logits, the same for every probe, so it is left out."""
    logits = model.lm_head(model.norm(x)).float()                             # (B, n, V)
    return float(F.cross_entropy(logits[0, :-1], cont[0, 1:], reduction="sum"))


@torch.no_grad()
def reference(model, prompt, cont, settings: RuleSettings) -> dict:
    """One FullKV prefill of prompt (1, T) with every pool statistic, then the continuation
    cont (1, n) under FullKV, one layer at a time: each layer's input x_l (1, n, dim), its
    attention output (1, H, n, D), its attention entropy, the continuation's NLL and the last
    layer's output `last` (1, n, dim)."""
    L = model.config.n_layers
    # every pool rule's needs
    pool = [Policy.uniform(r, 1, L, settings=settings) for r in polykv.pool()]
    full, obs = polykv.observe_for(model, prompt, pool)
    T, n = prompt.shape[1], cont.shape[1]
    pos = torch.arange(T, T + n, device=cont.device)[None]                   # (1, n)
    rec = {}

    def spy(layer, q, q_pos, lc, out):
        A = M.attention_probs(q, lc.k, lc.bias, q_pos, lc.pos)               # (1, H, n, T+n)
        rec[layer] = (out, -torch.xlogy(A, A).sum(-1).mean())                # H = −Σ_j A log A

    xs = []
    # (1, n, dim)
    x = M.run_layers(
        model, model.embed_tokens(cont), pos, full.layers, 0, Hooks(post_kernel=spy), xs
    )
    entropy = torch.stack([rec[l][1] for l in range(L)]).tolist()   # one read, after every layer
    return {"full": full, "obs": obs, "cont": cont, "pos": pos, "xs": xs,
            "out": [rec[l][0] for l in range(L)], "entropy": entropy,
            "nll": _nll(model, x, cont), "last": x}


def probe_policy(L: int, layer: int, prefill: tuple, decode: tuple, budget: int,
                 settings: RuleSettings = RuleSettings()) -> Policy:
    """Only `layer` compressed (prefill (rule, b), decode (rule, b)); every other layer FullKV."""
    keep = LayerPolicy(("full", budget), ("append", budget))
    return Policy([LayerPolicy(prefill, decode) if l == layer else keep for l in range(L)],
                  budget, settings)


@torch.no_grad()
def probe(model, ref: dict, layer: int, policy: Policy):
    """(cos, nll): layer's output cosine to FullKV on the continuation and the NLL sum, with
    `policy` (a probe_policy for `layer`) applied to the shared FullKV prefill of ref."""
    cache = policy.compress(model, ref["full"], ref["obs"])                  # full left untouched
    seen = []

    def spy(l, q, q_pos, lc, out):       # layer l's attention output (1, H, n, D)
        seen.append(out)
    dec = policy.decoder                 # decode rule evicts: one token at a time, as model.decode
    hooks = Hooks(post_kernel=spy, cache_update=dec.cache_update if dec else None)
    x, pos, lc = ref["xs"][layer], ref["pos"], cache.layers[layer]
    steps = [slice(i, i + 1) for i in range(x.shape[1])] if dec else [slice(None)]
    ys = []
    for s in steps:
        y, lc = model.layers[layer](
            x[:, s], pos[:, s], lc, model.inv_freq, layer, hooks, model.sdpa
        )
        ys.append(y)
    # FullKV above (1, n, dim)
    x = M.run_layers(model, torch.cat(ys, 1), pos, ref["full"].layers, layer + 1)
    return cosine(torch.cat(seen, 2), ref["out"][layer]), _nll(model, x, ref["cont"])


def measure(model, pairs, budget: int, preference: str = "cosine",
            settings: RuleSettings = RuleSettings(), log=None) -> dict:
    """Every signal, JSON-ready. pairs: [(prompt_ids, cont_ids)]; the decode probes use the
    prefill rules chosen by `preference`."""
    L, dev = model.config.n_layers, model.device
    log = log or quiet
    refs = []
    for i, (p, c) in enumerate(pairs):
        t0 = time.time()
        refs.append(
            reference(model, torch.tensor([p], device=dev), torch.tensor([c], device=dev), settings)
        )
        log(
            f"prompt {i + 1}/{len(pairs)}: FullKV prefill of {len(p)} + {len(c)} tokens "
            f"({time.time() - t0:.0f} s)"
        )
    count = sum(len(c) - 1 for _, c in pairs)

    def ppl(nll):                                                            # PPL = exp(mean NLL)
        return math.exp(nll / count)
    ppl_full = ppl(sum(r["nll"] for r in refs))
    sig = {"entropy": [sum(r["entropy"][l] for r in refs) / len(refs) for l in range(L)],
           "ppl_full": ppl_full}

    def run(phase, rules, prefill_of):
        t0 = time.time()
        cosine, dppl = {r: [] for r in rules}, {r: [] for r in rules}
        for l in range(L):
            if l and l % 5 == 0:
                eta = (time.time() - t0) / l * (L - l)
                log(
                    f"{phase} probes: layer {l}/{L}, {time.time() - t0:.0f} s, ETA {eta:.0f} s "
                    f"for this phase"
                )
            for r in rules:
                pre, dec = (r, budget), ("append", budget)
                if phase == "decode":
                    pre, dec = (prefill_of[l], budget), (r, budget)
                res = [
                    probe(model, ref, l, probe_policy(L, l, pre, dec, budget, settings))
                    for ref in refs
                ]
                cosine[r].append(sum(c for c, _ in res) / len(res))
                dppl[r].append(ppl(sum(nl for _, nl in res)) - ppl_full)
        log(
            f"{phase} probes: {L} layers x {len(rules)} rules x {len(refs)} prompts "
            f"({time.time() - t0:.0f} s)"
        )
        return {"cosine": cosine, "dppl": dppl}

    pool = polykv.pool()
    sig["prefill"] = run("prefill", pool, None)
    sig["decode_probe_prefill"] = best_rules(sig["prefill"], pool, preference)
    sig["decode"] = run("decode", polykv.decode_pool(), sig["decode_probe_prefill"])
    # the uniform baselines on the same text (every layer compressed), so that the harness's
    # budget-only ablation can take the best single rule without seeing eval data
    t0 = time.time()
    sig["uniform_dppl"], sig["uniform_memory"] = {}, UNIFORM_MEMORY
    for r in pool:
        nll = sum(uniform_run(model, ref, r, budget, settings)[0] for ref in refs)
        sig["uniform_dppl"][r] = ppl(nll) - ppl_full
    log(f"uniform baselines: {len(pool)} rules x {len(refs)} prompts ({time.time() - t0:.0f} s)")
    return sig


# at equal memory: how the calibration's uniform baselines run (a policy file records it)
UNIFORM_MEMORY = "equal: every rule appends the continuation"


@torch.no_grad()
def uniform_run(model, ref: dict, rule: str, budget: int, settings: RuleSettings) -> tuple:
    """(NLL sum, cache after the continuation): every layer's prompt compressed by `rule` to
    `budget`, then the continuation teacher-forced with every rule *appending* (no decode-time
    eviction), so each holds L·G·(B + n) entries at the end whatever its own decode form: the
    rules compete at equal memory, as in the harness (docs/protocol.md)."""
    uni = Policy.uniform(rule, budget, model.config.n_layers, decode="append", settings=settings)
    cache = uni.compress(model, ref["full"], ref["obs"])
    logits = M.decode(model, ref["cont"], cache)                          # (1, n, V)
    nll = float(F.cross_entropy(logits[0, :-1], ref["cont"][0, 1:], reduction="sum"))
    return nll, cache


# ----------------------------------------------------------------------------- construction

def allocate(signal, total: int, b_min: int, cap: int) -> list:
    """Integers b_l with Σ b_l = total, b_min <= b_l <= cap, non-decreasing in the signal.

    Reals: b_l = b_min + (total − L·b_min)·s_l/Σs (all s = 0: uniform); a layer above cap is
    fixed at cap and the rest re-spread over the others (water-filling); then largest-remainder
    rounding, ties to the larger signal so that s_i > s_j ⇒ b_i >= b_j."""
    L = len(signal)
    if L == 0 or any(not s >= 0 for s in signal):
        raise UsageError(f"signals must be non-negative numbers, got {list(signal)}")
    if not (0 <= b_min <= cap and L * b_min <= total <= L * cap):
        raise UsageError(f"cannot give {L} layers {total} entries with {b_min} <= b_l <= {cap}")
    s = list(signal) if sum(signal) > 0 else [1.0] * L
    capped = set()
    while True:
        free = [l for l in range(L) if l not in capped]
        rest = total - cap * len(capped) - b_min * len(free)              # spread ∝ s over free
        s_free = sum(s[l] for l in free)
        reals = [
            (
                float(cap)
                if l in capped
                else b_min + (rest * s[l] / s_free if s_free > 0 else rest / len(free))
            )
            for l in range(L)
        ]
        over = {l for l in free if reals[l] > cap}
        if not over or len(over) == len(free):
            break
        capped |= over
    order = sorted(range(L), key=lambda l: -s[l])                         # stable: ties by index
    ints = polykv.largest_remainder([reals[l] for l in order], total)
    out = [0] * L
    for rank, l in enumerate(order):
        out[l] = ints[rank]
    return out


def best_rules(phase_signals: dict, pool, preference: str) -> list:
    """Per layer, argmax cos (or argmin ΔPPL) over the pool; ties to the earlier rule."""
    if preference not in ("cosine", "ppl"):
        raise UsageError(f"preference must be cosine|ppl, got {preference!r}")
    # cosine: higher is better (its negative is minimised); ΔPPL: lower is better
    signal, sign = (phase_signals["cosine"], -1) if preference == "cosine" else \
        (phase_signals["dppl"], 1)
    L = len(phase_signals["cosine"][pool[0]])
    return [min(pool, key=lambda r: sign * signal[r][l]) for l in range(L)]


def sensitivity_of(sig: dict, phase: str, sensitivity: str) -> list:
    if sensitivity == "entropy":
        return sig["entropy"]
    return [
        max(0.0, *(d[l] for d in sig[phase]["dppl"].values())) for l in range(len(sig["entropy"]))
    ]


def build(sig: dict, budget: int, preference: str = "cosine", sensitivity: str = "entropy",
          b_min=None, cap: int = None, settings: RuleSettings = RuleSettings(),
          meta: dict = None) -> Policy:
    """The static policy from the signals (see the module docstring's construction)."""
    if preference not in ("cosine", "ppl") or sensitivity not in ("entropy", "ppl"):
        raise UsageError(f"preference must be cosine|ppl and sensitivity entropy|ppl, "
                         f"got {preference!r}, {sensitivity!r}")
    L = len(sig["entropy"])
    b_min = budget // 4 if b_min is None else b_min
    if not 0 <= b_min <= budget:
        raise UsageError(f"b_min must be in [0, B={budget}], got {b_min}")
    cap = L * budget if cap is None else cap
    pool = list(sig["prefill"]["cosine"])            # the pool the signals were measured on
    chosen = best_rules(sig["prefill"], pool, preference)
    if chosen != sig.get("decode_probe_prefill", chosen):
        raise UsageError(f"the decode signals were measured under the prefill rules another "
                         f"preference chose: measure with preference={preference!r}")
    rules = {"prefill": chosen,
             "decode": best_rules(sig["decode"], list(sig["decode"]["cosine"]), preference)}
    b = {ph: allocate(sensitivity_of(sig, ph, sensitivity), L * budget, b_min, cap)
         for ph in ("prefill", "decode")}
    layers = []
    for l in range(L):          # Σ_l b_{l,dec} = L·B: every layer evicts beyond its own budget
        layers.append(LayerPolicy((rules["prefill"][l], b["prefill"][l]),
                                  (rules["decode"][l], b["decode"][l])))
    meta = {**(meta or {}), "method": "polykv", "procedure": "paper", "preference": preference,
            "sensitivity": sensitivity, "b_min": b_min, "cap": cap,
            "signals": sig}
    if "uniform_dppl" in sig:     # the best single rule at this budget, for budget_only
        meta["best_uniform"] = min(pool, key=lambda r: sig["uniform_dppl"][r])
    return Policy(layers, budget, settings, meta)


# -------------------------------------------------------------------- calibrate once, keep the file


def calibrate(model, tok, budget: int, seed: int = 0, n_prompts: int = 2,
              prompt_len: int = PROMPT_LEN, cont_len: int = CONT_LEN, preference: str = "cosine",
              sensitivity: str = "entropy", b_min=None, settings: RuleSettings = RuleSettings(),
              texts=None, model_name: str = "", log=None) -> Policy:
    """The paper's procedure: measure the signals on the calibration set once and build the
    policy. texts: optional [(prompt_ids, cont_ids)] in place of `calibration_set` (then tok
    is unused)."""
    if texts is None:
        texts = calibration_set(tok, budget, n_prompts, prompt_len, cont_len, seed, b_min)
    settings = with_prompt(settings, tok)
    T, n, meta = set_meta(model, tok, texts, budget, seed, model_name, 0, b_min)
    sig = measure(model, texts, budget, preference, settings, log)
    return build(sig, budget, preference, sensitivity, b_min, cap=T,
                 settings=settings, meta=meta)


def policy_path(
    model_name: str, budget: int, seed: int, cache_dir, procedure="paper", prompt_len=PROMPT_LEN
) -> Path:
    """Where policy_for keeps the policy of (procedure, model, budget, seed, text, prompt length ≠
    default)."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", model_name)
    kind = "polykv" if procedure == "paper" else f"polykv-{procedure}"
    length = "" if prompt_len == PROMPT_LEN else f"-T{prompt_len}"
    return Path(cache_dir) / f"{kind}-{name}-B{budget}{length}-seed{seed}-{TEXT_VERSION}.json"


# the embedded default model's calibrated policies, shipped with the repository (the same files
# its calibration writes; `evaluate.py --recalibrate` makes them again)
SHIPPED = Path(__file__).resolve().parent / "policies"


def policy_for(model, tok, model_name: str, budget: int, seed: int = 0, cache_dir="runs/policies",
               procedure: str = "paper", shipped=None, recalibrate: bool = False,
               **kw) -> Policy:
    """Calibrate once per (procedure, model name, budget, seed) and keep the JSON in cache_dir;
    later calls load it. shipped: a folder of policies made the same way (SHIPPED for the
    embedded model), read where cache_dir has none. A file is used only if the calibration
    settings it records are those asked (else one line says which differ); recalibrate: neither
    is read, the calibration runs and its file replaces the cached one. kw: the procedure's own
    arguments (PROCEDURES)."""
    if procedure not in PROCEDURES:
        raise UsageError(f"procedure must be one of {', '.join(PROCEDURES)}, got {procedure!r}")
    length = kw.get("prompt_len", PROMPT_LEN)
    path = policy_path(model_name, budget, seed, cache_dir, procedure, length)
    found = [] if recalibrate else [path]
    if shipped is not None and not recalibrate:
        found.append(policy_path(model_name, budget, seed, shipped, procedure, length))
    asked = recipe(procedure, model_name, budget, seed, tok, kw)
    for known in found:
        if known.exists():
            return checked(model, known, asked)
    policy = PROCEDURES[procedure](model, tok, budget, seed, model_name=model_name, **kw)
    path.parent.mkdir(parents=True, exist_ok=True)
    policy.save(path)
    return policy


def checked(model, path: Path, asked: dict) -> Policy:
    """The policy file `path`, if it was made by what is asked now (`recipe`): else a UsageError
    naming every difference, on one line."""
    policy = Policy.load(path, n_layers=model.config.n_layers)    # wrong layer count: UsageError
    have = {**recorded(policy), "format": json.loads(path.read_text()).get("format")}
    diff = [f"{k}={have.get(k)!r} (asked {v!r})" for k, v in asked.items() if have.get(k) != v]
    if diff:
        raise UsageError(f"{str(path)!r} was calibrated with {', '.join(diff)}: remove it or "
                         "pass --recalibrate")
    return policy


def recipe(procedure: str, model_name: str, budget: int, seed: int, tok, kw: dict) -> dict:
    """Every argument that makes a policy, as asked: the procedure (and its objective), the model,
    budget and seed, the calibration set (its text, prompts, lengths, needles), today's pool, the
    rules' settings (with KVzip's prompt in tok's vocabulary), b_min, the signals, the joint
    options; the procedure's defaults where kw leaves them out."""
    fn = PROCEDURES[procedure]
    defaults = {name: p.default for name, p in
                inspect.signature(getattr(fn, "func", fn)).parameters.items()
                if p.default is not inspect.Parameter.empty}
    args = {**defaults, **getattr(fn, "keywords", {}), **kw}
    settings = args["settings"] if tok is None else with_prompt(args["settings"], tok)
    asked = {"format": polykv.POLICY_FORMAT, "model": model_name, "budget": budget, "seed": seed,
             "pool": list(polykv.pool()),
             "n_prompts": args["n_prompts"], "prompt_len": args["prompt_len"],
             "cont_len": args["cont_len"], "settings": settings.__dict__}
    asked["source"] = TEXT if tok is not None else "given"         # as set_meta records it
    if args.get("texts") is not None:                               # given texts: their lengths
        asked.update(n_prompts=len(args["texts"]),
                     prompt_len=min(len(p) for p, _ in args["texts"]),
                     cont_len=min(len(c) for _, c in args["texts"]))
    if procedure == "paper":
        b_min = budget // 4 if args["b_min"] is None else args["b_min"]
        asked.update(procedure="paper", preference=args["preference"],
                     sensitivity=args["sensitivity"], b_min=b_min, needles=0,
                     uniform_memory=UNIFORM_MEMORY)
    else:
        asked.update(procedure="joint", signal=args["signal"], needles=args["needles"],
                     probes=args["probes"], retrieval=args["retrieval"])
    return asked


def recorded(policy: Policy) -> dict:
    """What a policy file says made it, keyed as `recipe` (a joint file written before its
    objective was recorded: the text-only one)."""
    meta, cal = policy.meta, policy.meta.get("calibration", {})
    have = {"model": meta.get("model"), "budget": policy.budget, "seed": meta.get("seed"),
            "procedure": meta.get("procedure"), "settings": dict(policy.settings.__dict__),
            **{k: cal.get(k) for k in ("source", "n_prompts", "prompt_len", "cont_len",
                                       "needles", "pool")}}
    if meta.get("procedure") == "paper":
        have.update({k: meta.get(k) for k in ("preference", "sensitivity", "b_min")},
                    uniform_memory=meta.get("signals", {}).get("uniform_memory"))
    else:
        have.update(signal=meta.get("signals", {}).get("signal"),
                    probes=cal.get("probes", 0), retrieval=cal.get("retrieval"))
    return have


# ----------------------------------------------------------------------------- ablations

def pattern_only(policy: Policy) -> Policy:
    """The calibrated rules with the uniform budget B in both phases."""
    B = policy.budget
    layers = [LayerPolicy((lp.prefill.rule, B), (lp.decode.rule, B)) for lp in policy.layers]
    return Policy(layers, B, policy.settings, {**policy.meta, "ablation": "pattern_only"})


def prefill_only(policy: Policy) -> Policy:
    """The calibrated prefill phase (rules and budgets); no eviction while decoding (`append`),
    as uniform SnapKV and PyramidKV do. Isolates what the decode-phase calibration costs or buys."""
    layers = [LayerPolicy(lp.prefill, ("append", lp.prefill.budget)) for lp in policy.layers]
    return Policy(
        layers, policy.budget, policy.settings, {**policy.meta, "ablation": "prefill_only"}
    )


def budget_only(policy: Policy, rule: str) -> Policy:
    """One uniform rule (its own decode form) with the calibrated budgets."""
    if rule not in polykv.RULES:
        raise UsageError(f"unknown rule {rule!r}; choose from {', '.join(polykv.RULES)}")
    dec = polykv.RULES[rule].decode
    layers = [
        LayerPolicy((rule, lp.prefill.budget), (dec, lp.decode.budget)) for lp in policy.layers
    ]
    return Policy(
        layers, policy.budget, policy.settings, {**policy.meta, "ablation": f"budget_only:{rule}"}
    )


def budget_from_best(policy: Policy) -> Policy:
    """budget_only with the best uniform rule on the calibration text (never on evaluation data)."""
    return budget_only(policy, policy.meta.get("best_uniform", "snapkv"))


def decode_with(policy: Policy, rule: str) -> Policy:
    """The calibrated prefill phase and decode budgets, with one decode rule for every layer:
    what the per-layer choice of decode rules adds over a single one, at the same memory."""
    if rule not in polykv.decode_pool():
        raise UsageError(f"unknown decode rule {rule!r}; choose from "
                         f"{', '.join(polykv.decode_pool())}")
    layers = [LayerPolicy(lp.prefill, (rule, lp.decode.budget)) for lp in policy.layers]
    return Policy(layers, policy.budget, policy.settings,
                  {**policy.meta, "ablation": f"decode_with:{rule}"})


def as_calibrated(policy: Policy) -> Policy:
    """The calibrated policy itself (the row of the procedure, no ablation)."""
    return policy


# The PolyKV rows of the harness (evaluate.py --methods): name -> (procedure, transform of its
# calibrated policy). `polykv` is the paper's; `polykv-joint` is past the paper (below).
VARIANTS = {"polykv": ("paper", as_calibrated),
            "polykv-pattern": ("paper", pattern_only),          # chosen rules, uniform budgets
            "polykv-budget": ("paper", budget_from_best),       # best uniform rule, chosen budgets
            "polykv-prefill": ("paper", prefill_only),          # no decode-time eviction
            # one decode rule for every layer, the calibrated budgets (docs/polykv.md)
            "polykv-decode-streaming": ("paper", functools.partial(decode_with, rule="streaming")),
            "polykv-decode-h2o": ("paper", functools.partial(decode_with, rule="h2o")),
            "polykv-decode-tova": ("paper", functools.partial(decode_with, rule="tova")),
            "polykv-joint": ("joint", as_calibrated),
            "polykv-joint-pattern": ("joint", pattern_only),
            "polykv-joint-budget": ("joint", budget_from_best),
            "polykv-joint-text": ("joint-text", as_calibrated),     # the text-only objective
            "polykv-joint-weighted": ("joint-weighted", as_calibrated)}   # text + 0.1·probe loss


# ============================================================ past the paper: the joint calibration
# PolyKV past the paper: a calibration that sees the other layers (`calibrate.py --procedure
# joint`).
#
# The paper's calibration (calibrate.py) probes each layer alone, every other layer FullKV, and
# ranks rules by that layer's output cosine. On the embedded model this puts StreamingLLM on a
# third of the layers at B = 128: each is harmless alone, together they drop the same middle of
# the prompt (docs/polykv.md, "Past the paper"). This procedure scores every choice
# with the rest of the network already compressed:
#
#  1. Start: the best uniform rule on the calibration text, by end-to-end KL (below).
#  2. Sweep the layers l = 0..L−1: for each rule r of the pool, layer l compressed by r at B and
#     every other layer by the current policy; keep the r with the lowest score if it beats the
#     current choice by more than `tol` (relative). Repeat until a sweep changes nothing, at most
#     `sweeps` times (coordinate descent on the calibration objective).
#  3. Budgets (optional signal, kept only if it helps on the calibration text): s_l = the KL
#     increase when layer l's budget is halved under the current policy; budgets
#     b = (1 − α)·B + α·allocate(s, L·B, B/4, T) for α ∈ {½, 1} (calibrate.allocate: water-filled,
#     largest-remainder rounded, Σ b = L·B); the α (or uniform) with the lowest end-to-end KL wins.
#
# Score (`signal`):
#   "cosine": layer l's attention output vs FullKV's, mean cosine over continuation tokens, under
#             the compressed background (the paper's signal, measured where it will be used);
#   "kl":     KL(FullKV ‖ policy) of the held-out continuation, mean over its n positions and the
#             prompts: Σ_v p(v) (log p(v) − log q(v)), the harness's fidelity metric
# (evaluate.compare).
# [choice: cosine, on dev (docs/polykv.md): the end-to-end KL of 2 × 64 tokens overfits them and
# lost every dev needle at B = 128]. The starting rule and the budget step are scored by the KL.
#
# Cost: one FullKV prefill per prompt (`reference`) and one compression per pool rule;
# a candidate for layer l re-runs only layers l..L−1 of the n continuation tokens (layers < l see
# the same inputs under every candidate: the stream entering each layer is kept).
# [choices]: the continuation is teacher-forced with appends (no decode-time eviction: under equal
# memory a layer's decode rule evicts only beyond the generation allowance, and n is within it);
# each layer's decode rule is its prefill rule's own decode form (as a uniform rule).

def log_probs(model, x) -> torch.Tensor:
    """log p over the vocabulary (n, V) fp32 from the last hidden states x (1, n, dim)."""
    return torch.log_softmax(model.lm_head(model.norm(x)).float()[0], -1)


def kl(ref_lp, lp) -> float:
    """KL(FullKV ‖ q) summed over the vocabulary, mean over positions (evaluate.compare's kl)."""
    return float((ref_lp.exp() * (ref_lp - lp)).sum(-1).clamp_min(0).mean())


def run_from(model, ref, layer: int, x, caches) -> tuple:
    """Layers layer..L−1 on the continuation's stream x (1, n, dim) entering `layer`, layer l
    attending to caches[l]: (log p (n, V), [stream entering each layer > layer], layer's output)."""
    seen, xs = [], []

    def spy(l, q, q_pos, lc, out):       # the starting layer's attention output
        if l == layer:
            seen.append(out)
    x = M.run_layers(model, x, ref["pos"], caches, layer, Hooks(post_kernel=spy), xs)
    return log_probs(model, x), xs[1:], seen[0]


def policy_of(assign, budgets, settings, meta=None) -> Policy:
    """Layer l: (rule, b_l) at prefill, the rule's own decode form at b_l; B = mean b_l."""
    return Policy(
        [LayerPolicy((r, b), (polykv.RULES[r].decode, b)) for r, b in zip(assign, budgets)],
        sum(budgets) // len(budgets),
        settings,
        meta or {},
    )


def answer_dnll(ref, lp) -> float:
    """A retrieval probe's loss: the gold answer's NLL per token under the policy minus under
    FullKV, over answer tokens 1..n−1 (token 0 is predicted by the prompt's last logits, the same
    for every policy)."""
    tgt = ref["cont"][0, 1:, None]
    return float((ref["lp"][:-1].gather(1, tgt) - lp[:-1].gather(1, tgt)).mean())


@dataclass
class Trial:
    """One candidate policy scored on the calibration set: its text score (lower is better:
    the KL, or −cosine of the layer tried), the text KL, the probes' answer ΔNLL and the streams
    entering each later layer, per prompt (texts, then probes)."""
    text: float
    kl: float
    probe: float
    streams: list


class Objective:
    """How the retrieval probes enter the joint procedure [choice: docs/polykv.md, dev table].

    None: text only (the probes, if any, are measured, not used). A float w: the text score
    plus w·(probe answer ΔNLL). "constraint": a candidate is admissible only if its probe
    answer ΔNLL is at most τ, the best uniform rule's; among admissible ones the text score
    decides (the start is then the best-on-text uniform rule among the admissible)."""

    def __init__(self, retrieval):
        if not (retrieval is None or retrieval == "constraint" or isinstance(retrieval, float)):
            raise UsageError(f"retrieval must be None, 'constraint' or a weight, got {retrieval!r}")
        self.mode, self.tau = retrieval, math.inf

    def key(self, t: Trial, text: float = None) -> float:
        text = t.text if text is None else text
        if self.mode == "constraint":
            return text if t.probe <= self.tau + 1e-12 else math.inf
        return text + (self.mode * t.probe if isinstance(self.mode, float) else 0.0)


@torch.no_grad()
def measure_joint(
    model,
    pairs,
    budget: int,
    signal: str = "cosine",
    sweeps: int = 3,
    tol: float = 0.0,
    budget_signal: bool = True,
    settings: RuleSettings = RuleSettings(),
    log=None,
    probes=(),
    retrieval=None,
) -> dict:
    """Every signal of the joint procedure and the chosen rules/budgets, JSON-ready. pairs: the
    text (prompt, continuation) pairs; probes: retrieval probes (prompt, answer); retrieval:
    how the probes enter the choice (`Objective`)."""
    L, dev, pool = model.config.n_layers, model.device, polykv.pool()
    log, goal, n_text = log or quiet, Objective(retrieval), len(pairs)
    t0 = time.time()
    refs = []
    for p, c in list(pairs) + list(probes):
        ref = reference(
            model, torch.tensor([p], device=dev), torch.tensor([c], device=dev), settings
        )
        ref["lp"] = log_probs(model, ref.pop("last"))
        refs.append(ref)
    comp = {
        r: [
            Policy.uniform(r, budget, L, settings=settings).compress(model, ref["full"], ref["obs"])
            for ref in refs
        ]
        for r in pool
    }
    log(f"{len(refs)} FullKV prefills and {len(pool)} compressions ({time.time() - t0:.0f} s)")
    x0 = [model.embed_tokens(ref["cont"]) for ref in refs]   # each prompt's stream into layer 0
    prompts = range(len(refs))

    def evaluate(layer, caches, entering) -> Trial:
        """Every prompt i run from `layer` with its layer caches caches[i] (L) and the stream
        entering[i] (1, n, dim) into that layer."""
        kls, coss, dn, streams = [], [], [], []
        for i, ref in enumerate(refs):
            lp, xs, out = run_from(model, ref, layer, entering[i], caches[i])
            if i < n_text:
                kls.append(kl(ref["lp"], lp))
                coss.append(cosine(out, ref["out"][layer]))
            else:
                dn.append(answer_dnll(ref, lp))
            streams.append(xs)
        text = mean_or_zero(kls) if signal == "kl" else -mean_or_zero(coss)
        return Trial(text, mean_or_zero(kls), mean_or_zero(dn), streams)

    # 1. the start: the best uniform rule by end-to-end KL (admissible under the objective)
    uniform = {r: evaluate(0, [c.layers for c in comp[r]], x0) for r in pool}
    if goal.mode == "constraint":
        goal.tau = min(uniform[r].probe for r in pool)
    start = min(pool, key=lambda r: goal.key(uniform[r], uniform[r].kl))
    assign, cur = [start] * L, uniform[start]
    xs = [[x0[i]] + cur.streams[i] for i in range(len(refs))]         # stream entering each layer
    sig = {"signal": signal, "uniform_kl": {r: uniform[r].kl for r in pool}, "start": start,
           "sweeps": []}
    if probes:
        sig.update(retrieval=retrieval, tau=None if goal.tau == math.inf else goal.tau,
                   uniform_probe={r: uniform[r].probe for r in pool})
    log(
        "uniform rules, KL on the calibration text: "
        + ", ".join(f"{r} {uniform[r].kl:.4f}" for r in pool)
        + (
            "; probe answer ΔNLL: " + ", ".join(f"{r} {uniform[r].probe:.3f}" for r in pool)
            if probes
            else ""
        )
        + f"; start from {start}"
    )

    # 2. sweeps over the layers: every rule at layer l, the other layers as chosen so far
    def layers_of(rules):        # per prompt, layer l compressed by rules[l]
        return [[comp[rules[l]][i].layers[l] for l in range(L)] for i in prompts]

    for sweep in range(sweeps):
        changed, scores, probe_scores = [], [], []
        for l in range(L):
            cand = {}
            for r in pool:
                trial = assign[:l] + [r] + assign[l + 1:]
                cand[r] = evaluate(l, layers_of(trial), [xs[i][l] for i in prompts])
            best = min(pool, key=lambda r: goal.key(cand[r]))
            scores.append({r: cand[r].text for r in pool})
            probe_scores.append({r: cand[r].probe for r in pool})
            now = goal.key(cand[assign[l]])
            if best != assign[l] and goal.key(cand[best]) < now - tol * abs(now):
                changed.append((l, assign[l], best))
                assign[l], cur = best, cand[best]
                for i in range(len(refs)):
                    xs[i][l + 1:] = cand[best].streams[i]
        sig["sweeps"].append(
            {"scores": scores, "changed": changed, "kl": cur.kl,
             **({"probe_scores": probe_scores, "probe": cur.probe} if probes else {})}
        )
        log(
            f"sweep {sweep + 1}: {len(changed)} layers changed, KL {cur.kl:.4f}"
            + (f", probe answer ΔNLL {cur.probe:.3f}" if probes else "")
            + f" ({time.time() - t0:.0f} s)"
        )
        if not changed:
            break

    # 3. budgets: the KL increase when one layer's budget is halved, kept only if it helps
    budgets, final = [budget] * L, cur
    if budget_signal and budget >= 2:
        half = {
            r: [
                Policy.uniform(r, budget // 2, L, settings=settings).compress(
                    model, ref["full"], ref["obs"]
                )
                for ref in refs
            ]
            for r in set(assign)
        }
        sens = []
        for l in range(L):
            halved = [[half[assign[l]][i].layers[k] if k == l else comp[assign[k]][i].layers[k]
                       for k in range(L)] for i in prompts]           # layer l at half its budget
            sens.append(max(0.0, evaluate(l, halved, [xs[i][l] for i in prompts]).kl - cur.kl))
        T = min(ref["full"].layers[0].k.shape[2] for ref in refs)
        target = allocate(sens, L * budget, budget // 4, T)
        tried = {"0": (cur, budgets)}
        for alpha in (0.5, 1.0):
            b = largest_remainder([(1 - alpha) * budget + alpha * t for t in target], L * budget)
            made = [
                policy_of(assign, b, settings).compress(model, ref["full"], ref["obs"])
                for ref in refs
            ]
            tried[str(alpha)] = (evaluate(0, [c.layers for c in made], x0), b)
        alpha = min(tried, key=lambda a: goal.key(tried[a][0], tried[a][0].kl))
        final, budgets = tried[alpha]
        sig["budget"] = {
            "halving_sensitivity": sens,
            "kl_by_alpha": {a: t.kl for a, (t, _) in tried.items()},
            "alpha": alpha,
            **({"probe_by_alpha": {a: t.probe for a, (t, _) in tried.items()}} if probes else {}),
        }
        log(f"budgets: KL uniform {tried['0'][0].kl:.4f}, α=½ {tried['0.5'][0].kl:.4f}, "
            f"α=1 {tried['1.0'][0].kl:.4f}; kept α = {alpha} ({time.time() - t0:.0f} s)")
    sig.update(rules=assign, budgets=budgets, final={"kl": final.kl, "probe": final.probe} if probes
               else {"kl": final.kl}, seconds=round(time.time() - t0, 1))
    return sig


def mean_or_zero(xs) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def quiet(*_):
    """A log that prints nothing."""


def build_joint(
    sig: dict, budget: int, settings: RuleSettings = RuleSettings(), meta: dict = None
) -> Policy:
    """The policy the joint procedure chose; meta records the procedure and its signals."""
    assert sum(sig["budgets"]) == len(sig["budgets"]) * budget
    return policy_of(sig["rules"], sig["budgets"], settings,
                     {**(meta or {}), "method": "polykv", "procedure": "joint", "signals": sig,
                      "best_uniform": sig["start"]})


# the default objective (docs/polykv.md, dev table)
JOINT_PROBES, JOINT_RETRIEVAL = 4, "constraint"


def calibrate_joint(model, tok, budget: int, seed: int = 0, n_prompts: int = 2,
                    prompt_len: int = PROMPT_LEN, cont_len: int = CONT_LEN, signal: str = "cosine",
                    needles: int = 0, probes: int = JOINT_PROBES, retrieval=JOINT_RETRIEVAL,
                    settings: RuleSettings = RuleSettings(), texts=None, probe_pairs=None,
                    model_name: str = "", log=None) -> Policy:
    """The joint procedure on the calibration set (texts: as in `calibrate`). needles: that
    many dev-split niah_single_1 prompts join the texts, their gold answer as the continuation.
    probes: that many retrieval probes from the dev text (tasks.calibration_facts; probe_pairs:
    given ones instead), used as `retrieval` says (`Objective`)."""
    if texts is None:
        texts = calibration_set(tok, budget, n_prompts, prompt_len, cont_len, seed, needles=needles)
    if probe_pairs is None:
        probe_pairs = tasks.calibration_facts(tok, probes, prompt_len, seed) if probes else []
    settings = with_prompt(settings, tok)
    _, _, meta = set_meta(model, tok, texts, budget, seed, model_name, needles)
    meta["calibration"].update(probes=len(probe_pairs), retrieval=retrieval)
    sig = measure_joint(model, texts, budget, signal, settings=settings, log=log,
                        probes=probe_pairs, retrieval=retrieval)
    return build_joint(sig, budget, settings, meta)


# calibration procedures by name (--procedure; a policy file's name carries it): the paper's,
# and the joint one with each objective
PROCEDURES = {"paper": calibrate,
              "joint": calibrate_joint,                                             # the default
              "joint-text": functools.partial(calibrate_joint, probes=0, retrieval=None),
              "joint-weighted": functools.partial(calibrate_joint, retrieval=0.1)}


# ---------------------------------------------------------------------------- the placement control
# The later version of the paper tests whether its profiles carry information: with the counts
# of each rule held fixed, the profile-guided placement ranks second among 100 evaluated
# assignments. Here: the calibrated route against N seeded permutations of its layers' rules,
# each layer keeping its budgets, all scored by the harness's fidelity KL at equal memory.

def shuffled(policy: Policy, n: int, seed: int = 0) -> list:
    """n routes with the policy's rules placed at random: seeded permutations of the layers'
    (prefill rule, decode rule) pairs, every layer keeping its own budgets."""
    rng = random.Random(f"shuffle/{seed}")
    pairs = [(lp.prefill.rule, lp.decode.rule) for lp in policy.layers]
    return [Policy([LayerPolicy((pre, lp.prefill.budget), (dec, lp.decode.budget))
                    for (pre, dec), lp in zip(rng.sample(pairs, len(pairs)), policy.layers)],
                   policy.budget, policy.settings, {"shuffled": k, "seed": seed}) for k in range(n)]


@torch.no_grad()
def placement_control(model, tok, policy: Policy, n: int = 100, split: str = "dev",
                      n_prompts: int = 4, prompt_len: int = PROMPT_LEN, cont_len: int = CONT_LEN,
                      seed: int = 0, texts=None, log=None) -> dict:
    """Fidelity KL (evaluate.py's, at equal memory: decode budgets grow by the continuation) of
    the calibrated route and of n `shuffled` ones on n_prompts natural-text passages of `split`
    (tasks.fidelity_text with `seed`; texts: given [(prompt_ids, cont_ids)] instead); rank 1 =
    the lowest mean KL, ties counted against the route."""
    if texts is None:
        texts = [
            tasks.fidelity_text(tok, prompt_len, cont_len, seed, i, split) for i in range(n_prompts)
        ]
    routes = [
        r.with_allowance(max(len(c) for _, c in texts))
        for r in [policy] + shuffled(policy, n, seed)
    ]
    kls = [[] for _ in routes]
    for i, (p, c) in enumerate(texts):
        x, cont = torch.tensor([p], device=model.device), torch.tensor([c], device=model.device)
        full, obs = polykv.observe_for(model, x, routes)                     # one prefill for all
        ref = M.teacher_force(model, full.fork(), cont)[0]
        for j, r in enumerate(routes):
            dec = r.decoder if r.evicts_within(len(p), len(c)) else None
            lp = M.teacher_force(model, r.compress(model, full, obs), cont, dec, dec is not None)[0]
            kls[j].append(kl(ref, lp))
        if log:
            log(f"placement control, {split} prompt {i + 1}/{len(texts)}")
    mean = [sum(k) / len(k) for k in kls]
    return {"split": split, "seed": seed, "n": n, "prompts": len(texts), "budget": policy.budget,
            "procedure": policy.meta.get("procedure", "paper"), "route_kl": mean[0],
            "shuffled_kl": mean[1:], "rank": 1 + sum(m <= mean[0] for m in mean[1:]),
            "per_prompt": kls}


def main(argv=None):
    ap = cli.ArgumentParser(
        description="Calibrate a PolyKV policy (the paper's procedure, or --procedure joint).")
    ap.add_argument("--model", default=None, help="HF folder (default: embedded SmolLM2-135M)")
    ap.add_argument("--budget", type=int, default=512, help="average entries per (layer, KV head)")
    ap.add_argument("--out", default=None, help="the policy file (default policy.json)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-prompts", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
    ap.add_argument("--cont-len", type=int, default=CONT_LEN)
    ap.add_argument("--procedure", choices=PROCEDURES, default="paper",
                    help="paper: each layer probed alone (the paper); joint: every choice scored "
                         "with the other layers compressed (past the paper)")
    ap.add_argument("--signal", choices=("kl", "cosine"), default="cosine",
                    help="joint procedure's score (cosine: better on dev, docs/polykv.md)")
    ap.add_argument(
        "--needles",
        type=int,
        default=0,
        help="joint procedure: add N dev-split niah_single_1 prompts (gold answer as continuation)",
    )
    ap.add_argument("--preference", choices=("cosine", "ppl"), default="cosine")
    ap.add_argument("--sensitivity", choices=("entropy", "ppl"), default="entropy")
    ap.add_argument("--b-min", type=int, default=None, help="budget floor (default B // 4)")
    ap.add_argument("--plot", default=None, help="write a per-layer PNG (needs matplotlib)")
    ap.add_argument("--threads", type=int, default=1,   # probes are 64-row matmuls: see docstring
                    help="torch intra-op CPU threads (default 1)")
    ap.add_argument(
        "--show",
        nargs="+",
        default=None,
        metavar="POLICY",
        help="print the tables of existing policy files (and --plot them side by side); no "
             "calibration",
    )
    ap.add_argument(
        "--shuffle",
        type=int,
        default=0,
        metavar="N",
        help="with --show: the placement control, each policy against N shuffled routes "
        "(fidelity KL on --n-prompts passages of --split; JSON to --out if given)",
    )
    ap.add_argument("--split", choices=tasks.SPLITS, default="dev", help="--shuffle's passages")
    a = ap.parse_args(argv)
    check_options(a)
    if a.show:
        pols = [Policy.load(f) for f in a.show]
        for f, pol in zip(a.show, pols):
            print(f"{f}:\n{describe(pol)}")
        if a.plot:
            print(plot(pols, a.plot, polykv.pool()))
        if a.shuffle:
            torch.set_num_threads(a.threads)
            m, tok = M.load(a.model)
            res = []
            for f, pol in zip(a.show, pols):
                r = placement_control(m, tok, pol, a.shuffle, a.split, a.n_prompts, a.prompt_len,
                                      a.cont_len, a.seed, log=print)
                print(f"{f}: {placement(r)}")
                res.append({"policy": str(f), **r})
            if a.out:
                write_atomic(a.out, json.dumps(res, indent=1))
        return
    a.out = a.out or "policy.json"
    torch.set_num_threads(a.threads)
    name = Path(a.model).name if a.model else M.default_model_dir().name
    b_min = a.budget // 4 if a.b_min is None else a.b_min
    print(f"model={a.model or M.default_model_dir()} budget={a.budget} seed={a.seed} "
          f"n_prompts={a.n_prompts} prompt_len={a.prompt_len} cont_len={a.cont_len} "
          f"preference={a.preference} sensitivity={a.sensitivity} b_min={b_min} out={a.out} "
          f"threads={torch.get_num_threads()}")
    t0 = time.time()
    check_args(a.budget, a.n_prompts, a.prompt_len, a.cont_len, b_min)
    if a.needles and a.procedure == "paper":
        raise UsageError("needle prompts in the calibration set are for the joint procedures only")
    m, tok = M.load(a.model)
    common = dict(n_prompts=a.n_prompts, prompt_len=a.prompt_len, cont_len=a.cont_len,
                  model_name=name, log=print)
    if a.procedure == "paper":
        pol = calibrate(m, tok, a.budget, a.seed, preference=a.preference,
                        sensitivity=a.sensitivity, b_min=b_min, **common)
    else:
        pol = PROCEDURES[a.procedure](m, tok, a.budget, a.seed, signal=a.signal, needles=a.needles,
                                      **common)
    try:
        pol.save(a.out)
    except OSError as e:
        raise UsageError(f"cannot write {a.out!r}: {e.strerror}") from None
    print(describe(pol))
    if a.procedure == "paper":
        u = pol.meta["signals"]["uniform_dppl"]
        print(
            "uniform baselines, ΔPPL on the calibration text: "
            + ", ".join(f"{r} {u[r]:+.4f}" for r in u)
            + f"; best uniform: {pol.meta['best_uniform']}"
        )
    print(f"wrote {a.out} in {time.time() - t0:.0f} s")
    if a.plot:
        try:
            print(plot([pol], a.plot, polykv.pool()))
        except OSError as e:
            raise UsageError(f"cannot write {a.plot!r}: {e.strerror}") from None


def check_options(a):
    """The options that only mean something together, and the counts, before any work: --shuffle
    is --show's placement control and --out (with --show) where it writes; the files to write
    go into existing folders."""
    cli.at_least(1, threads=a.threads, n_prompts=a.n_prompts, prompt_len=a.prompt_len)
    cli.at_least(0, shuffle=a.shuffle)
    if a.shuffle and not a.show:
        raise UsageError("--shuffle N is the placement control of --show POLICY: give --show, "
                         "or leave --shuffle out to calibrate")
    if a.show and a.out and not a.shuffle:
        raise UsageError("--out with --show is where --shuffle N writes its JSON: give "
                         "--shuffle N >= 1, or leave --out out")
    for f in filter(None, (a.out, a.plot)):      # before minutes of probes, not after
        if Path(f).is_dir():
            raise UsageError(f"cannot write {f!r}: it is a folder")
        if not Path(f).resolve().parent.is_dir():
            raise UsageError(f"cannot write {f!r}: no such folder")


ON_CTRL_C = "interrupted: nothing written (a policy file is written once its calibration is done)"

if __name__ == "__main__":
    cli.run(main, ON_CTRL_C)
