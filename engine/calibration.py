"""The harness's side of PolyKV's calibration (calibrate.py is the paper's procedure):

- the uniform baselines on the calibration text, at equal memory (every rule compresses the
  prompt to B, then *appends* the n continuation tokens, so all hold the same L·G·(B + n)
  entries), whose best rule the budget-only ablation takes without seeing evaluation data;
- `calibrate_paper`: the paper's procedure as the harness runs it (the shared observation of
  engine/observe.py handed in, the uniform baselines recorded in the policy file);
- the paper's ablations as transforms of a calibrated policy (its rules alone, its budgets alone,
  its prefill phase alone, one decode rule for every layer): PolyKV's rows in
  engine/policy_cache.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import baselines
import calibrate
import model as M
import polykv
from engine.observe import observe_for
from polykv import LayerPolicy, Policy, RuleSettings
from support.errors import UsageError


# ----------------------------------------------------------------------------- uniform baselines

# at equal memory: how the calibration's uniform baselines run (a policy file records it)
UNIFORM_MEMORY = "equal: every rule appends the continuation"


@torch.no_grad()
def uniform_run(model, ref: dict, rule: str, budget: int, settings: RuleSettings,
                rules: dict = baselines.RULES) -> tuple:
    """(NLL sum, cache after the continuation): every layer's prompt compressed by `rule` to
    `budget`, then the continuation teacher-forced with every rule *appending* (no decode-time
    eviction), so each holds L·G·(B + n) entries at the end whatever its own decode form: the
    rules compete at equal memory, as in the harness (docs/protocol.md)."""
    uniform = Policy.uniform(rule, budget, model.config.n_layers, decode="append",
                             settings=settings, rules=rules)
    cache = uniform.compress(model, ref["full"], ref["obs"])
    logits = M.decode(model, ref["cont"], cache)                          # (1, n, V)
    nll = float(F.cross_entropy(logits[0, :-1], ref["cont"][0, 1:], reduction="sum"))
    return nll, cache


def uniform_baselines(model, refs: list, budget: int, settings: RuleSettings,
                      rules: dict = baselines.RULES, log=None) -> dict:
    """{"uniform_dppl": {rule: ΔPPL}, "uniform_memory": UNIFORM_MEMORY} of every pool rule on the
    calibration set's reference passes (calibrate.references)."""
    ppl = calibrate.perplexity(refs)
    ppl_full = ppl(sum(r["nll"] for r in refs))
    dppl = {}
    for r in polykv.pool(rules):
        nll = sum(uniform_run(model, ref, r, budget, settings, rules)[0] for ref in refs)
        dppl[r] = ppl(nll) - ppl_full
    (log or calibrate.quiet)(f"uniform baselines: {len(dppl)} rules x {len(refs)} prompts")
    return {"uniform_dppl": dppl, "uniform_memory": UNIFORM_MEMORY}


# -------------------------------------------------------------- the paper's procedure, as run here

def calibrate_paper(model, tok, budget: int, seed: int = 0, n_prompts: int = 2,
                    prompt_len: int = calibrate.PROMPT_LEN, cont_len: int = calibrate.CONT_LEN,
                    preference: str = "cosine", sensitivity: str = "entropy", b_min=None,
                    settings: RuleSettings = RuleSettings(), texts=None, model_name: str = "",
                    log=None) -> Policy:
    """calibrate.calibrate with the engine's shared observation, plus the uniform baselines on
    the same reference passes (the policy file's signals.uniform_dppl and best_uniform: the
    best single rule at this budget, for `budget_from_best`). The same signals and policy as
    the paper's procedure (tests/test_engine_equals_paper.py)."""
    rules = baselines.RULES
    if texts is None:
        texts = calibrate.calibration_set(tok, budget, n_prompts, prompt_len, cont_len, seed,
                                          b_min)
    settings = calibrate.with_prompt(settings, tok)
    T, n, meta = calibrate.set_meta(model, tok, texts, budget, seed, model_name, 0, b_min, rules)
    refs = calibrate.references(model, texts, settings, rules, observe_for, log)
    sig = calibrate.measure(model, refs, budget, preference, settings, rules, log)
    sig.update(uniform_baselines(model, refs, budget, settings, rules, log))
    policy = calibrate.build(sig, budget, preference, sensitivity, b_min, cap=T,
                             settings=settings, meta=meta, rules=rules)
    policy.meta["best_uniform"] = min(sig["uniform_dppl"], key=sig["uniform_dppl"].get)
    return policy


# ----------------------------------------------------------------------------- ablations

def pattern_only(policy: Policy) -> Policy:
    """The calibrated rules with the uniform budget B in both phases."""
    B = policy.budget
    layers = [LayerPolicy((lp.prefill.rule, B), (lp.decode.rule, B)) for lp in policy.layers]
    return Policy(layers, B, policy.settings, {**policy.meta, "ablation": "pattern_only"},
                  rules=policy.rules)


def prefill_only(policy: Policy) -> Policy:
    """The calibrated prefill phase (rules and budgets); no eviction while decoding (`append`),
    as uniform SnapKV and PyramidKV do. Isolates what the decode-phase calibration costs or buys."""
    layers = [LayerPolicy(lp.prefill, ("append", lp.prefill.budget)) for lp in policy.layers]
    return Policy(
        layers, policy.budget, policy.settings, {**policy.meta, "ablation": "prefill_only"},
        rules=policy.rules,
    )


def budget_only(policy: Policy, rule: str) -> Policy:
    """One uniform rule (its own decode form) with the calibrated budgets."""
    if rule not in policy.rules:
        raise UsageError(f"unknown rule {rule!r}; choose from {', '.join(policy.rules)}")
    dec = policy.rules[rule].decode
    layers = [
        LayerPolicy((rule, lp.prefill.budget), (dec, lp.decode.budget)) for lp in policy.layers
    ]
    return Policy(
        layers, policy.budget, policy.settings, {**policy.meta, "ablation": f"budget_only:{rule}"},
        rules=policy.rules,
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
                  {**policy.meta, "ablation": f"decode_with:{rule}"}, rules=policy.rules)


def as_calibrated(policy: Policy) -> Policy:
    """The calibrated policy itself (the row of the procedure, no ablation)."""
    return policy
