"""The GPU run, prepared: time and peak memory of every stage on a Llama-3.1-8B-shaped model.

`python bench_gpu.py` on one CUDA GPU: random weights in the shape of Llama-3.1-8B (32 layers,
32 query / 8 KV heads of 128, hidden 4096, MLP 14336, vocab 128256, Llama-3 RoPE scaling), bf16,
a `--length`-token random prompt (16K by default). It reports, each with the GPU's peak memory
(torch.cuda.max_memory_allocated) around it:
- the plain prefill, and the shared prefill observing for every default method;
- each method's compression at `--budget` (StreamingLLM, H2O, TOVA, SnapKV, K-norm, PyramidKV,
  GraceKV);
- `--steps` decoding steps with FullKV and with SnapKV's compressed cache.
Random weights give meaningless text but the real shapes, hence the real costs. On a machine
without CUDA it stops with a one-line error.
"""
from __future__ import annotations

import time

import torch

import evaluate as E
import model as M
import polykv as P
from support import cli
from support.errors import UsageError

LLAMA_31_8B = M.Config(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                       hidden_dim=14336, rope_theta=500000.0, max_seq_len=131072, tie_embeddings=False,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                       bos_id=128000, eos_ids=(128001, 128008, 128009))


def stage(name, fn):
    """Run fn once on the GPU: (result) and print its seconds and the peak memory while it ran."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    print(f"| {name} | {time.perf_counter() - t0:.3f} | {torch.cuda.max_memory_allocated() / 2**30:.1f} |", flush=True)
    return out


@torch.no_grad()
def main(argv=None):
    ap = cli.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise UsageError("bench_gpu.py needs a CUDA GPU (none is available here)")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    with dev:
        m = M.Llama(LLAMA_31_8B).to(torch.bfloat16).eval()
    for p in m.parameters():                       # small random weights: finite activations
        p.normal_(0, 0.02)
    for blk in m.layers:
        blk.input_layernorm.weight.fill_(1)
        blk.post_attention_layernorm.weight.fill_(1)
    m.norm.weight.fill_(1)
    m.inv_freq = M.rope_inv_freq(m.config).to(dev)
    x = torch.randint(0, m.config.vocab_size, (1, args.length), device=dev)
    L, B = m.config.n_layers, args.budget
    print(f"Llama-3.1-8B shape, random bf16 weights, {torch.cuda.get_device_name()}, T = {args.length}, B = {B}")
    print("| stage | s | peak GB |\n|---|---|---|")
    stage("warm-up prefill", lambda: M.prefill(m, x[:, :1024]))
    full = stage("plain prefill", lambda: M.prefill(m, x))
    made = {n: E.method(n, B, L) for n in E.default_methods() if n not in ("full", "random", "polykv")}
    full, obs = stage("prefill observing for every default method", lambda: P.observe_for(m, x, list(made.values())))
    caches = {n: stage(f"compress {n}", lambda: meth.compress(m, full, obs)) for n, meth in made.items()}
    stage(f"FullKV: {args.steps} decoding steps", lambda: M.greedy(m, full.fork(), args.steps))
    stage(f"SnapKV B={B}: {args.steps} decoding steps", lambda: M.greedy(m, caches["snapkv"].fork(), args.steps))


if __name__ == "__main__":
    cli.run(main)
