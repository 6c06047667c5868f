"""The attention's fast path: torch's fused kernel (`scaled_dot_product_attention`, flash or
memory-efficient on a GPU) in place of model.attention, wherever it gives the same result.

The naive form it replaces is `model.attention` (softmax(q kᵀ/√D + bias + causal) v, the
softmax in fp32); `model.layer_attention` with engine/fast.py's SPEED calls `attention_sdpa`
and falls back to the naive form where it returns None. Tested equal to it (tests/test_model.py),
and `step_facts` equal to `kernel_facts` read after the append (tests/test_sync.py).

Which fused call applies depends on the cache (a fresh prefill, a decoding step over plain
tokens, a cache with gaps or prototypes): `kernel_facts` reads that off the tensors on the
device, in one transfer per layer; `step_facts` reads it for every layer of a model step in one
transfer, before the new tokens are appended.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def kernel_facts(bias, q_pos, k_pos) -> tuple:
    """What `attention_sdpa` picks its kernel by, for keys k_pos, bias (B, G, S) and queries at
    q_pos (B, T): (fresh prefill: the keys are the queries' own tokens, no bias; every key
    visible to every query; no bias; a finite non-zero bias (a prototype's log m); the same
    positions and bias in every head). All five are reduced on the device and read in one
    transfer: one host synchronisation per layer and step, whichever kernel is picked."""
    S, T = k_pos.shape[2], q_pos.shape[1]
    no = torch.zeros((), dtype=torch.bool, device=bias.device)
    zero = (bias == 0).all()
    fresh = zero & (k_pos == q_pos[:, None, :]).all() if S == T else no
    before = (k_pos >= 0).all() & (k_pos.flatten(1).amax(1) <= q_pos.amin(1)).all() if S else ~no
    proto = (bias.isfinite() & (bias != 0)).any()
    shared = (k_pos == k_pos[:, :1]).all() & (bias == bias[:, :1]).all()
    return tuple(torch.stack((fresh, before, zero, proto, shared)).tolist())


def step_facts(layers: list, q_pos) -> list:
    """`kernel_facts` of every layer (model.LayerCache) for new tokens at q_pos (B, T), read off
    the caches as they are *before* the tokens are appended: an append adds, in every head, T
    entries at the queries' own positions with bias 0, so a layer is a fresh prefill iff it is
    empty, every key is visible iff the old keys are valid and none is past the earliest query
    and no query has a later new token beside it (T = 1), and the bias facts and the heads'
    sameness are those of the old entries. All layers in one transfer: one host
    synchronisation per step instead of one per layer. None for a ragged layer (its attention
    is model.attention_ragged, which needs no facts)."""
    q_lo, q_hi = q_pos.amin(1), q_pos.amax(1)                                 # (B,)
    new = (q_lo >= 0).all() & (q_hi <= q_lo).all()     # the new keys alone: all seen by all
    rows = []
    for lc in layers:
        if lc.head is not None:
            continue
        k_pos, bias = lc.pos, lc.bias                                         # (B, G, S) old
        before = new
        if lc.size:
            before = before & (k_pos >= 0).all() & (k_pos.flatten(1).amax(1) <= q_lo).all()
        prototypes = (bias.isfinite() & (bias != 0)).any()
        shared = (k_pos == k_pos[:, :1]).all() & (bias == bias[:, :1]).all()
        rows.append(torch.stack((before, (bias == 0).all(), prototypes, shared)))
    read = iter(torch.stack(rows).tolist() if rows else [])
    return [None if lc.head is not None else (lc.size == 0, *next(read)) for lc in layers]


def attention_sdpa(q, k, v, bias, q_pos, k_pos, facts: Optional[tuple] = None):
    """model.attention through torch's fused kernel, or None where the fused kernel would not
    give the same result (then the caller takes the explicit attention). Shapes as
    model.attention. facts: `kernel_facts` of these tensors if known (`step_facts`), else read
    here."""
    B, H, T, _ = q.shape
    G, S = k.shape[1], k.shape[2]
    fresh, before, zero, proto, shared = facts or kernel_facts(bias, q_pos, k_pos)
    if fresh:
        # a fresh prefill: keys are exactly the queries' tokens -> plain causal mask
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if q.dtype not in (torch.float32, torch.float64) and proto:
        # an fp32 bias (GraceKV's log m) would be rounded to q's bf16/fp16 in SDPA's mask:
        # the explicit attention keeps it exact (softmax in fp32)
        return None
    if before and zero:
        # every key visible to every query (a decoding step over tokens): no mask, so the
        # fused kernels stay available
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    if shared:
        # one mask for all heads (B, 1, T, S): no H copies
        k_pos, bias = k_pos[:, :1], bias[:, :1]
    # key j visible to query i iff 0 <= k_pos_j <= q_pos_i (model.visible_mask)
    kp = k_pos[:, :, None, :]                                                 # (B, G|1, 1, S)
    visible = (kp <= q_pos[:, None, :, None]) & (kp >= 0)                     # (B, G|1, T, S)
    mask = bias[:, :, None, :].masked_fill(~visible, float("-inf"))           # (B, G|1, T, S)
    if mask.shape[1] > 1:
        mask = mask[:, :, None].expand(B, G, H // G, T, S).reshape(B, H, T, S)    # (B, H, T, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype), enable_gqa=True)
