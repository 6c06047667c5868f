"""The memory formula (engine/memory.py) against the tensors the code really holds, on a tiny
random LLaMA in fp64: what an observation keeps for the compressions (the FullKV cache with its
append room, every statistic, KVzip's scores, GraceKV's flow, the surprisal) and GraceKV's
per-prompt units, byte for byte. The short-lived working sets are checked against measured
peaks on the embedded model instead (docs/memory.md)."""
import torch

import baselines as BL
import gracekv as GK
from engine import gracekv_fast as GF
import model as M
import polykv as P
from conftest import REPEAT, tiny
from engine import memory as MEM
from engine import observe as OB

T, W = 48, 4


def nbytes(*tensors) -> int:
    """Bytes of the distinct storages behind tensors (None skipped)."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def test_what_an_observation_keeps_equals_the_formula():
    m = tiny()
    L = m.config.n_layers
    x = torch.randint(1, 50, (1, T), generator=torch.Generator().manual_seed(0))
    every = frozenset({"colsum", "window", "last", "queries", "recon"})
    gset = GK.Settings(window=W)
    computed = BL.RULES["expected"].computed + BL.RULES["kvzip"].computed
    needs = OB.union([P.Needs((every,) * L, W, computed, chunk=5, repeat=REPEAT, future=7),
                     GF.needs(gset, L)], L)
    full, obs = OB.observe(m, x, needs)
    s = MEM.Shape.of(m.config, 8)
    sampled = len(GK.depths(gset.hop_depths, L))
    k = MEM.Knobs(window=W, stride=gset.evidence_stride, sampled=sampled)
    want = MEM.held(s, T, MEM.EVERY, k)
    buffers = (getattr(lc.room, f) for lc in full.layers for f in M.LayerCache.FIELDS)
    assert nbytes(*buffers) == want["kv cache"]
    for name in ("colsum", "window", "last", "recon"):
        assert nbytes(*(st[name] for st in obs.stats)) == want[f"{name} (kept)"]
    assert nbytes(*(t for st in obs.stats for t in st["queries"])) == want["queries (kept)"]
    assert nbytes(*(t for value in obs.extra["flow"] for t in value)) == want["flow (kept)"]
    assert nbytes(obs.surprisal) == want["surprisal (kept)"]


def test_gracekv_units_equal_the_formula():
    m = tiny()
    x = torch.randint(1, 50, (1, T), generator=torch.Generator().manual_seed(1))
    gset = GK.Settings(window=W, slot_min=3, slot_max=8, slot_target=5, bend_widths=(2, 3),
                       seeds=3, evidence=4)          # m = 4 evidence probes: the slots hold them
    full, flow = GK.observe(m, x, gset)
    ctx = GK.context(m, full, flow, W, gset)
    u = ctx.units
    got = nbytes(u.kr, u.v, u.k, u.knorm, u.R, u.lg, ctx.sal, u.floor)
    k = MEM.Knobs(window=W, evidence=gset.evidence)
    assert got == MEM.units_bytes(MEM.Shape.of(m.config, 8), T, k)
