"""GraceKV's speed helpers, none of them a formula: the budget flow with the splits evaluated
ahead in batches (`prefetched_flow`, gracekv.allocate_prefetched), a look at the heap's best
entries, the batching of node evaluations (gracekv.node_stats), the
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


def prefetched_flow(plan, heap: list, B_alloc: int, evaluate, prefetch: int):
    """gracekv.allocate's loop on `plan` from the heap of adds, with the best splits of the
    nodes an action brings in evaluated before it is applied, in batches: those of the next
    `prefetch` affordable actions, directly or down splits already evaluated that rank above
    the prefetch-th (an extraction chain: one round, not one per link), then the children of
    those whose split ranks above it too. evaluate(ids): the best splits of nodes ids
    (gracekv.best_splits). The same actions as the one-at-a-time loop (tested)."""
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
