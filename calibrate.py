"""PolyKV offline calibration: one static per-layer, per-phase policy from a small text sample.

Implements the calibration of Fei & Kalnis, "PolyKV: Heterogeneous Retention and Allocation for
KV Cache Compression" (arXiv 2606.15157, 2026; the paper's eviction-preference and
budget-sensitivity signals). A policy Π gives every layer l and
phase φ ∈ {prefill, decode} an eviction pattern r_{l,φ} and a budget b_{l,φ},
Σ_l b_{l,φ} = L·B. It is built once from layer-specific signals, then only executed
(polykv.Policy).

Read top to bottom: the calibration set, the signals (one FullKV reference pass, then one probe
per layer and rule), the construction (pattern choice, budget allocation), the procedure, the
paper's ablations (its rules alone, its budgets alone, its prefill phase alone), the placement
control of the paper's later version (`placement_control`, `--shuffle N`) and the command line.
What is not the paper lives beside it: the joint calibration that scores each choice with the
other layers compressed (calibrate_joint.py), the cache of calibrated files and the PolyKV rows
of the harness (policy_cache.py), the tables and plots of a policy file
(support/policy_tables.py).

Notation: B the average budget, T prompt tokens, n continuation tokens, H query heads,
D head dim, L layers, s_l a layer's budget-sensitivity signal.

Probe (l, r): compress *only* layer l with rule r at budget B, every other layer FullKV, reusing
the prompt's one FullKV prefill (polykv.observe + Policy.compress), then teacher-force the
continuation. Signals, averaged over the calibration prompts:
  eviction preference   cos_{l,φ}(r)  = mean_i cos(o_i^probe, o_i^full), o_i = layer l's
                                        attention output (H·D) at continuation token i
                                        (higher = better)
                        ΔPPL_{l,φ}(r) = PPL_probe − PPL_full of the continuation
                                        (lower = better)
  budget sensitivity    entropy_l     = mean_{h,i} −Σ_j A[h,i,j] log A[h,i,j], continuation
                                        queries under FullKV (diffuse attention needs more
                                        budget)
                        ppl_{l,φ}     = max(0, max_r ΔPPL_{l,φ}(r)) (worst case over the pool)
Construction: r_{l,φ} = the pool rule with the best preference (ties: earlier in the pool);
b_{l,φ} = b_min + (L·B − L·b_min)·s_l/Σs, water-filled under b ≤ T, largest-remainder
rounded.

[choices] (the paper leaves them open; docs/polykv.md has the measurements behind them):
- Calibration set: `tasks.calibration_texts`, passages of the *dev* split of Python's
  `pydoc_data.topics` (odd positions of the sorted topic keys, minus every paragraph that also
  occurs at an even position); the test split uses the even ones, so none is scored later.
  Defaults: 2 passages of T = 2,048 tokens (`PROMPT_LEN`; at 8K the paper's procedure needs 8K
  prompts, docs/results-8k.md) + n = 64 held-out tokens; the seed picks the offset. Cost: 2
  prefills + L·(|pool| + 3)·2 single-layer probes (600 with the 7-rule pool) + |pool|·2
  uniform runs (4x at 8K).
- CLI threads: one by default. The probes are 64-row matmuls; on the shared 2-core machine two
  intra-op threads made them about 4x *slower* (prefill probes 140 s -> over 9 min).
- Pool: every registered rule but the random floor (`polykv.pool()`: streaming, h2o, tova,
  snapkv, knorm, expected, kvzip, and any rule registered later), all probed at the same budget
  B. Not pyramidkv: at a fixed layer budget it *is* snapkv; its schedule belongs to the
  allocation side.
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

import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import baselines  # noqa: F401  (K-norm, Expected Attention, KVzip: rules of the pool)
import model as M
import polykv
from model import Hooks
from polykv import LayerPolicy, Policy, RuleSettings
from support import cli, tasks
from support.errors import UsageError
from support.files import writable_file, write_atomic
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
    """Σ −log p(cont_{i+1} | ≤ i) from the last hidden states x (B, n, dim); cont_0 is
    predicted by the prompt's last logits, the same for every probe, so it is left out."""
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
            x[:, s], pos[:, s], lc, model.inv_freq, layer, hooks, model.fast
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
    for i, (prompt, cont) in enumerate(pairs):
        t0 = time.time()
        prompt_ids, cont_ids = torch.tensor([prompt], device=dev), torch.tensor([cont], device=dev)
        refs.append(reference(model, prompt_ids, cont_ids, settings))
        log(
            f"prompt {i + 1}/{len(pairs)}: FullKV prefill of {len(prompt)} + {len(cont)} tokens "
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
                results = [
                    probe(model, ref, l, probe_policy(L, l, pre, dec, budget, settings))
                    for ref in refs
                ]
                cosine[r].append(sum(cos for cos, _ in results) / len(results))
                dppl[r].append(ppl(sum(nll for _, nll in results)) - ppl_full)
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
    uniform = Policy.uniform(rule, budget, model.config.n_layers, decode="append",
                             settings=settings)
    cache = uniform.compress(model, ref["full"], ref["obs"])
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



# ----------------------------------------------------------------------------- the procedure


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



def quiet(*_):
    """A log that prints nothing."""



# ---------------------------------------------------------------------------- the placement control
# The later version of the paper tests whether its profiles carry information: with the counts
# of each rule held fixed, the profile-guided placement ranks second among 100 evaluated
# assignments. Here: the calibrated route against N seeded permutations of its layers' rules,
# each layer keeping its budgets, all scored by the harness's fidelity KL at equal memory.

def kl(ref_lp, lp) -> float:
    """KL(FullKV ‖ q) summed over the vocabulary, mean over positions (evaluate.compare's kl)."""
    return float((ref_lp.exp() * (ref_lp - lp)).sum(-1).clamp_min(0).mean())



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


def arguments(description: str) -> cli.ArgumentParser:
    """The options every calibration command line shares (this file's, calibrate_joint.py's)."""
    ap = cli.ArgumentParser(description=description)
    ap.add_argument("--model", default=None, help="HF folder (default: embedded SmolLM2-135M)")
    ap.add_argument("--budget", type=int, default=512, help="average entries per (layer, KV head)")
    ap.add_argument("--out", default=None, help="the policy file (default policy.json)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-prompts", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
    ap.add_argument("--cont-len", type=int, default=CONT_LEN)
    ap.add_argument("--plot", default=None, help="write a per-layer PNG (needs matplotlib)")
    ap.add_argument("--threads", type=int, default=1,   # probes are 64-row matmuls: see docstring
                    help="torch intra-op CPU threads (default 1)")
    return ap


def run(a, settings_line: str, procedure) -> Policy:
    """Load the model, run procedure(model, tok, **common options), write and describe the
    policy file: the part of a calibration command line after its options are read."""
    a.out = a.out or "policy.json"
    torch.set_num_threads(a.threads)
    name = Path(a.model).name if a.model else M.default_model_dir().name
    print(f"model={a.model or M.default_model_dir()} budget={a.budget} seed={a.seed} "
          f"n_prompts={a.n_prompts} prompt_len={a.prompt_len} cont_len={a.cont_len} "
          f"{settings_line} out={a.out} threads={torch.get_num_threads()}")
    t0 = time.time()
    m, tok = M.load(a.model)
    pol = procedure(m, tok, a.budget, a.seed, n_prompts=a.n_prompts, prompt_len=a.prompt_len,
                    cont_len=a.cont_len, model_name=name, log=print)
    try:
        pol.save(a.out)
    except OSError as e:
        raise UsageError(f"cannot write {a.out!r}: {e.strerror}") from None
    print(describe(pol))
    if pol.meta.get("procedure") == "paper":
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
    return pol


def main(argv=None):
    ap = arguments("Calibrate a PolyKV policy by the paper's procedure (python calibrate_joint.py: "
                   "the joint calibration, past the paper).")
    ap.add_argument("--preference", choices=("cosine", "ppl"), default="cosine")
    ap.add_argument("--sensitivity", choices=("entropy", "ppl"), default="entropy")
    ap.add_argument("--b-min", type=int, default=None, help="budget floor (default B // 4)")
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
        show(a)
        return
    b_min = a.budget // 4 if a.b_min is None else a.b_min
    check_args(a.budget, a.n_prompts, a.prompt_len, a.cont_len, b_min)

    def paper(m, tok, budget, seed, **common):
        return calibrate(m, tok, budget, seed, preference=a.preference,
                         sensitivity=a.sensitivity, b_min=b_min, **common)
    run(a, f"preference={a.preference} sensitivity={a.sensitivity} b_min={b_min}", paper)


def show(a):
    """--show: the tables of policy files, their picture (--plot), the placement control
    (--shuffle N)."""
    pols = [Policy.load(f) for f in a.show]
    for f, pol in zip(a.show, pols):
        print(f"{f}:\n{describe(pol)}")
    if a.plot:
        try:
            print(plot(pols, a.plot, polykv.pool()))
        except OSError as e:
            raise UsageError(f"cannot write {a.plot!r}: {e.strerror}") from None
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


def check_options(a):
    """--show's options before any work: --shuffle is --show's placement control and --out
    (with --show) where it writes; then `check_files`."""
    cli.at_least(0, shuffle=a.shuffle)
    if a.shuffle and not a.show:
        raise UsageError("--shuffle N is the placement control of --show POLICY: give --show, "
                         "or leave --shuffle out to calibrate")
    if a.show and a.out and not a.shuffle:
        raise UsageError("--out with --show is where --shuffle N writes its JSON: give "
                         "--shuffle N >= 1, or leave --out out")
    check_files(a)


def check_files(a):
    """The counts, and that the files to write (the policy: --out, policy.json by default; the
    picture: --plot) can be written, before minutes of probes, not after."""
    cli.at_least(1, threads=a.threads, n_prompts=a.n_prompts, prompt_len=a.prompt_len)
    policy = a.out or (None if getattr(a, "show", None) else "policy.json")
    for f, option in ((policy, "--out"), (a.plot, "--plot")):
        if f:
            writable_file(f, option)


ON_CTRL_C = "interrupted: nothing written (a policy file is written once its calibration is done)"

if __name__ == "__main__":
    cli.run(main, ON_CTRL_C)
