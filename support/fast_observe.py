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
    In fp32, probabilities below the smallest normal number (1.2e-38) are set to 0 [choice:
    x86 CPUs compute on subnormal numbers many times slower, and at long prompts many
    probabilities of a sink-dominated row fall there; no sum of probabilities they enter moves
    by more than T·1.2e-38]. Tested against it."""
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
    p = torch.softmax(logits, dim=-1)
    if dtype == torch.float32:                          # subnormal probabilities: 0 (above)
        torch.threshold_(p, torch.finfo(dtype).tiny, 0.0)
    return p.view(B, H, c, c1)


def observe_layer(q, q_pos, lc, names, window: int, chunk: int, extra=(), layer: int = 0,
                  ends=None, attention_out=None):
    """Every requested statistic of one layer from one pass over its attention.

    q (B, H, T, D) are the prompt's queries and lc its fresh FullKV cache (key j at position j,
    so query rows [c0, c1) see keys [0, c1) only: the causal key range). Query rows go in
    descending chunks; each chunk's A (B, H, c, c1) is computed once (`causal_probs`) and feeds
    the column sums, the window sums, the last row and every extra statistic of each prompt
    length e in ends (default T alone): a prefix tokens[:, :e] reads its rows i < e over its
    keys j < e (causal: A there is the prefix's own attention; the columns j ≥ e of those rows
    are 0). Rows no statistic reads are skipped. Returns {e: ({name: (B, H, e)},
    {extra name: value})}, as polykv.observe_layer_naive.

    attention_out (B, H, T, D), if given: every query row is read and the layer's attention
    output A·V written into it chunk by chunk (`model.attention`'s explicit form, softmax in
    fp32), so the prefill need not compute the layer's attention a second time (the kernel of
    polykv.observe_prefixes).
    """
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
    start = 0 if attention_out is not None else min(first.values())
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = {e: {k: q.new_zeros(B, H, e, dtype=dtype) for k in names if k != "last"} for e in ends}
    state = {e: {name: statistic.begin(q[:, :, :e], prefix_layer(lc, e), layer)
                 for name, statistic in extra} for e in ends}
    for c1 in range(T, start, -chunk):
        c0 = max(start, c1 - chunk)
        p = causal_probs(q[:, :, c0:c1], lc.k[:, :, :c1], c0)        # (B, H, c, c1)
        if attention_out is not None:
            values_times(p, lc.v[:, :, :c1], attention_out[:, :, c0:c1])
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
            for name, statistic in extra:     # a chunk holding a row the statistic reads
                if r1 > statistic.lowest(e, layer):
                    statistic.add(state[e][name], r0, r1, pe)
    return {e: (out[e], {name: statistic.end(state[e][name]) for name, statistic in extra})
            for e in ends}


def values_times(p, v, out):
    """out (B, H, c, D) = p (B, H, c, c1) · v (B, G, c1, D), p cast to v's dtype first (as
    model.attention), one (g·c, c1) x (c1, D) product per KV group: v never repeated g times."""
    B, H, c, c1 = p.shape
    G = v.shape[1]
    grouped = p.reshape(B, G, H // G * c, c1)                                # (B, G, g·c, c1)
    for b in range(B):
        for group in range(G):
            rows = torch.mm(grouped[b, group].to(v.dtype), v[b, group])      # (g·c, D)
            out[b, group * (H // G):(group + 1) * (H // G)] = rows.view(H // G, c, -1)


def reads_every_row(names, extra, layer: int, T: int) -> bool:
    """Whether observe_layer reads every query row of the layer for these statistics (column
    sums, or an extra statistic from row 0): then computing the attention output in the same
    chunks costs one more product and spares the prefill's own attention."""
    return "colsum" in names or any(st.lowest(T, layer) == 0 for _, st in extra)


FUSED_ROWS = 128    # query rows per chunk where the pass computes the attention output too


def fused_kernel(per_layer: list, needs, layer_read, read: dict):
    """polykv.observe_prefixes' model.Hooks kernel on the fast path: where a layer's statistics
    (per_layer[layer], needs.extra) read every query row, layer_read(layer, q, q_pos, lc, chunk,
    attention_out=out) reads them and writes the layer's attention output into out, in chunks
    of at most FUSED_ROWS rows; what it read goes to read[layer] for the post-kernel hook.
    Elsewhere None: the model's own kernel, then the post-kernel hook's pass."""
    def kernel(layer, q, q_pos, lc):
        if not reads_every_row(per_layer[layer], needs.extra, layer, lc.size):
            return None
        out = q.new_empty(q.shape)                                           # (B, H, T, D)
        read[layer] = layer_read(layer, q, q_pos, lc, min(needs.chunk, FUSED_ROWS),
                                 attention_out=out)
        return out
    return kernel


def prefix_layer(lc, e: int):
    """The layer cache of the prefix tokens[:, :e] within a fresh prefill's cache lc (key j at
    position j): its first e entries, views; lc itself when e is all of it."""
    return lc if e == lc.size else lc.span(0, e)
