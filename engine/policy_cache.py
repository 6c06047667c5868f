"""The PolyKV policies a run uses: one calibration per (procedure, model, budget, seed, length),
kept as a JSON file and reused only when the settings it records are those asked; and the PolyKV
rows of the harness (`VARIANTS`: a procedure and a transform of its policy). Not the paper: the
bookkeeping around it (calibrate.py; engine/calibration.py, engine/calibrate_joint.py)."""
from __future__ import annotations

import functools
import inspect
import json
import re
from pathlib import Path

import baselines
import polykv
from calibrate import PROMPT_LEN, TEXT, TEXT_VERSION, with_prompt
from engine import calibrate_joint
from engine.calibration import (UNIFORM_MEMORY, as_calibrated, budget_from_best, calibrate_paper,
                                decode_with, pattern_only, prefill_only)
from polykv import Policy
from support.errors import UsageError

# calibration procedures by name (a policy file's name carries it): the paper's, and the joint
# one with each objective (past the paper)
PROCEDURES = {"paper": calibrate_paper,
              **{name: functools.partial(calibrate_joint.calibrate_joint, **objective)
                 for name, objective in calibrate_joint.OBJECTIVES.items()}}


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
SHIPPED = Path(__file__).resolve().parent.parent / "policies"


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
    # wrong layer count: UsageError
    policy = Policy.load(path, n_layers=model.config.n_layers, rules=baselines.RULES)
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
             "pool": list(polykv.pool(baselines.RULES)),
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

