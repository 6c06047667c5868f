"""GraceKV's engine paths (engine/gracekv_fast.py, engine/gracekv_variants.py) against the
paper's path they replace (gracekv.py: its own naive observation, node statistics node by node,
the budget flow one action at a time): the same observed Flow to rounding, and the same kept
sets (positions and KV head of every entry) and decoded logits, for `gracekv` and every row of
the variant table at T = 256 (tiny random LLaMA, fp64), for `gracekv` and two rows on the
embedded model at T = 1,024 (fp32), and under each protocol (the `context` cut of the flow,
the `agnostic` prefix observed within the whole prompt)."""
import pytest
import torch

import gracekv as GK
import model as M
import polykv as P
from conftest import tiny
from engine import gracekv_fast as GF
from engine import gracekv_variants as V
from engine import observe as OB
from engine import protocols as PR
from support import tasks as TK

SMALL = dict(window=4, slot_min=3, slot_max=8, slot_target=5, bend_widths=(2, 3), prefetch=3,
             seeds=3, evidence=4, evidence_stride=3)
N = 6                               # decoded tokens

pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.one_thread


def row(name: str, over: dict = SMALL) -> tuple:
    """(settings, formulas) of the variant row `name` with the settings `over` first."""
    return V.build({**over, **V.overrides(name)})


def fast_cache(m, x, name: str, budget: int, over: dict = SMALL, memo=None):
    """The harness's path: the shared observation of the row alone, the fast GraceKV."""
    settings, formulas = row(name, over)
    method = GF.fast(budget, settings, formulas, memo, V.FAST)
    full, obs = OB.observe(m, x, method.needs(m))
    return method.compress(m, full, obs)


def paper_cache(m, x, name: str, budget: int, over: dict = SMALL, observed=None):
    """The paper's path: gracekv.observe, node_statistics, allocate (observed: a (full, Flow)
    of gracekv.observe to reuse)."""
    settings, formulas = row(name, over)
    method = GK.GraceKV(budget, settings, formulas)
    full, flow = observed or GK.observe(m, x, settings, formulas)
    return method.compress_flow(m, full, flow)


