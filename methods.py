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
of their needs, each statistic computed once, in query chunks (never a whole (H, T, T) map).

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

import model as M
from cache import Cache
from errors import UsageError

STATS = ("colsum", "window", "last")


@dataclass(frozen=True)
class FlowNeeds:
    """GraceKV's observation: probes = the last `window` queries, value flow over `hops` hops."""
    window: int = 32
    hops: int = 2
    chunk: int = 512      # query rows per attention chunk (memory only)


@dataclass(frozen=True)
class Needs:
    stats: tuple = ()     # per layer, a frozenset of STATS names
    window: int = 32      # w of the `window` statistic
    chunk: int = 256      # query rows per chunk while reducing the statistics (memory only)
    flow: Optional[FlowNeeds] = None


def union(needs: list, n_layers: int) -> Needs:
    """What a shared prefill must observe for all of `needs`: per layer the union of the
    statistics, GraceKV's flow with the most hops. Methods must agree on windows and chunks."""
    stats = [frozenset()] * n_layers
    shape, flow = None, None
    for n in needs:
        if any(n.stats):
            if shape not in (None, (n.window, n.chunk)):
                raise UsageError(f"methods observe with different windows/chunks: {shape} vs {(n.window, n.chunk)}")
            shape = (n.window, n.chunk)
            stats = [a | b for a, b in zip(stats, n.stats)]
        if n.flow is not None:
            if flow is not None and (flow.window, flow.chunk) != (n.flow.window, n.flow.chunk):
                raise UsageError(f"GraceKV variants observe with different windows: {flow} vs {n.flow}")
            flow = n.flow if flow is None or n.flow.hops > flow.hops else flow
    w, c = shape or (32, 256)
    return Needs(tuple(stats), w, c, flow)


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

def attention_stats(q, q_pos, lc, names, window: int, chunk: int) -> dict:
    """Per-head attention statistics `names` of the new queries q (B, H, T, D) over the layer
    cache lc, each (B, H, S) fp32. Queries are processed chunk by chunk (all of them for colsum,
    only the last w otherwise), so at most (B, H, chunk, S) probabilities exist at once."""
    T = q.shape[2]
    first = 0 if "colsum" in names else max(0, T - window) if "window" in names else T - 1
    out = {}
    for a in range(first, T if names else first, chunk):
        b = min(a + chunk, T)
        p = M.attention_probs(q[:, :, a:b], lc.k, lc.bias, q_pos[:, a:b], lc.pos)  # (B, H, b−a, S)
        parts = {"colsum": p.sum(2),                                          # Σ_{all i} A[h,i,j]
                 "window": p[:, :, max(0, T - window - a):].sum(2),           # Σ_{i ≥ T−w} A[h,i,j]
                 "last": p[:, :, -1] if b == T else None}                     # A[h,T−1,j]
        for k in names:
            if parts[k] is not None:
                out[k] = out[k] + parts[k] if k in out and k != "last" else parts[k]
    return out


def value_flow(q, lc, need: FlowNeeds):
    """GraceKV's probes (H, r, D) and value flow x (hops+1, G, T) of one layer (batch 1).

    x^0_i = Σ_{u ∈ U} Ā[u, i] (U = the last r queries, Ā the group-mean attention) and
    x^k_i = Σ_j x^{k−1}_j Ā[j, i]. Rows in descending chunks: x^k_i = Σ_{j ≥ i} x^{k−1}_j Ā[j, i]
    is complete for the chunk's rows once the chunk is added, so all hops take one pass (causal)."""
    _, H, T, D = q.shape
    G, r = lc.k.shape[1], min(need.window, T)
    qq, kk = q[0].reshape(G, H // G, T, D), lc.k[0]              # (G, g, T, D), (G, T, D)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    x = q.new_zeros(need.hops + 1, G, T, dtype=acc)
    seed = torch.zeros(T, dtype=acc, device=q.device)
    seed[T - r:] = 1.0                                           # the probe rows u ∈ U
    for c1 in range(T, 0, -need.chunk):
        if need.hops == 0 and c1 <= T - r:
            break                                                # x^0 needs the probe rows only
        c0 = max(0, c1 - need.chunk)
        lg = (qq[:, :, c0:c1].to(acc) @ kk[:, None, :c1].to(acc).transpose(-1, -2)) / math.sqrt(D)
        tri = torch.ones(c1 - c0, c1 - c0, dtype=torch.bool, device=q.device).triu_(1)
        lg[..., c0:].masked_fill_(tri, float("-inf"))             # (G, g, c, c1) causal
        A = torch.softmax(lg, -1).mean(1)                         # (G, c, c1) group mean Ā
        prev = seed[c0:c1].expand(G, -1)                          # (G, c)
        for k in range(need.hops + 1):
            x[k, :, :c1] += (prev[:, None, :] @ A)[:, 0]          # x^k += x^{k−1}[rows] Ā[rows]
            prev = x[k, :, c0:c1]
    return q[0, :, T - r:].contiguous().clone(), x


@torch.no_grad()
def observe(model, tokens, needs: Needs):
    """One full-attention prefill of tokens (B, T) recording what `needs` asks for, layer by
    layer: (FullKV cache, Observation)."""
    L = model.config.n_layers
    per_layer = needs.stats or (frozenset(),) * L
    obs = Observation([dict() for _ in range(L)],
                      Flow(needs.flow.window, [None] * L, [None] * L) if needs.flow else None)

    def post_kernel(layer, q, q_pos, lc, out):
        if per_layer[layer]:
            obs.stats[layer] = attention_stats(q, q_pos, lc, per_layer[layer], needs.window, needs.chunk)
        if needs.flow is not None:
            obs.flow.probes[layer], obs.flow.flow[layer] = value_flow(q, lc, needs.flow)

    hooks = M.Hooks(post_kernel=post_kernel) if any(per_layer) or needs.flow else None
    return M.prefill(model, tokens, hooks), obs


def observe_for(model, tokens, methods: list):
    """The shared prefill of several methods: observe(model, tokens, union of their needs)."""
    return observe(model, tokens, union([m.needs(model) for m in methods], model.config.n_layers))
