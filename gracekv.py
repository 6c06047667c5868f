"""GraceKV: one global budget of cache entries, spent on coverage or on resolution.

Tian, Liu, Wang, "Every Cache Entry Earns Its Place: Global Allocation of Resolution and
Coverage for KV Cache Compression" (arXiv 2608.07001, 2026), by its equations (2)-(13). No code
is public. Every (layer, KV head) is a *unit* with a prototype tree over each slot of the
context; adding a slot's root widens coverage, splitting an added node refines resolution, and
all actions of all units compete for one budget. Read top to bottom, in the paper's order:

 0. Observation: one plain prefill; at each layer the attention A (model.attention_probs) gives
    the probes (the last r queries), the first hop x = Σ_{u∈U} Ā[u, ·] and, at a few sampled
    layers, the queries the multi-hop walks with.
 1. Budget (2): B entries per unit on average; the recent window of r tokens is kept exact and
    charged; B_alloc = U·B − U·r − B_floor goes to the greedy; T <= B is FullKV. Under the
    `context` protocol (engine/protocols.py) the prefix and question are exact and free.
 2. Slots (4)-(5): bends κ of the hidden-state trajectory over several layers and widths
    (mean − λ_stab·std), robust z-scored into boundary scores b, cut by dynamic programming
    into slots of 16..128.
 3. Prototype and distortion of ONE node (6)-(8): a node (n tokens) is one entry with key
    k̃ = RoPE(mean_t RoPE⁻¹(k_t, t), round(mean t)), multiplicity m = clamp(n·ħ², 1, n)
    entering attention as the logit bias log m, value ṽ = Σ(R_t+β_v)v_t / Σ(R_t+β_v) with the
    node's own β_v = 0.1·mean_{t∈v} R_t; its distortion D for the probes (U and m queries of
    high-evidence slots), D(drop) for nothing.
 4. Relevance (9)-(10): each unit's own first hop ŝ (what its query heads' probes attend to);
    seeds = the top tokens of the mean ŝ, propagated hop by hop along a few sampled layers'
    attention, chosen seeds removed at each hop, to d̂ (shared); R = (1−λ)ŝ + λd̂ per unit.
 5. Head weights ω per unit (11).
 6. Budget flow (12)-(13), `allocate`: one max-heap over "add a slot root" (cost 1) and "split
    an added node" — a bisection at the highest b (2 children, cost 1) or the extraction of
    its top-R token with both sides kept (3 children, cost 2) — by gain per entry, popped one
    action at a time.
 7. Singleton floor: exact tokens from the seeds, reserved before the competition.
 8. Cache assembly: a ragged cache (each unit exactly its entries); prototypes with bias log m.

Notation: T prompt tokens, r recent window, Tc = T − r context tokens, H query heads, G KV
heads, g = H/G, D head dim, L layers, U = L·G units, P = g·(r + m) probes per unit, n tokens in
a node; batch 1; at most U·B entries. [choice] marks where the paper is open (docs/gracekv.md,
"Choices"). Each step calls the paper's function through `Formulas` (the method section, at the
end); engine/gracekv_variants.py builds the other rows, each replacing one function or setting
(our earlier readings, ablations); the steps never branch on them.

This module is the paper's naive computation, and runs alone (`GraceKV(budget).prefill(m, x)`).
The engine's fast forms (engine/gracekv_fast.py: the shared observation's streamed statistic,
the node statistics of many nodes at once, the budget flow with splits evaluated ahead, the
per-prompt memo) are handed in as `GraceKV`'s fields, never imported here, and are tested equal
to the forms they replace (tests/test_gracekv_fast.py).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

import model as M
import polykv
from model import Cache, LayerCache
from support.errors import UsageError


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
    hop_depths: tuple = (0.25, 0.5, 0.75)   # the sampled layers, fractions of the depth [choice]
    # the hops' map: (1 − f)·what a token reads + f·who reads it [choice: dev]
    hop_forward: float = 0.5
    evidence: int = 32        # distortion probes also from high-evidence slots: this many per
    evidence_stride: int = 4  # layer, every stride-th query of the slots of top peak R [choice]
    beta: float = 0.1         # β_v = 0.1·mean_{t∈v} R_t (eq. 7)
    # φ: each unit its own top min(|seeds|, ⌊φ·(B − r)⌋) seeds [choice]
    floor_frac: float = 0.75
    # ε in ħ = ‖mean k°‖/(mean ‖k°‖ + ε) and in eq. 8's Z² + ε, ‖M‖² + ε
    eps: float = 1e-6
    log_rho_max: float = 20.0  # guard on log(Z̃/Z): D stays finite in fp32 for extreme logits
    # heap entries whose nodes are evaluated together: read by the engine's prefetched budget
    # flow only (engine/gracekv_fast.py; speed only, the same actions)
    prefetch: int = 2048
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


# ============================================================== 0. observation: probes and flow

@dataclass
class Flow:
    """What GraceKV keeps from the full prefill, per layer (never a whole (H, T, T) map)."""
    window: int
    probes: list = field(default_factory=list)  # [(H, r, D)] post-RoPE queries, the last r tokens
    flow: list = field(default_factory=list)    # [(1, G, T)] x^0 = s, the first hop
    queries: list = field(default_factory=list)  # [(H, T, D) or None] the sampled layers' queries
    # [(H, ⌈T/stride⌉, D) or None] every stride-th query
    strided: list = field(default_factory=list)
    phase: list = field(default_factory=list)    # [int] strided query i is token i·stride + phase
    lse: list = field(default_factory=list)      # [(H, T) or None] the sampled layers' row log Σ
    # (1, T) −log p of each token, if Settings.lambda_s
    surprisal: Optional[torch.Tensor] = None


def first_hop(A_bar: torch.Tensor, r: int, s: Settings) -> torch.Tensor:
    """Eq. 9's first hop of one layer, x_i = Σ_{u∈U} Ā[u, i] over the probe rows U (the last
    r), Ā (G, T, T) the group-mean attention of each KV head's query heads: (1, G, T)."""
    return A_bar[:, A_bar.shape[1] - r:].sum(1)[None]


