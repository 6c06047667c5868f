"""GraceKV: one global budget of cache entries, spent on coverage or on resolution.

Tian, Liu, Wang, "Every Cache Entry Earns Its Place: Global Allocation of Resolution and
Coverage for KV Cache Compression" (arXiv 2608.07001, 2026), by its equations (2)-(13). No code
is public. Every (layer, KV head) is a *unit* with a prototype tree over each slot of the
context; adding a slot's root widens coverage, splitting an added node refines resolution, and
all actions of all units compete for one budget. Read top to bottom, in the paper's order:

 1. Budget (2): B entries per unit on average; the recent window of r tokens is kept exact and
    charged; B_alloc = U·B − U·r − B_floor goes to the greedy; T <= B is FullKV. Under the
    `context` protocol (engine/protocols.py) the prefix and question are exact and free.
 2. Slots (4)-(5): bends κ of the hidden-state trajectory over several layers and widths
    (mean − λ_stab·std), robust z-scored, cut by dynamic programming into slots of 16..128.
 3. Prototype trees and distortion (6)-(8): a node (n tokens) is one entry with key
    k̃ = RoPE(mean_t RoPE⁻¹(k_t, t), round(mean t)), value
    ṽ = Σ(R_t+β_v)v_t / Σ(R_t+β_v) with the node's own β_v = 0.1·mean_{t∈v} R_t, and
    multiplicity m = clamp(n·ħ², 1, n) entering attention as the logit bias log m; its
    distortion D for the probes (U and m queries of high-evidence slots), D(drop) for nothing.
 4. Relevance (9)-(10): each unit's own first hop ŝ (what its query heads' probes attend to);
    seeds = the top tokens of the mean ŝ, propagated hop by hop along a few sampled layers'
    attention, chosen seeds removed at each hop, to d̂ (shared); R = (1−λ)ŝ + λd̂ per unit.
 5. Head weights ω per unit (11).
 6. Budget flow (12)-(13): one max-heap over "add a slot root" (cost 1) and "split an added
    node" — a bisection at the highest κ (2 children, cost 1) or the extraction of its top-R
    token with both sides kept (3 children, cost 2) — by gain per entry.
 7. Singleton floor: exact tokens from the seeds, reserved before the competition.
 8. Cache assembly: a ragged cache (each unit exactly its entries); prototypes with bias log m.

Notation: T prompt tokens, r recent window, Tc = T − r context tokens, H query heads, G KV
heads, g = H/G, D head dim, L layers, U = L·G units, P = g·(r + m) probes per unit, n tokens in
a node; batch 1; at most U·B entries. [choice] marks where the paper is open (docs/gracekv.md,
"Choices"). Each step calls the paper's function through `Formulas` (the method section, at the
end); gracekv_variants.py builds the other rows, each replacing one function or setting (our
earlier readings, ablations); the kernels never branch on them.
"""
from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

import model as M
import polykv
from model import Cache, LayerCache
from support.errors import UsageError
from support.greedy import Last, batched_logits, by_length, prefetched_flow


@dataclass(frozen=True)
class Settings:
    # r: exact recent tokens = probes U, the sequence's (= question's) suffix [choice: w = 32]
    window: int = 32
    slot_min: int = 16        # slot lengths 16..128, about 64 (the paper)
    slot_max: int = 128
    slot_target: int = 64     # [choice: the DP cuts the context into round(Tc / 64) slots]
    bend_depths: tuple = (0.25, 0.5, 0.75)  # κ's layers, as fractions of the depth [choice]
    bend_widths: tuple = (4, 8, 16)         # κ's window widths w [choice]
    lambda_stab: float = 0.5  # κ = mean − λ_stab·std over (layer, width) [choice]
    # b = z(κ) + λ_s·z(surprisal) (eq. 5) [choice: dev, 0.5 ties it, 0 loses]
    lambda_s: float = 1.0
    lambda_z: float = 1.0     # λ_Z, λ_M, λ_graph: not given by the paper [choice]
    lambda_m: float = 1.0
    lambda_graph: float = 0.3
    seeds: int = 128          # seeds per hop [choice: dev, docs/gracekv.md]
    hops: int = 2             # propagation hops [choice]
    decay: float = 0.5        # hop k weighs decay^(k−1) [choice]
    hop_depths: tuple = (0.25, 0.5, 0.75)   # the sampled layers, as fractions of the depth [choice]
    # the hops' map: (1 − f)·what a token reads + f·who reads it [choice: dev]
    hop_forward: float = 0.5
    evidence: int = 32        # distortion probes also from high-evidence slots: this many per
    evidence_stride: int = 4  # layer, every stride-th query of the slots of highest peak R [choice]
    beta: float = 0.1         # β_v = 0.1·mean_{t∈v} R_t (eq. 7)
    # φ: each unit its own top min(|seeds|, ⌊φ·(B − r)⌋) seeds [choice]
    floor_frac: float = 0.75
    # ε in ħ = ‖mean k°‖/(mean ‖k°‖ + ε) and in eq. 8's Z² + ε, ‖M‖² + ε
    eps: float = 1e-6
    log_rho_max: float = 20.0  # guard on log(Z̃/Z): D stays finite in fp32 for extreme logits
    prefetch: int = 2048      # heap entries whose nodes are evaluated together (speed only)
    def __post_init__(self):
        if min(self.window, self.slot_min, self.prefetch, self.seeds, self.evidence_stride) < 1:
            raise UsageError("window, slot_min, seeds, prefetch and evidence_stride must be >= 1")
        # w = 1: μ₋ = h̄_i, δ₋ = 0 (eq. 4)
        if not self.bend_widths or min(self.bend_widths) < 2:
            raise UsageError("bend_widths must be a non-empty tuple of widths >= 2, "
                             f"got {self.bend_widths}")
        if self.slot_max < 2 * self.slot_min:
            raise UsageError(f"need slot_max >= 2·slot_min, got {self.slot_min}..{self.slot_max}")
        for name in ("lambda_graph", "floor_frac", "hop_forward"):
            if not 0 <= getattr(self, name) <= 1:
                raise UsageError(f"{name}={getattr(self, name)!r} must be in [0, 1]")
        for name in ("hops", "evidence"):
            if getattr(self, name) < 0:
                raise UsageError(f"{name}={getattr(self, name)!r} must be >= 0")

    def to_json(self) -> dict:       # JSON-ready
        return dict(self.__dict__)


# layer indices at fractions of the depth: round(f·(L − 1)), distinct
def depths(fracs, L: int) -> list:
    return sorted({round(f * (L - 1)) for f in fracs})


# =============================================================== observation: probes and value flow

