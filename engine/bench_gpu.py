"""The GPU run, prepared: time and peak memory of every stage on a Llama-3.1-8B-shaped model.

`python -m engine.bench_gpu` on one CUDA GPU: random weights in the shape of Llama-3.1-8B (32
layers, 32 query / 8 KV heads of 128, hidden 4096, MLP 14336, vocab 128256, Llama-3 RoPE scaling),
bf16, a `--length`-token random prompt (16K by default). It prints one row per stage, with its
seconds, tokens per second and the GPU's peak memory (torch.cuda.max_memory_allocated) while it ran:
- the plain prefill, and the shared prefill observing for every default method (KVzip's
  reconstruction pass included);
- each default method's compression at `--budget` (PolyKV as a policy mixing the pool rules,
  one per layer: no calibration on random weights);
- `--steps` decoding steps with FullKV and with SnapKV's compressed cache (decode tokens per
  second at long context, FullKV against compressed).
Random weights give meaningless text but the real shapes, hence the real costs; KVzip's
reconstruction prompt is made of placeholder ids of the real prompt's lengths (its cost
depends on them only). On a machine without CUDA it stops with a one-line error. It has not
been run on a GPU (none was available); `tests/test_bench_gpu.py` runs its stages on a tiny
model on the CPU, and docs/memory.md computes the peaks it should show.
"""
from __future__ import annotations

import time

import torch

import model as M
import polykv as P
from support import cli
from engine import harness as H
from engine import observe as OB
from engine.fast import SPEED
from engine.memory import mixed_policy
from support.errors import UsageError

LLAMA_31_8B = M.Config(
    vocab_size=128256,
    dim=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    head_dim=128,
    hidden_dim=14336,
    rope_theta=500000.0,
    max_seq_len=131072,
    tie_embeddings=False,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    bos_id=128000,
    eos_ids=(128001, 128008, 128009),
)
# KVzip's instruction, later instruction and suffix: placeholder ids, the real prompt's lengths
REPEAT = ((1,) * 8, (2,) * 13, (3,) * 5)


def cuda_stage(name, fn, tokens: int):
    """Run fn once on the GPU and print its row: seconds, tokens per second, the peak memory."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    t = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**30
    print(f"| {name} | {t:.3f} | {tokens / t:.0f} | {peak:.1f} |", flush=True)
    return out


def methods(L: int, budget: int) -> dict:
    """Every default method but FullKV and the random floor; PolyKV as a mixed policy."""
    settings = P.RuleSettings(repeat=REPEAT)
    names = [n for n in H.default_methods() if n not in ("full", "random")]
    return {n: mixed_policy(L, budget, settings) if n == "polykv"
            else H.method(n, budget, L, settings) for n in names}


@torch.no_grad()
def run(m, x, budget: int, steps: int, stage) -> dict:
    """The stages on model m and prompt x (1, T); stage(name, fn, tokens) runs fn and reports it.
    Returns every method's compressed cache."""
    L, T = m.config.n_layers, x.shape[1]
    stage("warm-up prefill", lambda: M.prefill(m, x[:, :1024]), min(T, 1024))
    full = stage("plain prefill", lambda: M.prefill(m, x), T)
    made = methods(L, budget)
    everyone = list(made.values())
    full, obs = stage("prefill observing for every default method",
                      lambda: OB.observe_for(m, x, everyone), T)
    caches = {}
    for n, meth in made.items():
        caches[n] = stage(f"compress {n}", lambda: meth.compress(m, full, obs), T)
    stage(f"FullKV: {steps} decoding steps after {T}",
          lambda: M.greedy(m, full.fork(), steps), steps)
    snap, small = made["snapkv"], caches["snapkv"]
    stage(f"SnapKV B={budget}: {steps} decoding steps",
          lambda: M.greedy(m, small.fork(), steps, (), snap.decoder), steps)
    return caches


def main(argv=None):
    ap = cli.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise UsageError("python -m engine.bench_gpu needs a CUDA GPU (none is available here)")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    with dev:
        m = M.Llama(LLAMA_31_8B, SPEED).to(torch.bfloat16).eval()
    for p in m.parameters():                       # small random weights: finite activations
        p.data.normal_(0, 0.02)
    for blk in m.layers:
        blk.input_layernorm.weight.data.fill_(1)
        blk.post_attention_layernorm.weight.data.fill_(1)
    m.norm.weight.data.fill_(1)
    m.inv_freq = M.rope_inv_freq(m.config).to(dev)
    x = torch.randint(0, m.config.vocab_size, (1, args.length), device=dev)
    print(f"Llama-3.1-8B shape, random bf16 weights, {torch.cuda.get_device_name()}, "
          f"T = {args.length}, B = {args.budget}")
    print("| stage | s | tokens/s | peak GiB |\n|---|---|---|---|")
    run(m, x, args.budget, args.steps, cuda_stage)


if __name__ == "__main__":
    cli.run(main)
