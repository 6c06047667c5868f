"""The KV cache: what compression shrinks, laid out so that every method fits one contract.

Per layer (SPEC.md §1):
  k, v  (B, G, S, D)  post-RoPE keys and values,
  pos   (B, G, S)     the original position of each entry (-1 = padding),
  bias  (B, G, S)     an additive logit: 0 for a token, log m for a prototype standing for m
                      tokens (GraceKV), -inf for padding,
  acc   (B, G, S)     optional: a decode rule's running per-entry statistic (H2O's attention
                      column sums), kept next to the entry it describes.
Causality is decided by positions (key pos <= query pos), never by indices, so a cache with gaps
(after eviction) keeps working. Eviction is a `gather` along S, the only way a cache shrinks;
it moves every per-entry field together, so a decode rule's state can never fall out of step
with the entries. Appending writes in place into spare room (`Buffer`) only past every slot some
view can see, so a `fork` shares tensors and is independent.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

FIELDS = ("k", "v", "pos", "bias", "acc")


@dataclass
class Buffer:
    """Room to append in place: tensors with `cap` slots along S, of which the first `used` are
    written. Every LayerCache that views it sees a prefix [0, S) that never changes; only the
    view holding all `used` slots may write past them (anyone else copies): appends are
    amortised O(T), and forks stay independent."""
    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    bias: torch.Tensor
    acc: Optional[torch.Tensor]
    used: int

    @property
    def cap(self) -> int:
        return self.k.shape[2]


@dataclass
class LayerCache:
    k: torch.Tensor      # (B, G, S, D) post-RoPE keys
    v: torch.Tensor      # (B, G, S, D)
    pos: torch.Tensor    # (B, G, S) long, original positions, -1 = padding
    bias: torch.Tensor   # (B, G, S) additive logit: 0 token, log m prototype, -inf padding
    acc: Optional[torch.Tensor] = None   # (B, G, S) decode-rule state (H2O's Σ_i A), or None
    buffer: Optional[Buffer] = field(default=None, repr=False, compare=False)  # append room

    @property
    def size(self) -> int:
        return self.k.shape[2]

    def _owns_tail(self, T: int) -> bool:
        """This view may write slots [S, S+T) of its buffer: it holds every used slot, there is
        room, and its fields are the buffer's own (not replaced since)."""
        b = self.buffer
        if b is None or b.used != self.size or self.size + T > b.cap:
            return False
        return all((getattr(self, f) is None and getattr(b, f) is None) or
                   (getattr(self, f) is not None and getattr(b, f) is not None
                    and getattr(self, f).data_ptr() == getattr(b, f).data_ptr()) for f in FIELDS)

    def append(self, k, v, pos) -> "LayerCache":
        """New tokens k, v (B, G, T, D) at positions pos (B, T) go to the end (bias and acc 0).
        Written in place into the buffer when this view owns its tail, else into a new buffer
        with a quarter more room (at least 64 slots; the old entries copied once), so appends
        cost amortised O(T) for every method alike."""
        B, G, T, _ = k.shape
        S = self.size
        new = {"k": k, "v": v, "pos": pos[:, None, :].expand(B, G, T),
               "bias": self.bias.new_zeros(B, G, T),
               "acc": None if self.acc is None else self.acc.new_zeros(B, G, T)}
        b = self.buffer
        if not self._owns_tail(T):
            cap = S + T + max(64, (S + T) // 4)
            grow = lambda x: None if x is None else torch.cat(
                (x, x.new_empty(*x.shape[:2], cap - S, *x.shape[3:])), 2)      # (B, G, cap, ·)
            b = Buffer(*(grow(getattr(self, f)) for f in FIELDS), used=S)
        for f in FIELDS:
            if new[f] is not None:
                getattr(b, f)[:, :, S:S + T] = new[f]                              # in place
        b.used = S + T
        view = {f: None if getattr(b, f) is None else getattr(b, f)[:, :, :S + T] for f in FIELDS}
        return LayerCache(**view, buffer=b)

    def gather(self, idx: torch.Tensor) -> "LayerCache":
        """Keep entries idx (B, G, S') along S: the only way eviction changes a cache (new,
        compact tensors)."""
        i4 = idx[..., None].expand(*idx.shape, self.k.shape[-1])               # (B, G, S', D)
        return LayerCache(self.k.gather(2, i4), self.v.gather(2, i4),
                          self.pos.gather(2, idx), self.bias.gather(2, idx),
                          None if self.acc is None else self.acc.gather(2, idx))

    def real_entries(self) -> int:
        """Entries that are not padding, summed over batch and heads."""
        return int((self.pos >= 0).sum())


@dataclass
class Cache:
    layers: list            # [LayerCache] * L
    next_pos: int = 0       # position of the next token fed to the model (= tokens seen so far)
    last_logits: Optional[torch.Tensor] = None   # (B, V) logits after the last token fed

    @classmethod
    def empty(cls, n_layers: int, batch: int, G: int, D: int, device, dtype) -> "Cache":
        """No entries yet; k and v in the model's dtype, the bias in fp32 whatever it is (fp64
        for an fp64 model): a prototype's log m must not be rounded to bf16 (up to 1.6 % on m)."""
        z = lambda *s, **kw: torch.zeros(*s, device=device, **kw)
        bias = torch.float64 if dtype == torch.float64 else torch.float32
        return cls([LayerCache(z(batch, G, 0, D, dtype=dtype), z(batch, G, 0, D, dtype=dtype),
                               z(batch, G, 0, dtype=torch.long), z(batch, G, 0, dtype=bias))
                    for _ in range(n_layers)])

    def entries(self) -> int:
        """Real entries (padding excluded), all layers, batch rows and heads."""
        return sum(lc.real_entries() for lc in self.layers)

    def allocated(self) -> int:
        """Entry slots the k and v tensors hold, padding included: Σ_l B·G·S (bytes = this ×
        2·D·element size). The append buffer's spare room (at most a quarter more, the same
        rule for every method) is not counted."""
        return sum(lc.k.shape[0] * lc.k.shape[1] * lc.k.shape[2] for lc in self.layers)

    def fork(self) -> "Cache":
        """An independent cache sharing the tensors (appends write only past every slot another
        view sees, eviction makes new tensors): every per-entry state is in the layers, so a fork
        decodes exactly as the original would."""
        return Cache(list(self.layers), self.next_pos, self.last_logits)
