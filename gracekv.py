"""GraceKV: one global budget of cache entries, spent on coverage or on resolution.

Tian, Liu, Wang, "Every Cache Entry Earns Its Place: Global Allocation of Resolution and
Coverage for KV Cache Compression" (2026; seed 004, SPEC.md §5). No code is public; the formulas
come from one secondary write-up, and every guess is marked [choice] and listed below.

After one full-attention prefill of the prompt (T tokens):
 1. Slots: the context (all but the recent window) is cut at bends of the hidden-state
    trajectory into slots of `slot_min`..`slot_max` tokens.
 2. A prototype tree per unit = (layer, KV head) over each slot. A node (a span of n tokens) is
    one cache entry: key k̃ = RoPE(mean_t RoPE⁻¹(k_t, t), round(mean t)), value
    ṽ = Σ(R_t+β)v_t / Σ(R_t+β), multiplicity m = clamp(n·ħ², 1, n) entering attention as the
    logit bias log m. Leaves are the exact tokens. A node splits by bisection or by extracting
    its most salient token as an exact leaf (the node keeps standing for the rest).
 3. Distortion D(v) of a node for the probe queries, in log space; D(drop) = keeping nothing.
 4. Value flow: token relevance R_t (what the probes attend to, spread along attention for a
    few decayed hops) and a head weight ω per unit.
 5. Budget flow: after the exact window and the singleton floor (the highest-ω·R exact tokens),
    one max-heap over "add a slot root" and "split an added node" actions of all units, ranked
    by gain per entry, until B_alloc entries are spent.

Notation (SPEC.md): T prompt tokens, r recent window, Tc = T − r context tokens, H query heads,
G KV heads, g = H/G, D head dim, L layers, U = L·G units, P = g·r probes per unit, n tokens in a
node. Budget: B = average entries per unit; the cache holds at most U·B real entries, and a
prompt with T ≤ B is returned uncompressed (FullKV). One prompt at a time (batch 1).

[choices] (the write-up is silent or ambiguous):
- The question is not marked in the token ids: the last r = `window` tokens are the suffix;
  they are kept exact and their queries (all g heads of the group) are the probes U. If B ≤ r,
  only the last B tokens stay.
- Hidden state for slots: the cache's layer-L/2 un-rotated keys and values, per head
  L2-normalised and concatenated (a linear image [W_K; W_V]·RMSNorm(h) of the hidden state that
  the cache already holds: no extra hook). Surprisal is not used: it needs the LM head over all
  T positions, about the cost of the prefill on this model. Cut: the highest κ in each window
  [a+slot_min, a+slot_max] (allowed by the write-up); a slot starts at its bend token.
- Bisection at the highest κ of the node's central half (depth ≤ log_{4/3} n). Extraction of
  the token t with the most first-hop probe mass ŝ of that unit: children {t} and the node minus
  t (a prototype with a hole; t is left out of every later node of that unit), cost 1, so both
  splits cost one entry. The first version cut [a,t), {t}, (t,b) (cost 2); on the default suite
  it was worse (README, GraceKV ablation) and was dropped. Ties: bisection.
- Split gain ω·(R(v)D(v) − Σ_c R(c)D(c)): children's D weighted by their share of R, so the
  greedy lowers one objective Σ ω·R·D (the literal ω·R(v)·(D(v) − Σ_c D(c)) scores a useful
  split negative whenever the children's relative distortions add up to more than the parent's).
- D_u uses log Z normalised by each probe's full causal row (Z = the mass it gives the node);
  the Z term has no ε (Z > 0 in log space), the M term reads λ_M‖μ − ρṽ‖²/(‖μ‖² + ε) (μ = M/Z,
  ρ = Z̃/Z: scale-free); log ρ ≤ `log_rho_max`; D = Σ_u w_u D_u, w_u ∝ Z_u.
- ŝ_j and d̂_j normalised over the context per unit, then averaged over units; propagation in
  each layer along its group-mean attention, d = Σ_{k=1..hops} decay^(k−1)·x^k, x^k = x^(k−1)·Ā;
  β = 0.1·mean R = 0.1/Tc.
- Floor size ⌊floor_frac·U·(B−r)⌋, chosen over (unit, token) pairs by ω_j·R_t (ties: later
  token); floor tokens are holes in their unit's trees, nodes are tightened around them.
  floor_frac = 0.95, not the 10 % first tried: on the embedded model the prototype trees buy
  less per entry than the exact tokens they displace, and the floor's global ω·R allocation is
  where the method's gain comes from (README, GraceKV ablation: 10 % floor KL 0.279 / 0.058 at
  B = 128 / 512, 95 % 0.240 / 0.050, no trees at all 0.237 / 0.048; on fresh prompts 95 % still
  wins at 512 and on the needle, not on KL at 128).
- The greedy spends the whole B_alloc, negative gains included (an exact leaf is never worse than
  its prototype, and a budget ≥ T ends in all leaves = FullKV); an action costing more than what
  is left is dropped. Heap ties: earlier pushed first. Mean positions round half to even.

Files: the prototype of a node and its distortion (and the per-prompt Context they read) are in
prototypes.py; the rest is here.

Cost: the observation recomputes each layer's attention once, in query chunks, for the hops
(skipped when hops = 0); nodes are evaluated lazily, batched over all units (see `allocate`).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

import model as M
from model import Cache, Hooks, LayerCache, UsageError
from prototypes import Context, node_stats


@dataclass(frozen=True)
class Settings:
    window: int = 32          # r: exact recent tokens = probe queries [choice: SnapKV's w = 32]
    slot_min: int = 16        # slot lengths 16..128 (write-up; target 64)
    slot_max: int = 128
    bend_width: int = 8       # tokens averaged before/after i in κ_i [choice]
    bend_layer: Optional[int] = None  # layer whose cache traces the hidden state; None = L//2 [choice]
    lambda_z: float = 1.0     # λ_Z, λ_M, λ_graph, hops, decay: not public [choice: SPEC.md §5]
    lambda_m: float = 1.0
    lambda_graph: float = 0.3
    hops: int = 2
    decay: float = 0.5
    beta: float = 0.1         # β = 0.1·mean R_t in the value weights (write-up)
    floor_frac: float = 0.95  # singleton floor: share of the non-window budget [choice: measured, see docstring]
    eps: float = 1e-6         # ε in ħ = ‖mean k°‖/(mean ‖k°‖ + ε) and in ‖μ‖² + ε
    log_rho_max: float = 20.0  # cap on log(Z̃/Z): D stays finite for extreme logits [choice]
    chunk: int = 512          # query rows per attention chunk while observing (memory only)
    prefetch: int = 512       # heap entries whose nodes are evaluated together (speed only)

    def __post_init__(self):
        if min(self.window, self.slot_min, self.bend_width, self.chunk, self.prefetch) < 1:
            raise UsageError("window, slot_min, bend_width, chunk and prefetch must be >= 1")
        if self.slot_max < 2 * self.slot_min:
            raise UsageError(f"need slot_max >= 2·slot_min, got {self.slot_min}..{self.slot_max}")
        if not (0 <= self.lambda_graph <= 1 and 0 <= self.floor_frac <= 1 and self.hops >= 0):
            raise UsageError("need 0 <= lambda_graph <= 1, 0 <= floor_frac <= 1, hops >= 0")


# ----------------------------------------------------------------------------- observation

@dataclass
class Stats:
    """What GraceKV keeps from the full prefill, per layer (never a whole (H, T, T) map)."""
    window: int
    probes: list = field(default_factory=list)  # [(H, r, D)] post-RoPE queries of the last r tokens
    flow: list = field(default_factory=list)    # [(hops+1, G, T)] x^0 = s (first hop), x^k = x^{k−1}·Ā


def observer(model, s: Settings):
    """A post-kernel hook and the Stats it fills (to share one prefill with other methods)."""
    cfg = model.config
    st = Stats(s.window, [None] * cfg.n_layers, [None] * cfg.n_layers)

    def post_kernel(layer, q, q_pos, lc, out):
        _, H, T, D = q.shape
        G, r = lc.k.shape[1], min(s.window, T)
        qq, kk = q[0].reshape(G, H // G, T, D), lc.k[0]          # (G, g, T, D), (G, T, D)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        x = q.new_zeros(s.hops + 1, G, T, dtype=acc)
        seed = torch.zeros(T, dtype=acc, device=q.device)
        seed[T - r:] = 1.0                                       # the probe rows u ∈ U
        # Rows in descending chunks: x^k_i = Σ_{j ≥ i} x^{k−1}_j Ā[j, i] is complete for the
        # chunk's rows once the chunk is added, so all hops take one pass over A (causal).
        for c1 in range(T, 0, -s.chunk):
            if s.hops == 0 and c1 <= T - r:
                break                                            # x^0 needs the probe rows only
            c0 = max(0, c1 - s.chunk)
            lg = (qq[:, :, c0:c1].to(acc) @ kk[:, None, :c1].to(acc).transpose(-1, -2)) / math.sqrt(D)
            tri = torch.ones(c1 - c0, c1 - c0, dtype=torch.bool, device=q.device).triu_(1)
            lg[..., c0:].masked_fill_(tri, float("-inf"))         # (G, g, c, c1) causal
            A = torch.softmax(lg, -1).mean(1)                     # (G, c, c1) group mean Ā
            prev = seed[c0:c1].expand(G, -1)                      # (G, c)
            for k in range(s.hops + 1):
                x[k, :, :c1] += (prev[:, None, :] @ A)[:, 0]      # x^k += x^{k−1}[rows] Ā[rows]
                prev = x[k, :, c0:c1]
        st.probes[layer], st.flow[layer] = q[0, :, T - r:].contiguous().clone(), x
    return post_kernel, st


@torch.no_grad()
def observe(model, tokens, settings: Optional[Settings] = None):
    """Full prefill of tokens (1, T) with GraceKV's hook: (FullKV cache, Stats)."""
    hook, st = observer(model, settings or Settings())
    return M.prefill(model, tokens, Hooks(post_kernel=hook)), st


