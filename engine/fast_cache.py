"""The cache's fast path: appending in place into spare room, amortised O(T) per token.

The naive form it replaces is `model.LayerCache.append`, which concatenates (a decoding step
copies the whole layer). `append` here writes the same entries into a `Buffer` with spare slots
along S and returns a view of its written prefix; a model handed engine/fast.py's SPEED uses
it. Tested equal to the naive append, forks included (tests/test_model.py).

The rule that keeps forks independent: every LayerCache that views a buffer sees a prefix
[0, S) that never changes; only the view holding all `used` slots may write past them (any
other view copies into a new buffer). Eviction (`gather`) makes new compact tensors, so it
never touches a buffer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class Buffer:
    """Room to append in place: tensors with `cap` slots along S, of which the first `used` are
    written (the fields of model.LayerCache.FIELDS, None where the cache has none)."""
    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    bias: torch.Tensor
    acc: Optional[torch.Tensor]
    head: Optional[torch.Tensor]
    used: int

    @property
    def cap(self) -> int:
        return self.k.shape[2]


def owns_tail(lc, n: int) -> bool:
    """The view lc (model.LayerCache) may write slots [S, S+n) of its buffer: it holds every
    used slot, there is room, and its fields are the buffer's own (not replaced since)."""
    b, S = lc.room, lc.size
    if b is None or b.used != S or S + n > b.cap:
        return False
    for f in lc.FIELDS:
        mine, theirs = getattr(lc, f), getattr(b, f)
        if (mine is None) != (theirs is None):
            return False
        if mine is not None and mine.data_ptr() != theirs.data_ptr():
            return False
    return True


def grown(x: Optional[torch.Tensor], S: int, cap: int) -> Optional[torch.Tensor]:
    """x (B, G, S, ·) followed by cap − S unwritten slots along S: (B, G, cap, ·)."""
    if x is None:
        return None
    return torch.cat((x, x.new_empty(*x.shape[:2], cap - S, *x.shape[3:])), 2)


def room(n: int) -> int:
    """Slots of a new buffer for n written entries: a quarter more, at least 64 spare."""
    return n + max(64, n // 4)


def append(lc, k, v, pos):
    """lc.append(k, v, pos) (the same entries, model.LayerCache.new_entries), written in place
    into lc's buffer when lc owns its tail, else into a new buffer with a quarter more room (at
    least 64 slots; the old entries copied once)."""
    new = lc.new_entries(k, v, pos)
    n, S = new["k"].shape[2], lc.size           # entries added: T, or G·T in a ragged layer
    b = lc.room
    if not owns_tail(lc, n):
        cap = room(S + n)
        b = Buffer(*(grown(getattr(lc, f), S, cap) for f in lc.FIELDS), used=S)
    for f in lc.FIELDS:
        if new[f] is not None:
            getattr(b, f)[:, :, S:S + n] = new[f]                                  # in place
    b.used = S + n
    view = {f: None if getattr(b, f) is None else getattr(b, f)[:, :, :S + n] for f in lc.FIELDS}
    return type(lc)(**view, room=b)