def row_log_normalisers(q: torch.Tensor, q_pos: torch.Tensor, lc: LayerCache) -> torch.Tensor:
    """lse_i = log Σ_{j visible to i} e^{q_i·k_j/√D + bias_j} of every query row of one layer
    (H, T), with which the multi-hop rebuilds the rows of A it walks (`hop_rows`)."""
    H, D = q.shape[1], q.shape[-1]
    g = H // lc.k.shape[1]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    k = M.repeat_kv(lc.k, H)[0].to(dtype)                                       # (H, S, D)
    bias = M.repeat_kv(lc.bias, H)[0].to(dtype)                                 # (H, S)
    logits = q[0].to(dtype) @ k.transpose(1, 2) / math.sqrt(D) + bias[:, None]  # (H, T, S)
    visible = M.visible_mask(q_pos, lc.pos)[0].repeat_interleave(g, 0)          # (H, T, S)
    return logits.masked_fill(~visible, float("-inf")).logsumexp(-1)          # (H, T)


@torch.no_grad()
def observe(model, tokens, settings: Optional[Settings] = None,
            formulas: Optional["Formulas"] = None) -> tuple:
    """The paper's observation, naive: one plain prefill of tokens (1, T) (model.prefill with a
    post-kernel hook) reading each layer's whole attention A (H, T, T) = model.attention_probs:
    the probes (the last r queries), the first hop (f.first_hop of the group-mean Ā), every
    stride-th query (the evidence probes' candidates), and at the sampled layers (hop_depths)
    every query and its row's log-normaliser; the surprisal from the final norm's output.
    Returns (FullKV cache, Flow). engine/gracekv_fast.py reads the same in the shared
    observation's query chunks (tested equal)."""
    s, f = settings or Settings(), formulas or Formulas()
    sampled = depths(s.hop_depths, model.config.n_layers)
    stride = s.evidence_stride if s.evidence else 0
    flow = Flow(s.window)

    def post_kernel(layer, q, q_pos, lc, out):
        T, G = q.shape[2], lc.k.shape[1]
        r = min(s.window, T)
        A = M.attention_probs(q, lc.k, lc.bias, q_pos, lc.pos)[0]              # (H, T, T)
        A_bar = A.view(G, A.shape[0] // G, T, T).mean(1)                       # (G, T, T)
        flow.probes.append(q[0, :, T - r:].clone())                            # (H, r, D)
        flow.flow.append(f.first_hop(A_bar, r, s))                             # (1, G, T)
        flow.strided.append(q[0, :, ::stride].clone() if stride else None)
        flow.phase.append(0)
        flow.queries.append(q[0].clone() if layer in sampled else None)      # (H, T, D)
        flow.lse.append(row_log_normalisers(q, q_pos, lc) if layer in sampled else None)

    def final(h):                                    # the final norm's output (1, T, dim)
        if s.lambda_s:
            flow.surprisal = M.surprisal(model, h, tokens)                     # (1, T)
    full = M.prefill(model, tokens, M.Hooks(post_kernel=post_kernel, final=final))
    return full, flow


# ================================================================================ budget (eq. 2)
# B_total = U·B (B per unit = N_ctx/x); the window's U·r entries are charged; the floor's
# B_floor = |E_floor|; B_alloc = B_total − U·r − B_floor goes to the greedy (eq. 3: a knapsack
# with precedence, a node splits only once added, solved greedily by gain per entry, eq. 13).

def budget_alloc(U: int, budget: int, r: int, B_floor: int) -> int:
    """Eq. 2: B_alloc = U·B − U·r − B_floor."""
    return U * (budget - r) - B_floor


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


# ============================================== prototype and distortion of one node (eqs. 6-8)
# A node = a span [a, b) of one unit (layer, KV head) minus the floor's tokens; `Units` holds what
# a node reads. Each equation below is computed for ONE node, in plain tensor code;
# `node_statistics` runs them node by node (the engine hands in a batched form, tested equal).

@dataclass
class Units:
    """The per-unit tensors a prototype is made from, stacked over units j = l·G + g."""
    kr: torch.Tensor      # (U, Tc, D) un-rotated context keys k° = RoPE⁻¹(k_t, t)
    v: torch.Tensor       # (U, Tc, D) values
    knorm: torch.Tensor   # (U, Tc) ‖k°_t‖
    lg: torch.Tensor      # (U, Tc, P) log A[u, t]: probe logits − each row's logsumexp
    q: torch.Tensor       # (U, P, D) probe queries
    c: torch.Tensor       # (U, P) probe rows' logsumexp
    R: torch.Tensor       # (U, Tc) relevance R_t of each unit's tokens; Σ_t R = 1
    floor: torch.Tensor   # (U, Tc) tokens no node holds: the singleton floor's exact tokens
    inv_freq: torch.Tensor
    s: object             # Settings (β, ε, λ_Z, λ_M, log ρ cap)
    f: object             # Formulas (the key, multiplicity and β of a node)
    k: torch.Tensor       # (U, Tc, D) post-RoPE context keys k_t, the cache's own
    # (U, P) the probes' token indices: a probe reads nodes ending at or before it
    qpos: torch.Tensor
    # the position of token 0 (> 0 when a protocol cuts the prompt's prefix off)
    p0: int = 0

    @property
    def Tc(self) -> int:
        return self.kr.shape[1]


class NodeView(NamedTuple):
    """What eqs. 6-8 read of ONE node of unit j: its n tokens t ∈ I_v and their rows."""
    tokens: torch.Tensor    # (n,) token indices, ascending
    position: torch.Tensor  # () p_v = round(mean_{t∈I_v} t), as a position (+ p0)
    kr: torch.Tensor        # (n, D) k°_t
    k: torch.Tensor         # (n, D) k_t, post-RoPE
    v: torch.Tensor         # (n, D) v_t
    knorm: torch.Tensor     # (n,) ‖k°_t‖
    R: torch.Tensor         # (n,) R^tok_t (eq. 10)
    lg: torch.Tensor        # (n, P) log A[u, t] = q_u·k_t/√D − c_u
    q: torch.Tensor         # (P, D) the unit's probes q_u
    c: torch.Tensor         # (P,) their rows' logsumexp c_u
    seen: torch.Tensor      # (P,) bool: probe u sits at or after the node's last token
    inv_freq: torch.Tensor
    eps: float
    Tc: int                 # context tokens (a variant's global β reads it)


def node_view(units: Units, j: int, tokens) -> NodeView:
    """The rows of unit j at `tokens` (n,) (non-empty, ascending; a tensor or a list)."""
    t = torch.as_tensor(tokens, device=units.kr.device)                     # (n,)
    position = t.to(units.kr.dtype).mean().round() + units.p0               # p_v
    return NodeView(t, position, units.kr[j, t], units.k[j, t], units.v[j, t],
                    units.knorm[j, t], units.R[j, t], units.lg[j, t], units.q[j], units.c[j],
                    units.qpos[j] >= t[-1], units.inv_freq, units.s.eps, units.Tc)


def key_unrotated(node: NodeView) -> torch.Tensor:
    """Eq. 6: k̃_v = RoPE(mean_{t∈I_v} k°_t, p_v) with k°_t = RoPE⁻¹(k_t, t) (D,)."""
    return M.apply_rope(node.kr.mean(0), node.position, node.inv_freq)


def multiplicity_hbar(node: NodeView, key: torch.Tensor) -> torch.Tensor:
    """Eq. 7: ħ_v = ‖mean k°_t‖ / (mean ‖k°_t‖ + ε), m_v = clamp(n·ħ_v², 1, n); returns
    log m_v, the prototype's logit bias (key: unused by the paper's m)."""
    n = len(node.tokens)
    hbar = node.kr.mean(0).norm() / (node.knorm.mean() + node.eps)
    return (n * hbar ** 2).clamp(min=1, max=n).log()


def beta_local(node: NodeView, beta: float) -> torch.Tensor:
    """Eq. 7: the node's own β_v = beta·mean_{t∈I_v} R^tok_t."""
    return beta * node.R.mean()


def value(node: NodeView, beta_v: torch.Tensor) -> torch.Tensor:
    """Eq. 7: ṽ_v = Σ_t (R^tok_t + β_v) v_t / Σ_t (R^tok_t + β_v) (D,) (the denominator kept
    above 0 for a node of zero relevance and β)."""
    w = node.R + beta_v                                                     # (n,)
    return (w[:, None] * node.v).sum(0) / w.sum().clamp(min=1e-300)


def distortion(node: NodeView, key, log_m, val, s: Settings) -> tuple:
    """Eq. 8 for the probes u that read the node, each in its own max-subtracted scale
    (ℓ_ut = log A[u, t], its largest over the node's tokens subtracted):
    Z_u = Σ_t e^{ℓ_ut}, M_u = Σ_t e^{ℓ_ut} v_t, Z̃_u = m e^{q_u·k̃/√D − c_u}, M̃_u = Z̃_u ṽ,
    D_u = λ_Z (Z_u − Z̃_u)²/(Z_u² + ε) + λ_M ‖M_u − M̃_u‖²/(‖M_u‖² + ε);
    D(I_v) = Σ_u w_u D_u with w_u ∝ the attention mass u pays the node, Σ_{t∈v} A[u, t];
    D^drop: the same with Z̃ = M̃ = 0. Z̃_u <= e^{log_rho_max}·Z_u (a guard that binds only
    past fp32's range). Returns (D, D^drop), 0-dim."""
    lg, q, c = node.lg[:, node.seen], node.q[node.seen], node.c[node.seen]  # (n, P'), (P', D)
    shift = lg.amax(0)                                                      # (P',)
    e = (lg - shift).exp()                                                  # (n, P')
    Z = e.sum(0)                                                            # (P',) Z_u
    M_u = e.T @ node.v                                                      # (P', D) M_u
    qk = q @ key / math.sqrt(key.shape[-1]) - c                             # (P',)
    log_Z_proto = (log_m + qk - shift).clamp(max=Z.log() + s.log_rho_max)
    Z_proto = log_Z_proto.exp()                                             # (P',) Z̃_u
    M_proto = Z_proto[:, None] * val                                        # (P', D) M̃_u
    M2 = M_u.pow(2).sum(-1)                                                 # ‖M_u‖²
    D_u = (s.lambda_z * (Z - Z_proto) ** 2 / (Z ** 2 + s.eps)
           + s.lambda_m * (M_u - M_proto).pow(2).sum(-1) / (M2 + s.eps))
    D_drop = s.lambda_z * Z ** 2 / (Z ** 2 + s.eps) + s.lambda_m * M2 / (M2 + s.eps)
    w = torch.softmax(Z.log() + shift, 0)                   # ∝ Σ_{t∈v} A[u, t] = e^{shift}·Z_u
    return (w * D_u).sum(), (w * D_drop).sum()


def node_tokens(units: Units, j: int, a: int, b: int, skip: int) -> torch.Tensor:
    """The tokens (n,) of node [a, b) of unit j: the span minus the floor, minus token `skip`
    (−1: none; a candidate child of a variant's extraction leaves one out)."""
    t = torch.arange(a, b, device=units.floor.device)                       # (b − a,)
    return t[~units.floor[j, a:b] & (t != skip)]


def node_statistics(units: Units, u, a, b, skip=None) -> dict:
    """Eqs. 6-8 node by node, for nodes [a, b) of units u (N,) minus token skip (N,) (−1:
    none): the span tightened to the node's first and last token, n, R(v) = Σ_t R^tok_t,
    D, D^drop and the prototype (key, value, position, log m). A node of one token is that
    token (D = 0); an empty node is all zeros (never added)."""
    s, f, D = units.s, units.f, units.kr.shape[-1]
    skip = [-1] * len(u) if skip is None else skip.tolist()
    rows = []
    for j, a_v, b_v, skip_v in zip(u.tolist(), a.tolist(), b.tolist(), skip):
        tokens = node_tokens(units, j, a_v, b_v, skip_v)
        zero = units.kr.new_zeros(())
        if len(tokens) == 0:
            rows.append(dict(unit=j, a=a_v, b=a_v, n=0, R=zero, D=zero, Ddrop=zero,
                             key=units.kr.new_zeros(D), val=units.kr.new_zeros(D), pos=0,
                             logm=zero))
            continue
        node = node_view(units, j, tokens)
        key = f.key(node)                                                   # eq. 6
        log_m = f.multiplicity(node, key)                                   # eq. 7
        val = value(node, f.value_beta(node, s.beta))                       # eq. 7
        D_v, D_drop = distortion(node, key, log_m, val, s)                  # eq. 8
        rows.append(dict(unit=j, a=int(tokens[0]), b=int(tokens[-1]) + 1, n=len(tokens),
                         R=node.R.sum(), D=D_v if len(tokens) > 1 else zero, Ddrop=D_drop,
                         key=key, val=val, pos=int(node.position), logm=log_m))
    whole = ("unit", "a", "b", "n", "pos")                                  # integers
    return {name: torch.tensor([row[name] for row in rows], device=u.device) if name in whole
            else torch.stack([row[name] for row in rows]) for name in rows[0]}


# ============================================ relevance (eqs. 9-10), probes, head weights (eq. 11)

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


@dataclass
class Context:
    """One prompt's GraceKV state: the units' tensors and the paper's per-prompt quantities."""
    T: int
    r: int                # the exact recent window; Tc = T − r context tokens
    units: Units          # what prototypes are made from
    sal: torch.Tensor     # (U, Tc) first-hop probe mass ŝ_j of each unit
    omega: torch.Tensor   # (U,) head weight ω
    boundary: torch.Tensor  # (Tc,) boundary scores b (eq. 5): where slots are cut, nodes bisected
    slots: list           # [(a, b)] the context's slots
    seeds: list           # the multi-hop's seeds, in hop order (the floor's candidates)
    s: Settings
    f: "Formulas"         # the formula each step calls
    G: int = 1            # KV heads per layer: units l·G .. l·G+G−1 share layer l's cache
    # eqs. 6-8 of many nodes: `node_statistics` (node by node) or a batched form handed in
    node_stats: Callable = node_statistics

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
    boundary = slot_bends(model, full, Tc, s, dtype, flow.surprisal)  # (Tc,) b
    slots = f.slotting(boundary, Tc, s)
    G = model.config.n_kv_heads
    ev = evidence_probes(R, slots, G, s, flow.phase[0])              # (L, m)
    # (U, P, D), (U, P, T), (U, P) ×2
    q, lg, c, qpos = probes(model, full, flow, dtype, ev, s.evidence_stride)
    omega = head_weights(model, full, lg, dtype, flow.probes[0].shape[1])   # (U,)
    pos = full.layers[0].pos[0, 0]                                   # (T,) the keys' positions
    kr = torch.cat([M.apply_rope(lc.k[0, :, :Tc].to(dtype), -pos[:Tc], model.inv_freq)
                    for lc in full.layers])                          # (U, Tc, D) k°
    post = torch.cat([lc.k[0, :, :Tc].to(dtype) for lc in full.layers])     # (U, Tc, D) k
    values = torch.cat([lc.v[0, :, :Tc].to(dtype) for lc in full.layers])   # (U, Tc, D) v
    units = Units(kr=kr, v=values, k=post,
                  knorm=kr.norm(dim=-1),
                  lg=(lg[..., :Tc] - c[..., None]).transpose(1, 2).contiguous(),   # (U, Tc, P)
                  q=q, c=c, R=R.contiguous(),                                       # (U, Tc)
                  floor=torch.zeros(len(kr), Tc, dtype=torch.bool, device=q.device),
                  inv_freq=model.inv_freq, s=s, f=f, qpos=qpos, p0=int(pos[0]))
    return Context(T=T, r=r, units=units, sal=s_hat, omega=omega, boundary=boundary,
                   slots=slots, seeds=seeds, s=s, f=f, G=G)


# ===================================================================== budget flow (eqs. 12-13)
# Eq. 12: Δ_add(root) = ω·R(root)·(D_drop − D(root)), cost 1;
#         Δ_split(v) = ω·R(v)·(D(v) − Σ_{u∈child(v)} D(u)), cost |child(v)| − 1.
# Eq. 13: one max-heap on Δ/cost over all units; a node splits only once added.

@dataclass
class Node:
    """A node of a unit's tree (node_stats' fields): span [a, b) minus the floor (and minus what
    a variant's extraction left out), n tokens, R, D, D(drop), and its prototype: key (D,),
    value (D,), position, log m."""
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
    """Best split of each node, by gain per entry (ties: bisection): a bisection at the highest b
    in its central half (2 children, cost 1), or the extraction of f.extract (the paper's: 3
    children, cost 2). Gain: f.split_gain (eq. 12), cost = children − 1. Records each node's
    Split and its children in the plan; returns (units, tokens) (M,) of the M nodes whose best
    split is an extraction."""
    nodes = plan.nodes
    u, a, b = (
        torch.tensor([getattr(nodes[i], k) for i in ids], dtype=torch.long,
                     device=ctx.units.kr.device)
        for k in ("unit", "a", "b")
    )
    if not ids:
        return u, u
    length = b - a
    n = int(length.max())
    idx = a[:, None] + torch.arange(n, device=a.device)                        # (N, n)
    within = idx.clamp(max=ctx.Tc - 1)
    quarter = (length // 4).clamp(min=1)[:, None]
    central = (idx >= a[:, None] + quarter) & (idx <= b[:, None] - quarter)
    # the bisection point
    cut = a + ctx.boundary[within].masked_fill(~central, float("-inf")).argmax(1)
    free = (idx < b[:, None]) & ~ctx.units.floor[u[:, None], within]
    t, ext = ctx.f.extract(ctx, u, a, b, free, within)
    none = torch.full_like(a, -1)
    # K candidate children
    candidates = [(a, cut, none), (cut, b, none)] + ext
    K = len(candidates)
    starts, ends, skips = (torch.cat([x[i] for x in candidates]) for i in range(3))
    stats = ctx.node_stats(ctx.units, u.repeat(K), starts, ends, skips)
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
    gain, cost = (torch.where(use_ext, gain_extract, gain_bisect).tolist(),
                  torch.where(use_ext, cost_extract, cost_bisect).tolist())
    pick = torch.cat((valid[:2] & ~use_ext, valid[2:] & use_ext))         # (K, N) children rows
    # (node, candidate) pairs
    pairs = pick.T.nonzero()
    kids = add_nodes(nodes, stats, pairs[:, 1] * len(ids) + pairs[:, 0])
    start = 0
    for node, node_gain, node_cost, n_kids in zip(ids, gain, cost, pick.sum(0).tolist()):
        plan.split[node] = Split(node_gain, node_cost, kids[start:start + n_kids])
        start += n_kids
    return u[use_ext], t[use_ext]


def rank_by_gain(ctx, plan: Plan) -> dict:
    """Eq. 13 as stated: an add competes by Δ_add / 1 (root -> its rank in the heap)."""
    return dict(plan.add_gain)


def adds(ctx, B_alloc: int) -> tuple:
    """Eq. 12's adds: every slot's root of every unit with its Δ_add = ω·R(root)·(D_drop −
    D(root)), ranked by f.rank_adds (eq. 13 as stated: by the gain itself). Returns the Plan and
    the heap of (−gain/cost, tie, kind, node) it starts from."""
    plan = Plan(B_alloc, floor=ctx.units.floor.clone(), slots=ctx.slots)
    roots = [(j, a, b) for j in range(ctx.units.kr.shape[0]) for a, b in ctx.slots]
    if roots:
        u, a, b = (torch.tensor(x, device=ctx.units.kr.device) for x in zip(*roots))
        stats = ctx.node_stats(ctx.units, u, a, b)
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
    its best split (eq. 12, f.split: `best_splits`) and joins the heap. B_alloc counts entries
    (the cache is ragged: each unit holds exactly its own). The engine's prefetched form
    evaluates the splits ahead in batches (the same actions, tested)."""
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
        ctx.f.split(ctx, plan, [c for c in splittable if c not in plan.split])
        for c in splittable:
            child_split = plan.split[c]
            tie += 1
            heapq.heappush(heap, (-child_split.gain / child_split.cost, tie, "split", c))
    return plan


# ============================================================================= singleton floor

def seed_floor(ctx: Context, per_unit: int) -> int:
    """The budget-aware singleton floor, "chosen from the high-scoring seeds" (the paper): each
    unit keeps exact its own top min(per_unit, |seeds|) of the multi-hop's seeds, ranked by its
    own R^tok (eq. 10; ties to the later token), in ctx.units.floor, before the competition;
    per_unit = ⌊floor_frac·(B − r)⌋ grows with B up to the |seeds| = seeds·(hops + 1)
    candidates [choice: dev, docs/gracekv.md]. Returns its entries (<= U·per_unit)."""
    k = min(max(per_unit, 0), len(ctx.seeds))
    if k == 0:
        return 0
    dev = ctx.units.floor.device
    seeds = torch.tensor(sorted(ctx.seeds), device=dev).flip(0)   # (n,) latest first: ties to it
    R_seeds = ctx.units.R[:, seeds]                                  # (U, n) each unit's own R^tok
    best = R_seeds.sort(dim=-1, descending=True, stable=True).indices[:, :k]   # (U, k)
    ctx.units.floor.scatter_(1, seeds[best], True)
    return ctx.units.floor.shape[0] * k


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
                k, v, pos, bias = (torch.cat((x, y.to(x)))
                                   for x, y in zip((k, v, pos, bias), more))
            order = pos.argsort(stable=True)
            heads.append((k[order], v[order], pos[order], bias[order]))
        layers.append(LayerCache.pack(heads))                                 # (1, 1, Σ_g S_g, ·)
    return Cache(layers, full.next_pos, full.last_logits)


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


# ============================================================================= the method

@dataclass(frozen=True)
class Formulas:
    """The function each step calls: the paper's. A row of engine/gracekv_variants.py replaces
    one (a reading of ours or an ablation); the steps never branch on which."""
    first_hop: Callable = first_hop    # what the observation records of Ā (eq. 9's first hop)
    relevance: Callable = relevance    # R per unit and the seeds (eqs. 9-10)
    multi_hop: Callable = seeded_hops  # d̂ and the seeds (eqs. 9-10)
    slotting: Callable = dp_slots      # slots from the boundary scores (eq. 5)
    key: Callable = key_unrotated      # a node's key k̃ (eq. 6)
    multiplicity: Callable = multiplicity_hbar   # its log m (eq. 7)
    value_beta: Callable = beta_local  # β in its value weights (eq. 7)
    extract: Callable = extract_three  # the salient-token extraction (eq. 12's split)
    split: Callable = best_splits      # a node's best split (eq. 12)
    split_gain: Callable = split_gain  # Δ_split (eq. 12)
    rank_adds: Callable = rank_by_gain  # what an add competes with (eq. 13)
    floor: Callable = seed_floor       # the singleton floor

    def to_json(self) -> dict:        # each step's function by name
        return {k: v.__name__ for k, v in self.__dict__.items()}


@torch.no_grad()
def compress(model, full: Cache, flow: Flow, budget: int, settings: Optional[Settings] = None,
             return_plan: bool = False, formulas: Optional[Formulas] = None, memo=None,
             budget_flow: Optional[Callable] = None, node_stats: Optional[Callable] = None):
    """A new GraceKV cache from a FullKV prefill `full` of one prompt and its Flow (observe).

    At most U·budget real entries; `full` is left untouched (several methods share it).
    The engine's fast forms, handed in (None: the paper's): memo, the budget-independent steps
    (`context`, or a memo shared by several calls on one prompt); budget_flow (`allocate`, the
    paper's loop one action at a time); node_stats (`node_statistics`, node by node)."""
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
        ctx = (memo or context)(model, full, flow, s.window, s, f)            # budget-independent
        # this call's floor and node statistics
        units = replace(ctx.units, floor=ctx.units.floor.clone())
        ctx = replace(ctx, units=units, node_stats=node_stats or node_statistics)
        B_floor = f.floor(ctx, int(s.floor_frac * (budget - s.window)))
        B_alloc = budget_alloc(len(ctx.omega), budget, s.window, B_floor)    # eq. 2
        plan = (budget_flow or allocate)(ctx, B_alloc)
        out = assemble(ctx, full, plan)
    return (out, plan) if return_plan else out


def prefill(model, tokens, budget: int, settings: Optional[Settings] = None) -> Cache:
    """Full prefill of tokens (1, T), then GraceKV compression to `budget` entries per unit."""
    return GraceKV(budget, settings).prefill(model, tokens)


@dataclass
class GraceKV(polykv.Method):
    """GraceKV as a method: observes the probes and the flow, compresses once, then appends (no
    decode-time eviction). `model.generate(m, tok, prompt, GraceKV(128))`.

    The paper's path by default: `prefill` observes its own prompt (`observe`) and compresses
    with `node_statistics` and `allocate`. The engine hands in its fast forms as the fields
    below (engine/gracekv_fast.fast builds the GraceKV the harness runs): `shared`, what the
    shared observation of several methods records for GraceKV (polykv.Needs.extra) and how its
    Flow is read back, needed by `needs`/`compress`; memo, budget_flow, node_stats: see
    `compress`. formulas: the paper's if None (engine/gracekv_variants.py builds the other
    rows)."""
    budget: int
    settings: Optional[Settings] = None
    formulas: Optional[Formulas] = None
    memo: Optional[Callable] = None
    budget_flow: Optional[Callable] = None
    node_stats: Optional[Callable] = None
    # the engine's shared observation (needs(settings, n_layers), flow(obs, settings),
    # observe(model, tokens, settings)); None: the paper's own observation
    shared: Optional[object] = None

    def __post_init__(self):
        if self.budget < 1:
            raise UsageError(f"budget must be >= 1, got {self.budget}")
        self.settings = self.settings or Settings()
        self.formulas = self.formulas or Formulas()

    def needs(self, model) -> polykv.Needs:
        if self.shared is None:                  # nothing from a shared prefill: see compress
            return polykv.Needs()
        return self.shared.needs(self.settings, model.config.n_layers)

    def compress(self, model, full: Cache, obs: polykv.Observation) -> Cache:
        if self.shared is None:
            raise UsageError("the paper's GraceKV observes its own prefill (GraceKV.prefill); "
                             "a shared observation needs the engine's (engine.gracekv_fast.fast)")
        return self.compress_flow(model, full, self.shared.flow(obs, self.settings))

    def compress_flow(self, model, full: Cache, flow: Flow, return_plan: bool = False):
        """`compress` of a FullKV cache and its Flow with this method's pieces."""
        return compress(model, full, flow, self.budget, self.settings, return_plan,
                        self.formulas, self.memo, self.budget_flow, self.node_stats)

    @torch.no_grad()
    def prefill(self, model, tokens) -> Cache:                   # T <= B: FullKV, no observation
        if tokens.shape[1] <= self.budget:
            return M.prefill(model, tokens)
        look = observe if self.shared is None else self.shared.observe
        full, flow = look(model, tokens, self.settings, self.formulas)
        return self.compress_flow(model, full, flow)
