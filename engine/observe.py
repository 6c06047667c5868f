"""The engine's shared observation: one full-attention prefill observed for several methods
and several prompt lengths at once, each layer's statistics read off its attention in query
chunks, never holding the (B, H, T, T) matrix.

The paper's path observes one method alone, the naive way (polykv.observe: each layer's whole
attention matrix). Here the statistics of every method of a prompt (the union of their
`polykv.Needs`) and of each prefix the `agnostic` protocol reads come from one pass: each
layer's attention is computed once, in chunks of query rows (`observe_layer`), and where the
statistics read every row the same chunks also give the layer's attention output (the fused
kernel), so the prefill does not compute it twice. `observe_layer_whole` is the same pass from
the whole matrix, the form the chunked one is tested against; tests also check that every
method's kept sets are those of the paper's path (tests/test_engine_equals_paper.py).
"""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

import model as M
from model import Cache, Hooks, attention_probs
from polykv import ATTENTION_STATISTICS, Needs, Observation
from support.errors import UsageError

ATTENTION_STATS = tuple(ATTENTION_STATISTICS)    # those read off the prompt's own attention


# -------------------------------------------------------------- a layer's statistics in one pass

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
    {extra name: value})}, as observe_layer_whole.

    attention_out (B, H, T, D), if given: every query row is read and the layer's attention
    output A·V written into it chunk by chunk (`model.attention`'s explicit form, softmax in
    fp32), so the prefill need not compute the layer's attention a second time (the kernel of
    observe_prefixes).
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
                # i ≥ e−w
                stats["window"][..., :r1] += pe[:, :, max(0, e - window - r0):].sum(2)
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
    """observe_prefixes' model.Hooks kernel on the fast path: where a layer's statistics
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


def observe_layer_whole(q, q_pos, lc, names, window: int, chunk: int = 0,
                        extra=(), layer: int = 0, ends=None):
    """Every requested statistic of one layer from its whole attention matrix, the naive form:
    A (B, H, T, T) = model.attention_probs of the prompt's queries q (B, H, T, D) over its fresh
    cache lc, then the column sums, the window sums and the last row, and each extra statistic
    fed the rows it reads in one piece. `observe_layer` computes the same in query
    chunks, never holding A (the default of `observe`; tested equal). chunk: unused here.

    ends: the prompt lengths e to read statistics for (default T alone). Attention is causal, so
    the rows i < e of A over keys j < e are the attention of the prefix tokens[:, :e] itself:
    a prefix's statistics are those of A[:, :, :e, :e] (`observe_prefixes`).
    Returns {e: ({name: (B, H, e)}, {extra name: value})}."""
    B, H, T, D = q.shape
    names = [k for k in names if k in ATTENTION_STATS]
    A = attention_probs(q, lc.k, lc.bias, q_pos, lc.pos)                 # (B, H, T, T) causal
    result = {}
    for e in ends or (T,):
        Ae = A[:, :, :e, :e]                                             # (B, H, e, e)
        out = {}
        if "colsum" in names:
            out["colsum"] = Ae.sum(2)                                      # Σ_{all i} A[h,i,j]
        if "window" in names:
            out["window"] = Ae[:, :, e - min(window, e):].sum(2)         # Σ_{i ≥ e−w} A[h,i,j]
        if "last" in names:
            out["last"] = Ae[:, :, -1]                                     # A[h,e−1,j]
        values = {}
        for name, st in extra:
            lo = st.lowest(e, layer)
            state = st.begin(q[:, :, :e], prefix_layer(lc, e), layer)
            st.add(state, lo, e, Ae[:, :, lo:])                            # rows lo..e−1
            values[name] = st.end(state)
        result[e] = out, values
    return result


# ------------------------------------------------------- several methods and prefixes, one prefill

# which statistic each parameter of Needs serves (methods sharing a prefill must agree on it)
PARAMS = {"window": "window", "n_sink": "queries", "future": "queries", "repeat": "recon",
          "repeat_from": "recon"}


def union(needs: list, n_layers: int) -> Needs:
    """For all of `needs`: per layer the union of the statistics, the computed statistics and
    extras merged by name, the smallest chunk; methods reading a statistic must agree on its
    parameters (PARAMS)."""
    stats = [frozenset()] * n_layers
    params, extra, computed = {}, {}, {}
    chunk = min([n.chunk for n in needs] or [256])
    for n in needs:
        for p, stat in PARAMS.items():
            if stat in n.used:
                if params.setdefault(p, getattr(n, p)) != getattr(n, p):
                    raise UsageError(
                        f"methods observe with different {p}: {params[p]} vs {getattr(n, p)}"
                    )
        if any(n.stats):
            stats = [a | b for a, b in zip(stats, n.stats)]
        for name, st in n.extra:
            extra[name] = st if name not in extra else extra[name].merge(st)
        computed.update(n.computed)
    return Needs(tuple(stats), chunk=chunk, extra=tuple(extra.items()),
                 computed=tuple(computed.items()),
                 surprisal=any(n.surprisal for n in needs), **params)


@torch.no_grad()
def observe(model, tokens, needs: Needs, spy=None, layer_pass=observe_layer):
    """One full-attention prefill of tokens (B, T) recording what `needs` asks for, each layer's
    attention computed once (then the extra passes of the statistics read, e.g. KVzip's):
    (FullKV cache, Observation). spy: an extra post-kernel callable (layer, q, q_pos, lc, out);
    layer_pass: how a layer's statistics are read off its attention, in query chunks
    (`observe_layer`) or `observe_layer_whole`."""
    T = tokens.shape[1]
    return observe_prefixes(model, tokens, needs, (T,), spy, layer_pass)[T]


@torch.no_grad()
def observe_prefixes(model, tokens, needs: Needs, ends, spy=None, layer_pass=observe_layer,
                     fuse: bool = True):
    """`observe` of each prefix tokens[:, :e], e in ends, from one prefill of tokens (B, T):
    {e: (FullKV cache of the prefix, its Observation)}. Attention is causal, so the first e
    query rows and keys of the prefill are those of the prefix's own prefill: each statistic of
    a prefix is read over its own rows and keys in the same pass (the `agnostic` protocol's
    prefix + context within the whole prompt: evaluate.py). The prefix's cache is the first e
    entries of each layer (views), its last_logits those after token e−1. The extra passes
    after the prefill (KVzip's reconstruction) run once per prefix: theirs is another prompt.
    fuse (the fast layer pass on a fast model only): a layer whose statistics read every query
    row computes its attention output in the same chunks, instead of the model's kernel."""
    T, L = tokens.shape[1], model.config.n_layers
    ends = sorted(set(ends), reverse=True)
    if not ends or not all(0 < e <= T for e in ends):
        raise UsageError(f"prefix lengths {ends} must lie in 1..{T}")
    per_layer = needs.stats or (frozenset(),) * L
    obs = {e: Observation([dict() for _ in range(L)], {name: [None] * L for name, _ in needs.extra})
           for e in ends}
    last_logits = {}

    computed = dict(needs.computed)
    unknown = set().union(*per_layer) - set(ATTENTION_STATS) - set(computed)
    if unknown:
        raise UsageError(f"no statistic named {sorted(unknown)[0]!r} is defined "
                         f"(a rule declares the statistics it computes: polykv.Rule)")
    during = [n for n, st in computed.items() if st.per_layer is not None]

    def layer_read(layer, q, q_pos, lc, chunk=needs.chunk, **out):
        return layer_pass(q, q_pos, lc, per_layer[layer], needs.window, chunk, needs.extra,
                          layer, ends, **out)

    # the fast path's kernel (`fused_kernel`): where the statistics read every
    # query row, the chunked pass also computes the layer's attention output, so the attention
    # is computed once, not twice
    fused = fuse and layer_pass is observe_layer and model.speed is not None
    read = {}                                     # layer -> what the fused kernel read

    def post_kernel(layer, q, q_pos, lc, out):
        names = per_layer[layer]
        got = read.pop(layer) if layer in read else layer_read(layer, q, q_pos, lc)
        for e, (stats, values) in got.items():
            obs[e].stats[layer] = stats
            for name in during:
                if name in names:
                    stats[name] = computed[name].per_layer(q[:, :, :e], q_pos[:, :e], model,
                                                             needs)
            for name, value in values.items():
                obs[e].extra[name][layer] = value
        if spy is not None:
            spy(layer, q, q_pos, lc, out)

    def final(h):                                 # the final norm's output (B, T, dim)
        # −log p(token_t | tokens_<t) reads nothing after t: a prefix's is the prompt's first e
        surprisal = M.surprisal(model, h, tokens) if needs.surprisal else None
        for e in ends:
            if surprisal is not None:
                obs[e].surprisal = surprisal[:, :e]
            if e < T:                             # the logits after token e−1, as Llama.step
                logits = model.lm_head(h[:, e - 1])
                last_logits[e] = logits if logits.dtype == torch.float64 else logits.float()

    wanted = any(per_layer) or needs.extra or spy
    hooks = (Hooks(post_kernel=post_kernel if wanted else None,
                   final=final if needs.surprisal or ends != [T] else None,
                   kernel=fused_kernel(per_layer, needs, layer_read, read)
                   if fused and wanted else None)
             if wanted or needs.surprisal or ends != [T] else None)
    full = M.prefill(model, tokens, hooks)
    caches = {e: full if e == T else
              Cache([prefix_layer(lc, e) for lc in full.layers], e, last_logits[e])
              for e in ends}
    for name, st in computed.items():            # extra passes after the prefill
        layers = [l for l in range(L) if name in per_layer[l]]
        if st.after is not None and layers:
            for e in ends:
                t0 = time.perf_counter()
                for l, value in st.after(model, caches[e], tokens[:, :e], needs, layers).items():
                    obs[e].stats[l][name] = value
                obs[e].seconds[name] = time.perf_counter() - t0
    return {e: (caches[e], obs[e]) for e in ends}


def observe_for(model, tokens, methods: list):
    """The shared prefill of several methods: observe(model, tokens, union of their needs)."""
    return observe(model, tokens, union([m.needs(model) for m in methods], model.config.n_layers))


