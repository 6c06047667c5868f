"""The bookkeeping of GraceKV's budget flow (gracekv.allocate), apart from the paper's steps:
what an action costs in allocated cache slots, and a look at the heap's best entries."""
from __future__ import annotations

import heapq


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
    (G, S, D) tensor, S = the most entries of its heads (model.py: padding is allocated memory),
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
