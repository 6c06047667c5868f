"""The method interface, and the one shared prefill that observes for every method at once.

Every compression method in the project (each uniform rule, PyramidKV, a PolyKV policy,
GraceKV, each ablation) is a `Method` — the shape of NVIDIA/kvpress's presses:
  needs(model)                 what it must observe during the full-attention prefill (`Needs`);
  compress(model, full, obs)   (FullKV cache, `Observation`) -> its compressed cache; `full` is
                               left untouched, so several methods share one prefill;
  decoder                      its decode behaviour: None = append every generated token, else
                               hooks whose cache_update evicts after each step (model.decode);
  prefill(model, tokens)       observe + compress for one method alone.
`observe(model, tokens, union(needs...))` runs the prefill once for several methods: the union
of their needs, each layer's attention computed once, in query chunks over the causal key range
(never a whole (H, T, T) map).

Statistics (SPEC.md notation, A[h,i,j] the causal attention in fp32, per query head (B, H, T)):
  colsum  Σ_{all i} A[h,i,j]         H2O's heavy-hitter scores
  window  Σ_{i in last w} A[h,i,j]   SnapKV's observation window
  last    A[h,T−1,j]                 TOVA's last query
  flow    GraceKV's probe queries (the last r tokens) and value flow x^k (`Flow`)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

import model as M
from cache import Cache
from errors import UsageError

STATS = ("colsum", "window", "last")


@dataclass(frozen=True)
class FlowNeeds:
    """GraceKV's observation: probes = the last `window` queries, value flow over `hops` hops."""
    window: int = 32
    hops: int = 2


@dataclass(frozen=True)
class Needs:
    stats: tuple = ()     # per layer, a frozenset of STATS names
    window: int = 32      # w of the `window` statistic
    chunk: int = 256      # query rows per chunk of the observation pass (memory only)
    flow: Optional[FlowNeeds] = None


def union(needs: list, n_layers: int) -> Needs:
    """What a shared prefill must observe for all of `needs`: per layer the union of the
    statistics, GraceKV's flow with the most hops, the smallest chunk. Methods must agree on
    the observation window of each kind."""
    stats = [frozenset()] * n_layers
    window, flow, chunk = None, None, min([n.chunk for n in needs] or [256])
    for n in needs:
        if any(n.stats):
            if window not in (None, n.window):
                raise UsageError(f"methods observe with different windows: {window} vs {n.window}")
            window = n.window
            stats = [a | b for a, b in zip(stats, n.stats)]
        if n.flow is not None:
            if flow is not None and flow.window != n.flow.window:
                raise UsageError(f"GraceKV variants observe with different windows: {flow} vs {n.flow}")
            flow = n.flow if flow is None or n.flow.hops > flow.hops else flow
    return Needs(tuple(stats), window or 32, chunk, flow)


@dataclass
class Flow:
    """What GraceKV keeps from the full prefill, per layer (never a whole (H, T, T) map)."""
    window: int
    probes: list = field(default_factory=list)  # [(H, r, D)] post-RoPE queries of the last r tokens
    flow: list = field(default_factory=list)    # [(hops+1, G, T)] x^0 = s (first hop), x^k = x^{k−1}·Ā


@dataclass
class Observation:
    stats: list                     # [dict name -> (B, H, T)] * L
    flow: Optional[Flow] = None


class Method:
    """The interface (see the module docstring). Subclasses: polykv.Policy, polykv.Pyramid,
    gracekv.GraceKV; a new method implements needs and compress, and decoder if it evicts."""

    def needs(self, model) -> Needs:
        return Needs()

    def compress(self, model, full: Cache, obs: Observation) -> Cache:
        raise NotImplementedError

    @property
    def decoder(self) -> Optional[M.Hooks]:
        return None

    def evicts_within(self, T: int, n: int) -> bool:
        """Whether the decoder can evict while n tokens follow a prompt of T tokens (if not,
        decoding is plain appending and may run in one step)."""
        return False

    @torch.no_grad()
    def prefill(self, model, tokens) -> Cache:
        """Full prefill of tokens (1, T) observing what this method needs, then compression."""
        full, obs = observe(model, tokens, self.needs(model))
        return self.compress(model, full, obs)


# ----------------------------------------------------------------------------- statistics

