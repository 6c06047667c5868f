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


def observe_layer(q, q_pos, lc, names, window: int, chunk: int, extra=(), layer: int = 0,
                  ends=None):
    """Every requested statistic of one layer from one pass over its attention.

    q (B, H, T, D) are the prompt's queries and lc its fresh FullKV cache (key j at position j,
    so query rows [c0, c1) see keys [0, c1) only: the causal key range). Query rows go in
    descending chunks; each chunk's A (B, H, c, c1) is computed once (`causal_probs`) and feeds
    the column sums, the window sums, the last row and every extra statistic of each prompt
    length e in ends (default T alone): a prefix tokens[:, :e] reads its rows i < e over its
    keys j < e (causal: A there is the prefix's own attention; the columns j ≥ e of those rows
    are 0). Rows no statistic reads are skipped. Returns {e: ({name: (B, H, e)},
    {extra name: value})}, as polykv.observe_layer_naive."""
    B, H, T, D = q.shape
    # a fresh prefill's bias is 0 by construction (model.LayerCache.append); it is not read
    # here, which would cost a host synchronisation per layer
    assert lc.size == T, "observe_layer reads a fresh prefill (key j at position j)"
    names = [k for k in names if k in ATTENTION_STATS]
    ends = ends or (T,)

    def lowest(e):           # the first query row a statistic of length e reads
        if "colsum" in names:
            return 0
        return min([e - 1] + [e - min(window, e)] * ("window" in names)
                   + [statistic.lowest(e, layer) for _, statistic in extra])
    first = {e: lowest(e) for e in ends}
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = {e: {k: q.new_zeros(B, H, e, dtype=dtype) for k in names if k != "last"} for e in ends}
    state = {e: {name: statistic.begin(q[:, :, :e], prefix_layer(lc, e), layer)
                 for name, statistic in extra} for e in ends}
    for c1 in range(T, min(first.values()), -chunk):
        c0 = max(min(first.values()), c1 - chunk)
        p = causal_probs(q[:, :, c0:c1], lc.k[:, :, :c1], c0)        # (B, H, c, c1)
        for e in ends:
            if c0 >= e or c1 <= first[e]:
                continue
            r0, r1 = max(c0, first[e]), min(c1, e)                  # the rows of length e here
            pe = p                                                   # (B, H, r1 − r0, r1)
            if (r0, r1) != (c0, c1):             # a length's edge within the chunk: its part
                pe = p[:, :, r0 - c0:r1 - c0, :r1].contiguous()
            stats = out[e]
            if "colsum" in names:
                stats["colsum"][..., :r1] += pe.sum(2)               # Σ_{all i} A[h,i,j]
            if "window" in names and r1 > e - window:
                stats["window"][..., :r1] += pe[:, :, max(0, e - window - r0):].sum(2)  # i ≥ e−w
            if "last" in names and r1 == e:
                stats["last"] = F.pad(pe[:, :, -1], (0, e - r1))     # A[h,e−1,j]
            for name, statistic in extra:
                statistic.add(state[e][name], r0, r1, pe)
    return {e: (out[e], {name: statistic.end(state[e][name]) for name, statistic in extra})
            for e in ends}


def prefix_layer(lc, e: int):
    """The layer cache of the prefix tokens[:, :e] within a fresh prefill's cache lc (key j at
    position j): its first e entries, views; lc itself when e is all of it."""
    if e == lc.size:
        return lc
    return type(lc)(lc.k[:, :, :e], lc.v[:, :, :e], lc.pos[:, :, :e], lc.bias[:, :, :e])
