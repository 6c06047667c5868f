"""PolyKV past the paper: a calibration that sees the other layers
(`python -m engine.calibrate_joint`).

The paper's calibration (calibrate.py) probes each layer alone, every other layer FullKV, and
ranks rules by that layer's output cosine. On the embedded model this puts StreamingLLM on a
third of the layers at B = 128: each is harmless alone, together they drop the same middle of
the prompt (docs/polykv.md, "Past the paper"). This procedure scores every choice
with the rest of the network already compressed:

 1. Start: the best uniform rule on the calibration text, by end-to-end KL (below).
 2. Sweep the layers l = 0..L−1: for each rule r of the pool, layer l compressed by r at B and
    every other layer by the current policy; keep the r with the lowest score if it beats the
    current choice by more than `tol` (relative). Repeat until a sweep changes nothing, at most
    `sweeps` times (coordinate descent on the calibration objective).
 3. Budgets (optional signal, kept only if it helps on the calibration text): s_l = the KL
    increase when layer l's budget is halved under the current policy; budgets
    b = (1 − α)·B + α·allocate(s, L·B, B/4, T) for α ∈ {½, 1}
    (calibrate.allocate: water-filled, largest-remainder rounded, Σ b = L·B); the α (or
    uniform) with the lowest end-to-end KL wins.

Score (`signal`):
  "cosine": layer l's attention output vs FullKV's, mean cosine over continuation tokens, under
            the compressed background (the paper's signal, measured where it will be used);
  "kl":     KL(FullKV ‖ policy) of the held-out continuation, mean over its n positions and the
            prompts: Σ_v p(v) (log p(v) − log q(v)), the harness's fidelity metric
(evaluate.compare).
[choice: cosine, on dev (docs/polykv.md): the end-to-end KL of 2 × 64 tokens overfits them and
lost every dev needle at B = 128]. The starting rule and the budget step are scored by the KL.

Cost: one FullKV prefill per prompt (`reference`) and one compression per pool rule;
a candidate for layer l re-runs only layers l..L−1 of the n continuation tokens (layers < l see
the same inputs under every candidate: the stream entering each layer is kept).
[choices]: the continuation is teacher-forced with appends (no decode-time eviction: under equal
memory a layer's decode rule evicts only beyond the generation allowance, and n is within it);
each layer's decode rule is its prefill rule's own decode form (as a uniform rule).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

import baselines
import calibrate
import model as M
import polykv
from calibrate import (CONT_LEN, PROMPT_LEN, allocate, calibration_set, cosine, quiet,
                       reference, set_meta, with_prompt)
from engine.observe import observe_for
from engine.policy_tables import describe, kl, plot
from model import Hooks
from polykv import LayerPolicy, Policy, RuleSettings, largest_remainder
from support import cli, tasks
from support.errors import UsageError


def log_probs(model, x) -> torch.Tensor:
    """log p over the vocabulary (n, V) fp32 from the last hidden states x (1, n, dim)."""
    return torch.log_softmax(model.lm_head(model.norm(x)).float()[0], -1)


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
        [LayerPolicy((r, b), (baselines.RULES[r].decode, b)) for r, b in zip(assign, budgets)],
        sum(budgets) // len(budgets),
        settings,
        meta or {},
        rules=baselines.RULES,
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
    L, dev, pool = model.config.n_layers, model.device, polykv.pool(baselines.RULES)
    log, goal, n_text = log or quiet, Objective(retrieval), len(pairs)
    t0 = time.time()
    refs = []
    for p, c in list(pairs) + list(probes):
        ref = reference(model, torch.tensor([p], device=dev), torch.tensor([c], device=dev),
                        settings, baselines.RULES, observe_for)
        ref["lp"] = log_probs(model, ref.pop("last"))
        refs.append(ref)
    comp = {
        r: [
            Policy.uniform(r, budget, L, settings=settings, rules=baselines.RULES).compress(
                model, ref["full"], ref["obs"]
            )
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
                Policy.uniform(r, budget // 2, L, settings=settings,
                               rules=baselines.RULES).compress(
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
    _, _, meta = set_meta(model, tok, texts, budget, seed, model_name, needles,
                          rules=baselines.RULES)
    meta["calibration"].update(probes=len(probe_pairs), retrieval=retrieval)
    sig = measure_joint(model, texts, budget, signal, settings=settings, log=log,
                        probes=probe_pairs, retrieval=retrieval)
    return build_joint(sig, budget, settings, meta)


# the joint procedure by objective (--procedure; a policy file's name carries it)
OBJECTIVES = {"joint": {},                                                      # the default
              "joint-text": {"probes": 0, "retrieval": None},
              "joint-weighted": {"retrieval": 0.1}}


def main(argv=None):
    ap = calibrate.arguments("Calibrate a PolyKV policy by the joint procedure (past the paper; "
                             "python calibrate.py: the paper's).")
    ap.add_argument("--plot", default=None, help="write a per-layer PNG (needs matplotlib)")
    ap.add_argument("--procedure", choices=OBJECTIVES, default="joint",
                    help="the objective: joint (text score under the retrieval constraint), "
                         "joint-text (text alone), joint-weighted (text + 0.1 × probe loss)")
    ap.add_argument("--signal", choices=("kl", "cosine"), default="cosine",
                    help="the sweep's score (cosine: better on dev, docs/polykv.md)")
    ap.add_argument(
        "--needles",
        type=int,
        default=0,
        help="add N dev-split niah_single_1 prompts (gold answer as continuation)",
    )
    a = ap.parse_args(argv)
    calibrate.check_files(a)
    calibrate.check_args(a.budget, a.n_prompts, a.prompt_len, a.cont_len)

    def joint(m, tok, budget, seed, **common):
        return calibrate_joint(m, tok, budget, seed, signal=a.signal, needles=a.needles,
                               **OBJECTIVES[a.procedure], **common)
    pol = calibrate.run(a, f"procedure={a.procedure} signal={a.signal} needles={a.needles}", joint)
    print(describe(pol))
    if a.plot:
        try:
            print(plot([pol], a.plot, polykv.pool(baselines.RULES)))
        except OSError as e:
            raise UsageError(f"cannot write {a.plot!r}: {e.strerror}") from None


if __name__ == "__main__":
    cli.run(main, calibrate.ON_CTRL_C)