def assert_same(m, a, b, tokens, tol: float):
    """The same kept sets (every layer's positions and KV heads), the prototypes to rounding,
    and the same logits (to tol) of `tokens` decoded after each."""
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.pos, lb.pos) and torch.equal(la.head, lb.head)
        torch.testing.assert_close(la.bias, lb.bias, rtol=tol, atol=tol)
        torch.testing.assert_close(la.k, lb.k, rtol=tol, atol=tol)
        torch.testing.assert_close(la.v, lb.v, rtol=tol, atol=tol)
    torch.testing.assert_close(M.decode(m, tokens, a.fork()), M.decode(m, tokens, b.fork()),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("name", ["gracekv", "gracekv-dense"])
def test_streamed_flow_equals_the_naive_observation(name):
    """ValueFlow (DenseFlow) in the shared observation's query chunks against gracekv.observe's
    whole attention matrices: every field of the Flow, each layer, to rounding (fp64)."""
    m = tiny(2)
    x = torch.randint(1, 50, (1, 40), generator=torch.Generator().manual_seed(2))
    s, f = row(name, {**SMALL, "hop_depths": (0.0, 1.0)})
    _, naive = GK.observe(m, x, s, f)
    _, fast = GF.Shared(V.FAST[f.first_hop]).observe(m, x, s, f, chunk=5)
    for field in ("probes", "flow", "queries", "strided", "lse"):
        for a, b in zip(getattr(fast, field), getattr(naive, field)):
            assert (a is None) == (b is None), field
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert fast.phase == naive.phase
    torch.testing.assert_close(fast.surprisal, naive.surprisal, rtol=1e-10, atol=1e-12)
    assert len(naive.flow[0]) == (s.hops + 1 if name == "gracekv-dense" else 1)


@pytest.mark.parametrize("name", list(V.VARIANTS))
def test_every_row_equals_the_paper_path_at_T256(name):
    """Each row of the table: its fast GraceKV (the harness's) and its paper path keep the same
    entries and decode the same logits, T = 256 (tiny, fp64); `gracekv` at two budgets."""
    m = tiny(1)
    T = 250
    x = torch.randint(1, 50, (1, T + N), generator=torch.Generator().manual_seed(1))
    observed = GK.observe(m, x[:, :T], *row(name))
    for budget in (24, 64) if name == "gracekv" else (40,):
        a = fast_cache(m, x[:, :T], name, budget)
        b = paper_cache(m, x[:, :T], name, budget, observed=observed)
        assert_same(m, a, b, x[:, T:], 1e-9)


@pytest.mark.parametrize("protocol", PR.PROTOCOLS)
@pytest.mark.parametrize("name", ["gracekv", "gracekv-v1"])
def test_each_protocol_equals_the_paper_path(protocol, name):
    """Under each protocol (support/protocols.py) as evaluate.run_protocol runs it: `context`
    cuts the shared observation (ValueFlow.cut) and the paper's Flow alike (cut_flow) to the
    context, compresses it and joins the exact prefix and question back; `agnostic` observes the
    prefix + context within the whole prompt's pass (engine/observe.observe_prefixes) where the
    paper
    observes it alone, then feeds the question. Same kept sets, same logits (fp64)."""
    m = tiny(3)
    T, a, b, budget = 120, 7, 110, 24
    x = torch.randint(1, 50, (1, T + N), generator=torch.Generator().manual_seed(3))
    settings, formulas = row(name)
    method = GF.fast(budget, settings, formulas, GF.context_memo(), V.FAST)
    end = b if protocol == "agnostic" else T
    needs = OB.union([method.needs(m)], m.config.n_layers)
    full, obs = OB.observe_prefixes(m, x[:, :T], needs, (T, end))[end]
    naive_full, flow = GK.observe(m, x[:, :end], settings, formulas)
    if protocol == "context":
        part, part_obs = PR.cut(full, obs, needs, a, b)
        stride = settings.evidence_stride if settings.evidence else 0
        naive_part = PR.cut(naive_full, P.Observation([{}] * m.config.n_layers), P.Needs(),
                            a, b)[0]
        flow = GF.cut_flow(flow, a, b, stride)
    else:
        part, part_obs, naive_part = full, obs, naive_full
    fast = method.compress(m, part, part_obs)
    paper = GK.GraceKV(budget, settings, formulas).compress_flow(m, naive_part, flow)
    for la, lb in zip(fast.layers, paper.layers):
        assert torch.equal(la.pos, lb.pos) and torch.equal(la.head, lb.head)
        torch.testing.assert_close(la.k, lb.k, rtol=1e-9, atol=1e-9)
    if protocol == "context":
        fast, paper = PR.join(full, fast, a, b), PR.join(naive_full, paper, a, b)
    follow = x[:, end:]                       # agnostic: the question, then the continuation
    torch.testing.assert_close(M.decode(m, follow, fast.fork()), M.decode(m, follow, paper.fork()),
                               rtol=1e-9, atol=1e-9)


def test_prefill_of_the_paper_alone_equals_the_fast_prefill():
    """GraceKV(budget).prefill (the paper's own observation and steps, nothing from the engine)
    against engine.gracekv_fast.fast(budget).prefill (the shared observation's pass); the
    paper's GraceKV cannot take part in a shared observation (it says so)."""
    m = tiny(4)
    x = torch.randint(1, 50, (1, 80), generator=torch.Generator().manual_seed(4))
    settings = GK.Settings(**SMALL)
    a = GK.GraceKV(20, settings).prefill(m, x)
    b = GF.fast(20, settings).prefill(m, x)
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.pos, lb.pos) and torch.equal(la.head, lb.head)
    paper = GK.GraceKV(20, settings)
    full, obs = OB.observe(m, x, paper.needs(m))
    with pytest.raises(M.UsageError, match="observes its own prefill"):
        paper.compress(m, full, obs)


@pytest.mark.embedded
def test_embedded_model_at_1024_tokens_equals_the_paper_path(embedded):
    """The embedded model (fp32), one 1,024-token prompt at B = 128: `gracekv` and the row
    whose extraction leaves a hole (gracekv-hole), fast (the harness's: one shared observation
    of both rows, the per-prompt memo) against the paper's path (one gracekv.observe: both rows
    observe the paper's first hop): the same kept sets, logits to fp32 rounding. (Every row
    at T = 256: test_every_row_equals_the_paper_path_at_T256.)"""
    m, tok = embedded
    ids, cont = TK.fidelity_text(tok, 1024, N, index=0)
    x, follow = torch.tensor([ids]), torch.tensor([cont])
    default = dict(GK.Settings().__dict__)
    names, budget = ("gracekv", "gracekv-hole"), 128
    fast = [GF.fast(budget, *row(name, default), GF.context_memo(), V.FAST) for name in names]
    needs = OB.union([method.needs(m) for method in fast], m.config.n_layers)
    full, obs = OB.observe(m, x, needs)
    observed = GK.observe(m, x, *row("gracekv", default))
    for name, method in zip(names, fast):
        a = method.compress(m, full, obs)
        b = paper_cache(m, x, name, budget, default, observed)
        for la, lb in zip(a.layers, b.layers):
            assert torch.equal(la.pos, lb.pos) and torch.equal(la.head, lb.head), name
            torch.testing.assert_close(la.bias, lb.bias, rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(M.decode(m, follow, a.fork()), M.decode(m, follow, b.fork()),
                                   rtol=1e-3, atol=1e-3)
