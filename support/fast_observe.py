"""The shared observation's fast path: a layer's statistics read off its attention in query
chunks, never holding the (B, H, T, T) matrix (polykv.observe's default). The naive form it
replaces is polykv.observe_layer_naive (the whole matrix at once, model.attention_probs); tests
check the two give the same statistics and the same kept sets."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

ATTENTION_STATS = ("colsum", "window", "last")      # those read off the prompt's own attention


def causal_probs(q, k, c0: int) -> torch.Tensor:
    """A[b, h, i, j] (B, H, c, c1) of query rows c0..c1−1 over keys 0..c1−1 of a fresh prefill
    (key j at position j, bias 0): model.attention_probs with the mask reduced to the upper
    triangle of the last c×c block, fp32 (fp64 for fp64 inputs). The scale 1/√D goes on the
    queries before the product (exact when D is a power of 4, e.g. 64; else a rounding apart).
    Tested against it."""
    B, H, c, D = q.shape
    G, c1 = k.shape[1], k.shape[2]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    # one (g·c, D) x (D, c1) product per KV group: the keys are never broadcast to g copies
    # (a loop of 2-D products: faster on CPU than one batched product over transposed keys)
    q_grouped = (q.to(dtype) / math.sqrt(D)).reshape(B, G, H // G * c, D)    # (B, G, g·c, D)
    keys = k.to(dtype)
    logits = q_grouped.new_empty(B, G, H // G, c, c1)                        # (B, G, g, c, c1)
    for b in range(B):
        for group in range(G):
            torch.mm(q_grouped[b, group], keys[b, group].T, out=logits[b, group].view(-1, c1))
    tri = torch.ones(c, c, dtype=torch.bool, device=q.device).triu_(1)       # j > i: the future
    logits[..., c0:].masked_fill_(tri, float("-inf"))
    return torch.softmax(logits, dim=-1).view(B, H, c, c1)


def observe_layer(q, q_pos, lc, names, window: int, chunk: int, extra=(), layer: int = 0):
    """Every requested statistic of one layer from one pass over its attention.

    q (B, H, T, D) are the prompt's queries and lc its fresh FullKV cache (key j at position j,
    so query rows [c0, c1) see keys [0, c1) only: the causal key range). Query rows go in
    descending chunks; each chunk's A (B, H, c, c1) is computed once (`causal_probs`) and feeds
    the column sums, the window sums, the last row and every extra statistic. Rows no statistic
    reads are skipped. Returns ({name: (B, H, T)}, {extra name: value})."""
    B, H, T, D = q.shape
    # a fresh prefill's bias is 0 by construction (model.LayerCache.append); it is not read
    # here, which would cost a host synchronisation per layer
    assert lc.size == T, "observe_layer reads a fresh prefill (key j at position j)"
    names = [k for k in names if k in ATTENTION_STATS]
    lowest = (
        0
        if "colsum" in names
        else min(
            [T - 1]
            + [T - min(window, T)] * ("window" in names)
            + [statistic.lowest(T, layer) for _, statistic in extra]
        )
    )
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = {k: q.new_zeros(B, H, T, dtype=dtype) for k in names if k != "last"}
    state = {name: statistic.begin(q, lc, layer) for name, statistic in extra}
    for c1 in range(T, lowest, -chunk):
        c0 = max(lowest, c1 - chunk)
        p = causal_probs(q[:, :, c0:c1], lc.k[:, :, :c1], c0)        # (B, H, c, c1)
        if "colsum" in names:
            out["colsum"][..., :c1] += p.sum(2)                      # Σ_{all i} A[h,i,j]
        if "window" in names and c1 > T - window:
            out["window"][..., :c1] += p[:, :, max(0, T - window - c0):].sum(2)   # Σ_{i ≥ T−w}
        if "last" in names and c1 == T:
            out["last"] = F.pad(p[:, :, -1], (0, T - c1))            # A[h,T−1,j]
        for name, statistic in extra:
            statistic.add(state[name], c0, c1, p)
    return out, {name: statistic.end(state[name]) for name, statistic in extra}