@dataclass(frozen=True)
class ValueFlow:
    """GraceKV's per-layer statistic of the shared prefill (polykv.Needs.extra): the probe
    queries (the last r tokens); the first hop x_i = Σ_{u∈U} Ā[u, i] per KV head (Ā the
    group-mean attention); the queries of the `sampled` layers, for the hop-wise propagation;
    every stride-th query (positions 0, stride, ...), from which `context` draws the evidence
    probes; the sampled layers' row log-normalisers lse_i, read off the pass's A at the row's
    largest entry j*: lse_i = q_i·k_j*/√D − log A[i, j*] (no underflow: A[i, j*] ≥ 1/(i+1)).
    Value per layer: (probes (H, r, D), x (1, G, T), queries (H, T, D), strided queries
    (H, ⌈T/stride⌉, D), their phase 0, lse (H, T); None where not kept)."""
    window: int = 32
    sampled: tuple = ()
    stride: int = 0           # 0: no evidence probes

    def lowest(self, T: int, layer: int) -> int:
        """The first query row read: every row of a sampled layer, else the last r."""
        return 0 if layer in self.sampled else T - min(self.window, T)

    def begin(self, q, lc, layer: int) -> dict:
        T = q.shape[2]
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        r = min(self.window, T)
        G = lc.k.shape[1]
        sampled = layer in self.sampled
        return {"x": q.new_zeros(self.flow_rows(), G, T, dtype=dtype),      # (rows, G, T)
                "seed": (torch.arange(T, device=q.device) >= T - r).to(dtype),  # (T,) u ∈ U
                "probes": q[0, :, T - r:].contiguous().clone(),              # (H, r, D)
                "strided": q[0, :, ::self.stride].clone() if self.stride else None,
                "queries": q[0].clone() if sampled else None,                # (H, T, D)
                "k": lc.k[0],                                                # (G, T, D)
                "lse": q.new_zeros(q.shape[1], T, dtype=dtype) if sampled else None}

    def flow_rows(self) -> int:      # rows of x: the first hop alone
        return 1

    def add(self, state: dict, c0: int, c1: int, p):
        """Query rows [c0, c1) with their attention p (1, H, c, c1)."""
        G = state["x"].shape[1]
        A = p[0].view(G, p.shape[1] // G, c1 - c0, c1).mean(1)        # (G, c, c1) group mean Ā
        self.spread(state["x"], state["seed"], c0, c1, A)
        if state["lse"] is not None:        # lse = logit − log A at the row's largest entry
            top, j = p[0].max(-1)                                    # (H, c)
            H = len(j)
            q = state["queries"][:, c0:c1]                           # (H, c, D)
            head_group = torch.arange(H, device=j.device)[:, None] * G // H
            kj = state["k"][head_group, j]                           # (H, c, D) the keys j*
            logit = (q.to(top) * kj.to(top)).sum(-1) / math.sqrt(q.shape[-1])
            state["lse"][:, c0:c1] = logit - top.log()               # (H, c)

    def spread(self, x, seed, c0: int, c1: int, A):
        """x_i += Σ_{u ∈ rows ∩ U} Ā[u, i]: the first hop of the chunk's rows."""
        prev = seed[c0:c1].expand(A.shape[0], -1)                    # (G, c)
        x[0, :, :c1] += (prev[:, None, :] @ A)[:, 0]

    def end(self, state: dict):
        return state["probes"], state["x"], state["queries"], state["strided"], 0, state["lse"]

    def cut(self, value, a: int, b: int):
        """The value over keys a..b−1 alone (support/protocols.cut): the probes (the last r
        queries) stay, x and the queries are sliced, the strided ones from the first in [a, b),
        with a phase."""
        probes, x, queries, strided, phase, lse = value
        if strided is not None:
            i0, i1 = (-(-(e - phase) // self.stride) for e in (a, b))
            strided, phase = strided[:, i0:i1], i0 * self.stride + phase - a
        queries = None if queries is None else queries[:, a:b]
        lse = None if lse is None else lse[:, a:b]          # the whole prompt's normalisers
        return probes, x[..., a:b], queries, strided, phase, lse

    def merge(self, other: "ValueFlow") -> "ValueFlow":
        """Rows sharing one pass: every sampled layer serves all; a subclass (a variant's
        statistic) merges it in."""
        if type(other) is not type(self) and isinstance(other, type(self)):
            return other.merge(self)
        if other.window != self.window:
            raise UsageError(f"GraceKV rows observe with different windows: {self} vs {other}")
        if other.stride != self.stride and min(self.stride, other.stride) > 0:
            raise UsageError(f"GraceKV rows observe different evidence strides: {self} vs {other}")
        sampled = tuple(sorted(set(self.sampled) | set(other.sampled)))
        return replace(self, sampled=sampled, stride=max(self.stride, other.stride))


@dataclass
class Flow:
    """What GraceKV keeps from the full prefill, per layer (never a whole (H, T, T) map)."""
    window: int
    probes: list = field(default_factory=list)  # [(H, r, D)] post-RoPE queries of the last r tokens
    flow: list = field(default_factory=list)    # [(1, G, T)] x^0 = s, the first hop
    queries: list = field(default_factory=list)  # [(H, T, D) or None] the sampled layers' queries
    # [(H, ⌈T/stride⌉, D) or None] every stride-th query
    strided: list = field(default_factory=list)
    phase: list = field(default_factory=list)    # [int] strided query i is token i·stride + phase
    lse: list = field(default_factory=list)      # [(H, T) or None] the sampled layers' row log Σ
    # (1, T) −log p of each token, if Settings.lambda_s
    surprisal: Optional[torch.Tensor] = None


def needs(s: "Settings", n_layers: int, statistic=ValueFlow) -> polykv.Needs:
    """What GraceKV observes during the prefill: probes, first hop, the sampled layers' queries
    (statistic: the class that records them, ValueFlow; a variant may extend it)."""
    sampled = tuple(depths(s.hop_depths, n_layers))
    stride = s.evidence_stride if s.evidence else 0
    flow = statistic(s.window, sampled, stride)
    return polykv.Needs(extra=(("flow", flow),), surprisal=s.lambda_s != 0)


def flow_of(obs: polykv.Observation, window: int) -> Flow:   # the Flow of an observation
    # per layer: probes .. lse
    return Flow(window, *map(list, zip(*obs.extra["flow"])), obs.surprisal)


@torch.no_grad()
def observe(model, tokens, settings: Optional["Settings"] = None, chunk: int = 256,
            statistic=ValueFlow):
    """Full prefill of tokens (1, T) observing the probes and flow (chunk: query rows per pass)."""
    s = settings or Settings()
    wanted = replace(needs(s, model.config.n_layers, statistic), chunk=chunk)
    full, obs = polykv.observe(model, tokens, wanted)
    return full, flow_of(obs, s.window)


# ============================================================================= slots (eqs. 4-5)

def bends(h: torch.Tensor, w: int) -> torch.Tensor:
    """Eq. 4, bends of a trajectory h (T, F) with h̄ = h/‖h‖:
    μ₋ = mean h̄_{i−w+1..i} (the window ends at i itself), μ₊ = mean h̄_{i+1..i+w},
    δ₋ = h̄_i − μ₋, δ₊ = μ₊ − h̄_i, κ_i = 1 − cos(δ₋, δ₊);
    windows clipped at the ends; κ_0 = κ_{T−1} = 0 (one side empty)."""
    T, h = h.shape[0], F.normalize(h, dim=-1)
    C = F.pad(h.cumsum(0), (0, 0, 1, 0))                          # (T+1, F) prefix sums
    i = torch.arange(T, device=h.device)
    lo, hi = (i - w + 1).clamp(min=0), (i + 1 + w).clamp(max=T)
    before = (C[i + 1] - C[lo]) / (i + 1 - lo)[:, None]           # μ₋ over i−w+1..i
    after = (C[hi] - C[(i + 1).clamp(max=T)]) / (hi - i - 1).clamp(min=1)[:, None]
    k = 1 - F.cosine_similarity(h - before, after - h, dim=-1)    # (T,)
    k[0] = k[-1] = 0.0
    return k


def robust_z(x: torch.Tensor) -> torch.Tensor:
    """(x − median) / (1.4826·MAD + 1e-12): a z-score that a few large bends do not flatten
    [choice]."""
    med = x.median()
    return (x - med) / (1.4826 * (x - med).abs().median() + 1e-12)


def slot_bends(model, full: Cache, Tc: int, s: Settings, dtype, surprisal=None) -> torch.Tensor:
    """Boundary scores b (Tc,) of eq. 5: κ_i^{(l,w)} of the trajectories
    h_t = [k°_t/‖k°_t‖, v_t/‖v_t‖] over heads (the cache's un-rotated keys and values at
    layer l: a linear image of the hidden state) for the layers at `bend_depths` and the widths
    `bend_widths`; κ = mean − λ_stab·std over (l, w);
    b = z(κ) + λ_s·z(surprisal (1, T): −log p of each token), robust z."""
    # pos (T,): the keys' positions
    T, pos, kappas = full.layers[0].k.shape[2], full.layers[0].pos[0, 0], []
    for lc in [full.layers[layer] for layer in depths(s.bend_depths, model.config.n_layers)]:
        k_unrotated = M.apply_rope(lc.k[0].to(dtype), -pos, model.inv_freq)   # (G, T, D)
        h = torch.cat(
            (F.normalize(k_unrotated, dim=-1), F.normalize(lc.v[0].to(dtype), dim=-1)), -1
        ).transpose(0, 1)
        kappas += [bends(h.reshape(T, -1), w)[:Tc] for w in s.bend_widths]
    stacked = torch.stack(kappas)                                        # (layers·widths, Tc)
    std = stacked.std(0, unbiased=False) if len(kappas) > 1 else 0
    kappa = stacked.mean(0) - s.lambda_stab * std
    if Tc == 1:                                          # one context token: nothing to z-score
        return kappa + (s.lambda_s * surprisal[0, :Tc].to(dtype) if s.lambda_s else 0)
    return robust_z(kappa) + (s.lambda_s * robust_z(surprisal[0, :Tc].to(dtype)) if s.lambda_s
                              else 0)


def n_slots(Tc: int, s: Settings) -> int:
    """K = round(Tc / target), within what lengths slot_min..slot_max allow (1 below slot_min)."""
    lo, hi = -(-Tc // s.slot_max), max(1, Tc // s.slot_min)
    return min(max(round(Tc / s.slot_target), lo, 1), hi)


def dp_slots(b: torch.Tensor, Tc: int, s: Settings) -> list:
    """Eq. 5: the K-slot segmentation of [0, Tc), every slot slot_min..slot_max tokens, that
    maximises the sum of b at its K − 1 cuts, by dynamic programming: best_k(i) = b_i + max
    over j ∈ [i − max, i − min] of best_{k−1}(j), best_0 = 0 at 0 only.
    O(K·Tc·(max − min))."""
    K = n_slots(Tc, s)
    if K <= 1:
        return [(0, Tc)] if Tc else []
    W, hi = s.slot_max - s.slot_min + 1, s.slot_max
    # on the CPU whatever the model's device: K small sequential steps, then K reads of a cut
    cpu = torch.device("cpu")
    zero = torch.zeros(1, dtype=torch.float64, device=cpu)
    gain = torch.cat((b.detach().double().cpu(), zero))                 # b_i at cut i
    best = torch.full((Tc + 1,), float("-inf"), dtype=torch.float64, device=cpu)
    best[0] = 0.0
    back = []
    for k in range(1, K + 1):
        prev = F.pad(best, (hi, 0), value=float("-inf"))              # prev[i + hi] = best(i)
        # window of i: j = i − hi .. i − lo
        top, arg = prev.unfold(0, W, 1)[:Tc + 1].max(1)
        back.append(arg + torch.arange(Tc + 1, device=cpu) - hi)      # the previous cut j
        best = top + (gain if k < K else 0.0)
    cuts = [Tc]
    for k in range(K, 0, -1):
        cuts.insert(0, int(back[k - 1][cuts[0]]))
    return list(zip(cuts[:-1], cuts[1:]))


# ======================================================== prototype trees and distortion (eqs. 6-8)
# A node = a span [a, b) of one unit (layer, KV head) minus its holes (floor tokens, tokens
# extracted from its ancestors); `Units` holds what a node reads; `node_stats`: eqs. 6-8, batched.

@dataclass
class Units:
    """The per-unit tensors a prototype is made from, stacked over units j = l·G + g; every
    (U, Tc+1, ·) tensor has a sentinel row Tc (zeros, or −inf for logits) that gathers read."""
    kr: torch.Tensor      # (U, Tc+1, D) un-rotated context keys k° = RoPE⁻¹(k_t, t)
    v: torch.Tensor       # (U, Tc+1, D) values
    knorm: torch.Tensor   # (U, Tc+1) ‖k°_t‖
    lg: torch.Tensor      # (U, Tc+1, P) log A[u, t]: probe logits − each row's logsumexp
    q: torch.Tensor       # (U, P, D) probe queries
    c: torch.Tensor       # (U, P) probe rows' logsumexp
    R: torch.Tensor       # (U, Tc+1) relevance R_t of each unit's tokens; Σ_t R = 1
    hole: torch.Tensor    # (U, Tc) tokens later nodes leave out: the floor, then extracted leaves
    inv_freq: torch.Tensor
    s: object             # Settings (β, ε, λ_Z, λ_M, log ρ cap)
    f: object             # Formulas (the key, multiplicity and β of a node)
    k: torch.Tensor       # (U, Tc+1, D) post-RoPE context keys k_t, the cache's own
    # (U, P) the probes' token indices: a probe reads nodes ending at or before it
    qpos: torch.Tensor
    # the position of token 0 (> 0 when a protocol cuts the prompt's prefix off)
    p0: int = 0

    @property
    def Tc(self) -> int:
        return self.kr.shape[1] - 1


class Span:
    """What a node's formulas read, for a batch of N nodes of at most n tokens: rows(x) gathers
    a (U, Tc+1, ·) tensor as (N, n, ·), zeros outside each node; nf (N,) token counts, p (N,)
    rounded mean positions, mask (N, n) the node's tokens (1.0), Rt (N, n) their relevance;
    once the key is made, qk (N, P) = q_u·k̃/√D − c_u and
    logZ (N, P) = log Σ_{t∈v} A[u, t]."""

    def __init__(self, units, rows, nf, p, mask, Rt):
        self.units, self.rows, self.nf, self.p, self.mask, self.Rt = units, rows, nf, p, mask, Rt
        self.qk = self.logZ = None

    @cached_property
    def kbar(self) -> torch.Tensor:
        return self.rows(self.units.kr).sum(1) / self.nf[:, None]            # mean k°  (N, D)


def key_unrotated(span: Span) -> torch.Tensor:
    """Eq. 6: k̃ = RoPE(mean_t RoPE⁻¹(k_t, t), round(mean t))."""
    return M.apply_rope(span.kbar, span.p, span.units.inv_freq)


def multiplicity_hbar(span: Span) -> torch.Tensor:
    """Eq. 7: ħ = ‖mean k°‖ / (mean ‖k°‖ + ε), m = clamp(n·ħ², 1, n); returns
    log m (N,)."""
    nf = span.nf
    hbar = span.kbar.norm(dim=-1) / (span.rows(span.units.knorm).sum(1) / nf + span.units.s.eps)
    return (nf * hbar ** 2).clamp(min=1).minimum(nf).log()


def beta_local(span: Span, beta: float) -> torch.Tensor:
    """Eq. 7: each node its own β_v = beta·mean_{t∈v} R_t (N,)."""
    return beta * (span.Rt * span.mask).sum(1) / span.nf


def distortion(logZ, Z2, mu2, muv, logZp, v2, s):
    """Eq. 8: D and D(drop) of nodes (N,) for their probes u (N, P), each probe in its own
    max-subtracted scale (its largest term over the node's tokens is e^0 = 1, so Z_u >= 1):
    Z_u = Σ_t e^{q_u·k_t/√D − max}, M_u = Σ_t e^{q_u·k_t/√D − max} v_t,
    Z̃_u = m e^{q_u·k̃/√D − max}, M̃_u = Z̃_u ṽ,
    D_u = λ_Z (Z_u − Z̃_u)²/(Z_u² + ε) + λ_M ‖M_u − M̃_u‖²/(‖M_u‖² + ε).
    Computed from Z_u² (Z2), μ = M/Z (‖μ‖² mu2, ⟨μ, ṽ⟩ muv), ‖ṽ‖² (v2, (N,))
    and ρ = Z̃/Z = exp(logZp − logZ), so that no exponential of a raw logit is taken:
    (Z − Z̃)² = Z²(1 − ρ)², ‖M − M̃‖² = Z²‖μ − ρṽ‖²,
    ‖M‖² = Z²‖μ‖². D(drop): Z̃ = 0, M̃ = 0. D(I_v) = Σ_u w_u D_u with w_u ∝ the
    attention mass u pays the node, exp(logZ) = Σ_{t∈v} A[u, t]. log ρ <= log_rho_max (a
    guard: it binds only where (1 − ρ)² > e^40, past fp32's range)."""
    rho = (logZp - logZ).clamp(max=s.log_rho_max).exp()                     # (N, P) Z̃/Z
    err = (mu2 - 2 * rho * muv + rho ** 2 * v2[:, None]).clamp(min=0)        # ‖μ − ρṽ‖²
    Du = (s.lambda_z * Z2 * (1 - rho) ** 2 / (Z2 + s.eps)
          + s.lambda_m * Z2 * err / (Z2 * mu2 + s.eps))
    Ddrop = s.lambda_z * Z2 / (Z2 + s.eps) + s.lambda_m * Z2 * mu2 / (Z2 * mu2 + s.eps)
    w = torch.softmax(logZ, -1)                                               # (N, P) mass weights
    return (w * Du).sum(-1), (w * Ddrop).sum(-1)


def node_stats(units: Units, unit, a, b, skip=None) -> dict:
    """Tightened spans, n, R, D, D(drop) and prototype (key, value, pos, log m) of nodes
    [a, b) of units `unit` (N,), minus the unit's holes and minus token `skip` (N,) (−1: none):
    `_node_stats` over batches of similar lengths (support.greedy.by_length)."""
    skip = torch.full_like(a, -1) if skip is None else skip
    return by_length(functools.partial(_node_stats, units), (unit, a, b, skip), b - a,
                     cap=max(1, (1 << 21) // units.lg.shape[2]))


def _node_stats(units: Units, u, a, b, skip, n):
    """node_stats for spans of at most n tokens: gathered as (N, n, ·) with a sentinel row."""
    s, f, Tc = units.s, units.f, units.Tc
    idx = a[:, None] + torch.arange(n, device=a.device)                        # (N, n)
    mask = (idx < b[:, None]) & (idx != skip[:, None])
    mask &= ~units.hole[u[:, None], idx.clamp(max=Tc - 1)]
    idx_or_sentinel = idx.masked_fill(~mask, Tc)                              # Tc: the sentinel row
    count = mask.sum(1)                                                       # (N,) tokens n
    first = mask.to(torch.int8).argmax(1)
    last = n - 1 - mask.flip(1).to(torch.int8).argmax(1)
    nf = count.clamp(min=1).to(units.kr.dtype)
    # rows of (U·(Tc+1), ·)
    flat = (u[:, None] * (Tc + 1) + idx_or_sentinel).view(-1)

    def rows(x):
        """(U, Tc+1, ·) -> (N, n, ·), the sentinel row outside the node."""
        return x.flatten(0, 1).index_select(0, flat).view(len(u), n, *x.shape[2:])
    V = rows(units.v)                                                         # (N, n, D), 0 outside
    # rounded mean position
    p = ((idx * mask).sum(1) / nf).round() + units.p0
    Rt = rows(units.R)                                                        # (N, n), 0 outside
    span = Span(units, rows, nf, p, mask.to(Rt.dtype), Rt)
    key = f.key(span)                                                         # k̃ (N, D), eq. 6
    w = Rt + f.value_beta(span, s.beta)[:, None] * span.mask                  # R_t + β_v (N, n)
    val = (w[..., None] * V).sum(1) / w.sum(1).clamp(min=1e-300)[:, None]     # ṽ
    # (N, n, P), −inf outside
    lg = rows(units.lg)
    # (N, P) log-space shift: the largest logit of each probe over the node's tokens
    lg_max = lg.amax(1).clamp(min=torch.finfo(lg.dtype).min)
    # e = exp(lg − lg_max) ≤ 1, the largest term 1; exponents below −80 clamped:
    # e ≥ 1.8e−35 in place of a denormal or 0 (the CPU's exp: up to 30× slower), which next
    # to 1 vanishes from every sum
    e = (lg - lg_max[:, None]).clamp_(min=-80.0).exp_()
    Z = e.sum(1)                                                              # (N, P)
    # unseen: weight 0
    unseen = (a + last)[:, None] > units.qpos.index_select(0, u)
    logZ = (Z.log() + lg_max).masked_fill(unseen, -1e30)
    # a = e/Z: Z² may underflow
    e /= Z[:, None]
    n_probes, head_dim = e.shape[2], V.shape[2]
    # short spans: ‖μ‖² = aᵀ(VVᵀ)a, n²·(D+P) per node
    if n * (head_dim + n_probes) <= n_probes * head_dim:
        mu2 = (e * (V @ V.transpose(1, 2) @ e)).sum(1)                         # (N, P)
    else:                            # long spans: μ = aᵀV directly, n·P·D per node
        mu2 = (e.transpose(1, 2) @ V).pow(2).sum(-1)                          # (N, P)
    muv = (e * (V @ val[..., None])).sum(1)                                   # (N, P) ⟨μ, ṽ⟩
    # (N, P) q_u·k̃/√D − c
    qk = batched_logits(units.q, u, key) - units.c.index_select(0, u)
    span.qk, span.logZ = qk, logZ
    logm = f.multiplicity(span)                                               # log m (N,), eq. 7
    logZp = logm[:, None] + qk                                # log Z̃ = log m + q·k̃/√D − c
    D, Ddrop = distortion(logZ, Z.pow(2), mu2, muv, logZp, val.pow(2).sum(-1), s)
    zero = torch.zeros((), dtype=D.dtype, device=D.device)
    return dict(unit=u, a=a + first, b=a + last + 1, n=count, R=Rt.sum(1),
                D=torch.where(count <= 1, zero, D),                          # a leaf is its token
                Ddrop=torch.where(count == 0, zero, Ddrop), key=key, val=val, pos=p.long(),
                logm=logm)


# ========================================================== value flow and head weights (eqs. 9-11)


def evidence_probes(
    R: torch.Tensor, slots: list, G: int, s: Settings, phase: int = 0
) -> torch.Tensor:
    """The evidence probes per layer (L, m), indices into the strided queries: the first
    m = s.evidence inside the slots of highest peak relevance max_t mean_g R_{l,g,t} (t ≥ 4, past
    StreamingLLM's 4 sinks), best first [choice: the peak; by mass the recent slots win]."""
    if not s.evidence or not slots:
        return torch.zeros(R.shape[0] // G, 0, dtype=torch.long, device=R.device)
    # (L, Tc)
    R_layer = (
        R.view(-1, G, R.shape[1])
        .mean(1)
        .index_fill(1, torch.arange(min(4, R.shape[1]), device=R.device), 0)
    )
    # (L, K), one read
    peaks = torch.stack([R_layer[:, a:b].amax(1) for a, b in slots], 1).tolist()
    out, stride = [], s.evidence_stride
    for peak in peaks:
        best = [slots[i] for i in sorted(range(len(slots)), key=lambda i: -peak[i])]
        at = [(t - phase) // stride
              for a, b in best for t in range(a + (phase - a) % stride, b, stride)]
        out.append(at[:s.evidence])
    return torch.tensor(out, dtype=torch.long, device=R.device)


def probes(model, full: Cache, flow: Flow, dtype, ev: torch.Tensor, stride: int):
    """Distortion probes per unit, g heads each: U (the last r tokens), then the evidence probes
    ev (L, m): q (U, P, D), causal logits over every key lg (U, P, T), the rows' logsumexp
    c (U, P), the probes' token indices (U, P); P = g·(r + m), ordered (head, probe)."""
    cfg = model.config
    G, g, D = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
    # pos (T,)
    r, pos, qs, lgs, probe_tokens = flow.probes[0].shape[1], full.layers[0].pos[0, 0], [], [], []
    # U: the prompt's last r
    last = torch.arange(full.next_pos - r, full.next_pos, device=pos.device)
    for l, lc in enumerate(full.layers):
        # (H, m, D)
        evidence_q = flow.strided[l][:, ev[l]] if ev.shape[1] else flow.probes[l][:, :0]
        # (P,) the probes' positions
        at = torch.cat((last, pos[ev[l] * stride + flow.phase[l]])).repeat(g)
        q = torch.cat((flow.probes[l], evidence_q), 1).to(dtype).reshape(G, -1, D)  # (G, P, D)
        lg = (q @ lc.k[0].to(dtype).transpose(1, 2)) / math.sqrt(D)  # (G, P, T)
        lgs.append(lg.masked_fill(pos > at[:, None], float("-inf")))  # causal rows
        qs.append(q)
        probe_tokens.append((at - pos[0]).expand(G, -1))              # token indices
    lg = torch.cat(lgs)                                              # (U, P, T)
    return torch.cat(qs), lg, lg.logsumexp(-1), torch.cat(probe_tokens)


def head_weights(model, full: Cache, lg, dtype, r: int) -> torch.Tensor:
    """Eq. 11, ω = √(a·b) per unit (U,): a = ‖W_O slice‖_F of the KV head's query heads,
    b = mean over the r probes u ∈ U of ‖Σ_{h∈group} W_O,h out_{h,u}‖ (out = the heads'
    outputs)."""
    cfg, omega = model.config, []
    G, g, D = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
    for l, lc in enumerate(full.layers):
        lg_window = lg[l * G:(l + 1) * G].unflatten(1, (g, -1))[:, :, :r]  # (G, g, r, T) U only
        out = torch.softmax(lg_window, -1) @ lc.v[0, :, None].to(dtype)  # (G, g, r, D) outputs
        # (dim, G, g, D)
        Wo = model.layers[l].self_attn.o_proj.weight.detach().to(dtype).view(-1, G, g, D)
        a = Wo.pow(2).sum((0, 2, 3)).sqrt()                          # (G,)
        b = torch.einsum("mghd,ghud->gum", Wo, out).norm(dim=-1).mean(1)
        omega.append((a * b).sqrt())
    return torch.cat(omega)


def relevance(model, full: Cache, flow: Flow, Tc: int, s: Settings, f: "Formulas"):
    """Eqs. 9-10 per unit: the first hop ŝ (x^0 over the context, normalised per unit), the
    multi-hop d̂ and the seeds (f.multi_hop), R = (1 − λ_graph)·ŝ + λ_graph·d̂, each unit
    its own row (only d̂ is shared). Returns (R (U, Tc), ŝ (U, Tc), seeds [token ids, hop
    order])."""
    x = torch.stack([y[0] for y in flow.flow])[..., :Tc]             # (L, G, Tc) first hop
    s_hat = unit_norm(x.reshape(-1, Tc))                             # (U, Tc)
    d_hat, seeds = f.multi_hop(model, full, flow, s_hat, s)          # (Tc,) shared, or (U, Tc)
    R = (1 - s.lambda_graph) * s_hat + s.lambda_graph * d_hat        # (U, Tc), Σ_t = 1 per unit
    return R, s_hat, seeds


def unit_norm(y: torch.Tensor) -> torch.Tensor:                       # rows summing to 1
    return y / y.sum(-1, keepdim=True).clamp(min=1e-300)


def hop_rows(model, full: Cache, flow: Flow, Tc: int, forward: float = 0.0):
    """rows(idx) -> (len(idx), Tc): the token attention map the hops walk on, mean over all H
    heads and the sampled layers (those whose queries the flow kept): (1 − forward)·A[idx, :]
    (what tokens idx < Tc read) + forward·A[:, idx]ᵀ (who reads them),
    A[i, j] = exp(q_i·k_j/√D − lse_i) with the observed normalisers (the whole prompt's, also
    under `context`)."""
    H, G, every = (model.config.n_heads, model.config.n_kv_heads,
                   torch.arange(Tc, device=full.layers[0].k.device))
    layers = [l for l, q in enumerate(flow.queries) if q is not None]

    # (H, n, m) causal, queries at, keys
    def A(l, at, keys):
        q, k = flow.queries[l][:, at], full.layers[l].k[0, :, keys]  # (H, n, D), (G, m, D)
        lg = (q.double() @ k.double().repeat_interleave(H // G, 0).transpose(1, 2)) / math.sqrt(
            q.shape[-1]
        )
        lg = lg - flow.lse[l][:, at, None].double()
        return lg.masked_fill(keys[None, :] > at[:, None], float("-inf")).exp()

    def rows(idx):                                                   # (n, Tc)
        def reads(l):
            """Layer l's A[idx, :], what tokens idx read (0 when only the forward map counts)."""
            return A(l, idx, every).mean(0) if forward < 1 else 0.0

        def readers(l):
            """Layer l's A[:, idx]ᵀ, who reads tokens idx (0 when only reads count)."""
            return A(l, every, idx).mean(0).T if forward > 0 else 0.0
        return sum((1 - forward) * reads(l) + forward * readers(l) for l in layers) / len(layers)
    return rows


def propagate(s_bar: torch.Tensor, rows, n_seeds: int, hops: int, decay: float):
    """The hop-wise multi-hop of eq. 9-10 on a token attention map rows(idx) -> (|idx|, Tc):
    seeds S_0 = the n_seeds tokens of highest s̄ (weights s̄); hop k:
    d_k = Σ_{j∈S_{k−1}} w_j·A[j, ·] with every seed chosen so far set to 0, S_k = its n_seeds
    best (weights d_k); d̂ = normalised Σ_k decay^(k−1)·d_k (s̄ itself if nothing flows).
    Returns (d̂ (Tc,), seeds)."""
    # best first, ties to the later token
    def order(v):
        rank = torch.sort(v.flip(0), descending=True, stable=True).indices
        best = (len(v) - 1 - rank)[:n_seeds]
        ids, flows = torch.stack((best, (v[best] > 0).long())).tolist()   # one read
        return [i for i, flowing in zip(ids, flows) if flowing]
    frontier = order(s_bar)
    seeds, w, d = list(frontier), s_bar[frontier], torch.zeros_like(s_bar)
    for k in range(1, hops + 1):
        if not frontier:
            break
        at = torch.tensor(frontier, device=s_bar.device)
        mass = (w.to(torch.float64)[:, None] * rows(at)).sum(0).to(s_bar.dtype)   # (Tc,)
        mass[seeds] = 0.0                                            # chosen seeds leave the flow
        d += decay ** (k - 1) * mass
        frontier = order(mass)
        w = mass[frontier]
        seeds += frontier
    return (unit_norm(d) if d.sum() > 0 else s_bar), seeds


def seeded_hops(model, full: Cache, flow: Flow, s_hat, s: Settings):
    """The paper's multi-hop: s̄ = mean of ŝ over units, `propagate` on the sampled layers'
    map."""
    Tc = s_hat.shape[1]
    rows = hop_rows(model, full, flow, Tc, s.hop_forward)
    return propagate(unit_norm(s_hat.mean(0)), rows, s.seeds, s.hops, s.decay)


@dataclass
class Context:
    """One prompt's GraceKV state: the units' tensors and the paper's per-prompt quantities."""
    T: int
    r: int                # the exact recent window; Tc = T − r context tokens
    units: Units          # what prototypes are made from
    sal: torch.Tensor     # (U, Tc) first-hop probe mass ŝ_j of each unit
    omega: torch.Tensor   # (U,) head weight ω
    kappa: torch.Tensor   # (Tc,) boundary scores b (bends)
    slots: list           # [(a, b)] the context's slots
    seeds: list           # the multi-hop's seeds, in hop order (the floor's candidates)
    s: Settings
    f: "Formulas"         # the formula each step calls
    G: int = 1            # KV heads per layer: units l·G .. l·G+G−1 share layer l's cache

    @property
    def Tc(self) -> int:
        """Tc = T − r context tokens."""
        return self.T - self.r


def context(model, full: Cache, flow: Flow, r: int, s: Settings,
            f: Optional["Formulas"] = None) -> Context:
    """One prompt's per-prompt steps (batch 1): probes, head weights ω, relevance R, slots; and
    the units' un-rotated keys, values and probe log-masses. f: the paper's formulas if None."""
    f = f or Formulas()
    T, Tc = full.layers[0].k.shape[2], full.layers[0].k.shape[2] - r
    dtype = torch.float64 if full.layers[0].k.dtype == torch.float64 else torch.float32
    R, s_hat, seeds = f.relevance(model, full, flow, Tc, s, f)       # (U, Tc), (U, Tc), [t]
    kappa = slot_bends(model, full, Tc, s, dtype, flow.surprisal)    # (Tc,)
    slots = f.slotting(kappa, Tc, s)
    G = model.config.n_kv_heads
    ev = evidence_probes(R, slots, G, s, flow.phase[0])              # (L, m)
    # (U, P, D), (U, P, T), (U, P) ×2
    q, lg, c, qpos = probes(model, full, flow, dtype, ev, s.evidence_stride)
    omega = head_weights(model, full, lg, dtype, flow.probes[0].shape[1])   # (U,)
    pos = full.layers[0].pos[0, 0]                                   # (T,) the keys' positions

    def pad(x, val=0.0):
        """x (U, Tc, ·) with the sentinel row Tc appended, filled with val."""
        return F.pad(x, (0, 0, 0, 1), value=val)
    kr = torch.cat([pad(M.apply_rope(lc.k[0, :, :Tc].to(dtype), -pos[:Tc], model.inv_freq))
                    for lc in full.layers])                          # (U, Tc+1, D) k°
    post = torch.cat([pad(lc.k[0, :, :Tc].to(dtype)) for lc in full.layers])  # (U, Tc+1, D) k
    values = torch.cat([pad(lc.v[0, :, :Tc].to(dtype)) for lc in full.layers])  # (U, Tc+1, D) v
    units = Units(kr=kr, v=values, k=post,
                  knorm=kr.norm(dim=-1),
                  lg=pad((lg[..., :Tc] - c[..., None]).transpose(1, 2), -math.inf),   # (U, Tc+1, P)
                  q=q, c=c, R=F.pad(R, (0, 1)).contiguous(),                          # (U, Tc+1)
                  hole=torch.zeros(len(kr), Tc, dtype=torch.bool, device=q.device),
                  inv_freq=model.inv_freq, s=s, f=f, qpos=qpos, p0=int(pos[0]))
    return Context(T=T, r=r, units=units, sal=s_hat, omega=omega, kappa=kappa,
                   slots=slots, seeds=seeds, s=s, f=f, G=G)


def context_key(model, full: Cache, flow: Flow, r: int, s: Settings, f: "Formulas") -> tuple:
    """What a Context depends on, by identity."""
    return id(model), id(full), id(flow.probes[0]), r, s, f


def context_memo() -> Last:
    """`context` remembered for its last arguments (speed only): the GraceKV rows and budgets
    of one prompt share its budget-independent steps; clear it when the prompt is done."""
    return Last(context, context_key)


# ========================================================================= budget flow (eqs. 12-13)
# Eq. 12: Δ_add(root) = ω·R(root)·(D_drop − D(root)), cost 1;
#         Δ_split(v) = ω·R(v)·(D(v) − Σ_{u∈child(v)} D(u)), cost |child(v)| − 1.
# Eq. 13: one max-heap on Δ/cost over all units; a node splits only once added.

@dataclass
class Node:
    """A node of a unit's tree (node_stats' fields): span [a, b) minus the unit's holes when made,
    n tokens, R, D, D(drop), and its prototype: key (D,), value (D,), position, log m."""
    __slots__ = ("unit", "a", "b", "n", "R", "D", "Ddrop", "key", "val", "pos", "logm")
    unit: int
    a: int
    b: int
    n: int
    R: float
    D: float
    Ddrop: float
    key: torch.Tensor
    val: torch.Tensor
    pos: int
    logm: float


NODE_FIELDS = Node.__slots__


def add_nodes(nodes: list, stats: dict, rows) -> list:
    """Append rows of node_stats' output `stats` to the node table; returns their node ids."""
    first = len(nodes)
    cols = [stats[f][rows] for f in NODE_FIELDS]
    cols = [x.tolist() if x.dim() == 1 else x.unbind(0) for x in cols]
    nodes.extend(Node(*vals) for vals in zip(*cols))
    return list(range(first, len(nodes)))


class Split(NamedTuple):
    """A node's best split: its gain, its cost in entries and the children it makes."""
    gain: float
    cost: int
    children: list


@dataclass
class Plan:
    """The forest as far as it was explored, and the greedy's trace: roots have add_gain;
    evaluated nodes have split (gain, cost, children); steps: (kind, node, gain, cost)."""
    B_alloc: int
    nodes: list = field(default_factory=list)     # [Node], node i at index i
    add_gain: dict = field(default_factory=dict)
    # root -> its heap rank (add_gain, or the lookahead's)
    add_rank: dict = field(default_factory=dict)
    split: dict = field(default_factory=dict)     # node -> Split
    steps: list = field(default_factory=list)
    frontier: set = field(default_factory=set)    # nodes in the cache at the end
    floor: Optional[torch.Tensor] = None          # (U, Tc) the singleton floor's exact tokens
    slots: list = field(default_factory=list)     # [(a, b)] the context's slots
    # (len(steps) then, kind, node): popped, not affordable
    dropped: list = field(default_factory=list)


def picture(plan: Plan, unit: int, Tc: int) -> list:
    """One unit's cache as text, a line per slot and a character per context token: 'F' floor
    token, 'x' exact leaf, a letter per prototype (the tokens it stands for), '.' dropped; the
    recent window (exact) is not drawn."""
    nodes, row = plan.nodes, ["."] * Tc
    mine = sorted((nodes[i].a, i) for i in plan.frontier if nodes[i].unit == unit)
    leaves = {nodes[i].a for _, i in mine if nodes[i].n == 1}
    letters = "abcdefghijklmnopqrstuvwyzABCDEGHIJKLMNOPQRSTUVWXYZ"          # all but x and F
    for k, (_, i) in enumerate([e for e in mine if nodes[e[1]].n > 1]):
        for t in range(nodes[i].a, nodes[i].b):
            if not plan.floor[unit, t] and t not in leaves:
                row[t] = letters[k % len(letters)]
    for t in leaves:
        row[t] = "x"
    for t in plan.floor[unit].nonzero()[:, 0].tolist():
        row[t] = "F"
    return [f"{a:5d}-{b - 1:<5d} |" + "".join(row[a:b]) + "|" for a, b in plan.slots]


def extract_three(ctx, u, a, b, free, within):
    """The paper's extraction: the token t of highest R^tok leaves as an exact leaf, both sides
    stay nodes: children [a, t), {t}, [t+1, b) (an empty side is no child: t at an end of the
    span makes 2 children at cost 1 [choice]). Returns (t (N,), [(start, end, skip)] the
    candidate children, each (N,); skip −1: none)."""
    t = a + ctx.units.R[u[:, None], within].masked_fill(~free, float("-inf")).argmax(1)
    none = torch.full_like(a, -1)
    return t, [(a, t, none), (t, t + 1, none), (t + 1, b, none)]


class Children(NamedTuple):
    """The candidate children of N nodes: relevance R and distortion D, (K, N) each; an absent
    child has R = D = 0."""
    R: torch.Tensor
    D: torch.Tensor


def split_gain(omega, R_v, D_v, children: Children):
    """Eq. 12: Δ_split(v) = ω·R(v)·(D(v) − Σ_{u∈child(v)} D(u)): the parent's relevance
    times the drop in distortion (nodes (N,))."""
    return omega * R_v * (D_v - children.D.sum(0))


def best_splits(ctx, plan: Plan, ids: list):
    """Best split of each node, by gain per entry (ties: bisection): a bisection at the highest κ
    in its central half (2 children, cost 1), or the extraction of f.extract (the paper's: 3
    children, cost 2). Gain: f.split_gain (eq. 12), cost = children − 1. An extracted token
    becomes a hole of its unit: no later node of the unit holds it."""
    nodes = plan.nodes
    if not ids:
        return
    u, a, b = (
        torch.tensor([getattr(nodes[i], k) for i in ids], device=ctx.units.kr.device)
        for k in ("unit", "a", "b")
    )
    length = b - a
    n = int(length.max())
    idx = a[:, None] + torch.arange(n, device=a.device)                        # (N, n)
    within = idx.clamp(max=ctx.Tc - 1)
    quarter = (length // 4).clamp(min=1)[:, None]
    central = (idx >= a[:, None] + quarter) & (idx <= b[:, None] - quarter)
    # the bisection point
    cut = a + ctx.kappa[within].masked_fill(~central, float("-inf")).argmax(1)
    free = (idx < b[:, None]) & ~ctx.units.hole[u[:, None], within]
    t, ext = ctx.f.extract(ctx, u, a, b, free, within)
    none = torch.full_like(a, -1)
    # K candidate children
    candidates = [(a, cut, none), (cut, b, none)] + ext
    K = len(candidates)
    starts, ends, skips = (torch.cat([x[i] for x in candidates]) for i in range(3))
    stats = node_stats(ctx.units, u.repeat(K), starts, ends, skips)
    valid = (stats["n"] > 0).view(K, -1)                      # (K, N) the non-empty children
    D_children = stats["D"].view(K, -1) * valid               # (K, N), a leaf's D = 0
    R_children = stats["R"].view(K, -1) * valid
    R_v, D_v = (
        torch.tensor([getattr(nodes[i], f) for i in ids], device=a.device, dtype=D_children.dtype)
        for f in ("R", "D")
    )
    omega = ctx.omega[u]
    bisected = Children(R_children[:2], D_children[:2])
    extracted = Children(R_children[2:], D_children[2:])
    gain_bisect = ctx.f.split_gain(omega, R_v, D_v, bisected)
    gain_extract = ctx.f.split_gain(omega, R_v, D_v, extracted)
    cost_bisect = valid[:2].sum(0) - 1
    cost_extract = (valid[2:].sum(0) - 1).clamp(min=1)
    use_ext = gain_extract / cost_extract > gain_bisect / cost_bisect.clamp(min=1)
    ctx.units.hole[u[use_ext], t[use_ext]] = True
    gain, cost = (torch.where(use_ext, gain_extract, gain_bisect).tolist(),
                  torch.where(use_ext, cost_extract, cost_bisect).tolist())
    pick = torch.cat((valid[:2] & ~use_ext, valid[2:] & use_ext))             # (K, N) children rows
    # (node, candidate) pairs
    pairs = pick.T.nonzero()
    kids = add_nodes(nodes, stats, pairs[:, 1] * len(ids) + pairs[:, 0])
    start = 0
    for node, node_gain, node_cost, n_kids in zip(ids, gain, cost, pick.sum(0).tolist()):
        plan.split[node] = Split(node_gain, node_cost, kids[start:start + n_kids])
        start += n_kids


def rank_by_gain(ctx, plan: Plan) -> dict:
    """Eq. 13 as stated: an add competes by Δ_add / 1 (root -> its rank in the heap)."""
    return dict(plan.add_gain)


def adds(ctx, B_alloc: int) -> tuple:
    """Eq. 12's adds: every slot's root of every unit with its Δ_add = ω·R(root)·(D_drop −
    D(root)), ranked by f.rank_adds (eq. 13 as stated: by the gain itself). Returns the Plan and
    the heap of (−gain/cost, tie, kind, node) it starts from."""
    # floor = the holes before the greedy
    plan = Plan(B_alloc, floor=ctx.units.hole.clone(), slots=ctx.slots)
    roots = [(j, a, b) for j in range(ctx.units.kr.shape[0]) for a, b in ctx.slots]
    if roots:
        u, a, b = (torch.tensor(x, device=ctx.units.kr.device) for x in zip(*roots))
        stats = node_stats(ctx.units, u, a, b)
        keep = (stats["n"] > 0).nonzero()[:, 0]
        gain = ctx.omega[stats["unit"]] * stats["R"] * (stats["Ddrop"] - stats["D"])
        plan.add_gain = dict(zip(add_nodes(plan.nodes, stats, keep), gain[keep].tolist()))
    rank = plan.add_rank = ctx.f.rank_adds(ctx, plan)
    heap = [(-g, i, "add", i) for i, g in rank.items()]
    heapq.heapify(heap)
    return plan, heap


def allocate(ctx, B_alloc: int) -> Plan:
    """Budget flow (eq. 13), the paper's loop: one max-heap over add(root) (cost 1) and
    split(added node) (cost = children − 1) by gain per entry; the best action is applied if its
    cost fits what is left, else dropped [choice: not retried]; a node entering the cache gets
    its best split (eq. 12, `best_splits`) and joins the heap. B_alloc counts entries (the
    cache is ragged: each unit holds exactly its own). Extractions mark holes in
    ctx.units.hole: one Context serves one call. `allocate_prefetched` is the same flow with the
    splits evaluated ahead in batches (the default; tested equal)."""
    plan, heap = adds(ctx, B_alloc)
    nodes, tie, left = plan.nodes, len(heap), B_alloc
    while heap and left > 0:
        _, _, kind, v = heapq.heappop(heap)
        gain, cost, kids = (plan.add_gain[v], 1, [v]) if kind == "add" else plan.split[v]
        if cost > left:                                             # does not fit: dropped
            plan.dropped.append((len(plan.steps), kind, v))
            continue
        left -= cost
        plan.steps.append((kind, v, gain, cost))
        if kind == "split":
            plan.frontier.remove(v)
        plan.frontier.update(kids)
        splittable = [c for c in kids if nodes[c].n > 1]
        best_splits(ctx, plan, [c for c in splittable if c not in plan.split])
        for c in splittable:
            child_split = plan.split[c]
            tie += 1
            heapq.heappush(heap, (-child_split.gain / child_split.cost, tie, "split", c))
    return plan


def allocate_prefetched(ctx, B_alloc: int) -> Plan:
    """`allocate` with the best splits evaluated ahead, in batches (support/greedy.py)."""
    plan, heap = adds(ctx, B_alloc)
    return prefetched_flow(plan, heap, B_alloc, functools.partial(best_splits, ctx, plan),
                           ctx.s.prefetch)


# ============================================================================= singleton floor

def seed_floor(ctx: Context, per_unit: int) -> int:
    """The budget-aware singleton floor, "chosen from the high-scoring seeds" (the paper): each
    unit keeps exact its own top min(per_unit, |seeds|) of the multi-hop's seeds, ranked by its
    own R^tok (eq. 10; ties to the later token), as holes in its trees, before the competition;
    per_unit = ⌊floor_frac·(B − r)⌋ grows with B up to the |seeds| = seeds·(hops + 1)
    candidates [choice: dev, docs/gracekv.md]. Returns its entries (<= U·per_unit)."""
    k = min(max(per_unit, 0), len(ctx.seeds))
    if k == 0:
        return 0
    dev = ctx.units.hole.device
    seeds = torch.tensor(sorted(ctx.seeds), device=dev).flip(0)      # (n,) latest first: ties to it
    R_seeds = ctx.units.R[:, seeds]                                  # (U, n) each unit's own R^tok
    best = R_seeds.sort(dim=-1, descending=True, stable=True).indices[:, :k]   # (U, k)
    ctx.units.hole.scatter_(1, seeds[best], True)
    return ctx.units.hole.shape[0] * k


# ============================================================================= cache assembly

def assemble(ctx, full: Cache, plan: Plan) -> Cache:
    """Per unit: floor tokens, window and frontier leaves exact (bias 0), prototypes with bias
    log m; sorted by position; a ragged layer (model.LayerCache.pack: no padding)."""
    nodes, G, Tc = plan.nodes, full.layers[0].k.shape[1], ctx.Tc
    U = ctx.units.kr.shape[0]
    mine, floor = [[] for _ in range(U)], [[] for _ in range(U)]     # per unit: frontier, floor
    for i in sorted(plan.frontier):
        mine[nodes[i].unit].append(i)
    for j, t in plan.floor.nonzero().tolist():                        # one read for every unit
        floor[j].append(t)
    dev, layers = ctx.units.kr.device, []
    for l, lc in enumerate(full.layers):
        heads = []
        for g in range(G):
            j = l * G + g
            protos = [nodes[i] for i in mine[j] if nodes[i].n > 1]
            leaves = [nodes[i].a for i in mine[j] if nodes[i].n == 1]
            exact = sorted(floor[j] + leaves) + list(range(Tc, ctx.T))
            exact = torch.tensor(exact, dtype=torch.long, device=dev)        # exact entries
            k, v = lc.k[0, g, exact], lc.v[0, g, exact]
            pos, bias = lc.pos[0, g, exact], lc.bias[0, g, exact]
            # bias log m: m tokens' mass
            if protos:
                more = (torch.stack([x.key for x in protos]), torch.stack([x.val for x in protos]),
                        torch.tensor([x.pos for x in protos], device=dev),
                        torch.tensor([x.logm for x in protos], dtype=torch.float64, device=dev))
                k, v, pos, bias = (torch.cat((x, y.to(x))) for x, y in zip((k, v, pos, bias), more))
            order = pos.argsort(stable=True)
            heads.append((k[order], v[order], pos[order], bias[order]))
        layers.append(LayerCache.pack(heads))                                 # (1, 1, Σ_g S_g, ·)
    return Cache(layers, full.next_pos, full.last_logits)


# ============================================================================= the method

@dataclass(frozen=True)
class Formulas:
    """The function each step calls: the paper's. A row of gracekv_variants.py replaces one
    (a reading of ours or an ablation); the steps never branch on which."""
    statistic: type = ValueFlow        # what the prefill records (eq. 9's first hop, probes)
    relevance: Callable = relevance    # R per unit and the seeds (eqs. 9-10)
    multi_hop: Callable = seeded_hops  # d̂ and the seeds (eqs. 9-10)
    slotting: Callable = dp_slots      # slots from the boundary scores (eq. 5)
    key: Callable = key_unrotated      # a node's key k̃ (eq. 6)
    multiplicity: Callable = multiplicity_hbar   # its log m (eq. 7)
    value_beta: Callable = beta_local  # β in its value weights (eq. 7)
    extract: Callable = extract_three  # the salient-token extraction (eq. 12's split)
    split_gain: Callable = split_gain  # Δ_split (eq. 12)
    rank_adds: Callable = rank_by_gain  # what an add competes with (eq. 13)
    floor: Callable = seed_floor       # the singleton floor

    def to_json(self) -> dict:        # each step's function by name
        return {k: v.__name__ for k, v in self.__dict__.items()}


@torch.no_grad()
def compress(model, full: Cache, flow: Flow, budget: int, settings: Optional[Settings] = None,
             return_plan: bool = False, formulas: Optional[Formulas] = None, memo=None,
             budget_flow: Optional[Callable] = None):
    """A new GraceKV cache from a FullKV prefill `full` of one prompt and its Flow (observe).

    At most U·budget real entries; `full` is left untouched (several methods share it).
    memo: a `context_memo()` shared by several calls on one prompt; None computes the
    budget-independent steps here. budget_flow: `allocate` (the paper's loop, one node at a
    time) or `allocate_prefetched` (the default: the same actions, splits evaluated in batches)."""
    s, f = settings or Settings(), formulas or Formulas()
    T, B = full.layers[0].k.shape[2], full.layers[0].k.shape[0]
    if budget < 1:
        raise UsageError(f"budget must be >= 1, got {budget}")
    if B != 1:
        raise UsageError(f"gracekv compresses one prompt at a time, got a batch of {B}")
    if flow.window != s.window or (s.lambda_s and flow.surprisal is None):
        raise UsageError(f"flow: window {flow.window}, surprisal {flow.surprisal is not None}; "
                         f"settings: {s.window}, λ_s {s.lambda_s}")
    dev, G, plan = full.layers[0].k.device, full.layers[0].k.shape[1], None
    if T <= budget:                                                           # identity: FullKV
        out = Cache(list(full.layers), full.next_pos, full.last_logits)
    elif budget <= s.window:          # only the window fits: the attention sink + the last B − 1
        idx = torch.cat((torch.zeros(1, dtype=torch.long, device=dev),
                         torch.arange(T - budget + 1, T, device=dev)))       # (B,)
        idx = idx.expand(1, G, budget)                                       # (1, G, B)
        out = Cache([lc.gather(idx) for lc in full.layers], full.next_pos, full.last_logits)
    else:
        steps = memo or context                                               # budget-independent
        ctx = steps(model, full, flow, s.window, s, f)
        # this call's holes
        ctx = replace(ctx, units=replace(ctx.units, hole=ctx.units.hole.clone()))
        # B_total − U·r (eq. 2)
        spare = len(ctx.omega) * (budget - s.window)
        floor = f.floor(ctx, int(s.floor_frac * (budget - s.window)))          # B_floor
        plan = (budget_flow or allocate_prefetched)(ctx, spare - floor)        # B_alloc
        out = assemble(ctx, full, plan)
    return (out, plan) if return_plan else out


def prefill(model, tokens, budget: int, settings: Optional[Settings] = None) -> Cache:
    """Full prefill of tokens (1, T), then GraceKV compression to `budget` entries per unit."""
    return GraceKV(budget, settings).prefill(model, tokens)


@dataclass
class GraceKV(polykv.Method):
    """GraceKV as a method: observes the probes and value flow, compresses once, then appends
    (no decode-time eviction). `model.generate(m, tok, prompt, GraceKV(128))`.
    formulas: the paper's if None (gracekv_variants.py builds the other rows); memo: see
    `compress`."""
    budget: int
    settings: Optional[Settings] = None
    formulas: Optional[Formulas] = None
    memo: Optional[Callable] = None
    # `allocate` (the paper's loop) or None: `allocate_prefetched`, the same actions faster
    budget_flow: Optional[Callable] = None

    def __post_init__(self):
        if self.budget < 1:
            raise UsageError(f"budget must be >= 1, got {self.budget}")
        self.settings = self.settings or Settings()
        self.formulas = self.formulas or Formulas()

    def needs(self, model) -> polykv.Needs:
        return needs(self.settings, model.config.n_layers, self.formulas.statistic)

    def compress(self, model, full: Cache, obs: polykv.Observation) -> Cache:
        flow = flow_of(obs, self.settings.window)
        return compress(model, full, flow, self.budget, self.settings,
                        formulas=self.formulas, memo=self.memo, budget_flow=self.budget_flow)

    @torch.no_grad()
    def prefill(self, model, tokens) -> Cache:                   # T <= B: FullKV, no observation
        if tokens.shape[1] <= self.budget:
            return M.prefill(model, tokens)
        return super().prefill(model, tokens)
