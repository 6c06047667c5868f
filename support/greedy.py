"""GraceKV's speed helpers, none of them a formula: a look at the heap's best entries
(gracekv.allocate's prefetch), the batching of node evaluations (gracekv.node_stats), the
per-unit products of the probes with node keys, and a one-entry memo (`Last`) that lets the
budgets of one prompt share its budget-independent steps (gracekv.compress)."""
from __future__ import annotations

import heapq
import math



import torch


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
        while (
            j < len(lens) and (j + 1 - i) * lens[j] <= cap and (j - i < 64 or lens[j] < 2 * lens[i])
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
