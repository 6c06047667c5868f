"""PolyKV offline calibration: one static per-layer, per-phase policy from a small text sample.

Implements the calibration of Fei & Kalnis, "PolyKV: Heterogeneous Retention and Allocation for
KV Cache Compression" (arXiv 2606.15157, 2026; the paper's eviction-preference and
budget-sensitivity signals). A policy Π gives every layer l and
phase φ ∈ {prefill, decode} an eviction pattern r_{l,φ} and a budget b_{l,φ},
Σ_l b_{l,φ} = L·B. It is built once from layer-specific signals, then only executed
(polykv.Policy).

Read top to bottom: the calibration set, the signals (one FullKV reference pass, then one probe
per layer and rule), the construction (pattern choice, budget allocation), the procedure and
its command line. The pool is an argument (`rules`: a rule table, baselines.RULES by default);
the observation is the naive one (polykv.observe) unless the engine hands in its shared pass.
What is not the paper lives in the engine (engine/): the paper's ablations and the uniform
baselines the harness compares with (engine/calibration.py), the placement control of the
paper's later version and the tables and plots of a policy file (engine/policy_tables.py), the
joint calibration that scores each choice with the other layers compressed
(engine/calibrate_joint.py), the cache of calibrated files (engine/policy_cache.py).

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
  prefills + L·(|pool| + 3)·2 single-layer probes (600 with the 7-rule pool).
- CLI threads: one by default. The probes are 64-row matmuls; on the shared 2-core machine two
  intra-op threads made them about 4x *slower* (prefill probes 140 s -> over 9 min).
- Pool: every rule of the table but the random floor (`polykv.pool(baselines.RULES)`:
  streaming, h2o, tova, snapkv, knorm, expected, kvzip), all probed at the same budget B. Not
  pyramidkv: at a fixed layer budget it *is* snapkv; its schedule belongs to the allocation
  side.
- Decode: probed after the prefill rules are chosen. Layer l's prompt is compressed to B by its
  chosen prefill rule, then the n continuation tokens run with decode rule d ∈ {streaming, h2o,
  tova} at decode budget B, so d evicts once per token (n evictions). `append` is not a rule at
  a fixed budget and is never chosen. Every layer keeps its chosen decode rule, even where its
  decode budget exceeds its prefill budget by more than the n calibration tokens (it then
  evicts only later): so the decode total stays L·B however long the generation. With the
  entropy signal both phases get the same budgets, so every layer evicts from the first
  generated token on and never exceeds b_l.
- b_min = ⌊B/4⌋; budgets capped at T (the calibration prompt length).
- Fast path: a probe leaves layers < l untouched, so it starts from the continuation's FullKV
  input to layer l (kept from one reference pass), runs layer l (token by token when its decode
  rule evicts, as model.decode does) and layers > l in one step. The tests compare it with the
  naive full-model probe (polykv.prefill + model.decode).
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

import baselines
import model as M
import polykv
from model import Hooks
from polykv import LayerPolicy, Policy, RuleSettings
from support import cli, tasks
from support.errors import UsageError
from support.files import writable_file

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
    model, tok, texts, budget: int, seed: int, model_name: str, needles: int, b_min=None,
    rules: dict = baselines.RULES,
) -> tuple:
    """(T, n, meta) of a calibration set, checked: the shortest prompt and continuation, and what
    a policy file records about the set (rules: the table whose pool is probed)."""
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
        "needles": needles, "pool": list(polykv.pool(rules))}}


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


def observe_naive(model, tokens, methods: list) -> tuple:
    """The naive observation (polykv.observe) of what several methods need: per layer the union
    of their statistics."""
    needs = [m.needs(model) for m in methods]
    stats = tuple(frozenset().union(*per_layer) for per_layer in zip(*(n.stats for n in needs)))
    computed = {name: st for n in needs for name, st in n.computed}
    return polykv.observe(model, tokens, replace(needs[0], stats=stats,
                                                 computed=tuple(computed.items())))


@torch.no_grad()
def reference(model, prompt, cont, settings: RuleSettings, rules: dict = baselines.RULES,
              observe=None) -> dict:
    """One FullKV prefill of prompt (1, T) with every pool statistic, then the continuation
    cont (1, n) under FullKV, one layer at a time: each layer's input x_l (1, n, dim), its
    attention output (1, H, n, D), its attention entropy, the continuation's NLL and the last
    layer's output `last` (1, n, dim). observe(model, tokens, methods) -> (full, obs): the
    prefill observed for all the pool's rules (`observe_naive`, or the engine's shared pass)."""
    L = model.config.n_layers
    pool = [Policy.uniform(r, 1, L, settings=settings, rules=rules) for r in polykv.pool(rules)]
    full, obs = (observe or observe_naive)(model, prompt, pool)
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
                 settings: RuleSettings = RuleSettings(), rules: dict = baselines.RULES) -> Policy:
    """Only `layer` compressed (prefill (rule, b), decode (rule, b)); every other layer FullKV."""
    keep = LayerPolicy(("full", budget), ("append", budget))
    return Policy([LayerPolicy(prefill, decode) if l == layer else keep for l in range(L)],
                  budget, settings, rules=rules)


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
            x[:, s], pos[:, s], lc, model.inv_freq, layer, hooks, model.speed
        )
        ys.append(y)
    # FullKV above (1, n, dim)
    x = M.run_layers(model, torch.cat(ys, 1), pos, ref["full"].layers, layer + 1)
    return cosine(torch.cat(seen, 2), ref["out"][layer]), _nll(model, x, ref["cont"])


def references(model, pairs, settings: RuleSettings, rules: dict = baselines.RULES,
               observe=None, log=None) -> list:
    """`reference` of every (prompt_ids, cont_ids) of the calibration set."""
    refs = []
    for i, (prompt, cont) in enumerate(pairs):
        t0 = time.time()
        x = torch.tensor([prompt], device=model.device)                        # (1, T)
        c = torch.tensor([cont], device=model.device)                          # (1, n)
        refs.append(reference(model, x, c, settings, rules, observe))
        (log or quiet)(f"prompt {i + 1}/{len(pairs)}: FullKV prefill of {len(prompt)} + "
                       f"{len(cont)} tokens ({time.time() - t0:.0f} s)")
    return refs


def perplexity(refs: list):
    """PPL = exp(mean NLL) over the calibration set's predicted continuation tokens, as a
    function of an NLL sum over the same tokens."""
    count = sum(r["cont"].shape[1] - 1 for r in refs)

    def ppl(nll: float) -> float:
        return math.exp(nll / count)
    return ppl


def measure(model, refs: list, budget: int, preference: str = "cosine",
            settings: RuleSettings = RuleSettings(), rules: dict = baselines.RULES,
            log=None) -> dict:
    """Every signal, JSON-ready, from the reference passes `refs` (`references`): the prefill
    probes of the pool, then the decode probes under the prefill rules chosen by `preference`."""
    L = model.config.n_layers
    ppl = perplexity(refs)
    ppl_full = ppl(sum(r["nll"] for r in refs))
    sig = {"entropy": [sum(r["entropy"][l] for r in refs) / len(refs) for l in range(L)],
           "ppl_full": ppl_full}

    def run(phase, pool, prefill_of):
        t0 = time.time()
        cosine, dppl = {r: [] for r in pool}, {r: [] for r in pool}
        for l in range(L):
            for r in pool:
                pre, dec = (r, budget), ("append", budget)
                if phase == "decode":
                    pre, dec = (prefill_of[l], budget), (r, budget)
                policy = probe_policy(L, l, pre, dec, budget, settings, rules)
                results = [probe(model, ref, l, policy) for ref in refs]
                cosine[r].append(sum(cos for cos, _ in results) / len(results))
                dppl[r].append(ppl(sum(nll for _, nll in results)) - ppl_full)
        (log or quiet)(f"{phase} probes: {L} layers x {len(pool)} rules x {len(refs)} prompts "
                       f"({time.time() - t0:.0f} s)")
        return {"cosine": cosine, "dppl": dppl}

    pool = polykv.pool(rules)
    sig["prefill"] = run("prefill", pool, None)
    sig["decode_probe_prefill"] = best_rules(sig["prefill"], pool, preference)
    sig["decode"] = run("decode", polykv.decode_pool(), sig["decode_probe_prefill"])
    return sig


def quiet(*_):
    """A log that prints nothing."""


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
          meta: dict = None, rules: dict = baselines.RULES) -> Policy:
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
    picked = {"prefill": chosen,
              "decode": best_rules(sig["decode"], list(sig["decode"]["cosine"]), preference)}
    b = {ph: allocate(sensitivity_of(sig, ph, sensitivity), L * budget, b_min, cap)
         for ph in ("prefill", "decode")}
    layers = []
    for l in range(L):          # Σ_l b_{l,dec} = L·B: every layer evicts beyond its own budget
        layers.append(LayerPolicy((picked["prefill"][l], b["prefill"][l]),
                                  (picked["decode"][l], b["decode"][l])))
    meta = {**(meta or {}), "method": "polykv", "procedure": "paper", "preference": preference,
            "sensitivity": sensitivity, "b_min": b_min, "cap": cap,
            "signals": sig}
    return Policy(layers, budget, settings, meta, rules=rules)


# ----------------------------------------------------------------------------- the procedure

def calibrate(model, tok, budget: int, seed: int = 0, n_prompts: int = 2,
              prompt_len: int = PROMPT_LEN, cont_len: int = CONT_LEN, preference: str = "cosine",
              sensitivity: str = "entropy", b_min=None, settings: RuleSettings = RuleSettings(),
              texts=None, model_name: str = "", log=None, rules: dict = baselines.RULES,
              observe=None) -> Policy:
    """The paper's procedure: measure the signals on the calibration set once and build the
    policy. texts: optional [(prompt_ids, cont_ids)] in place of `calibration_set` (then tok
    is unused); rules: the table whose pool is probed; observe: `observe_naive` if None (the
    engine hands in its shared pass)."""
    if texts is None:
        texts = calibration_set(tok, budget, n_prompts, prompt_len, cont_len, seed, b_min)
    settings = with_prompt(settings, tok)
    T, n, meta = set_meta(model, tok, texts, budget, seed, model_name, 0, b_min, rules)
    refs = references(model, texts, settings, rules, observe, log)
    sig = measure(model, refs, budget, preference, settings, rules, log)
    return build(sig, budget, preference, sensitivity, b_min, cap=T,
                 settings=settings, meta=meta, rules=rules)


# ----------------------------------------------------------------------------- the command line

def arguments(description: str) -> cli.ArgumentParser:
    """The options every calibration command line shares (this file's, the joint one's)."""
    ap = cli.ArgumentParser(description=description)
    ap.add_argument("--model", default=None, help="HF folder (default: embedded SmolLM2-135M)")
    ap.add_argument("--budget", type=int, default=512, help="average entries per (layer, KV head)")
    ap.add_argument("--out", default=None, help="the policy file (default policy.json)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-prompts", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
    ap.add_argument("--cont-len", type=int, default=CONT_LEN)
    ap.add_argument("--threads", type=int, default=1,   # probes are 64-row matmuls: see docstring
                    help="torch intra-op CPU threads (default 1)")
    return ap


def check_files(a):
    """The counts, and that the files to write (the policy: --out, policy.json by default; the
    joint command's picture: --plot) can be written, before minutes of probes, not after."""
    cli.at_least(1, threads=a.threads, n_prompts=a.n_prompts, prompt_len=a.prompt_len)
    for f, option in ((a.out or "policy.json", "--out"), (getattr(a, "plot", None), "--plot")):
        if f:
            writable_file(f, option)


def run(a, settings_line: str, procedure) -> Policy:
    """Load the model, run procedure(model, tok, **common options), write the policy file and
    print its layers: the part of a calibration command line after its options are read."""
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
    for l, lp in enumerate(pol.layers):
        print(f"layer {l:>2}: prefill {lp.prefill.rule} {lp.prefill.budget}, "
              f"decode {lp.decode.rule} {lp.decode.budget}")
    print(f"wrote {a.out} in {time.time() - t0:.0f} s (its signals: "
          f"python -m engine.policy_tables --show {a.out})")
    return pol


def main(argv=None):
    ap = arguments("Calibrate a PolyKV policy by the paper's procedure (python -m "
                   "engine.calibrate_joint: the joint calibration, past the paper).")
    ap.add_argument("--preference", choices=("cosine", "ppl"), default="cosine")
    ap.add_argument("--sensitivity", choices=("entropy", "ppl"), default="entropy")
    ap.add_argument("--b-min", type=int, default=None, help="budget floor (default B // 4)")
    a = ap.parse_args(argv)
    check_files(a)
    b_min = a.budget // 4 if a.b_min is None else a.b_min
    check_args(a.budget, a.n_prompts, a.prompt_len, a.cont_len, b_min)

    def paper(m, tok, budget, seed, **common):
        return calibrate(m, tok, budget, seed, preference=a.preference,
                         sensitivity=a.sensitivity, b_min=b_min, **common)
    run(a, f"preference={a.preference} sensitivity={a.sensitivity} b_min={b_min}", paper)


ON_CTRL_C = "interrupted: nothing written (a policy file is written once its calibration is done)"

if __name__ == "__main__":
    cli.run(main, ON_CTRL_C)
