"""What both PolyKV calibrations share (calibrate.py: the paper's; joint.py: the joint one):
the pool of rules, the FullKV reference pass over a calibration text, and the budget allocation.

Notation (SPEC.md): B the average budget, T prompt tokens, n continuation tokens, L layers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import methods
import model as M
import polykv
import rules
from errors import UsageError
from model import Hooks
from polykv import Policy, RuleSettings

# prefill patterns (SPEC.md §4): every registered rule but the random floor
POOL = tuple(name for name, r in rules.RULES.items() if r.pool)
# decode patterns that evict at a fixed budget (every decode form but append)
DECODE_POOL = tuple(name for name, d in rules.DECODE.items() if d.score is not None)


# ----------------------------------------------------------------------------- budgets

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
        reals = [float(cap) if l in capped else
                 b_min + (rest * s[l] / s_free if s_free > 0 else rest / len(free)) for l in range(L)]
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


# ----------------------------------------------------------------------------- the reference pass

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
    pool = [Policy.uniform(r, 1, L, settings=settings) for r in POOL]   # every pool rule's needs
    full, obs = methods.observe_for(model, prompt, pool)
    T, n = prompt.shape[1], cont.shape[1]
    pos = torch.arange(T, T + n, device=cont.device)[None]                   # (1, n)
    rec = {}

    def spy(layer, q, q_pos, lc, out):
        A = M.attention_probs(q, lc.k, lc.bias, q_pos, lc.pos)               # (1, H, n, T+n)
        rec[layer] = (out, float(-torch.xlogy(A, A).sum(-1).mean()))         # H = −Σ_j A log A

    x, xs = model.embed_tokens(cont), []                                      # (1, n, dim)
    for l in range(L):
        xs.append(x)
        x, _ = model.layers[l](x, pos, full.layers[l], model.inv_freq, l, Hooks(post_kernel=spy), model.sdpa)
    return {"full": full, "obs": obs, "cont": cont, "pos": pos, "xs": xs,
            "out": [rec[l][0] for l in range(L)], "entropy": [rec[l][1] for l in range(L)],
            "nll": _nll(model, x, cont), "last": x}
