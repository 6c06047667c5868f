"""Rotary position embeddings (Su et al., "RoFormer", 2021) in Hugging Face's "rotate_half"
layout, with Llama-3's frequency scaling. Keys are stored rotated at their own position
(post-RoPE); queries are rotated at their true position, so a kept key never moves.
"""
from __future__ import annotations

import math

import torch


def rope_inv_freq(cfg) -> torch.Tensor:
    """Inverse frequencies θ_i = theta^(-2i/D), i < D/2, in fp64, with Llama-3 scaling.

    Llama-3 (HF `_compute_llama3_parameters`, Meta's `apply_scaling`): with wavelength
    λ_i = 2π/θ_i, L0 = original_max_position_embeddings, low/high = L0/low_freq_factor,
    L0/high_freq_factor:  λ_i < high -> θ_i;  λ_i > low -> θ_i / factor;  otherwise
    (1 − s)·θ_i/factor + s·θ_i with s = (L0/λ_i − low_freq_factor)/(high_freq_factor − low_freq_factor).
    """
    D = cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
    sc = cfg.rope_scaling
    if sc is None:
        return inv
    factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    L0 = sc["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    smooth = (L0 / wavelen - lo) / (hi - lo)
    mid = (1 - smooth) * inv / factor + smooth * inv
    out = torch.where(wavelen > L0 / lo, inv / factor, mid)
    return torch.where(wavelen < L0 / hi, inv, out)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (−x2, x1) over the two halves of the last dim (HF layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate x (..., D) by angle pos·θ: x·cos + rotate_half(x)·sin.

    pos broadcasts against x[..., 0] (e.g. (B, 1, T) for q (B, H, T, D), or (B, G, S) per head);
    it may be negative to undo a rotation (RoPE⁻¹ at p is RoPE at −p). Angles are computed in
    fp64 for fp64 inputs, else fp32 (as Hugging Face does), then cast to x's dtype.
    """
    ang_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    ang = pos.to(ang_dtype)[..., None] * inv_freq.to(device=x.device, dtype=ang_dtype)  # (..., D/2)
    ang = torch.cat((ang, ang), dim=-1)                                                # (..., D)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    return x * cos + rotate_half(x) * sin


