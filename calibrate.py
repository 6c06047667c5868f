"""PolyKV offline calibration: one static per-layer, per-phase policy from a small text sample.

Implements the calibration of Fei & Kalnis, "PolyKV: Heterogeneous Retention and Allocation for
KV Cache Compression" (2026; seeds 000/001, SPEC.md §4). A policy Π gives every layer l and
phase φ ∈ {prefill, decode} an eviction pattern r_{l,φ} and a budget b_{l,φ}, Σ_l b_{l,φ} = L·B.
It is built once from layer-specific signals, then only executed (polykv.Policy).

Notation (SPEC.md): B the average budget, T prompt tokens, n continuation tokens, H query heads,
D head dim, L layers, s_l a layer's budget-sensitivity signal.

Probe (l, r): compress *only* layer l with rule r at budget B, every other layer FullKV, reusing
the prompt's one FullKV prefill (methods.observe + Policy.compress), then teacher-force the
continuation. Signals, averaged over the calibration prompts:
  eviction preference   cos_{l,φ}(r)  = mean_i cos(o_i^probe, o_i^full), o_i = layer l's attention
                                        output (H·D) at continuation token i   (higher = better)
                        ΔPPL_{l,φ}(r) = PPL_probe − PPL_full of the continuation (lower = better)
  budget sensitivity    entropy_l     = mean_{h,i} −Σ_j A[h,i,j] log A[h,i,j], continuation queries
                                        under FullKV (diffuse attention needs more budget)
                        ppl_{l,φ}     = max(0, max_r ΔPPL_{l,φ}(r)) (worst case over the pool)
Construction: r_{l,φ} = the pool rule with the best preference (ties: earlier in the pool);
b_{l,φ} = b_min + (L·B − L·b_min)·s_l/Σs, water-filled under b ≤ T, largest-remainder rounded.

[choices] (SPEC.md §4 leaves them open):
- Calibration set: `tasks.calibration_texts`, passages of the *dev* split of Python's
  `pydoc_data.topics` (odd positions of the sorted topic keys, minus every paragraph that also
  occurs at an even position); the test split uses the even ones, so none is scored later. Defaults: 2 passages of T = 2,048 tokens (the evaluation's length scale) plus n = 64
  held-out tokens; the seed picks the passages' offset. Cost: 2 prefills + L·(4 + 3)·2 = 420
  single-layer probes + 8 uniform baselines: 5 min 19 s at B = 512 on a quiet 2-core CPU.
- CLI threads: one by default. The probes are 64-row matmuls; on the shared 2-core machine two
  intra-op threads made them about 4x *slower* (prefill probes 140 s -> over 9 min).
- Pool: prefill streaming, h2o, tova, snapkv, all probed at the same budget B. Not pyramidkv:
  at a fixed layer budget it *is* snapkv; its schedule belongs to the allocation side.
- Decode: probed after the prefill rules are chosen. Layer l's prompt is compressed to B by its
  chosen prefill rule, then the n continuation tokens run with decode rule d ∈ {streaming, h2o,
  tova} at decode budget B, so d evicts once per token (n evictions). `append` is not a rule at
  a fixed budget and is never chosen by preference; a layer is *left* `append` only when its
  decode budget cannot bind within the calibrated horizon, b_{l,dec} ≥ b_{l,pre} + n (append is
  then the same computation without per-token eviction). With the entropy signal both phases
  get the same budgets, so every layer evicts during decode and never exceeds b_l.
- b_min = ⌊B/4⌋; budgets capped at T (the calibration prompt length).
- Fast path: a probe leaves layers < l untouched, so it starts from the continuation's FullKV
  input to layer l (kept from one reference pass), runs layer l (token by token when its decode
  rule evicts, as model.decode does) and layers > l in one step. The tests compare it with the
  naive full-model probe (polykv.prefill + model.decode).
"""
from __future__ import annotations

