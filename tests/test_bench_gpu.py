"""bench_gpu.py without a GPU: its command line refuses with one line, and its stages (every
default method observed, compressed and decoded) run on a tiny model on the CPU, each method's
cache within its budget."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import bench_gpu
from conftest import tiny

ROOT = Path(__file__).resolve().parent.parent


def test_without_cuda_it_refuses_in_one_line():
    if torch.cuda.is_available():
        pytest.skip("a GPU machine runs bench_gpu.py for real")
    r = subprocess.run([sys.executable, "-m", "engine.bench_gpu", "--length", "1024"], cwd=ROOT,
                       capture_output=True, text=True)
    want = "error: python -m engine.bench_gpu needs a CUDA GPU (none is available here)"
    assert r.returncode == 2 and r.stderr.strip() == want     # 2: the command could not run


def test_stages_run_on_a_tiny_model_and_keep_each_budget():
    """Every stage is reported once, in order; every compressed cache holds at most L·G·B real
    entries (the budget contract), KVzip's pass included (the placeholder prompt)."""
    m = tiny().float()
    T, budget, steps = 128, 40, 4           # a budget past GraceKV's window of 32
    x = torch.randint(1, 50, (1, T), generator=torch.Generator().manual_seed(0))
    names = []

    def stage(name, fn, tokens):
        names.append(name)
        return fn()
    caches = bench_gpu.run(m, x, budget, steps, stage)
    made = bench_gpu.methods(m.config.n_layers, budget)
    first = ["warm-up prefill", "plain prefill", "prefill observing for every default method"]
    assert names == (first + [f"compress {n}" for n in made]
                     + [f"FullKV: {steps} decoding steps after {T}",
                        f"SnapKV B={budget}: {steps} decoding steps"])
    L, G = m.config.n_layers, m.config.n_kv_heads
    assert set(caches) == set(made) and all(c.entries() <= L * G * budget for c in caches.values())
