"""GraceKV's fast forms: the engine's, each replacing one naive form of gracekv.py, handed in
as a field of gracekv.GraceKV (never imported by it) and tested equal to the form it replaces
(tests/test_gracekv_fast.py: the same kept sets and decoded logits, fp64 and the embedded
model, under every protocol):

- `ValueFlow`: GraceKV's statistic of the shared observation (polykv.Needs.extra: lowest,
  begin, add, end, cut, merge), streamed through the query chunks of one prefill shared with
  other methods and prefixes, where gracekv.observe reads each layer's whole attention;
  `Shared`, what a GraceKV row asks of that observation and how its Flow is read back.
- `NodeStats`: eqs. 6-8 of many nodes at once (gathers of similar lengths, log-space sums, the
  probes' products per unit), for gracekv.node_statistics' node by node; each per-node formula
  has its batched twin (`FAST`, which also names the streamed statistic of a first hop).
- `allocate_prefetched`: the budget flow with the best splits evaluated ahead in batches, for
  gracekv.allocate's one action at a time (the same actions).
- `context_memo`: the per-prompt steps (gracekv.context) remembered while several rows and
  budgets compress one prompt.
- `fast(budget, ...)`: the GraceKV the harness runs, every piece above handed in.
"""
from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Optional

import torch

import gracekv as GK
import model as M
import polykv
from engine.observe import observe as shared_observe
from support.errors import UsageError


