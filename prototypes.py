"""GraceKV's prototypes: what one cache entry standing for a span of tokens is, and how far it
is from the tokens it replaces (SPEC.md §5; gracekv.py's docstring lists the formulas and every
[choice]).

A node = a span [a, b) of one unit (layer, KV head) minus the unit's holes. Its prototype:
key k̃ = RoPE(mean_t RoPE⁻¹(k_t, t), round(mean t)) (the write-up), or with
Settings.prototype_key = "post" the mean of the post-RoPE keys k̃ = mean_t k_t, whose logit
q·k̃ = mean_t q·k_t is exact for every query (SPEC §5); value ṽ = Σ(R_t+β)v_t / Σ(R_t+β),
multiplicity m = clamp(n·ħ², 1, n) (the write-up), m = n (Settings.multiplicity = "n": with the
post-RoPE key m·e^{q·k̃} is Jensen's lower bound of Z), or log m fitted on the probes ("fit": the
mass-weighted mean of log Z − q·k̃, clamped to [0, log n + c]); it enters attention as the logit
bias log m. Its distortion D for the probe queries,
in log space, and D(drop) for keeping nothing. `Units` holds every per-prompt tensor these
read, stacked over units; gracekv.context builds them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

import model as M


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
    s: object             # gracekv.Settings (β, ε, λ_Z, λ_M, log ρ cap, prototype key)
    k: Optional[torch.Tensor] = None   # (U, Tc+1, D) post-RoPE keys, for prototype_key = "post"

    @property
    def Tc(self) -> int:
        return self.kr.shape[1] - 1


def distortion(logZ, mu2, muv, logZp, v2, s):
    """D and D(drop) of nodes (N,) from the exact log Z_u, ‖μ_u‖², ⟨μ_u, ṽ⟩ (N, P), μ = M/Z,
    and the prototype's log Z̃_u (N, P) and ‖ṽ‖² (N,); s: gracekv.Settings (λ_Z, λ_M, ε, log ρ cap).

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
    if cx.k is None or s.multiplicity == "hbar":
        kbar = rows(cx.kr).sum(1) / nf[:, None]                               # mean k°  (N, D)
    p = ((idx * mask).sum(1) / nf).round()                                    # rounded mean position
    if cx.k is None:
        key = M.apply_rope(kbar, p, cx.inv_freq)                              # k̃ = RoPE(mean k°, p̃)
    else:                                             # k̃ = mean_t k_t: q·k̃ = mean_t q·k_t, any q
        key = rows(cx.k).sum(1) / nf[:, None]
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
    if s.multiplicity == "hbar":
        hbar = kbar.norm(dim=-1) / (rows(cx.knorm).sum(1) / nf + s.eps)       # ħ = ‖mean k°‖/mean‖k°‖
        logm = (nf * hbar ** 2).clamp(min=1).minimum(nf).log()               # m = clamp(n ħ², 1, n)
    elif s.multiplicity == "n":
        logm = nf.log()                                                      # m = n
    else:                             # fitted: mass-weighted mean over probes of log Z − q·k̃/√D
        fit = (torch.softmax(logZ, -1) * (logZ - qk)).sum(-1)
        logm = torch.minimum(fit.clamp(min=0), nf.log() + s.fit_slack)
    logZp = logm[:, None] + qk                                      # log Z̃ = log m + q·k̃/√D − c
    D, Dd = distortion(logZ, mu2, muv, logZp, val.pow(2).sum(-1), s)
    zero = torch.zeros((), dtype=D.dtype, device=D.device)
    return dict(unit=u, a=a + first, b=a + last + 1, n=cnt, R=Rt.sum(1),
                D=torch.where(cnt <= 1, zero, D),                            # a leaf is its token
                Ddrop=torch.where(cnt == 0, zero, Dd), key=key, val=val, pos=p.long(), logm=logm)