import math
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import model as M
import rules
import tasks
from errors import UsageError
from model import Hooks
from polykv import LayerPolicy, Policy, RuleSettings
# the pool, the FullKV reference pass and the budget allocation, shared with joint.py
from probing import DECODE_POOL, POOL, _nll, allocate, cosine, reference  # noqa: F401  (public API)

# the calibration text; a cached policy calibrated on another text is never reused (file name)
TEXT = "pydoc_data.topics, dev split: odd sorted topics minus paragraphs repeated in test"
TEXT_VERSION = "dev2"
# calibration procedures: the paper's (this module) and the joint one (joint.py)
PROCEDURES = ("paper", "joint")



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
    spy = lambda l, q, q_pos, lc, out: seen.append(out)
    dec = policy.decoder                 # decode rule evicts: one token at a time, as model.decode
    hooks = Hooks(post_kernel=spy, cache_update=dec.cache_update if dec else None)
    x, pos, lc = ref["xs"][layer], ref["pos"], cache.layers[layer]
    steps = [slice(i, i + 1) for i in range(x.shape[1])] if dec else [slice(None)]
    ys = []
    for s in steps:
        y, lc = model.layers[layer](x[:, s], pos[:, s], lc, model.inv_freq, layer, hooks, model.sdpa)
        ys.append(y)
    x = torch.cat(ys, 1)                                                      # (1, n, dim)
    for l in range(layer + 1, model.config.n_layers):                         # FullKV above
        x, _ = model.layers[l](x, pos, ref["full"].layers[l], model.inv_freq, l, None, model.sdpa)
    return cosine(torch.cat(seen, 2), ref["out"][layer]), _nll(model, x, ref["cont"])


def measure(model, pairs, budget: int, preference: str = "cosine",
            settings: RuleSettings = RuleSettings(), log=None) -> dict:
    """Every signal, JSON-ready. pairs: [(prompt_ids, cont_ids)]; the decode probes use the
    prefill rules chosen by `preference`."""
    L, dev = model.config.n_layers, model.device
    log = log or (lambda *_: None)
    refs = []
    for i, (p, c) in enumerate(pairs):
        t0 = time.time()
        refs.append(reference(model, torch.tensor([p], device=dev), torch.tensor([c], device=dev), settings))
        log(f"prompt {i + 1}/{len(pairs)}: FullKV prefill of {len(p)} + {len(c)} tokens ({time.time() - t0:.0f} s)")
    count = sum(len(c) - 1 for _, c in pairs)
    ppl = lambda nll: math.exp(nll / count)                                  # PPL = exp(mean NLL)
    ppl_full = ppl(sum(r["nll"] for r in refs))
    sig = {"entropy": [sum(r["entropy"][l] for r in refs) / len(refs) for l in range(L)],
           "ppl_full": ppl_full}

    def run(phase, rules, prefill_of):
        t0 = time.time()
        cosine, dppl = {r: [] for r in rules}, {r: [] for r in rules}
        for l in range(L):
            if l and l % 5 == 0:
                eta = (time.time() - t0) / l * (L - l)
                log(f"{phase} probes: layer {l}/{L}, {time.time() - t0:.0f} s, ETA {eta:.0f} s for this phase")
            for r in rules:
                pre, dec = (r, budget), ("append", budget)
                if phase == "decode":
                    pre, dec = (prefill_of[l], budget), (r, budget)
                res = [probe(model, ref, l, probe_policy(L, l, pre, dec, budget, settings)) for ref in refs]
                cosine[r].append(sum(c for c, _ in res) / len(res))
                dppl[r].append(ppl(sum(nl for _, nl in res)) - ppl_full)
        log(f"{phase} probes: {L} layers x {len(rules)} rules x {len(refs)} prompts ({time.time() - t0:.0f} s)")
        return {"cosine": cosine, "dppl": dppl}

    sig["prefill"] = run("prefill", POOL, None)
    sig["decode_probe_prefill"] = best_rules(sig["prefill"], POOL, preference)
    sig["decode"] = run("decode", DECODE_POOL, sig["decode_probe_prefill"])
    # the uniform baselines on the same text (every layer compressed, model.decode), so that
    # the harness's budget-only ablation can take the best single rule without seeing eval data
    t0 = time.time()
    sig["uniform_dppl"] = {}
    for r in POOL:
        uni, nll = Policy.uniform(r, budget, L, settings=settings), 0.0
        for ref in refs:
            logits = M.decode(model, ref["cont"], uni.compress(model, ref["full"], ref["obs"]), uni.decoder)
            nll += float(F.cross_entropy(logits[0, :-1], ref["cont"][0, 1:], reduction="sum"))
        sig["uniform_dppl"][r] = ppl(nll) - ppl_full
    log(f"uniform baselines: {len(POOL)} rules x {len(refs)} prompts ({time.time() - t0:.0f} s)")
    return sig


