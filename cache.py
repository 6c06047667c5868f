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
with the entries. No operation writes in place: a `fork` shares tensors and is independent.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class LayerCache:
    k: torch.Tensor      # (B, G, S, D) post-RoPE keys
    v: torch.Tensor      # (B, G, S, D)
    pos: torch.Tensor    # (B, G, S) long, original positions, -1 = padding
    bias: torch.Tensor   # (B, G, S) additive logit: 0 token, log m prototype, -inf padding
    acc: Optional[torch.Tensor] = None   # (B, G, S) decode-rule state (H2O's Σ_i A), or None

    @property
    def size(self) -> int:
        return self.k.shape[2]

    def append(self, k, v, pos) -> "LayerCache":
        """New tokens k, v (B, G, T, D) at positions pos (B, T) go to the end (acc starts at 0)."""
        B, G, T, _ = k.shape
        p = pos[:, None, :].expand(B, G, T)                                     # (B, G, T)
        zeros = lambda x: torch.cat((x, x.new_zeros(B, G, T)), 2)               # (B, G, S+T)
        return LayerCache(torch.cat((self.k, k), 2), torch.cat((self.v, v), 2),
                          torch.cat((self.pos, p), 2), zeros(self.bias),
                          None if self.acc is None else zeros(self.acc))

    def gather(self, idx: torch.Tensor) -> "LayerCache":
        """Keep entries idx (B, G, S') along S: the only way eviction changes a cache."""
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
        z = lambda *s, **kw: torch.zeros(*s, device=device, **kw)
        return cls([LayerCache(z(batch, G, 0, D, dtype=dtype), z(batch, G, 0, D, dtype=dtype),
                               z(batch, G, 0, dtype=torch.long), z(batch, G, 0, dtype=dtype))
                    for _ in range(n_layers)])

    def entries(self) -> int:
        """Real entries (padding excluded), all layers, batch rows and heads."""
        return sum(lc.real_entries() for lc in self.layers)

    def allocated(self) -> int:
        """Entry slots the k and v tensors hold, padding included: Σ_l B·G·S (bytes = this ×
        2·D·element size)."""
        return sum(lc.k.shape[0] * lc.k.shape[1] * lc.k.shape[2] for lc in self.layers)

    def fork(self) -> "Cache":
        """An independent cache sharing the tensors (LayerCache ops never write in place): every
        per-entry state is in the layers, so a fork decodes exactly as the original would."""
        return Cache(list(self.layers), self.next_pos, self.last_logits)