# ----------------------------------------------------------------------------- slots

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


# ----------------------------------------------------------------------------- per-prompt context

def context(model, full: Cache, stats: Stats, r: int, s: Settings) -> Context:
    """Probe logits, value flow R, head weights ω, bends and slots for one prompt (batch 1)."""
    cfg = model.config
    G, H, D, T = cfg.n_kv_heads, cfg.n_heads, cfg.head_dim, full.layers[0].k.shape[2]
    g, Tc, rp = H // G, T - r, stats.probes[0].shape[1]
    acc = torch.float64 if full.layers[0].k.dtype == torch.float64 else torch.float32
    pos = torch.arange(T, device=full.layers[0].k.device)
    pad = lambda x, val=0.0: F.pad(x, (0, 0, 0, 1), value=val)     # the sentinel row Tc
    kr, vs, lgs, qs, cs, omega = [], [], [], [], [], []
    for l, lc in enumerate(full.layers):
        k, v = lc.k[0].to(acc), lc.v[0].to(acc)                      # (G, T, D)
        q = stats.probes[l].to(acc).reshape(G, g * rp, D)            # (G, P, D) probes (h, u) of group g
        lg = (q @ k.transpose(1, 2)) / math.sqrt(D)                  # (G, P, T)
        lg = lg.masked_fill(pos > pos[T - rp:].repeat(g)[:, None], float("-inf"))  # causal rows
        c = lg.logsumexp(-1)                                         # (G, P)
        out = torch.softmax(lg, -1) @ v                              # (G, P, D) head outputs
        # ω = √(a·b): a = ‖W_O slice‖_F, b = mean_u ‖Σ_{h∈group} W_O,h out_{h,u}‖
        Wo = model.layers[l].self_attn.o_proj.weight.detach().to(acc).view(-1, G, g, D)  # (dim, G, g, D)
        a = Wo.pow(2).sum((0, 2, 3)).sqrt()                          # (G,)
        b = torch.einsum("mghd,ghud->gum", Wo, out.view(G, g, rp, D)).norm(dim=-1).mean(1)
        omega.append((a * b).sqrt())
        kr.append(pad(M.apply_rope(k[:, :Tc], -pos[:Tc], model.inv_freq)))   # (G, Tc+1, D) k°
        vs.append(pad(v[:, :Tc]))
        lgs.append(pad((lg[..., :Tc] - c[..., None]).transpose(1, 2), -math.inf))  # (G, Tc+1, P)
        qs.append(q)
        cs.append(c)
    # value flow: ŝ_j, d̂_j normalised over the context; R = (1−λ)·mean_j ŝ_j + λ·mean_j d̂_j
    x = torch.stack(stats.flow).to(acc)[..., :Tc]                   # (L, hops+1, G, Tc)
    unit = lambda y: y.reshape(-1, Tc) / y.reshape(-1, Tc).sum(-1, keepdim=True).clamp(min=1e-300)
    s_hat = unit(x[:, 0])                                           # (U, Tc)
    d_hat = unit(sum(s.decay ** (k - 1) * x[:, k] for k in range(1, s.hops + 1)) if s.hops else x[:, 0])
    R = (1 - s.lambda_graph) * s_hat.mean(0) + s.lambda_graph * d_hat.mean(0)   # (Tc,)
    R = F.pad(R, (0, 1)).expand(len(s_hat), -1).contiguous()        # (U, Tc+1)
    # slots: bends of the layer-L/2 trajectory h_t = [k°_t/‖k°_t‖, v_t/‖v_t‖] over heads
    lb = cfg.n_layers // 2 if s.bend_layer is None else s.bend_layer
    kb = M.apply_rope(full.layers[lb].k[0].to(acc), -pos, model.inv_freq)   # (G, T, D)
    h = torch.cat((F.normalize(kb, dim=-1), F.normalize(full.layers[lb].v[0].to(acc), dim=-1)), -1)
    kappa = bends(h.transpose(0, 1).reshape(T, -1), s.bend_width)[:Tc]      # (Tc,)
    kr = torch.cat(kr)                                              # (U, Tc+1, D)
    hole = torch.zeros(len(kr), Tc, dtype=torch.bool, device=pos.device)
    return Context(T, r, kr, torch.cat(vs), kr.norm(dim=-1), torch.cat(lgs), torch.cat(qs),
                   torch.cat(cs), R, s_hat, torch.cat(omega), kappa, segment(kappa, Tc, s), hole,
                   model.inv_freq, s)


