"""GraceKV's budget flow (step 5 of gracekv.py): one global greedy over all units that spends
the entries left after the exact window and the singleton floor on coverage ("add a slot root")
or resolution ("split an added node"), ranked by gain per entry; then the cache it chose.

Tian, Liu, Wang, "Every Cache Entry Earns Its Place" (2026; seed 004, SPEC.md §5):
  Δ_add(root) = ω·R(root)·(D_drop − D(root)), cost 1;
  Δ_split(v)  = ω·(R(v)D(v) − Σ_c R(c)D(c)), cost |children| − 1 (see gracekv.py's [choices]);
one max-heap on Δ/cost over all units and layers, popped until B_alloc allocated slots are spent
(`Slots`: a layer's heads share one padded tensor); a node splits only after it was added.
`cx` is gracekv.Context (one prompt); prototypes and distortions
come from prototypes.node_stats.

Notation (SPEC.md): U = L·G units, Tc context tokens, r recent window, n tokens of a node.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field, fields
from typing import Optional

import torch

from cache import Cache, LayerCache
from prototypes import node_stats


# ----------------------------------------------------------------------------- budget flow

@dataclass
class Nodes:
    """Every node made so far, node i in position i of each list (prototypes.node_stats' fields):
    unit i's span [a, b) minus the unit's holes when it was made (floor tokens, tokens extracted
    from its ancestors), its n tokens, relevance R, distortion D and D(drop), and its prototype
    (key (D,), value (D,), position, log m)."""
    unit: list = field(default_factory=list)
    a: list = field(default_factory=list)
    b: list = field(default_factory=list)
    n: list = field(default_factory=list)
    R: list = field(default_factory=list)
    D: list = field(default_factory=list)
    Ddrop: list = field(default_factory=list)
    key: list = field(default_factory=list)
    val: list = field(default_factory=list)
    pos: list = field(default_factory=list)
    logm: list = field(default_factory=list)

    def add(self, st: dict, rows) -> list:
        """Append rows of node_stats' output st; returns their node ids."""
        first = len(self.unit)
        for f in fields(self):
            x = st[f.name][rows]
            getattr(self, f.name).extend(x.tolist() if x.dim() == 1 else x.unbind(0))
        return list(range(first, len(self.unit)))


@dataclass
class Plan:
    """The forest as far as it was explored, and the greedy's trace: roots have add_gain;
    evaluated nodes have split (gain, cost, children); steps: (kind, node, gain, cost)."""
    B_alloc: int
    nodes: Nodes = field(default_factory=Nodes)
    add_gain: dict = field(default_factory=dict)
    add_rank: dict = field(default_factory=dict)  # root -> its heap rank (add_gain, or the lookahead's)
    split: dict = field(default_factory=dict)     # node -> (gain, cost, [children])
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
    u, a, b = (torch.tensor([getattr(nd, k)[i] for i in ids], device=cx.units.kr.device) for k in ("unit", "a", "b"))
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
    RDv = torch.tensor([nd.R[i] * nd.D[i] for i in ids], device=a.device, dtype=RD.dtype)
    om = cx.omega[u]
    # Δ_split = ω·(R(v)D(v) − Σ_c R(c)D(c)), cost |children| − 1 = 1 (the leaf has D = 0)
    g_bis, g_ext = om * (RDv - RD[:2].sum(0)), om * (RDv - RD[2])
    use_ext = g_ext > g_bis                                                   # ties: bisection
    cx.units.hole[u[use_ext], t[use_ext]] = True
    gain = torch.where(use_ext, g_ext, g_bis).tolist()
    pick = torch.cat((valid[:2] & ~use_ext, valid[2:] & use_ext))             # (4, N) children rows
    ik = pick.T.nonzero()                                                     # (node, candidate) pairs
    kids = plan.nodes.add(st, ik[:, 1] * len(ids) + ik[:, 0])
    start = 0
    for node, gv, nk in zip(ids, gain, pick.sum(0).tolist()):
        plan.split[node] = (gv, nk - 1, kids[start:start + nk])
        start += nk


def peek(heap: list, k: int) -> list:
    """The k best entries of a heap, best first, left in it: k pops and k pushes, O(k log n)
    (heapq.nsmallest reads the whole heap). Entries are unique, so the pops that follow come
    in the same order as before the peek."""
    top = [heapq.heappop(heap) for _ in range(min(k, len(heap)))]
    for e in top:
        heapq.heappush(heap, e)
    return top


class Slots:
    """What the greedy's entries cost in allocated cache slots. A layer's G heads share one
    (G, S, D) tensor, S = the most entries of its heads (cache.py: padding is allocated memory),
    so an action that gives unit u k more entries costs G·max(0, n_u + k − cap_l) slots (cap_l =
    the layer's largest head): entries under the cap fill padding for free, entries above it
    pay for the layer's G heads. The budget is in slots, like every other method's."""

    def __init__(self, counts: list, group: int, left: int):
        self.n, self.G, self.left = list(counts), group, left           # n_u: unit u's entries
        self.cap = [max(counts[i:i + group]) for i in range(0, len(counts), group)]
        self.room = sum(self.cap[u // group] - c for u, c in enumerate(counts))   # padding now

    def charge(self, u: int, k: int) -> int:
        return self.G * max(0, self.n[u] + k - self.cap[u // self.G])

    def take(self, u: int, k: int):
        c = self.charge(u, k)
        self.left -= c
        self.room += c - k
        self.n[u] += k
        self.cap[u // self.G] = max(self.cap[u // self.G], self.n[u])

    def done(self) -> bool:
        """No padding left to fill and too few slots left to raise a layer."""
        return self.room == 0 and self.left < self.G


def allocate(cx, B_alloc: int) -> Plan:
    """Budget flow: a global max-heap over add(root) and split(added node) by gain per entry.

    Δ_add(root) = ω·R·(D_drop − D(root)), cost 1; with Settings.lookahead an add is ranked by
    max(Δ_add, (Δ_add + Δ_split(root))/(1 + cost_split)) (SPEC.md §5: a slot whose mass sits on
    one token has a poor root; the extraction behind it now competes), and popping it applies the
    add alone (cost 1), after which its split competes on its own. Nodes are evaluated lazily, in batches: before
    an action is applied, the nodes it brings into the cache (and those of the next `prefetch`
    best actions) get their best split, so every available action is known when it competes.
    Extractions mark holes in cx.units.hole: one Context serves one allocate call.

    B_alloc counts allocated slots (`Slots`): the best action is applied if its charge fits in
    what is left, else dropped [choice: not retried if the layer's cap rises later]; the greedy
    goes on while padding can still be filled, so a layer's heads end with (nearly) as many
    entries each and the cache's allocated slots are its entries."""
    plan = Plan(B_alloc, floor=cx.units.hole.clone(), slots=cx.slots, group=cx.G)  # floor = holes before the greedy
    cost_of = Slots(plan.floor.sum(1).tolist(), cx.G, B_alloc)
    roots = [(j, a, b) for j in range(cx.units.kr.shape[0]) for a, b in cx.slots]
    if roots:
        u, a, b = (torch.tensor(x, device=cx.units.kr.device) for x in zip(*roots))
        st = node_stats(cx.units, u, a, b)
        keep = (st["n"] > 0).nonzero()[:, 0]
        gain = (cx.omega[st["unit"]] * st["R"] * (st["Ddrop"] - st["D"]))[keep].tolist()
        plan.add_gain = dict(zip(plan.nodes.add(st, keep), gain))
    rank = dict(plan.add_gain)
    if cx.s.lookahead:        # an add ranked by the better of itself and "add + best first split"
        best_splits(cx, plan, [i for i in plan.add_gain if plan.nodes.n[i] > 1])
        for i, g in plan.add_gain.items():
            if i in plan.split:
                sg, sc, _ = plan.split[i]
                rank[i] = max(g, (g + sg) / (1 + sc))                   # gain per entry of both
    plan.add_rank = rank
    heap = [(-g, i, "add", i) for i, g in rank.items()]             # (−gain/cost, tie, kind, node)
    heapq.heapify(heap)
    n, unit, tie = plan.nodes.n, plan.nodes.unit, len(heap)

    def entering(kind, v):      # unevaluated splittable nodes an action brings into the cache
        new = [v] if kind == "add" else plan.split[v][2]
        return [c for c in new if n[c] > 1 and c not in plan.split]

    def fits(kind, v):          # the action's charge fits in what is left now
        return cost_of.charge(unit[v], 1 if kind == "add" else plan.split[v][1]) <= cost_of.left

    def below(kind, v, tau):    # what the action brings in and, down splits already evaluated
        out = entering(kind, v)          # that rank >= tau (applied soon after it), what they bring in
        walk = [c for c in ([v] if kind == "add" else plan.split[v][2]) if n[c] > 1 and c in plan.split]
        while walk:
            c = walk.pop()
            g, cost, kids = plan.split[c]
            if g / cost >= tau:
                out += entering("split", c)
                walk += [k for k in kids if n[k] > 1 and k in plan.split]
        return out

    while heap and not cost_of.done():
        kind, v = heap[0][2:]
        if not fits(kind, v):
            heapq.heappop(heap)
            plan.dropped.append((len(plan.steps), kind, v))
            continue
        if entering(kind, v):
            # evaluate what the next `prefetch` affordable actions bring in, directly or below
            # splits evaluated in an earlier round that rank above the prefetch-th action (a
            # chain of extractions: without the walk each link costs a round of its own), then,
            # for nodes whose own split ranks above it, their children too (they will be needed
            # first); actions that do not fit now are left to the loop (near the end of the
            # budget most of them are dropped unevaluated)
            top = peek(heap, cx.s.prefetch)
            tau, done = -top[-1][0], 0
            todo = {c for e in top if fits(*e[2:]) for c in below(*e[2:], tau)}
            while todo and done < 4 * cx.s.prefetch:                    # bounded look-ahead
                best_splits(cx, plan, sorted(todo))
                done += len(todo)
                todo = {c for v in todo if plan.split[v][0] / plan.split[v][1] >= tau and fits("split", v)
                        for c in entering("split", v)}
        _, _, kind, v = heapq.heappop(heap)
        gain, cost, kids = (plan.add_gain[v], 1, [v]) if kind == "add" else plan.split[v]
        cost_of.take(unit[v], cost)
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

def assemble(cx, full: Cache, plan: Plan) -> Cache:
    """Per unit: floor tokens, window and frontier leaves exact (bias 0), prototypes with bias
    log m; sorted by position; a layer's heads padded to one size (bias −inf, pos −1)."""
    nd, G, Tc = plan.nodes, full.layers[0].k.shape[1], cx.Tc
    mine = [[] for _ in range(cx.units.kr.shape[0])]
    for i in sorted(plan.frontier):
        mine[nd.unit[i]].append(i)
    dev, layers = cx.units.kr.device, []
    for l, lc in enumerate(full.layers):
        heads = []
        for g in range(G):
            j = l * G + g
            protos = [i for i in mine[j] if nd.n[i] > 1]
            leaves = [nd.a[i] for i in mine[j] if nd.n[i] == 1]
            ex = sorted(plan.floor[j].nonzero()[:, 0].tolist() + leaves) + list(range(Tc, cx.T))
            ex = torch.tensor(ex, dtype=torch.long, device=dev)              # exact entries
            k, v, pos, bias = lc.k[0, g, ex], lc.v[0, g, ex], ex, lc.bias[0, g, ex]
            if protos:
                k = torch.cat((k, torch.stack([nd.key[i] for i in protos]).to(k.dtype)))
                v = torch.cat((v, torch.stack([nd.val[i] for i in protos]).to(v.dtype)))
                pos = torch.cat((pos, torch.tensor([nd.pos[i] for i in protos], device=dev)))
                logm = torch.tensor([nd.logm[i] for i in protos], device=dev, dtype=bias.dtype)
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
    mine = sorted((nd.a[i], i) for i in plan.frontier if nd.unit[i] == unit)
    leaves = {nd.a[i] for _, i in mine if nd.n[i] == 1}
    letters = "abcdefghijklmnopqrstuvwyzABCDEGHIJKLMNOPQRSTUVWXYZ"          # all but x and F
    for k, (_, i) in enumerate([e for e in mine if nd.n[e[1]] > 1]):
        for t in range(nd.a[i], nd.b[i]):
            if not plan.floor[unit, t] and t not in leaves:
                row[t] = letters[k % len(letters)]
    for t in leaves:
        row[t] = "x"
    for t in plan.floor[unit].nonzero()[:, 0].tolist():
        row[t] = "F"
    return [f"{a:5d}-{b - 1:<5d} |" + "".join(row[a:b]) + "|" for a, b in plan.slots]
