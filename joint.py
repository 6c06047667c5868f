"""PolyKV past the paper: a calibration that sees the other layers (`calibrate.py --procedure joint`).

The paper's calibration (calibrate.py) probes each layer alone, every other layer FullKV, and
ranks rules by that layer's output cosine. On the embedded model this puts StreamingLLM on a
third of the layers at B = 128: each is harmless alone, together they drop the same middle of
the prompt (README, "What the paper's procedure loses"). This procedure scores every choice
with the rest of the network already compressed:

 1. Start: the best uniform rule on the calibration text, by end-to-end KL (below).
 2. Sweep the layers l = 0..L−1: for each rule r of the pool, layer l compressed by r at B and
    every other layer by the current policy; keep the r with the lowest score if it beats the
    current choice by more than `tol` (relative). Repeat until a sweep changes nothing, at most
    `sweeps` times (coordinate descent on the calibration objective).
 3. Budgets (optional signal, kept only if it helps on the calibration text): s_l = the KL
    increase when layer l's budget is halved under the current policy; budgets
    b = (1 − α)·B + α·allocate(s, L·B, B/4, T) for α ∈ {½, 1} (calibrate.allocate: water-filled,
    largest-remainder rounded, Σ b = L·B); the α (or uniform) with the lowest end-to-end KL wins.

Score (`signal`):
  "cosine": layer l's attention output vs FullKV's, mean cosine over continuation tokens, under
            the compressed background (the paper's signal, measured where it will be used);
  "kl":     KL(FullKV ‖ policy) of the held-out continuation, mean over its n positions and the
            prompts: Σ_v p(v) (log p(v) − log q(v)), the harness's fidelity metric (evaluate.compare).
[choice: cosine, measured on dev] The end-to-end KL of 2 × 64 calibration tokens is the more
direct objective but overfits them: on the dev split (seed 2, 6 + 6 prompts, equal memory) the
KL-scored policy reached fidelity KL 0.232 / 0.025 at B = 128 / 512 and lost every needle at
128; the cosine-scored one 0.165 / 0.022 with needles 83 % / 100 % (SnapKV 0.237 / 0.065,
67 % / 67 %). The starting rule and the budget step are scored by the KL in both.

Cost: one FullKV prefill per prompt (calibrate.reference) and one compression per pool rule;
a candidate for layer l re-runs only layers l..L−1 of the n continuation tokens (layers < l see
the same inputs under every candidate: the stream entering each layer is kept).
[choices]: the continuation is teacher-forced with appends (no decode-time eviction: under equal
memory a layer's decode rule evicts only beyond the generation allowance, and n is within it);
each layer's decode rule is its prefill rule's own decode form (SPEC.md §3, as a uniform rule).
"""
from __future__ import annotations

import time

import torch

import probing as C
import rules
from model import Hooks
from polykv import LayerPolicy, Policy, RuleSettings, largest_remainder


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
    spy = lambda l, q, q_pos, lc, out: seen.append(out) if l == layer else None
    hooks = Hooks(post_kernel=spy)
    for l in range(layer, model.config.n_layers):
        if l > layer:
            xs.append(x)
        x, _ = model.layers[l](x, ref["pos"], caches[l], model.inv_freq, l, hooks if l == layer else None,
                               model.sdpa)
    return log_probs(model, x), xs, seen[0]