# ----------------------------------------------------------------------------- budget flow

@dataclass
class Plan:
    """The forest as far as it was explored, and the greedy's trace.

    Node i: unit[i], span [a[i], b[i]) minus the unit's holes when it was made (floor tokens,
    tokens extracted from its ancestors), n[i] tokens, R[i], D[i]; roots have
    add_gain; evaluated nodes have split (gain, cost, children). steps: (kind, node, gain, cost)."""
    B_alloc: int
    nodes: dict = field(default_factory=lambda: {k: [] for k in
                        ("unit", "a", "b", "n", "R", "D", "Ddrop", "key", "val", "pos", "logm")})
    add_gain: dict = field(default_factory=dict)
    split: dict = field(default_factory=dict)     # node -> (gain, cost, [children])
    steps: list = field(default_factory=list)
    frontier: set = field(default_factory=set)    # nodes in the cache at the end
    floor: Optional[torch.Tensor] = None          # (U, Tc) the singleton floor's exact tokens
    slots: list = field(default_factory=list)     # [(a, b)] the context's slots

    def new(self, st: dict, rows) -> list:
        first = len(self.nodes["unit"])
        for k, lst in self.nodes.items():
            lst.extend(st[k][rows].tolist() if st[k].dim() == 1 else st[k][rows].unbind(0))
        return list(range(first, len(self.nodes["unit"])))