# ----------------------------------------------------------------------------- construction

def best_rules(phase_signals: dict, pool, preference: str) -> list:
    """Per layer, argmax cos (or argmin ΔPPL) over the pool; ties to the earlier rule."""
    key = {"cosine": lambda r, l: -phase_signals["cosine"][r][l],
           "ppl": lambda r, l: phase_signals["dppl"][r][l]}[preference]
    L = len(phase_signals["cosine"][pool[0]])
    return [min(pool, key=lambda r: key(r, l)) for l in range(L)]


def sensitivity_of(sig: dict, phase: str, sensitivity: str) -> list:
    if sensitivity == "entropy":
        return sig["entropy"]
    return [max(0.0, *(d[l] for d in sig[phase]["dppl"].values())) for l in range(len(sig["entropy"]))]


def build(sig: dict, budget: int, preference: str = "cosine", sensitivity: str = "entropy",
          b_min=None, cap: int = None, horizon: int = 64, settings: RuleSettings = RuleSettings(),
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
    rules = {"prefill": best_rules(sig["prefill"], POOL, preference),
             "decode": best_rules(sig["decode"], DECODE_POOL, preference)}
    b = {ph: allocate(sensitivity_of(sig, ph, sensitivity), L * budget, b_min, cap)
         for ph in ("prefill", "decode")}
    layers = []
    for l in range(L):
        dec = "append" if b["decode"][l] >= b["prefill"][l] + horizon else rules["decode"][l]
        layers.append(LayerPolicy((rules["prefill"][l], b["prefill"][l]), (dec, b["decode"][l])))
    meta = {**(meta or {}), "method": "polykv", "procedure": "paper", "preference": preference,
            "sensitivity": sensitivity, "b_min": b_min, "cap": cap, "decode_horizon": horizon,
            "signals": sig}
    if "uniform_dppl" in sig:     # the best single rule at this budget, for budget_only
        meta["best_uniform"] = min(POOL, key=lambda r: sig["uniform_dppl"][r])
    return Policy(layers, budget, settings, meta)


def check_args(budget: int, n_prompts: int, prompt_len: int, cont_len: int, b_min=None):
    """User mistakes, caught before any model is loaded."""
    if budget < 1:
        raise UsageError(f"budget must be >= 1, got {budget}")
    if n_prompts < 1 or cont_len < 2:
        raise UsageError(f"need n_prompts >= 1 and cont_len >= 2, got {n_prompts}, {cont_len}")
    if prompt_len <= budget:
        raise UsageError(f"calibration prompts ({prompt_len} tokens) must be longer than the budget {budget}")
    if b_min is not None and not 0 <= b_min <= budget:
        raise UsageError(f"b_min must be in [0, B={budget}], got {b_min}")


def calibrate(model, tok, budget: int, seed: int = 0, n_prompts: int = 2, prompt_len: int = 2048,
              cont_len: int = 64, preference: str = "cosine", sensitivity: str = "entropy",
              b_min=None, settings: RuleSettings = RuleSettings(), texts=None,
              model_name: str = "", log=None, procedure: str = "paper", signal: str = "cosine",
              needles: int = 0) -> Policy:
    """Measure the signals on the calibration set once and build the policy. texts: optional
    [(prompt_ids, cont_ids)] in place of `tasks.calibration_texts` (then tok is unused).
    procedure: "paper" (this module) or "joint" (joint.py; `signal` kl|cosine, preference,
    sensitivity and b_min unused). needles (joint only): that many dev-split `niah_single_1`
    prompts of prompt_len tokens join the texts, their gold answer as the held-out continuation
    (tasks.calibration_needles)."""
    if procedure not in PROCEDURES:
        raise UsageError(f"procedure must be one of {', '.join(PROCEDURES)}, got {procedure!r}")
    if needles and procedure != "joint":
        raise UsageError("needle prompts in the calibration set are for --procedure joint only")
    if texts is None:
        check_args(budget, n_prompts, prompt_len, cont_len, b_min)
        texts = tasks.calibration_texts(tok, n_prompts, prompt_len, cont_len, seed)
        texts += tasks.calibration_needles(tok, needles, prompt_len, seed)
    T, n = min(len(p) for p, _ in texts), min(len(c) for _, c in texts)
    check_args(budget, len(texts), T, n, b_min)
    M.check_length(model, T + n)
    meta = {"model": model_name, "seed": seed, "calibration": {
        "source": TEXT if tok else "given",
        "n_prompts": len(texts), "prompt_len": T, "cont_len": n, "needles": needles}}
    if procedure == "joint":
        import joint
        return joint.build(joint.measure(model, texts, budget, signal, settings=settings, log=log),
                           budget, settings, meta)
    sig = measure(model, texts, budget, preference, settings, log)
    return build(sig, budget, preference, sensitivity, b_min, cap=T, horizon=n,
                 settings=settings, meta=meta)


def policy_path(model_name: str, budget: int, seed: int, cache_dir, procedure: str = "paper") -> Path:
    """Where policy_for keeps the policy of (procedure, model name, budget, seed, calibration text)."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", model_name)
    kind = "polykv" if procedure == "paper" else f"polykv-{procedure}"
    return Path(cache_dir) / f"{kind}-{name}-B{budget}-seed{seed}-{TEXT_VERSION}.json"


def policy_for(model, tok, model_name: str, budget: int, seed: int = 0, cache_dir="runs/policies",
               **kw) -> Policy:
    """Calibrate once per (model name, budget, seed) and keep the JSON; later calls load it."""
    path = policy_path(model_name, budget, seed, cache_dir, kw.get("procedure", "paper"))
    if path.exists():
        policy = Policy.load(path, n_layers=model.config.n_layers)  # wrong layer count: UsageError
        have = {**policy.meta.get("calibration", {}), **policy.meta}
        diff = [f"{k}={have.get(k)!r} (asked {v!r})" for k, v in kw.items()
                if k in ("preference", "sensitivity", "n_prompts", "prompt_len", "cont_len") and have.get(k) != v]
        if diff:
            raise UsageError(f"{str(path)!r} was calibrated with {', '.join(diff)}: remove it to recalibrate")
        return policy
    policy = calibrate(model, tok, budget, seed, model_name=model_name, **kw)
    path.parent.mkdir(parents=True, exist_ok=True)
    policy.save(path)
    return policy


# ----------------------------------------------------------------------------- ablations

def pattern_only(policy: Policy) -> Policy:
    """The calibrated rules with the uniform budget B in both phases."""
    B = policy.budget
    layers = [LayerPolicy((lp.prefill[0], B), (lp.decode[0], B)) for lp in policy.layers]
    return Policy(layers, B, policy.settings, {**policy.meta, "ablation": "pattern_only"})


def prefill_only(policy: Policy) -> Policy:
    """The calibrated prefill phase (rules and budgets); no eviction while decoding (`append`),
    as uniform SnapKV and PyramidKV do. Isolates what the decode-phase calibration costs or buys."""
    layers = [LayerPolicy(lp.prefill, ("append", lp.prefill[1])) for lp in policy.layers]
    return Policy(layers, policy.budget, policy.settings, {**policy.meta, "ablation": "prefill_only"})


def budget_only(policy: Policy, rule: str) -> Policy:
    """One uniform rule (its own decode form, SPEC.md §3) with the calibrated budgets."""
    if rule not in rules.RULES:
        raise UsageError(f"unknown rule {rule!r}; choose from {', '.join(rules.RULES)}")
    dec = rules.RULES[rule].decode
    layers = [LayerPolicy((rule, lp.prefill[1]), (dec, lp.decode[1])) for lp in policy.layers]
    return Policy(layers, policy.budget, policy.settings, {**policy.meta, "ablation": f"budget_only:{rule}"})


# ----------------------------------------------------------------------------- report

def table(policy: Policy) -> str:
    """One line per layer: the chosen rules and budgets, and the signals behind them."""
    sig = policy.meta["signals"]
    ab = {r: r[:4] for r in POOL}
    head = (f"{'layer':>5} {'prefill':>9} {'b_pre':>5} {'decode':>9} {'b_dec':>5} {'entropy':>7} | "
            + " ".join(f"{'cos.' + ab[r]:>9}" for r in POOL) + f" {'ΔPPLmax':>8} | "
            + " ".join(f"{'dcos.' + ab[r]:>9}" for r in DECODE_POOL) + f" {'ΔPPLmax':>8}")
    rows = [head]
    for l, lp in enumerate(policy.layers):
        worst = lambda ph: max(d[l] for d in sig[ph]["dppl"].values())
        rows.append(f"{l:>5} {lp.prefill[0]:>9} {lp.prefill[1]:>5} {lp.decode[0]:>9} {lp.decode[1]:>5} "
                    f"{sig['entropy'][l]:>7.3f} | "
                    + " ".join(f"{sig['prefill']['cosine'][r][l]:>9.5f}" for r in POOL)
                    + f" {worst('prefill'):>8.4f} | "
                    + " ".join(f"{sig['decode']['cosine'][r][l]:>9.5f}" for r in DECODE_POOL)
                    + f" {worst('decode'):>8.4f}")
    return "\n".join(rows)


def describe(policy: Policy) -> str:
    """The per-layer table of a calibrated policy, whichever procedure made it ("" if none)."""
    if policy.meta.get("procedure") == "joint":
        import joint
        return joint.table(policy)
    return table(policy) if "signals" in policy.meta else ""


def plot(policies, path) -> str:
    """Bars: prefill budget per layer, coloured by the prefill rule; one panel per policy (a
    Policy or a list of them, e.g. the paper's and the joint procedure's). Needs matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot written"
    policies = [policies] if isinstance(policies, Policy) else list(policies)
    colour = dict(zip(POOL, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")))
    fig, axes = plt.subplots(1, len(policies), figsize=(7 * len(policies), 3.5), squeeze=False)
    for ax, policy in zip(axes[0], policies):
        for l, lp in enumerate(policy.layers):
            ax.bar(l, lp.prefill[1], color=colour.get(lp.prefill[0], "grey"))
        ax.axhline(policy.budget, color="grey", ls="--", lw=1, label=f"B = {policy.budget}")
        for r in POOL:
            ax.bar(0, 0, color=colour[r], label=r)
        ax.set(xlabel="layer", ylabel="prefill budget (entries per KV head)",
               title=f"PolyKV ({policy.meta.get('procedure', 'paper')}): {policy.meta.get('model', '')}, "
                     f"B = {policy.budget}")
        ax.legend(ncol=3, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"wrote {path}"


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(description="Calibrate a PolyKV policy (SPEC.md §4).")
    ap.add_argument("--model", default=None, help="HF folder (default: embedded SmolLM2-135M)")
    ap.add_argument("--budget", type=int, default=512, help="average entries per (layer, KV head)")
    ap.add_argument("--out", default="policy.json")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-prompts", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--cont-len", type=int, default=64)
    ap.add_argument("--procedure", choices=PROCEDURES, default="paper",
                    help="paper: each layer probed alone (the paper); joint: every choice scored "
                         "with the other layers compressed (joint.py)")
    ap.add_argument("--signal", choices=("kl", "cosine"), default="cosine",
                    help="joint procedure's score (cosine: better on dev, see joint.py)")
    ap.add_argument("--needles", type=int, default=0,
                    help="joint procedure: add N dev-split niah_single_1 prompts (gold answer as continuation)")
    ap.add_argument("--preference", choices=("cosine", "ppl"), default="cosine")
    ap.add_argument("--sensitivity", choices=("entropy", "ppl"), default="entropy")
    ap.add_argument("--b-min", type=int, default=None, help="budget floor (default B // 4)")
    ap.add_argument("--plot", default=None, help="write a per-layer PNG (needs matplotlib)")
    ap.add_argument("--threads", type=int, default=1,   # probes are 64-row matmuls: see docstring
                    help="torch intra-op CPU threads (default 1)")
    ap.add_argument("--show", nargs="+", default=None, metavar="POLICY",
                    help="print the tables of existing policy files (and --plot them side by side); no calibration")
    a = ap.parse_args(argv)
    if a.show:
        try:
            pols = [Policy.load(f) for f in a.show]
        except UsageError as e:
            sys.exit(f"error: {e}")
        for f, pol in zip(a.show, pols):
            print(f"{f}:\n{describe(pol)}")
        if a.plot:
            print(plot(pols, a.plot))
        return
    torch.set_num_threads(max(1, a.threads))
    name = Path(a.model).name if a.model else M.default_model_dir().name
    b_min = a.budget // 4 if a.b_min is None else a.b_min
    print(f"model={a.model or M.default_model_dir()} budget={a.budget} seed={a.seed} "
          f"n_prompts={a.n_prompts} prompt_len={a.prompt_len} cont_len={a.cont_len} "
          f"preference={a.preference} sensitivity={a.sensitivity} b_min={b_min} out={a.out} "
          f"threads={torch.get_num_threads()}")
    t0 = time.time()
    try:
        check_args(a.budget, a.n_prompts, a.prompt_len, a.cont_len, b_min)
        for f in filter(None, (a.out, a.plot)):      # before minutes of probes, not after
            if not Path(f).resolve().parent.is_dir():
                raise UsageError(f"cannot write {f!r}: no such folder")
        m, tok = M.load(a.model)
        pol = calibrate(m, tok, a.budget, a.seed, a.n_prompts, a.prompt_len, a.cont_len,
                        a.preference, a.sensitivity, b_min, model_name=name, log=print,
                        procedure=a.procedure, signal=a.signal, needles=a.needles)
    except UsageError as e:
        sys.exit(f"error: {e}")
    try:
        pol.save(a.out)
    except OSError as e:
        sys.exit(f"error: cannot write {a.out!r}: {e.strerror}")
    print(describe(pol))
    if a.procedure == "paper":
        u = pol.meta["signals"]["uniform_dppl"]
        print("uniform baselines, ΔPPL on the calibration text: "
              + ", ".join(f"{r} {u[r]:+.4f}" for r in POOL) + f"; best uniform: {pol.meta['best_uniform']}")
    print(f"wrote {a.out} in {time.time() - t0:.0f} s")
    if a.plot:
        try:
            print(plot(pol, a.plot))
        except OSError as e:
            sys.exit(f"error: cannot write {a.plot!r}: {e.strerror}")


if __name__ == "__main__":
    main()
