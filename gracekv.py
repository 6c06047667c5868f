"""GraceKV: one global budget of cache entries, spent on coverage or on resolution.

Tian, Liu, Wang, "Every Cache Entry Earns Its Place: Global Allocation of Resolution and
Coverage for KV Cache Compression" (arXiv 2608.07001, 2026). No code is public. Every
(layer, KV head) is a *unit* with a prototype tree over each slot of the context; adding a
slot's root widens coverage, splitting an added node refines resolution, and all actions of all
units compete for one budget. Read top to bottom, in the paper's order:

 1. Budget: B entries per unit on average; the recent window of r tokens is kept exact and
    charged; a prompt with T <= B is returned uncompressed (FullKV).
 2. Slots: the context is cut at bends κ of the hidden-state trajectory (eqs. 4-5).
 3. Prototype trees and distortion: a node (a span of n tokens) is one entry with key
    k̃ = RoPE(mean_t RoPE⁻¹(k_t, t), round(mean t)) (eq. 6), value ṽ = Σ(R_t+β)v_t / Σ(R_t+β)
    and multiplicity m = clamp(n·ħ², 1, n) entering attention as the logit bias log m (eq. 7);
    its distortion D for the probe queries in log space, D(drop) for keeping nothing (eq. 8).
 4. Value flow: token relevance R (what the probes attend to, spread along attention for a
    few decayed hops; eqs. 9-10), observed in the shared prefill (`ValueFlow`).
 5. Head weights ω per unit (eq. 11).
 6. Budget flow: one max-heap over "add a slot root" (Δ_add = ω·R·(D_drop − D), cost 1) and
    "split an added node" actions of all units by gain per entry (eqs. 12-13).
 7. Singleton floor: exact tokens reserved before the competition.
 8. Cache assembly: floor, window, leaves exact; prototypes with bias log m.

Notation: T prompt tokens, r recent window, Tc = T − r context tokens, H query heads, G KV
heads, g = H/G, D head dim, L layers, U = L·G units, P = g·r probes per unit, n tokens in a
node. One prompt at a time (batch 1). The cache holds at most U·B real entries.

[choices] where the reading of the paper is open are marked so beside the code; docs/gracekv.md
("Choices") lists them with the measurements behind them, and every variant's row.
Variants (`VARIANTS`) swap one function or setting each; the kernels never branch on them.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

import model as M
import polykv
from model import Cache, LayerCache
from support.errors import UsageError
from support.greedy import Slots, peek


def _later(name: str):
    """A default that names a function defined further down, in its step's section."""
    return field(default_factory=lambda: globals()[name])


@dataclass(frozen=True)
class Settings:
    window: int = 32          # r: exact recent tokens = probe queries [choice: SnapKV's w = 32]
    slot_min: int = 16        # slot lengths 16..128 (the paper; target 64)
    slot_max: int = 128
    bend_width: int = 8       # tokens averaged before/after i in κ_i [choice]
    bend_layer: Optional[int] = None  # layer whose cache traces the hidden state; None = L//2 [choice]
    lambda_z: float = 1.0     # λ_Z, λ_M, λ_graph, hops, decay: not given by the paper [choice]
    lambda_m: float = 1.0
    lambda_graph: float = 0.3
    hops: int = 2
    decay: float = 0.5
    beta: float = 0.1         # β = 0.1·mean R_t in the value weights (eq. 7)
    floor_frac: float = 0.1   # singleton floor: share of the non-window budget [choice]
    eps: float = 1e-6         # ε in ħ = ‖mean k°‖/(mean ‖k°‖ + ε) and in ‖μ‖² + ε
    log_rho_max: float = 20.0  # cap on log(Z̃/Z): D stays finite for extreme logits [choice]
    prefetch: int = 512       # heap entries whose nodes are evaluated together (speed only)
    # the formulas a variant may swap (VARIANTS), each picked once here, never branched on:
    key: Callable = _later("key_unrotated")              # a node's key k̃ (eq. 6)
    multiplicity: Callable = _later("multiplicity_hbar")  # its log m (eq. 7)
    unit_rows: Callable = _later("shared_row")           # R per unit from the per-unit rows (eq. 10)
    rank_adds: Callable = _later("rank_with_lookahead")   # what an add competes with in the heap

    def __post_init__(self):
        if min(self.window, self.slot_min, self.bend_width, self.prefetch) < 1:
            raise UsageError("window, slot_min, bend_width and prefetch must be >= 1")
        if self.slot_max < 2 * self.slot_min:
            raise UsageError(f"need slot_max >= 2·slot_min, got {self.slot_min}..{self.slot_max}")
        if not (0 <= self.lambda_graph <= 1 and 0 <= self.floor_frac <= 1 and self.hops >= 0):
            raise UsageError("need 0 <= lambda_graph <= 1, 0 <= floor_frac <= 1, hops >= 0")

    def to_json(self) -> dict:
        """JSON-ready: each formula by its function's name."""
        return {k: getattr(v, "__name__", v) for k, v in self.__dict__.items()}


# ============================================================================= observation: probes and value flow