def evaluate(cx: Context, plan: Plan, ids: list):
    """Best split of each node: bisection at the highest κ in its central half, or extraction of
    its most salient token t as an exact leaf, the node minus t standing for the rest (t becomes
    a hole of the unit, so every later node of that unit, all inside this one, leaves it out).
    Both cost one entry; the larger gain wins (ties: bisection)."""
    nd = plan.nodes
    u, a, b = (torch.tensor([nd[k][i] for i in ids], device=cx.kr.device) for k in ("unit", "a", "b"))
    L = b - a
    n = int(L.max())
    idx = a[:, None] + torch.arange(n, device=a.device)                        # (N, n)
    idc = idx.clamp(max=cx.Tc - 1)
    q = (L // 4).clamp(min=1)[:, None]
    central = (idx >= a[:, None] + q) & (idx <= b[:, None] - q)
    c = a + cx.kappa[idc].masked_fill(~central, float("-inf")).argmax(1)       # bisection point
    ok = (idx < b[:, None]) & ~cx.hole[u[:, None], idc]
    t = a + cx.sal[u[:, None], idc].masked_fill(~ok, float("-inf")).argmax(1)  # most salient token
    none = torch.full_like(a, -1)
    # candidate children (4, N): [a,c), [c,b) | [a,b) ∖ {t}, {t}
    st = node_stats(cx, u.repeat(4), torch.cat((a, c, a, t)), torch.cat((c, b, b, t + 1)),
                    torch.cat((none, none, t, none)))
    RD = (st["R"] * st["D"]).view(4, -1)                                      # (4, N)
    valid = (st["n"] > 0).view(4, -1)
    RDv = torch.tensor([nd["R"][i] * nd["D"][i] for i in ids], device=a.device, dtype=RD.dtype)
    om = cx.omega[u]
    # Δ_split = ω·(R(v)D(v) − Σ_c R(c)D(c)), cost |children| − 1 = 1 (the leaf has D = 0)
    g_bis, g_ext = om * (RDv - RD[:2].sum(0)), om * (RDv - RD[2])
    use_ext = g_ext > g_bis                                                   # ties: bisection
    cx.hole[u[use_ext], t[use_ext]] = True
    gain = torch.where(use_ext, g_ext, g_bis).tolist()
    pick = torch.cat((valid[:2] & ~use_ext, valid[2:] & use_ext))             # (4, N) children rows
    ik = pick.T.nonzero()                                                     # (node, candidate) pairs
    kids = plan.new(st, ik[:, 1] * len(ids) + ik[:, 0])
    start = 0
    for node, gv, nk in zip(ids, gain, pick.sum(0).tolist()):
        plan.split[node] = (gv, nk - 1, kids[start:start + nk])
        start += nk


def allocate(cx: Context, B_alloc: int) -> Plan:
    """Budget flow: a global max-heap over add(root) and split(added node) by gain per entry.

    Δ_add(root) = ω·R·(D_drop − D(root)), cost 1. Nodes are evaluated lazily, in batches: before
    an action is applied, the nodes it brings into the cache (and those of the next `prefetch`
    best actions) get their best split, so every available action is known when it competes.
    Extractions mark holes in cx.hole: one Context serves one allocate call."""
    plan = Plan(B_alloc, floor=cx.hole.clone(), slots=cx.slots)   # floor = holes before the greedy
    roots = [(j, a, b) for j in range(cx.kr.shape[0]) for a, b in cx.slots]
    if roots:
        u, a, b = (torch.tensor(x, device=cx.kr.device) for x in zip(*roots))
        st = node_stats(cx, u, a, b)
        keep = (st["n"] > 0).nonzero()[:, 0]
        gain = (cx.omega[st["unit"]] * st["R"] * (st["Ddrop"] - st["D"]))[keep].tolist()
        plan.add_gain = dict(zip(plan.new(st, keep), gain))
    heap = [(-g, i, "add", i) for i, g in plan.add_gain.items()]   # (−gain/cost, tie, kind, node)
    heapq.heapify(heap)
    n, spent, tie = plan.nodes["n"], 0, len(heap)

    def entering(kind, v):      # unevaluated splittable nodes an action brings into the cache
        new = [v] if kind == "add" else plan.split[v][2]
        return [c for c in new if n[c] > 1 and c not in plan.split]

    while heap and spent < B_alloc:
        if entering(*heap[0][2:]):
            # evaluate what the next `prefetch` actions bring in, then, for nodes whose own split
            # ranks above the prefetch-th action, their children too (they will be needed first)
            top = heapq.nsmallest(cx.s.prefetch, heap)
            tau, done = -top[-1][0], 0
            todo = {c for e in top for c in entering(*e[2:])}
            while todo and done < 4 * cx.s.prefetch:                    # bounded look-ahead
                evaluate(cx, plan, sorted(todo))
                done += len(todo)
                todo = {c for v in todo if plan.split[v][0] / plan.split[v][1] >= tau
                        for c in entering("split", v)}
        _, _, kind, v = heapq.heappop(heap)
        gain, cost, kids = (plan.add_gain[v], 1, [v]) if kind == "add" else plan.split[v]
        if spent + cost > B_alloc:
            continue                                                          # never affordable again
        spent += cost
        plan.steps.append((kind, v, gain, cost))
        if kind == "split":
            plan.frontier.remove(v)
        plan.frontier.update(kids)
        for c in kids:
            if n[c] > 1:
                sg, sc, _ = plan.split[c]
                tie += 1
                heapq.heappush(heap, (-sg / sc, tie, "split", c))
    return plan


# ----------------------------------------------------------------------------- cache

def assemble(cx: Context, full: Cache, plan: Plan) -> Cache:
    """Per unit: floor tokens, window and frontier leaves exact (bias 0), prototypes with bias
    log m; sorted by position; a layer's heads padded to one size (bias −inf, pos −1)."""
    nd, G, Tc = plan.nodes, full.layers[0].k.shape[1], cx.Tc
    mine = [[] for _ in range(cx.kr.shape[0])]
    for i in sorted(plan.frontier):
        mine[nd["unit"][i]].append(i)
    dev, layers = cx.kr.device, []
    for l, lc in enumerate(full.layers):
        heads = []
        for g in range(G):
            j = l * G + g
            protos = [i for i in mine[j] if nd["n"][i] > 1]
            leaves = [nd["a"][i] for i in mine[j] if nd["n"][i] == 1]
            ex = sorted(plan.floor[j].nonzero()[:, 0].tolist() + leaves) + list(range(Tc, cx.T))
            ex = torch.tensor(ex, dtype=torch.long, device=dev)              # exact entries
            k, v, pos, bias = lc.k[0, g, ex], lc.v[0, g, ex], ex, lc.bias[0, g, ex]
            if protos:
                k = torch.cat((k, torch.stack([nd["key"][i] for i in protos]).to(k.dtype)))
                v = torch.cat((v, torch.stack([nd["val"][i] for i in protos]).to(v.dtype)))
                pos = torch.cat((pos, torch.tensor([nd["pos"][i] for i in protos], device=dev)))
                logm = torch.tensor([nd["logm"][i] for i in protos], device=dev, dtype=bias.dtype)
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
    """One unit's cache as text, a line per slot and a character per context token:
    'F' floor token, 'x' exact leaf of the tree, a letter per prototype (the tokens it stands
    for), '.' dropped. The recent
    window (exact) is not drawn."""
    nd, row = plan.nodes, ["."] * Tc
    mine = sorted((nd["a"][i], i) for i in plan.frontier if nd["unit"][i] == unit)
    leaves = {nd["a"][i] for _, i in mine if nd["n"][i] == 1}
    letters = "abcdefghijklmnopqrstuvwyzABCDEGHIJKLMNOPQRSTUVWXYZ"          # all but x and F
    for k, (_, i) in enumerate([e for e in mine if nd["n"][e[1]] > 1]):
        for t in range(nd["a"][i], nd["b"][i]):
            if not plan.floor[unit, t] and t not in leaves:
                row[t] = letters[k % len(letters)]
    for t in leaves:
        row[t] = "x"
    for t in plan.floor[unit].nonzero()[:, 0].tolist():
        row[t] = "F"
    return [f"{a:5d}-{b - 1:<5d} |" + "".join(row[a:b]) + "|" for a, b in plan.slots]


# ----------------------------------------------------------------------------- API

@torch.no_grad()
def compress(model, full: Cache, stats: Stats, budget: int, settings: Optional[Settings] = None,
             return_plan: bool = False):
    """A new GraceKV cache from a FullKV prefill `full` of one prompt and its Stats (observe).

    At most U·budget real entries; `full` is left untouched (several methods share it)."""
    s = settings or Settings()
    T, B = full.layers[0].k.shape[2], full.layers[0].k.shape[0]
    if budget < 1:
        raise UsageError(f"budget must be >= 1, got {budget}")
    if B != 1:
        raise UsageError(f"gracekv compresses one prompt at a time, got a batch of {B}")
    if stats.window != s.window:
        raise UsageError(f"stats observed with window {stats.window}, settings say {s.window}")
    dev, G = full.layers[0].k.device, full.layers[0].k.shape[1]
    plan = None
    if T <= budget:                                                           # identity: FullKV
        out = Cache(list(full.layers), full.next_pos, full.last_logits)
    elif budget <= s.window:                                                  # only the window fits
        idx = torch.arange(T - budget, T, device=dev).expand(1, G, budget)    # (1, G, B)
        out = Cache([lc.gather(idx) for lc in full.layers], full.next_pos, full.last_logits)
    else:
        cx = context(model, full, stats, s.window, s)
        U, Tc = cx.kr.shape[0], cx.Tc
        spare = U * (budget - s.window)                                       # B_total − U·r
        n_floor = int(s.floor_frac * spare)
        # singleton floor: the n_floor highest ω_j·R_t (unit, token) pairs, ties to the later token
        score = (cx.omega[:, None] * cx.R[:, :Tc]).flip(-1).reshape(-1)         # (U·Tc,)
        top = score.sort(descending=True, stable=True).indices[:n_floor]
        cx.hole[top // Tc, Tc - 1 - top % Tc] = True
        plan = allocate(cx, spare - n_floor)
        out = assemble(cx, full, plan)
    return (out, plan) if return_plan else out


@torch.no_grad()
def prefill(model, tokens, budget: int, settings: Optional[Settings] = None) -> Cache:
    """Full prefill of tokens (1, T), then GraceKV compression to `budget` entries per unit."""
    if budget < 1:
        raise UsageError(f"budget must be >= 1, got {budget}")
    if tokens.shape[1] <= budget:
        return M.prefill(model, tokens)
    full, stats = observe(model, tokens, settings)
    return compress(model, full, stats, budget, settings)


@dataclass
class GraceKV:
    """`model.generate(m, tok, prompt, GraceKV(128))`: compress once, then append (no decode hooks)."""
    budget: int
    settings: Optional[Settings] = None

    def prefill(self, model, tokens) -> Cache:
        return prefill(model, tokens, self.budget, self.settings)