# ================================================================ the shared observation's flow

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
        """The value over keys a..b−1 alone (engine/protocols.cut): the probes (the last r
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

    @classmethod
    def of(cls, s: GK.Settings, sampled: tuple, stride: int) -> "ValueFlow":
        """The statistic a row with settings s observes (a subclass may read more of s)."""
        return cls(s.window, sampled, stride)


def needs(s: GK.Settings, n_layers: int, statistic=ValueFlow) -> polykv.Needs:
    """What GraceKV observes during the shared prefill: probes, first hop, the sampled layers'
    queries (statistic: the class that records them, ValueFlow; a variant may extend it)."""
    sampled = tuple(GK.depths(s.hop_depths, n_layers))
    stride = s.evidence_stride if s.evidence else 0
    flow = statistic.of(s, sampled, stride)
    return polykv.Needs(extra=(("flow", flow),), surprisal=s.lambda_s != 0)


def flow_of(obs: polykv.Observation, window: int) -> GK.Flow:   # the Flow of an observation
    # per layer: probes .. lse
    return GK.Flow(window, *map(list, zip(*obs.extra["flow"])), obs.surprisal)


def cut_flow(flow: GK.Flow, a: int, b: int, stride: int) -> GK.Flow:
    """A Flow over keys a..b−1 alone (engine/protocols.cut's, for a Flow of gracekv.observe):
    ValueFlow.cut of each layer, the surprisal sliced."""
    statistic = ValueFlow(flow.window, (), stride)
    layers = zip(flow.probes, flow.flow, flow.queries, flow.strided, flow.phase, flow.lse)
    cut = [statistic.cut(value, a, b) for value in layers]
    surprisal = None if flow.surprisal is None else flow.surprisal[:, a:b]
    return GK.Flow(flow.window, *map(list, zip(*cut)), surprisal)


@dataclass(frozen=True)
class Shared:
    """GraceKV in the shared observation (gracekv.GraceKV.shared): what it records there
    (`statistic`, ValueFlow or a variant's) and how its Flow is read back."""
    statistic: type = ValueFlow

    def needs(self, s: GK.Settings, n_layers: int) -> polykv.Needs:
        return needs(s, n_layers, self.statistic)

    def flow(self, obs: polykv.Observation, s: GK.Settings) -> GK.Flow:
        return flow_of(obs, s.window)

    @torch.no_grad()
    def observe(self, model, tokens, s: Optional[GK.Settings] = None, f=None,
                chunk: int = 256) -> tuple:
        """The shared observation of tokens (1, T) for this row alone (chunk: query rows per
        pass): (FullKV cache, Flow), as gracekv.observe."""
        s = s or GK.Settings()
        wanted = replace(self.needs(s, model.config.n_layers), chunk=chunk)
        full, obs = shared_observe(model, tokens, wanted)
        return full, self.flow(obs, s)


# ============================================================== node statistics in batches

def by_length(fn, xs: tuple, length, cap: int) -> dict:
    """fn(*chunk, n) over chunks of the rows of xs (each (N, ...)), sorted by `length` (N,): a
    chunk holds 64 rows, then only rows up to twice its shortest (little padding), and at most
    `cap` (row, token) pairs; n = the chunk's longest length. Results concatenated back in the
    rows' order."""
    order = length.argsort(stable=True)                                     # short spans together
    lens, parts, i = length[order].clamp(min=1).tolist(), [], 0
    while i < len(lens):
        j = i + 1
        while (
            j < len(lens) and (j + 1 - i) * lens[j] <= cap
            and (j - i < 64 or lens[j] < 2 * lens[i])
        ):
            j += 1
        parts.append(fn(*(x[order[i:j]] for x in xs), lens[j - 1]))
        i = j
    inv = order.argsort()
    return {k: torch.cat([p[k] for p in parts])[inv] for k in parts[0]}


def batched_logits(q, u, key):
    """q_u·k/√D (N, P) of keys key (N, D) of units u (N,) against their unit's queries
    q (U, P, D): the nodes sorted by unit, one (n_u, D) × (D, P) product per unit present
    (gathering each node's (P, D) queries costs ten times more)."""
    order = u.argsort(stable=True)
    units, counts = torch.unique_consecutive(u[order], return_counts=True)
    ks, out, i = key[order], key.new_empty(len(u), q.shape[1]), 0
    for j, n in zip(units.tolist(), counts.tolist()):
        out[order[i:i + n]] = ks[i:i + n] @ q[j].T
        i += n
    return out / math.sqrt(key.shape[-1])


class Span:
    """What a node's formulas read, for a batch of N nodes of at most n tokens: rows(x) gathers
    a (U, Tc, ·) tensor as (N, n, ·), zeros outside each node (−inf for log-masses); nf (N,)
    token counts, p (N,) rounded mean positions, mask (N, n) the node's tokens (1.0), Rt (N, n)
    their relevance; once the key is made, qk (N, P) = q_u·k̃/√D − c_u and
    logZ (N, P) = log Σ_{t∈v} A[u, t]."""

    def __init__(self, units, rows, nf, p, mask, Rt):
        self.units, self.rows, self.nf, self.p, self.mask, self.Rt = units, rows, nf, p, mask, Rt
        self.qk = self.logZ = None

    @cached_property
    def kbar(self) -> torch.Tensor:
        return self.rows(self.units.kr).sum(1) / self.nf[:, None]            # mean k°  (N, D)


def key_unrotated(span: Span) -> torch.Tensor:
    """gracekv.key_unrotated (eq. 6) of N nodes: k̃ = RoPE(mean_t RoPE⁻¹(k_t, t), p_v)."""
    return M.apply_rope(span.kbar, span.p, span.units.inv_freq)


def multiplicity_hbar(span: Span) -> torch.Tensor:
    """gracekv.multiplicity_hbar (eq. 7) of N nodes: ħ = ‖mean k°‖ / (mean ‖k°‖ + ε),
    m = clamp(n·ħ², 1, n); returns log m (N,)."""
    nf = span.nf
    mean_norm = span.rows(span.units.knorm).sum(1) / nf                       # mean ‖k°‖
    hbar = span.kbar.norm(dim=-1) / (mean_norm + span.units.s.eps)
    return (nf * hbar ** 2).clamp(min=1).minimum(nf).log()


def beta_local(span: Span, beta: float) -> torch.Tensor:
    """gracekv.beta_local (eq. 7) of N nodes: each node its own β_v = beta·mean_{t∈v} R_t."""
    return beta * (span.Rt * span.mask).sum(1) / span.nf


# each naive formula of gracekv.Formulas the fast forms replace -> its fast form here: the
# shared observation's statistic of a first hop, the batched twin of a node's formula
# (engine/gracekv_variants.FAST adds the variants')
FAST = {GK.first_hop: ValueFlow, GK.key_unrotated: key_unrotated,
        GK.multiplicity_hbar: multiplicity_hbar, GK.beta_local: beta_local}


def distortion(logZ, Z2, mu2, muv, logZp, v2, s):
    """gracekv.distortion (eq. 8) of N nodes (N,) for their probes u (N, P), each probe in its
    own max-subtracted scale (its largest term over the node's tokens is e^0 = 1, so Z_u >= 1):
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


@dataclass(frozen=True)
class NodeStats:
    """gracekv.node_statistics of many nodes at once (gracekv.GraceKV.node_stats): the same
    fields, nodes of similar lengths gathered together (`by_length`); twins: the batched form
    of each per-node formula (FAST, or engine/gracekv_variants.FAST)."""
    twins: dict = field(default_factory=FAST.copy)

    def __call__(self, units: GK.Units, u, a, b, skip=None) -> dict:
        skip = torch.full_like(a, -1) if skip is None else skip
        return by_length(functools.partial(self.batch, units), (u, a, b, skip), b - a,
                         cap=max(1, (1 << 21) // units.lg.shape[2]))

    def twin(self, formula):
        """The batched form of a per-node formula."""
        if formula not in self.twins:
            raise UsageError(f"no fast form of {formula.__name__} (engine/gracekv_fast.FAST, "
                             "engine/gracekv_variants.FAST)")
        return self.twins[formula]

    def batch(self, units: GK.Units, u, a, b, skip, n):
        """The statistics of nodes of at most n tokens, gathered as (N, n, ·)."""
        s, f, Tc = units.s, units.f, units.Tc
        idx = a[:, None] + torch.arange(n, device=a.device)                    # (N, n)
        within = idx.clamp(max=Tc - 1)
        mask = (idx < b[:, None]) & (idx != skip[:, None])
        mask &= ~units.floor[u[:, None], within]
        count = mask.sum(1)                                                   # (N,) tokens n
        first = mask.to(torch.int8).argmax(1)
        last = n - 1 - mask.flip(1).to(torch.int8).argmax(1)
        nf = count.clamp(min=1).to(units.kr.dtype)
        flat = (u[:, None] * Tc + within).view(-1)                            # rows of (U·Tc, ·)

        def rows(x, outside=0.0):
            """(U, Tc, ·) -> (N, n, ·), `outside` where a row is not the node's token."""
            got = x.flatten(0, 1).index_select(0, flat).view(len(u), n, *x.shape[2:])
            return got.masked_fill(~mask.view(*mask.shape, *(1,) * (x.dim() - 2)), outside)
        V = rows(units.v)                                                  # (N, n, D), 0 outside
        # rounded mean position
        p = ((idx * mask).sum(1) / nf).round() + units.p0
        Rt = rows(units.R)                                                    # (N, n), 0 outside
        span = Span(units, rows, nf, p, mask.to(Rt.dtype), Rt)
        key = self.twin(f.key)(span)                                          # k̃ (N, D), eq. 6
        beta = self.twin(f.value_beta)(span, s.beta)
        w = Rt + beta[:, None] * span.mask                                    # R_t + β_v (N, n)
        val = (w[..., None] * V).sum(1) / w.sum(1).clamp(min=1e-300)[:, None]   # ṽ
        lg = rows(units.lg, float("-inf"))                                    # (N, n, P)
        # (N, P) log-space shift: the largest logit of each probe over the node's tokens
        lg_max = lg.amax(1).clamp(min=torch.finfo(lg.dtype).min)
        # e = exp(lg − lg_max) ≤ 1, the largest term 1; exponents below −80 clamped:
        # e ≥ 1.8e−35 in place of a denormal or 0 (the CPU's exp: up to 30× slower), which next
        # to 1 vanishes from every sum
        e = (lg - lg_max[:, None]).clamp_(min=-80.0).exp_()
        Z = e.sum(1)                                                          # (N, P)
        # unseen: weight 0
        unseen = (a + last)[:, None] > units.qpos.index_select(0, u)
        logZ = (Z.log() + lg_max).masked_fill(unseen, -1e30)
        # a = e/Z: Z² may underflow
        e /= Z[:, None]
        n_probes, head_dim = e.shape[2], V.shape[2]
        # short spans: ‖μ‖² = aᵀ(VVᵀ)a, n²·(D+P) per node
        if n * (head_dim + n_probes) <= n_probes * head_dim:
            mu2 = (e * (V @ V.transpose(1, 2) @ e)).sum(1)                     # (N, P)
        else:                            # long spans: μ = aᵀV directly, n·P·D per node
            mu2 = (e.transpose(1, 2) @ V).pow(2).sum(-1)                      # (N, P)
        muv = (e * (V @ val[..., None])).sum(1)                               # (N, P) ⟨μ, ṽ⟩
        # (N, P) q_u·k̃/√D − c
        qk = batched_logits(units.q, u, key) - units.c.index_select(0, u)
        span.qk, span.logZ = qk, logZ
        logm = self.twin(f.multiplicity)(span)                                # log m (N,), eq. 7
        logZp = logm[:, None] + qk                            # log Z̃ = log m + q·k̃/√D − c
        D, Ddrop = distortion(logZ, Z.pow(2), mu2, muv, logZp, val.pow(2).sum(-1), s)
        zero = torch.zeros((), dtype=D.dtype, device=D.device)
        return dict(unit=u, a=a + first, b=a + last + 1, n=count, R=Rt.sum(1),
                    D=torch.where(count <= 1, zero, D),                      # a leaf is its token
                    Ddrop=torch.where(count == 0, zero, Ddrop), key=key, val=val, pos=p.long(),
                    logm=logm)


# ============================================================== the budget flow, prefetched

def peek(heap: list, k: int) -> list:
    """The k best entries of a heap, best first, left in it: k pops and k pushes, O(k log n)
    (heapq.nsmallest reads the whole heap). Entries are unique, so the pops that follow come
    in the same order as before the peek."""
    top = [heapq.heappop(heap) for _ in range(min(k, len(heap)))]
    for e in top:
        heapq.heappush(heap, e)
    return top


def prefetched_flow(plan, heap: list, B_alloc: int, evaluate, prefetch: int):
    """gracekv.allocate's loop on `plan` from the heap of adds, with the best splits of the
    nodes an action brings in evaluated before it is applied, in batches: those of the next
    `prefetch` affordable actions, directly or down splits already evaluated that rank above
    the prefetch-th (an extraction chain: one round, not one per link), then the children of
    those whose split ranks above it too. evaluate(ids): the best splits of nodes ids
    (the row's gracekv.best_splits). The same actions as the one-at-a-time loop (tested)."""
    nodes, tie, left = plan.nodes, len(heap), B_alloc

    def entering(kind, v):      # unevaluated splittable nodes an action brings into the cache
        new = [v] if kind == "add" else plan.split[v].children
        return [c for c in new if nodes[c].n > 1 and c not in plan.split]

    def fits(kind, v):          # the action's cost fits in what is left now
        return (1 if kind == "add" else plan.split[v].cost) <= left

    def below(kind, v, tau):    # what the action brings in and, down splits already evaluated
        out = entering(kind, v)          # that rank >= tau (applied soon after), what they bring
        first = [v] if kind == "add" else plan.split[v].children
        walk = [c for c in first if nodes[c].n > 1 and c in plan.split]
        while walk:
            c = walk.pop()
            gain, cost, kids = plan.split[c]
            if gain / cost >= tau:
                out += entering("split", c)
                walk += [k for k in kids if nodes[k].n > 1 and k in plan.split]
        return out

    while heap and left > 0:
        kind, v = heap[0][2:]
        if not fits(kind, v):
            heapq.heappop(heap)
            plan.dropped.append((len(plan.steps), kind, v))
            continue
        if entering(kind, v):
            top = peek(heap, prefetch)
            tau, done = -top[-1][0], 0
            todo = {c for e in top if fits(*e[2:]) for c in below(*e[2:], tau)}
            while todo and done < 4 * prefetch:                          # bounded look-ahead
                evaluate(sorted(todo))
                done += len(todo)
                todo = {c for v in todo
                        if plan.split[v].gain / plan.split[v].cost >= tau and fits("split", v)
                        for c in entering("split", v)}
        _, _, kind, v = heapq.heappop(heap)
        gain, cost, kids = (plan.add_gain[v], 1, [v]) if kind == "add" else plan.split[v]
        left -= cost
        plan.steps.append((kind, v, gain, cost))
        if kind == "split":
            plan.frontier.remove(v)
        plan.frontier.update(kids)
        for c in kids:
            if nodes[c].n > 1:
                child_split = plan.split[c]
                tie += 1
                heapq.heappush(heap, (-child_split.gain / child_split.cost, tie, "split", c))
    return plan


def allocate_prefetched(ctx: GK.Context, B_alloc: int) -> GK.Plan:
    """gracekv.allocate (the same actions) with the best splits evaluated ahead in batches of
    about Settings.prefetch heap entries (`prefetched_flow`)."""
    plan, heap = GK.adds(ctx, B_alloc)
    return prefetched_flow(plan, heap, B_alloc, functools.partial(ctx.f.split, ctx, plan),
                           ctx.s.prefetch)


# ============================================================== the per-prompt memo

class Last:
    """fn's result for the last arguments, kept while the next call has the same key (speed
    only: gracekv.compress at several budgets of one prompt runs the budget-independent steps
    once). key(*args) must name its arguments by identity; the memo pins what it keys on, so
    an id is not reused while it is held; a new key drops the old value before computing."""

    def __init__(self, fn, key):
        self.fn, self.key, self.held = fn, key, None

    def __call__(self, *args):
        k = self.key(*args)
        if self.held is None or self.held[0] != k:
            self.held = None                                  # free the old value first
            self.held = (k, self.fn(*args), args)
        return self.held[1]

    def clear(self):
        self.held = None


def context_key(model, full, flow: GK.Flow, r: int, s: GK.Settings, f: GK.Formulas) -> tuple:
    """What a Context depends on, by identity."""
    return id(model), id(full), id(flow.probes[0]), r, s, f


def context_memo() -> Last:
    """gracekv.context remembered for its last arguments (gracekv.GraceKV.memo; speed only):
    the GraceKV rows and budgets of one prompt share its budget-independent steps; clear it
    when the prompt is done."""
    return Last(GK.context, context_key)


# ============================================================== the GraceKV the harness runs

def fast(budget: int, settings: Optional[GK.Settings] = None,
         formulas: Optional[GK.Formulas] = None, memo: Optional[Last] = None,
         forms: Optional[dict] = None) -> GK.GraceKV:
    """gracekv.GraceKV with the engine's fast forms handed in: the shared observation's
    statistic of the row's first hop, the batched node statistics, the prefetched budget flow
    and the per-prompt memo (memo: a context_memo shared by the rows of one prompt; None:
    gracekv.context each call). forms: each naive formula's fast form (FAST, or
    engine/gracekv_variants.FAST for the variants' rows)."""
    forms = dict(forms or FAST)
    f = formulas or GK.Formulas()
    if f.first_hop not in forms:
        raise UsageError(f"no fast form of {f.first_hop.__name__} (engine/gracekv_fast.FAST)")
    return GK.GraceKV(budget, settings, f, memo, budget_flow=allocate_prefetched,
                      node_stats=NodeStats(forms), shared=Shared(forms[f.first_hop]))
