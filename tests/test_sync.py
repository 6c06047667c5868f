"""Host synchronisation in the hot loops (docs/design.md, "Host synchronisation"): how often each
path reads a value back from the device, counted on the CPU. A read is any call that turns a
tensor into a Python value (`.item()`, `.tolist()`, `int()`, `float()`, `bool()`, an `if` on a
tensor, `.nonzero()`, `.cpu()`), caught with a torch function mode; on a GPU each one waits for
the device to finish what it was given. Also: `fast_attention.step_facts`, which reads the kernel
choice of all layers at once, equals `fast_attention.kernel_facts` read per layer after the append.
Tiny random LLaMA in fp64."""
import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, strategies as st
from torch.overrides import TorchFunctionMode

import model as M
import polykv as P
from engine import fast_attention as FA
from conftest import REPEAT, tiny
from engine import harness as H
from engine import observe as OB
import baselines as BL

SET = P.RuleSettings(window=4, kernel=3, n_sink=2, chunk=5, repeat=REPEAT, future=7)
READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu",
         "numpy"}


class Reads(TorchFunctionMode):
    """Counts the calls that read a tensor back to the host, by name."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def reads(fn, *args):
    """(fn's result, the names of the device reads it made)."""
    with Reads() as r:
        out = fn(*args)
    return out, r.names


@pytest.mark.parametrize("L", [1, 3])
def test_a_step_reads_the_device_once_whatever_the_depth(L):
    """Prefill, a teacher-forced decode step and a greedy token: one read per step (the kernel
    choice of every layer, `step_facts`), plus greedy's token id; teacher forcing reads its
    entry counts once at the end."""
    m = tiny(L=L)
    x = torch.randint(1, 50, (1, 30), generator=torch.Generator().manual_seed(0))
    cache, names = reads(M.prefill, m, x[:, :24])
    assert names == ["tolist"]
    _, names = reads(M.decode, m, x[:, 24:25], cache.fork())
    assert names == ["tolist"]
    _, names = reads(M.greedy, m, cache.fork(), 3)
    assert names == ["__int__", "tolist"] * 3
    pol = P.Policy.uniform("h2o", 10, L, settings=SET, rules=BL.RULES)       # evicts every step
    small = pol.prefill(m, x[:, :24])
    _, names = reads(M.teacher_force, m, small, x[:, 24:], pol.decoder, True)
    assert names == ["tolist"] * 5 + ["__int__"]


def test_observation_and_compression_read_nothing_per_layer():
    """The shared observation of every rule reads once per model step (the prefill, and KVzip's
    reconstruction pass: one chunk here), never per layer; a policy's compression reads
    nothing; the head-wise allocation reads twice in all."""
    m = tiny()
    x = torch.randint(1, 50, (1, 40), generator=torch.Generator().manual_seed(1))
    methods = [P.Policy.uniform(r, 8, 3, settings=SET, rules=BL.RULES) for r in BL.RULES]
    (full, obs), names = reads(OB.observe_for, m, x, methods)
    assert names == ["tolist", "tolist"]
    for method in methods:
        _, names = reads(method.compress, m, full, obs)
        assert names == []
    for name in ("adakv", "kvzip"):
        _, names = reads(H.method(name, 8, 3, SET).compress, m, full, obs)
        assert names == ["nonzero", "tolist"]


def appended(lc, q_pos, seed):
    """lc with new tokens at positions q_pos (1, T) appended, random keys and values."""
    G, D = lc.k.shape[1], lc.k.shape[3]
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(1, G, q_pos.shape[1], D, generator=g, dtype=lc.k.dtype) for _ in range(2))
    return lc.append(k, v, q_pos)


def caches(seed):
    """Dense layer caches of every kind a step meets: empty, a fresh prefill, an eviction with
    gaps and heads keeping different positions, a bias log m on some entries, padding."""
    m = tiny(seed, L=1)
    x = torch.randint(1, 50, (1, 12), generator=torch.Generator().manual_seed(seed))
    full = M.prefill(m, x).layers[0]
    idx = torch.tensor([[[0, 3, 5, 11], [1, 3, 7, 11]]])                     # (1, G, 4)
    same = torch.tensor([[[0, 3, 5, 11], [0, 3, 5, 11]]])
    proto = full.bias.clone()
    proto[0, 1, 4] = math.log(3.0)
    pad = full.gather(same)
    pad = replace(pad, pos=pad.pos.index_fill(2, torch.tensor([1]), -1),
                  bias=pad.bias.index_fill(2, torch.tensor([1]), -math.inf))
    return [m.new_cache().layers[0], full, full.gather(idx), full.gather(same),
            replace(full, bias=proto), pad]


@given(seed=st.integers(0, 3), T=st.integers(1, 3), start=st.integers(0, 14))
def test_step_facts_equal_kernel_facts_after_the_append(seed, T, start):
    """For every cache kind and new tokens at start.. start+T−1: the facts read before the
    append (`step_facts`, all layers at once) equal those `attention_sdpa` would read from the
    cache after it (`kernel_facts`)."""
    q_pos = torch.arange(start, start + T)[None]                              # (1, T)
    layers = caches(seed)
    got = FA.step_facts(layers, q_pos)
    for lc, facts in zip(layers, got):
        after = appended(lc, q_pos, seed)
        assert facts == FA.kernel_facts(after.bias, q_pos, after.pos)