def causal_probs(q, k, c0: int) -> torch.Tensor:
    """A[b, h, i, j] (B, H, c, c1) of query rows c0..c1−1 over keys 0..c1−1 of a fresh prefill
    (key j at position j, bias 0): model.attention_probs with the mask reduced to the upper
    triangle of the last c×c block, fp32 (fp64 for fp64 inputs). The scale 1/√D goes on the
    queries before the product (exact when D is a power of 4, e.g. 64; else a rounding apart).
    Tested against it."""
    B, H, c, D = q.shape
    G, c1 = k.shape[1], k.shape[2]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    # one (g·c, D) x (D, c1) product per KV group: the keys are never broadcast to g copies
    # (a loop of 2-D products: faster on CPU than one batched product over transposed keys)
    qg = (q.to(acc) / math.sqrt(D)).reshape(B, G, H // G * c, D)             # (B, G, g·c, D)
    kk = k.to(acc)
    logits = qg.new_empty(B, G, H // G, c, c1)                               # (B, G, g, c, c1)
    for b in range(B):
        for gi in range(G):
            torch.mm(qg[b, gi], kk[b, gi].T, out=logits[b, gi].view(-1, c1))
    tri = torch.ones(c, c, dtype=torch.bool, device=q.device).triu_(1)       # j > i: the future
    logits[..., c0:].masked_fill_(tri, float("-inf"))
    return torch.softmax(logits, dim=-1).view(B, H, c, c1)


def observe_layer(q, q_pos, lc, names, window: int, chunk: int, flow: Optional[FlowNeeds]):
    """Every requested statistic of one layer from one pass over its attention.

    q (B, H, T, D) are the prompt's queries and lc its fresh FullKV cache (key j at position j,
    so query rows [c0, c1) see keys [0, c1) only: the causal key range). Query rows go in
    descending chunks; each chunk's A (B, H, c, c1) is computed once (model.attention_probs's maths,
    fp32, `causal_probs`) and feeds the column sums, the window sums, the last row and GraceKV's value flow:
    x^0_i = Σ_{u ∈ U} Ā[u, i] (U = the last r queries, Ā the group-mean attention) and
    x^k_i = Σ_j x^{k−1}_j Ā[j, i] = Σ_{j ≥ i} x^{k−1}_j Ā[j, i], complete for a chunk's rows once
    that chunk is added, so every hop takes the same pass. Rows no statistic reads are skipped.
    Returns ({name: (B, H, T)}, (probes (H, r, D), x (hops+1, G, T)) or None)."""
    B, H, T, D = q.shape
    G = lc.k.shape[1]
    assert lc.size == T and not lc.bias.any(), "observe_layer reads a fresh prefill (key j at position j)"
    r = min(flow.window, T) if flow else 0
    lowest = 0 if "colsum" in names or (flow and flow.hops) else \
        min([T - 1] + [T - min(window, T)] * ("window" in names) + [T - r] * bool(flow))
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = {k: q.new_zeros(B, H, T, dtype=acc) for k in names if k != "last"}
    if flow:
        x = q.new_zeros(flow.hops + 1, G, T, dtype=acc)
        seed = torch.zeros(T, dtype=acc, device=q.device)
        seed[T - r:] = 1.0                                           # the probe rows u ∈ U
    for c1 in range(T, lowest, -chunk):
        c0 = max(lowest, c1 - chunk)
        p = causal_probs(q[:, :, c0:c1], lc.k[:, :, :c1], c0)        # (B, H, c, c1)
        if "colsum" in names:
            out["colsum"][..., :c1] += p.sum(2)                      # Σ_{all i} A[h,i,j]
        if "window" in names and c1 > T - window:
            out["window"][..., :c1] += p[:, :, max(0, T - window - c0):].sum(2)   # Σ_{i ≥ T−w}
        if "last" in names and c1 == T:
            out["last"] = F.pad(p[:, :, -1], (0, T - c1))            # A[h,T−1,j]
        if flow:
            A = p[0].view(G, H // G, c1 - c0, c1).mean(1)            # (G, c, c1) group mean Ā
            prev = seed[c0:c1].expand(G, -1)                         # (G, c)
            for k in range(flow.hops + 1):
                x[k, :, :c1] += (prev[:, None, :] @ A)[:, 0]         # x^k += x^{k−1}[rows] Ā[rows]
                prev = x[k, :, c0:c1]
    return out, ((q[0, :, T - r:].contiguous().clone(), x) if flow else None)


@torch.no_grad()
def observe(model, tokens, needs: Needs, spy=None):
    """One full-attention prefill of tokens (B, T) recording what `needs` asks for, layer by
    layer, each layer's attention computed once: (FullKV cache, Observation). spy: an extra
    post-kernel callable (layer, q, q_pos, lc, out) that sees the same pass."""
    L = model.config.n_layers
    per_layer = needs.stats or (frozenset(),) * L
    obs = Observation([dict() for _ in range(L)],
                      Flow(needs.flow.window, [None] * L, [None] * L) if needs.flow else None)

    def post_kernel(layer, q, q_pos, lc, out):
        obs.stats[layer], fl = observe_layer(q, q_pos, lc, per_layer[layer], needs.window, needs.chunk, needs.flow)
        if fl is not None:
            obs.flow.probes[layer], obs.flow.flow[layer] = fl
        if spy is not None:
            spy(layer, q, q_pos, lc, out)

    hooks = M.Hooks(post_kernel=post_kernel) if any(per_layer) or needs.flow or spy else None
    return M.prefill(model, tokens, hooks), obs


def observe_for(model, tokens, methods: list):
    """The shared prefill of several methods: observe(model, tokens, union of their needs)."""
    return observe(model, tokens, union([m.needs(model) for m in methods], model.config.n_layers))
