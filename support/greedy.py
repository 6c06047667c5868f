"""GraceKV's machinery apart from the paper's formulas: the budget flow's records (a tree's
`Node`, a node's `Split`, the whole `Plan` and its text `picture`), a look at the heap's best
entries (gracekv.allocate) and the batching of node evaluations (gracekv.node_stats)."""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch


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
    dropped: list = field(default_factory=list)   # (len(steps) then, kind, node): popped, not affordable


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


def peek(heap: list, k: int) -> list:
    """The k best entries of a heap, best first, left in it: k pops and k pushes, O(k log n)
    (heapq.nsmallest reads the whole heap). Entries are unique, so the pops that follow come
    in the same order as before the peek."""
    top = [heapq.heappop(heap) for _ in range(min(k, len(heap)))]
    for e in top:
        heapq.heappush(heap, e)
    return top


def by_length(fn, xs: tuple, length, cap: int) -> dict:
    """fn(*chunk, n) over chunks of the rows of xs (each (N, ...)), sorted by `length` (N,): a
    chunk holds 64 rows, then only rows up to twice its shortest (little padding), and at most
    `cap` (row, token) pairs; n = the chunk's longest length. Results concatenated back in the
    rows' order."""
    order = length.argsort(stable=True)                                     # short spans together
    lens, parts, i = length[order].clamp(min=1).tolist(), [], 0
    while i < len(lens):
        j = i + 1
        while j < len(lens) and (j + 1 - i) * lens[j] <= cap and (j - i < 64 or lens[j] < 2 * lens[i]):
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