def policy_of(assign, budgets, settings, meta=None) -> Policy:
    """Layer l: (rule, b_l) at prefill, the rule's own decode form at b_l; B = mean b_l."""
    return Policy([LayerPolicy((r, b), (rules.RULES[r].decode, b)) for r, b in zip(assign, budgets)],
                  sum(budgets) // len(budgets), settings, meta or {})


@torch.no_grad()
def measure(model, pairs, budget: int, signal: str = "cosine", sweeps: int = 3, tol: float = 0.0,
            budget_signal: bool = True, settings: RuleSettings = RuleSettings(), log=None) -> dict:
    """Every signal of the joint procedure and the chosen rules/budgets, JSON-ready."""
    L, dev, pool = model.config.n_layers, model.device, C.POOL
    log = log or (lambda *_: None)
    t0 = time.time()
    refs = []
    for p, c in pairs:
        ref = C.reference(model, torch.tensor([p], device=dev), torch.tensor([c], device=dev), settings)
        ref["lp"] = log_probs(model, ref.pop("last"))
        refs.append(ref)
    comp = {r: [Policy.uniform(r, budget, L, settings=settings).compress(model, ref["full"], ref["obs"])
                for ref in refs] for r in pool}
    log(f"{len(refs)} FullKV prefills and {len(pool)} compressions ({time.time() - t0:.0f} s)")
    x0 = [model.embed_tokens(ref["cont"]) for ref in refs]

    def evaluate(layer, caches_of, xs_of):
        """Run every prompt from `layer`: (score (lower is better), kl, [streams per prompt])."""
        kls, coss, streams = [], [], []
        for i, ref in enumerate(refs):
            lp, xs, out = run_from(model, ref, layer, xs_of(i), caches_of(i))
            kls.append(kl(ref["lp"], lp))
            coss.append(C.cosine(out, ref["out"][layer]))
            streams.append(xs)
        k, cs = sum(kls) / len(kls), sum(coss) / len(coss)
        return (k if signal == "kl" else -cs), k, streams

    # 1. the best uniform rule, by end-to-end KL
    uniform = {r: evaluate(0, lambda i, r=r: comp[r][i].layers, lambda i: x0[i]) for r in pool}
    start = min(pool, key=lambda r: uniform[r][1])
    assign = [start] * L
    cur_kl, streams = uniform[start][1], uniform[start][2]
    xs = [[x0[i]] + streams[i] for i in range(len(refs))]          # stream entering each layer
    sig = {"signal": signal, "uniform_kl": {r: uniform[r][1] for r in pool}, "start": start, "sweeps": []}
    log("uniform rules, KL on the calibration text: "
        + ", ".join(f"{r} {uniform[r][1]:.4f}" for r in pool) + f"; start from {start}")

    # 2. sweeps over the layers
    caches = lambda i, a: [comp[a[l]][i].layers[l] for l in range(L)]
    for sweep in range(sweeps):
        changed, scores = [], []
        for l in range(L):
            cand = {}
            for r in pool:
                trial = assign[:l] + [r] + assign[l + 1:]
                cand[r] = evaluate(l, lambda i, t=trial: caches(i, t), lambda i: xs[i][l])
            best = min(pool, key=lambda r: cand[r][0])
            scores.append({r: cand[r][0] for r in pool})
            if best != assign[l] and cand[best][0] < cand[assign[l]][0] - tol * abs(cand[assign[l]][0]):
                changed.append((l, assign[l], best))
                assign[l] = best
                cur_kl = cand[best][1]
                for i in range(len(refs)):
                    xs[i][l + 1:] = cand[best][2][i]
        sig["sweeps"].append({"scores": scores, "changed": changed, "kl": cur_kl})
        log(f"sweep {sweep + 1}: {len(changed)} layers changed, KL {cur_kl:.4f} ({time.time() - t0:.0f} s)")
        if not changed:
            break

    # 3. budgets: the KL increase when one layer's budget is halved, kept only if it helps
    budgets = [budget] * L
    if budget_signal and budget >= 2:
        half = {r: [Policy.uniform(r, budget // 2, L, settings=settings).compress(model, ref["full"], ref["obs"])
                    for ref in refs] for r in set(assign)}
        sens = []
        for l in range(L):
            trial = lambda i, l=l: [half[assign[l]][i].layers[k] if k == l else comp[assign[k]][i].layers[k]
                                    for k in range(L)]
            sens.append(max(0.0, evaluate(l, trial, lambda i: xs[i][l])[1] - cur_kl))
        T = min(ref["full"].layers[0].k.shape[2] for ref in refs)
        target = C.allocate(sens, L * budget, budget // 4, T)
        tried = {"0": cur_kl}
        for alpha in (0.5, 1.0):
            b = largest_remainder([(1 - alpha) * budget + alpha * t for t in target], L * budget)
            pol = policy_of(assign, b, settings)
            made = [pol.compress(model, ref["full"], ref["obs"]) for ref in refs]
            tried[str(alpha)] = evaluate(0, lambda i: made[i].layers, lambda i: x0[i])[1]
            if tried[str(alpha)] < min(v for k, v in tried.items() if k != str(alpha)):
                budgets = b
        sig["budget"] = {"halving_sensitivity": sens, "kl_by_alpha": tried,
                         "alpha": min(tried, key=tried.get)}
        log(f"budgets: KL uniform {tried['0']:.4f}, α=½ {tried['0.5']:.4f}, α=1 {tried['1.0']:.4f}; "
            f"kept α = {sig['budget']['alpha']} ({time.time() - t0:.0f} s)")
    sig.update(rules=assign, budgets=budgets, seconds=round(time.time() - t0, 1))
    return sig


def build(sig: dict, budget: int, settings: RuleSettings = RuleSettings(), meta: dict = None) -> Policy:
    """The policy the joint procedure chose; meta records the procedure and its signals."""
    assert sum(sig["budgets"]) == len(sig["budgets"]) * budget
    return policy_of(sig["rules"], sig["budgets"], settings,
                     {**(meta or {}), "method": "polykv", "procedure": "joint", "signals": sig,
                      "best_uniform": sig["start"]})


def table(policy: Policy) -> str:
    """One line per layer: the chosen rule and budget, and each rule's score in the last sweep
    (KL, or −cosine with signal = cosine) with the other layers as chosen before it."""
    sig = policy.meta["signals"]
    last = sig["sweeps"][-1]["scores"]
    head = f"{'layer':>5} {'rule':>9} {'budget':>6} | " + " ".join(f"{r:>9}" for r in C.POOL)
    rows = [head] + [f"{l:>5} {lp.prefill[0]:>9} {lp.prefill[1]:>6} | "
                     + " ".join(f"{last[l][r]:>9.5f}" for r in C.POOL) for l, lp in enumerate(policy.layers)]
    changed = [len(s["changed"]) for s in sig["sweeps"]]
    rows.append(f"start: uniform {sig['start']}; layers changed per sweep {changed}; {sig['seconds']} s")
    return "\n".join(rows)