@dataclass(frozen=True)
class ValueFlow:
    """GraceKV's per-layer statistic of the shared prefill (polykv.Needs.extra): the probe queries
    (the last r tokens) and the value flow x^0_i = Σ_{u∈U} Ā[u, i] (Ā the group-mean attention),
    x^k_i = Σ_{j≥i} x^{k−1}_j Ā[j, i]. Query rows come in descending chunks, so every hop takes the
    same pass. Value per layer: (probes (H, r, D), x (hops+1, G, T))."""
    window: int = 32
    hops: int = 2

    def lowest(self, T: int) -> int:            # hops read every row; the first hop the last r
        return 0 if self.hops else T - min(self.window, T)

    def begin(self, q, lc) -> dict:
        B, H, T, D = q.shape
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        r = min(self.window, T)
        seed = torch.zeros(T, dtype=acc, device=q.device)
        seed[T - r:] = 1.0                                           # the probe rows u ∈ U
        return {"x": q.new_zeros(self.hops + 1, lc.k.shape[1], T, dtype=acc), "seed": seed,
                "probes": q[0, :, T - r:].contiguous().clone()}

    def add(self, st: dict, c0: int, c1: int, p):
        G, x = st["x"].shape[1], st["x"]
        A = p[0].view(G, p.shape[1] // G, c1 - c0, c1).mean(1)        # (G, c, c1) group mean Ā
        prev = st["seed"][c0:c1].expand(G, -1)                       # (G, c)
        for k in range(self.hops + 1):
            x[k, :, :c1] += (prev[:, None, :] @ A)[:, 0]             # x^k += x^{k−1}[rows] Ā[rows]
            prev = x[k, :, c0:c1]

    def end(self, st: dict):
        return st["probes"], st["x"]

    def merge(self, other: "ValueFlow") -> "ValueFlow":
        """Variants with other hop counts share one pass: the most hops serve all."""
        if other.window != self.window:
            raise UsageError(f"GraceKV variants observe with different windows: {self} vs {other}")
        return self if self.hops >= other.hops else other


@dataclass
class Flow:
    """What GraceKV keeps from the full prefill, per layer (never a whole (H, T, T) map)."""
    window: int
    probes: list = field(default_factory=list)  # [(H, r, D)] post-RoPE queries of the last r tokens
    flow: list = field(default_factory=list)    # [(hops+1, G, T)] x^0 = s (first hop), x^k = x^{k−1}·Ā


def needs(s: "Settings") -> polykv.Needs:
    """What GraceKV observes during the prefill: the probes and the value flow."""
    return polykv.Needs(extra=(("flow", ValueFlow(s.window, s.hops)),))


def flow_of(obs: polykv.Observation, window: int) -> Flow:   # the Flow of an observation
    probes, flow = zip(*obs.extra["flow"])
    return Flow(window, list(probes), list(flow))


@torch.no_grad()
def observe(model, tokens, settings: Optional["Settings"] = None, chunk: int = 256):
    """Full prefill of tokens (1, T) observing the probes and flow (chunk: query rows per pass)."""
    s = settings or Settings()
    full, obs = polykv.observe(model, tokens, polykv.Needs(chunk=chunk, extra=needs(s).extra))
    return full, flow_of(obs, s.window)


# ============================================================================= slots (eqs. 4-5)

def bends(h: torch.Tensor, w: int) -> torch.Tensor:
    """Bends of a trajectory h (T, F): κ_i = 1 − cos(h̄_i − mean h̄_{i−w..i−1},
    mean h̄_{i+1..i+w} − h̄_i) with h̄ = h/‖h‖, windows clipped at the ends; κ_0 = κ_{T−1} = 0."""
    T = h.shape[0]
    h = F.normalize(h, dim=-1)
    C = F.pad(h.cumsum(0), (0, 0, 1, 0))                          # (T+1, F) prefix sums
    i = torch.arange(T, device=h.device)
    lo, hi = (i - w).clamp(min=0), (i + 1 + w).clamp(max=T)
    before = (C[i] - C[lo]) / (i - lo).clamp(min=1)[:, None]
    after = (C[hi] - C[(i + 1).clamp(max=T)]) / (hi - i - 1).clamp(min=1)[:, None]
    k = 1 - F.cosine_similarity(h - before, after - h, dim=-1)    # (T,)
    k[0] = k[-1] = 0.0
    return k


def segment(kappa: torch.Tensor, Tc: int, s: Settings) -> list:
    """Slots [(a, b)] covering [0, Tc): cut at the highest κ in [a+slot_min, a+slot_max]."""
    slots, a = [], 0
    while Tc - a > s.slot_max:
        hi = min(a + s.slot_max, Tc - s.slot_min)
        c = a + s.slot_min + int(kappa[a + s.slot_min:hi + 1].argmax())
        slots.append((a, c))
        a = c
    return slots + ([(a, Tc)] if Tc > a else [])


def slot_bends(model, full: Cache, Tc: int, s: Settings, acc) -> torch.Tensor:
    """Bends κ (Tc,) of the layer-L/2 trajectory h_t = [k°_t/‖k°_t‖, v_t/‖v_t‖] over
    heads (the cache's un-rotated keys and values: a linear image of the hidden state)."""
    lb = model.config.n_layers // 2 if s.bend_layer is None else s.bend_layer
    lc = full.layers[lb]
    T = lc.k.shape[2]
    pos = torch.arange(T, device=lc.k.device)
    kb = M.apply_rope(lc.k[0].to(acc), -pos, model.inv_freq)         # (G, T, D)
    h = torch.cat((F.normalize(kb, dim=-1), F.normalize(lc.v[0].to(acc), dim=-1)), -1)
    return bends(h.transpose(0, 1).reshape(T, -1), s.bend_width)[:Tc]


# ============================================================================= prototype trees and distortion (eqs. 6-8)
# A node = a span [a, b) of one unit (layer, KV head) minus the unit's holes (floor tokens and
# tokens extracted from its ancestors). `Units` holds every per-prompt tensor a node reads,
# stacked over units; `context` builds them. `node_stats` is the batched kernel of eqs. 6-8.

@dataclass
class Units:
    """The per-unit tensors a prototype is made from, stacked over units j = l·G + g; every
    (U, Tc+1, ·) tensor has a sentinel row Tc (zeros, or −inf for logits) that gathers read."""
    kr: torch.Tensor      # (U, Tc+1, D) un-rotated context keys k° = RoPE⁻¹(k_t, t)
    v: torch.Tensor       # (U, Tc+1, D) values
    knorm: torch.Tensor   # (U, Tc+1) ‖k°_t‖
    lg: torch.Tensor      # (U, Tc+1, P) log A[u, t]: probe logits minus each probe row's
                          # logsumexp (so exp = attention mass)
    q: torch.Tensor       # (U, P, D) probe queries
    c: torch.Tensor       # (U, P) probe rows' logsumexp
    R: torch.Tensor       # (U, Tc+1) relevance R_t of each unit's tokens; Σ_t R = 1
    hole: torch.Tensor    # (U, Tc) tokens later nodes leave out: the floor, then extracted leaves
    inv_freq: torch.Tensor
    s: object             # Settings (β, ε, λ_Z, λ_M, log ρ cap, the key and multiplicity formulas)
    k: torch.Tensor       # (U, Tc+1, D) post-RoPE context keys (the post-RoPE-key variant)

    @property
    def Tc(self) -> int:
        return self.kr.shape[1] - 1


class Span:
    """The gathered tokens of a batch of nodes (rows(x): (N, n, ·), zeros outside each node),
    their count nf (N,) and rounded mean position p (N,): what the key and multiplicity
    formulas read."""

    def __init__(self, cx, rows, nf, p):
        self.cx, self.rows, self.nf, self.p = cx, rows, nf, p

    @cached_property
    def kbar(self) -> torch.Tensor:
        return self.rows(self.cx.kr).sum(1) / self.nf[:, None]               # mean k°  (N, D)


def key_unrotated(span: Span) -> torch.Tensor:
    """Eq. 6: k̃ = RoPE(mean_t RoPE⁻¹(k_t, t), round(mean t))."""
    return M.apply_rope(span.kbar, span.p, span.cx.inv_freq)


def key_post(span: Span) -> torch.Tensor:
    """Variant: k̃ = mean_t k_t of the post-RoPE keys, so q·k̃ = mean_t q·k_t for every q."""
    return span.rows(span.cx.k).sum(1) / span.nf[:, None]


def multiplicity_hbar(span: Span, qk, logZ) -> torch.Tensor:
    """Eq. 7: ħ = ‖mean k°‖ / (mean ‖k°‖ + ε), m = clamp(n·ħ², 1, n); returns log m (N,)."""
    nf = span.nf
    hbar = span.kbar.norm(dim=-1) / (span.rows(span.cx.knorm).sum(1) / nf + span.cx.s.eps)
    return (nf * hbar ** 2).clamp(min=1).minimum(nf).log()


def multiplicity_n(span: Span, qk, logZ) -> torch.Tensor:
    """Variant: m = n (with the post-RoPE key, m·e^{q·k̃} is Jensen's lower bound of Z)."""
    return span.nf.log()


FIT_SLACK = 2.0    # c in the fitted bias's clamp [0, log n + c] [choice]


def multiplicity_fit(span: Span, qk, logZ) -> torch.Tensor:
    """Variant: log m fitted on the probes, the mass-weighted mean of log Z − q·k̃/√D (qk),
    clamped to [0, log n + FIT_SLACK]."""
    fit = (torch.softmax(logZ, -1) * (logZ - qk)).sum(-1)
    return torch.minimum(fit.clamp(min=0), span.nf.log() + FIT_SLACK)


def distortion(logZ, mu2, muv, logZp, v2, s):
    """D and D(drop) of nodes (N,) from the exact log Z_u, ‖μ_u‖², ⟨μ_u, ṽ⟩ (N, P), μ = M/Z,
    and the prototype's log Z̃_u (N, P) and ‖ṽ‖² (N,); s: Settings (λ_Z, λ_M, ε, log ρ cap).

    D_u = λ_Z (Z − Z̃)²/Z² + λ_M ‖M − M̃‖²/(‖M‖² + ε) with M̃ = Z̃ṽ, written with ρ = Z̃/Z:
    λ_Z (1 − ρ)² + λ_M ‖μ − ρṽ‖²/(‖μ‖² + ε), log ρ ≤ log_rho_max; probes weighted by mass Z_u."""
    rho = (logZp - logZ).clamp(max=s.log_rho_max).exp()                     # (N, P) Z̃/Z
    err = (mu2 - 2 * rho * muv + rho ** 2 * v2[:, None]).clamp(min=0)        # ‖μ − ρṽ‖²
    Du = s.lambda_z * (1 - rho) ** 2 + s.lambda_m * err / (mu2 + s.eps)
    Dd = s.lambda_z + s.lambda_m * mu2 / (mu2 + s.eps)                         # ρ = 0: nothing kept
    w = torch.softmax(logZ, -1)                                               # (N, P) mass weights
    return (w * Du).sum(-1), (w * Dd).sum(-1)


def node_stats(cx: Units, unit, a, b, skip=None) -> dict:
    """Tightened spans, n, R, D, D(drop) and prototype (key, value, pos, log m) of nodes
    [a, b) of units `unit` (N,), minus the unit's holes and minus token `skip` (N,) (−1: none).
    Sorted by length, in chunks."""
    skip = torch.full_like(a, -1) if skip is None else skip
    length = b - a
    order = length.argsort(stable=True)                                     # short spans together
    lens, parts, i = length[order].clamp(min=1).tolist(), [], 0
    cap = max(1, (1 << 21) // cx.lg.shape[2])           # (node, token) pairs per chunk: memory bound
    while i < len(lens):             # a chunk: 64 spans, then only up to twice the shortest (padding)
        j = i + 1
        while j < len(lens) and (j + 1 - i) * lens[j] <= cap and (j - i < 64 or lens[j] < 2 * lens[i]):
            j += 1
        parts.append(_node_stats(cx, *(x[order[i:j]] for x in (unit, a, b, skip)), lens[j - 1]))
        i = j
    inv = order.argsort()
    return {k: torch.cat([p[k] for p in parts])[inv] for k in parts[0]}


def probe_logits(q, u, key, max_elems: int = 1 << 22):
    """q_u·k̃/√D (N, P) of node keys key (N, D) of units u (N,) against their unit's probes
    q (U, P, D): one batched product per chunk of nodes, the gathered probes (chunk, P, D)
    bounded by max_elems."""
    step = max(1, max_elems // (q.shape[1] * q.shape[2]))
    out = [torch.bmm(q.index_select(0, u[i:i + step]), key[i:i + step, :, None])[..., 0]
           for i in range(0, len(u), step)]
    return torch.cat(out) / math.sqrt(key.shape[-1]) if out else key.new_zeros(0, q.shape[1])


def _node_stats(cx: Units, u, a, b, skip, n):
    """node_stats for spans of at most n tokens: gathered as (N, n, ·) with a sentinel row."""
    s, Tc = cx.s, cx.Tc
    idx = a[:, None] + torch.arange(n, device=a.device)                        # (N, n)
    mask = (idx < b[:, None]) & (idx != skip[:, None])
    mask &= ~cx.hole[u[:, None], idx.clamp(max=Tc - 1)]
    ix = idx.masked_fill(~mask, Tc)                                           # Tc: the sentinel row
    cnt = mask.sum(1)                                                         # (N,) tokens n
    first = mask.to(torch.int8).argmax(1)
    last = n - 1 - mask.flip(1).to(torch.int8).argmax(1)
    nf = cnt.clamp(min=1).to(cx.kr.dtype)
    flat = (u[:, None] * (Tc + 1) + ix).view(-1)                              # rows of (U·(Tc+1), ·)
    rows = lambda x: x.flatten(0, 1).index_select(0, flat).view(len(u), n, *x.shape[2:])
    V = rows(cx.v)                                                            # (N, n, D), 0 outside
    p = ((idx * mask).sum(1) / nf).round()                                    # rounded mean position
    span = Span(cx, rows, nf, p)
    key = s.key(span)                                                         # k̃ (N, D), eq. 6
    Rt = rows(cx.R)                                                           # (N, n), 0 outside
    w = Rt + s.beta / Tc * mask.to(Rt.dtype)                                  # R_t + β, β = 0.1/Tc
    val = (w[..., None] * V).sum(1) / w.sum(1).clamp(min=1e-300)[:, None]     # ṽ
    lg = rows(cx.lg)                                                          # (N, n, P), −inf outside
    mx = lg.amax(1).clamp(min=torch.finfo(lg.dtype).min)                      # (N, P) log-space shift
    # e = exp(lg − mx) ≤ 1, the largest term 1; exponents below −80 are clamped there: e ≥ 1.8e−35
    # in place of a denormal or 0, which the CPU's exp computes up to 30× slower, and next to
    # the term 1 it vanishes from every sum, fp32 or fp64
    e = (lg - mx[:, None]).clamp_(min=-80.0).exp_()
    Z = e.sum(1)                                                              # (N, P)
    logZ = Z.log() + mx
    Pn, Dh = e.shape[2], V.shape[2]
    if n * (Dh + Pn) <= Pn * Dh:     # short spans: ‖μ‖² = eᵀ(VVᵀ)e / Z², n²·(D+P) per node
        mu2 = (e * (V @ V.transpose(1, 2) @ e)).sum(1) / Z ** 2                # (N, P)
    else:                            # long spans: μ = eᵀV / Z directly, n·P·D per node
        mu2 = (e.transpose(1, 2) @ V).pow(2).sum(-1) / Z ** 2                 # (N, P)
    muv = (e * (V @ val[..., None])).sum(1) / Z                               # (N, P) ⟨μ, ṽ⟩
    qk = probe_logits(cx.q, u, key) - cx.c.index_select(0, u)               # (N, P) q_u·k̃/√D − c
    logm = s.multiplicity(span, qk, logZ)                                     # log m (N,), eq. 7
    logZp = logm[:, None] + qk                                      # log Z̃ = log m + q·k̃/√D − c
    D, Dd = distortion(logZ, mu2, muv, logZp, val.pow(2).sum(-1), s)
    zero = torch.zeros((), dtype=D.dtype, device=D.device)
    return dict(unit=u, a=a + first, b=a + last + 1, n=cnt, R=Rt.sum(1),
                D=torch.where(cnt <= 1, zero, D),                            # a leaf is its token
                Ddrop=torch.where(cnt == 0, zero, Dd), key=key, val=val, pos=p.long(), logm=logm)


# ============================================================================= value flow and head weights (eqs. 9-11)

def probes(model, full: Cache, flow: Flow, acc):
    """Probe queries U (the last r tokens, all g heads of each group) per unit:
    q (U, P, D), their causal logits over every key lg (U, P, T) and the rows' logsumexp c (U, P)."""
    cfg = model.config
    G, g, D, T = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim, full.layers[0].k.shape[2]
    rp = flow.probes[0].shape[1]
    pos = torch.arange(T, device=full.layers[0].k.device)
    qs, lgs = [], []
    for l, lc in enumerate(full.layers):
        q = flow.probes[l].to(acc).reshape(G, g * rp, D)             # (G, P, D) probes (h, u) of group g
        lg = (q @ lc.k[0].to(acc).transpose(1, 2)) / math.sqrt(D)    # (G, P, T)
        lgs.append(lg.masked_fill(pos > pos[T - rp:].repeat(g)[:, None], float("-inf")))  # causal rows
        qs.append(q)
    lg = torch.cat(lgs)                                              # (U, P, T)
    return torch.cat(qs), lg, lg.logsumexp(-1)


def head_weights(model, full: Cache, lg, acc) -> torch.Tensor:
    """Eq. 11, ω = √(a·b) per unit (U,): a = ‖W_O slice‖_F of the KV head's query heads,
    b = mean over probes of ‖Σ_{h∈group} W_O,h out_{h,u}‖ (out = the heads' attention outputs)."""
    cfg = model.config
    G, g, D = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
    omega = []
    for l, lc in enumerate(full.layers):
        out = torch.softmax(lg[l * G:(l + 1) * G], -1) @ lc.v[0].to(acc)   # (G, P, D) head outputs
        Wo = model.layers[l].self_attn.o_proj.weight.detach().to(acc).view(-1, G, g, D)  # (dim, G, g, D)
        a = Wo.pow(2).sum((0, 2, 3)).sqrt()                          # (G,)
        b = torch.einsum("mghd,ghud->gum", Wo, out.view(G, g, -1, D)).norm(dim=-1).mean(1)
        omega.append((a * b).sqrt())
    return torch.cat(omega)


def relevance(flow: Flow, Tc: int, s: Settings):
    """Eqs. 9-10, value flow: ŝ_j, d̂_j normalised over the context per unit (U, Tc);
    R_j = (1−λ_graph)·ŝ_j + λ_graph·d̂_j per unit with d = Σ_{k=1..hops} decay^(k−1)·x^k; then
    Settings.unit_rows turns the per-unit rows into what each unit uses. Returns (R (U, Tc), ŝ)."""
    x = torch.stack(flow.flow)[..., :Tc]                             # (L, hops+1, G, Tc)
    unit = lambda y: y.reshape(-1, Tc) / y.reshape(-1, Tc).sum(-1, keepdim=True).clamp(min=1e-300)
    s_hat = unit(x[:, 0])                                            # (U, Tc)
    d_hat = unit(sum(s.decay ** (k - 1) * x[:, k] for k in range(1, s.hops + 1)) if s.hops else x[:, 0])
    R = (1 - s.lambda_graph) * s_hat + s.lambda_graph * d_hat        # (U, Tc), Σ_t = 1 per unit
    return s.unit_rows(R), s_hat


def shared_row(R: torch.Tensor) -> torch.Tensor:
    """One row shared by every unit, the mean of the per-unit rows (U, Tc) [choice]."""
    return R.mean(0).expand_as(R)


def half_own_row(R: torch.Tensor) -> torch.Tensor:
    """Variant: each unit mixes the shared row with its own, ½·mean_j R_j + ½·R_j."""
    return (1 - 0.5) * R.mean(0) + 0.5 * R


@dataclass
class Context:
    """One prompt's GraceKV state: the units' tensors and the paper's per-prompt quantities."""
    T: int
    r: int                # the exact recent window; Tc = T − r context tokens
    units: Units          # what prototypes are made from
    sal: torch.Tensor     # (U, Tc) first-hop probe mass ŝ_j of each unit (extraction salience)
    omega: torch.Tensor   # (U,) head weight ω
    kappa: torch.Tensor   # (Tc,) bends of the hidden-state trajectory
    slots: list           # [(a, b)] the context's slots
    s: Settings
    G: int = 1            # KV heads per layer: units l·G .. l·G+G−1 share layer l's cache

    @property
    def Tc(self) -> int:
        return self.T - self.r


def context(model, full: Cache, flow: Flow, r: int, s: Settings) -> Context:
    """One prompt's per-prompt steps (batch 1): probes, head weights ω, value flow R, slots; and
    the units' un-rotated keys, values and probe log-masses."""
    T = full.layers[0].k.shape[2]
    Tc = T - r
    acc = torch.float64 if full.layers[0].k.dtype == torch.float64 else torch.float32
    q, lg, c = probes(model, full, flow, acc)                       # (U, P, D), (U, P, T), (U, P)
    omega = head_weights(model, full, lg, acc)                       # (U,)
    R, s_hat = relevance(flow, Tc, s)                                # (U, Tc), (U, Tc)
    kappa = slot_bends(model, full, Tc, s, acc)                      # (Tc,)
    pos = torch.arange(T, device=q.device)
    pad = lambda x, val=0.0: F.pad(x, (0, 0, 0, 1), value=val)       # the sentinel row Tc
    kr = torch.cat([pad(M.apply_rope(lc.k[0, :, :Tc].to(acc), -pos[:Tc], model.inv_freq))
                    for lc in full.layers])                          # (U, Tc+1, D) k°
    post = torch.cat([pad(lc.k[0, :, :Tc].to(acc)) for lc in full.layers])   # (U, Tc+1, D) k
    units = Units(kr=kr, v=torch.cat([pad(lc.v[0, :, :Tc].to(acc)) for lc in full.layers]), k=post,
                  knorm=kr.norm(dim=-1),
                  lg=pad((lg[..., :Tc] - c[..., None]).transpose(1, 2), -math.inf),   # (U, Tc+1, P)
                  q=q, c=c, R=F.pad(R, (0, 1)).contiguous(),                          # (U, Tc+1)
                  hole=torch.zeros(len(kr), Tc, dtype=torch.bool, device=q.device),
                  inv_freq=model.inv_freq, s=s)
    return Context(T=T, r=r, units=units, sal=s_hat, omega=omega, kappa=kappa,
                   slots=segment(kappa, Tc, s), s=s, G=model.config.n_kv_heads)


# ============================================================================= budget flow (eqs. 12-13)
# Δ_add(root) = ω·R(root)·(D_drop − D(root)), cost 1; Δ_split(v) = ω·(R(v)D(v) − Σ_c R(c)D(c)),
# cost |children| − 1; one max-heap on Δ/cost over all units; a node splits only once added.

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


def add_nodes(nodes: list, st: dict, rows) -> list:
    """Append rows of node_stats' output st to the node table; returns their node ids."""
    first = len(nodes)
    cols = [st[f][rows] for f in NODE_FIELDS]
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
    add_rank: dict = field(default_factory=dict)  # root -> its heap rank (add_gain, or the lookahead's)
    split: dict = field(default_factory=dict)     # node -> Split
    steps: list = field(default_factory=list)
    frontier: set = field(default_factory=set)    # nodes in the cache at the end
    floor: Optional[torch.Tensor] = None          # (U, Tc) the singleton floor's exact tokens
    slots: list = field(default_factory=list)     # [(a, b)] the context's slots
    group: int = 1                                # G: units l·G .. l·G+G−1 share layer l's cache
    dropped: list = field(default_factory=list)   # (len(steps) then, kind, node): popped, not affordable


def best_splits(cx, plan: Plan, ids: list):
    """Best split of each node: bisection at the highest κ in its central half, or extraction of
    its most salient token t as an exact leaf, the node minus t standing for the rest (t becomes
    a hole of the unit, so every later node of that unit, all inside this one, leaves it out).
    Both cost one entry; the larger gain wins (ties: bisection)."""
    nd = plan.nodes
    if not ids:
        return
    u, a, b = (torch.tensor([getattr(nd[i], k) for i in ids], device=cx.units.kr.device) for k in ("unit", "a", "b"))
    L = b - a
    n = int(L.max())
    idx = a[:, None] + torch.arange(n, device=a.device)                        # (N, n)
    idc = idx.clamp(max=cx.Tc - 1)
    q = (L // 4).clamp(min=1)[:, None]
    central = (idx >= a[:, None] + q) & (idx <= b[:, None] - q)
    c = a + cx.kappa[idc].masked_fill(~central, float("-inf")).argmax(1)       # bisection point
    ok = (idx < b[:, None]) & ~cx.units.hole[u[:, None], idc]
    t = a + cx.sal[u[:, None], idc].masked_fill(~ok, float("-inf")).argmax(1)  # most salient token
    none = torch.full_like(a, -1)
    # candidate children (4, N): [a,c), [c,b) | [a,b) ∖ {t}, {t}
    st = node_stats(cx.units, u.repeat(4), torch.cat((a, c, a, t)), torch.cat((c, b, b, t + 1)),
                    torch.cat((none, none, t, none)))
    RD = (st["R"] * st["D"]).view(4, -1)                                      # (4, N)
    valid = (st["n"] > 0).view(4, -1)
    RDv = torch.tensor([nd[i].R * nd[i].D for i in ids], device=a.device, dtype=RD.dtype)
    om = cx.omega[u]
    # Δ_split = ω·(R(v)D(v) − Σ_c R(c)D(c)), cost |children| − 1 = 1 (the leaf has D = 0)
    g_bis, g_ext = om * (RDv - RD[:2].sum(0)), om * (RDv - RD[2])
    use_ext = g_ext > g_bis                                                   # ties: bisection
    cx.units.hole[u[use_ext], t[use_ext]] = True
    gain = torch.where(use_ext, g_ext, g_bis).tolist()
    pick = torch.cat((valid[:2] & ~use_ext, valid[2:] & use_ext))             # (4, N) children rows
    ik = pick.T.nonzero()                                                     # (node, candidate) pairs
    kids = add_nodes(nd, st, ik[:, 1] * len(ids) + ik[:, 0])
    start = 0
    for node, gv, nk in zip(ids, gain, pick.sum(0).tolist()):
        plan.split[node] = Split(gv, nk - 1, kids[start:start + nk])
        start += nk


def rank_by_gain(cx, plan: "Plan") -> dict:
    """Eq. 13 as stated: an add competes by its own gain per entry, Δ_add / 1."""
    return dict(plan.add_gain)


def rank_with_lookahead(cx, plan: "Plan") -> dict:
    """An add ranked by max(Δ_add, (Δ_add + Δ_split(root))/(1 + cost_split)): a slot whose mass
    sits on one token has a poor root, and the extraction behind it now competes [choice: won
    on dev; the paper corrects this myopia with the floor]."""
    best_splits(cx, plan, [i for i in plan.add_gain if plan.nodes[i].n > 1])
    rank = dict(plan.add_gain)
    for i, g in plan.add_gain.items():
        if i in plan.split:
            sg, sc = plan.split[i].gain, plan.split[i].cost
            rank[i] = max(g, (g + sg) / (1 + sc))                       # gain per entry of both
    return rank


def allocate(cx, B_alloc: int) -> Plan:
    """Budget flow: a global max-heap over add(root) (eq. 12, ranked by Settings.rank_adds,
    applied alone at cost 1) and split(added node) (eq. 13) by gain per entry. Nodes get their
    best split lazily, in batches, before an action that brings them in (and the next `prefetch`
    best) is applied, so every available action is known when it competes. Extractions mark
    holes in cx.units.hole: one Context serves one call. B_alloc counts allocated slots
    (`Slots`): an action whose charge does not fit is dropped [choice: not retried]; the greedy
    goes on while padding can be filled, so a layer's heads end (nearly) equally long."""
    plan = Plan(B_alloc, floor=cx.units.hole.clone(), slots=cx.slots, group=cx.G)  # floor = holes before the greedy
    cost_of = Slots(plan.floor.sum(1).tolist(), cx.G, B_alloc)   # k more entries of u: G·max(0, n_u + k − cap_l)
    roots = [(j, a, b) for j in range(cx.units.kr.shape[0]) for a, b in cx.slots]
    if roots:
        u, a, b = (torch.tensor(x, device=cx.units.kr.device) for x in zip(*roots))
        st = node_stats(cx.units, u, a, b)
        keep = (st["n"] > 0).nonzero()[:, 0]
        gain = (cx.omega[st["unit"]] * st["R"] * (st["Ddrop"] - st["D"]))[keep].tolist()
        plan.add_gain = dict(zip(add_nodes(plan.nodes, st, keep), gain))
    rank = plan.add_rank = cx.s.rank_adds(cx, plan)
    heap = [(-g, i, "add", i) for i, g in rank.items()]             # (−gain/cost, tie, kind, node)
    heapq.heapify(heap)
    nd, tie = plan.nodes, len(heap)

    def entering(kind, v):      # unevaluated splittable nodes an action brings into the cache
        new = [v] if kind == "add" else plan.split[v].children
        return [c for c in new if nd[c].n > 1 and c not in plan.split]

    def fits(kind, v):          # the action's charge fits in what is left now
        return cost_of.charge(nd[v].unit, 1 if kind == "add" else plan.split[v].cost) <= cost_of.left

    def below(kind, v, tau):    # what the action brings in and, down splits already evaluated
        out = entering(kind, v)          # that rank >= tau (applied soon after it), what they bring in
        walk = [c for c in ([v] if kind == "add" else plan.split[v].children) if nd[c].n > 1 and c in plan.split]
        while walk:
            c = walk.pop()
            g, cost, kids = plan.split[c]
            if g / cost >= tau:
                out += entering("split", c)
                walk += [k for k in kids if nd[k].n > 1 and k in plan.split]
        return out

    while heap and not cost_of.done():
        kind, v = heap[0][2:]
        if not fits(kind, v):
            heapq.heappop(heap)
            plan.dropped.append((len(plan.steps), kind, v))
            continue
        if entering(kind, v):
            # evaluate what the next `prefetch` affordable actions bring in, directly or below
            # evaluated splits ranked above the prefetch-th (extraction chains: one round, not
            # one per link), then the children of those whose split ranks above it too
            top = peek(heap, cx.s.prefetch)
            tau, done = -top[-1][0], 0
            todo = {c for e in top if fits(*e[2:]) for c in below(*e[2:], tau)}
            while todo and done < 4 * cx.s.prefetch:                    # bounded look-ahead
                best_splits(cx, plan, sorted(todo))
                done += len(todo)
                todo = {c for v in todo if plan.split[v].gain / plan.split[v].cost >= tau and fits("split", v)
                        for c in entering("split", v)}
        _, _, kind, v = heapq.heappop(heap)
        gain, cost, kids = (plan.add_gain[v], 1, [v]) if kind == "add" else plan.split[v]
        cost_of.take(nd[v].unit, cost)
        plan.steps.append((kind, v, gain, cost))
        if kind == "split":
            plan.frontier.remove(v)
        plan.frontier.update(kids)
        for c in kids:
            if nd[c].n > 1:
                sg, sc, _ = plan.split[c]
                tie += 1
                heapq.heappush(heap, (-sg / sc, tie, "split", c))
    return plan


# ============================================================================= singleton floor

def singleton_floor(cx: Context, n_floor: int) -> int:
    """The singleton floor in at most n_floor allocated slots: layer l's G heads each keep their
    f_l highest-R_t tokens exact (ties to the later token), as holes in their trees; the f_l from
    one ranking of "one more floor token in every head of layer l", worth Σ_heads ω_j·R_j,(f_l+1)
    for G slots [choice: whole rows, docs/gracekv.md]. Returns the floor's slots."""
    Tc, G = cx.Tc, cx.G
    R, order = cx.units.R[:, :Tc].flip(-1).sort(dim=-1, descending=True, stable=True)   # (U, Tc) per unit
    row = (cx.omega[:, None] * R).view(-1, G, Tc).sum(1)                 # (L, Tc) non-increasing
    top = row.reshape(-1).sort(descending=True, stable=True).indices[:n_floor // G]   # prefixes
    f = torch.bincount(top // Tc, minlength=row.shape[0]).repeat_interleave(G)      # (U,) f_l per head
    keep = torch.arange(Tc, device=f.device) < f[:, None]                # (U, Tc) the first f_l
    u = torch.arange(len(f), device=f.device)[:, None].expand(-1, Tc)
    cx.units.hole[u[keep], Tc - 1 - order[keep]] = True
    return int(f.sum())


# ============================================================================= cache assembly

def assemble(cx, full: Cache, plan: Plan) -> Cache:
    """Per unit: floor tokens, window and frontier leaves exact (bias 0), prototypes with bias
    log m; sorted by position; a layer's heads padded to one size (bias −inf, pos −1)."""
    nd, G, Tc = plan.nodes, full.layers[0].k.shape[1], cx.Tc
    mine = [[] for _ in range(cx.units.kr.shape[0])]
    for i in sorted(plan.frontier):
        mine[nd[i].unit].append(i)
    dev, layers = cx.units.kr.device, []
    for l, lc in enumerate(full.layers):
        heads = []
        for g in range(G):
            j = l * G + g
            protos = [nd[i] for i in mine[j] if nd[i].n > 1]
            leaves = [nd[i].a for i in mine[j] if nd[i].n == 1]
            ex = sorted(plan.floor[j].nonzero()[:, 0].tolist() + leaves) + list(range(Tc, cx.T))
            ex = torch.tensor(ex, dtype=torch.long, device=dev)              # exact entries
            k, v, pos, bias = lc.k[0, g, ex], lc.v[0, g, ex], ex, lc.bias[0, g, ex]
            if protos:
                k = torch.cat((k, torch.stack([x.key for x in protos]).to(k.dtype)))
                v = torch.cat((v, torch.stack([x.val for x in protos]).to(v.dtype)))
                pos = torch.cat((pos, torch.tensor([x.pos for x in protos], device=dev)))
                logm = torch.tensor([x.logm for x in protos], device=dev, dtype=bias.dtype)
                bias = torch.cat((bias, logm))                               # log m: m tokens' mass
            o = pos.argsort(stable=True)
            heads.append((k[o], v[o], pos[o], bias[o]))
        S = max(len(h[2]) for h in heads)
        pad = lambda x, val: torch.cat((x, x.new_full((S - len(x), *x.shape[1:]), val)))
        k, v, pos, bias = (torch.stack([pad(h[i], val) for h in heads])[None]
                           for i, val in enumerate((0.0, 0.0, -1, float("-inf"))))
        layers.append(LayerCache(k, v, pos, bias))                            # (1, G, S, ·)
    return Cache(layers, full.next_pos, full.last_logits)


def picture(plan: Plan, unit: int, Tc: int) -> list:
    """One unit's cache as text, a line per slot and a character per context token: 'F' floor
    token, 'x' exact leaf, a letter per prototype (the tokens it stands for), '.' dropped; the
    recent window (exact) is not drawn."""
    nd, row = plan.nodes, ["."] * Tc
    mine = sorted((nd[i].a, i) for i in plan.frontier if nd[i].unit == unit)
    leaves = {nd[i].a for _, i in mine if nd[i].n == 1}
    letters = "abcdefghijklmnopqrstuvwyzABCDEGHIJKLMNOPQRSTUVWXYZ"          # all but x and F
    for k, (_, i) in enumerate([e for e in mine if nd[e[1]].n > 1]):
        for t in range(nd[i].a, nd[i].b):
            if not plan.floor[unit, t] and t not in leaves:
                row[t] = letters[k % len(letters)]
    for t in leaves:
        row[t] = "x"
    for t in plan.floor[unit].nonzero()[:, 0].tolist():
        row[t] = "F"
    return [f"{a:5d}-{b - 1:<5d} |" + "".join(row[a:b]) + "|" for a, b in plan.slots]


# ============================================================================= the method

@torch.no_grad()
def compress(model, full: Cache, flow: Flow, budget: int, settings: Optional[Settings] = None,
             return_plan: bool = False):
    """A new GraceKV cache from a FullKV prefill `full` of one prompt and its Flow (observe).

    At most U·budget real entries; `full` is left untouched (several methods share it)."""
    s = settings or Settings()
    T, B = full.layers[0].k.shape[2], full.layers[0].k.shape[0]
    if budget < 1:
        raise UsageError(f"budget must be >= 1, got {budget}")
    if B != 1:
        raise UsageError(f"gracekv compresses one prompt at a time, got a batch of {B}")
    if flow.window != s.window:
        raise UsageError(f"flow observed with window {flow.window}, settings say {s.window}")
    dev, G = full.layers[0].k.device, full.layers[0].k.shape[1]
    plan = None
    if T <= budget:                                                           # identity: FullKV
        out = Cache(list(full.layers), full.next_pos, full.last_logits)
    elif budget <= s.window:          # only the window fits: the attention sink + the last B − 1
        idx = torch.cat((torch.zeros(1, dtype=torch.long, device=dev),
                         torch.arange(T - budget + 1, T, device=dev))).expand(1, G, budget)  # (1, G, B)
        out = Cache([lc.gather(idx) for lc in full.layers], full.next_pos, full.last_logits)
    else:
        cx = context(model, full, flow, s.window, s)
        spare = len(cx.omega) * (budget - s.window)                           # B_total − U·r slots
        floor = singleton_floor(cx, int(s.floor_frac * spare))
        plan = allocate(cx, spare - floor)
        out = assemble(cx, full, plan)
    return (out, plan) if return_plan else out


@torch.no_grad()
def prefill(model, tokens, budget: int, settings: Optional[Settings] = None) -> Cache:
    """Full prefill of tokens (1, T), then GraceKV compression to `budget` entries per unit."""
    return GraceKV(budget, settings).prefill(model, tokens)


# GraceKV's rows (evaluate.py --methods): name -> Settings overrides, each swapping one formula
# or setting; `gracekv` is the method as read here. Their figures: docs/gracekv.md.
VARIANTS = {"gracekv": {},
            "gracekv-postkey": {"key": key_post},                 # the exact mean-logit key
            "gracekv-mn": {"multiplicity": multiplicity_n},       # m = n
            "gracekv-fit": {"multiplicity": multiplicity_fit},    # log m fitted on the probes
            "gracekv-spec": {"key": key_post, "multiplicity": multiplicity_n},
            "gracekv-myopic": {"rank_adds": rank_by_gain},        # no lookahead: eq. 13 as stated
            "gracekv-unit": {"unit_rows": half_own_row},          # half the unit's own row
            "gracekv-trees": {"floor_frac": 0.0},                 # the trees alone: no floor
            "gracekv-1hop": {"hops": 0, "lambda_graph": 0.0},     # value flow without propagation
            # a large floor: 95 % of the budget on exact tokens ranked by ω·R, the trees refine
            # the rest (ties gracekv on fidelity, loses answers at B = 128: docs/gracekv.md)
            "gracekv-floor": {"floor_frac": 0.95, "rank_adds": rank_by_gain},
            "gracekv-exact": {"floor_frac": 1.0}}                 # no trees: every entry an exact token


@dataclass
class GraceKV(polykv.Method):
    """GraceKV as a method: observes the probes and value flow, compresses once, then appends
    (no decode-time eviction). `model.generate(m, tok, prompt, GraceKV(128))`."""
    budget: int
    settings: Optional[Settings] = None

    def __post_init__(self):
        if self.budget < 1:
            raise UsageError(f"budget must be >= 1, got {self.budget}")
        self.settings = self.settings or Settings()

    def needs(self, model) -> polykv.Needs:
        return needs(self.settings)

    def compress(self, model, full: Cache, obs: polykv.Observation) -> Cache:
        return compress(model, full, flow_of(obs, self.settings.window), self.budget, self.settings)

    @torch.no_grad()
    def prefill(self, model, tokens) -> Cache:
        if tokens.shape[1] <= self.budget:       # nothing to compress: skip the observation
            return M.prefill(model, tokens)
        return super().prefill(model, tokens)


def variant(name: str, budget: int) -> GraceKV:
    """The GraceKV row `name` of VARIANTS at `budget`."""
    return GraceKV(budget, Settings(**VARIANTS[name]))
