"""The fast paths against the naive forms they replace: the shared observation in query chunks
(engine/observe.py, polykv.observe's default) against the whole attention matrix of each
layer (OB.observe_layer_whole), for every method that needs no calibration: the same
statistics, the same kept sets and the same decoded logits; and GraceKV's budget flow with the
splits evaluated ahead in batches (engine.gracekv_fast.allocate_prefetched, the harness's)
against the paper's loop one node at a time (gracekv.allocate); GraceKV's other engine paths:
tests/test_gracekv_fast.py. Tiny random LLaMA in fp64, chunks of 5
query rows so that every prompt takes several."""
from dataclasses import replace

import pytest
import torch

import gracekv as GK
from engine import gracekv_fast as GF
from engine import gracekv_variants as V
import model as M
import polykv as P
from conftest import REPEAT, tiny
from engine import harness as H
from engine import observe as OB
import baselines as BL

SET = P.RuleSettings(window=4, kernel=3, n_sink=2, chunk=5, repeat=REPEAT, future=7)
GRACE = "[window=4;slot_min=3;slot_max=8;slot_target=5;bend_widths=(2,3);prefetch=3;seeds=3]"
T, BUDGET, N = 40, 12, 4
NAMES = [n for n in H.all_methods() if H.family(n) != "polykv" and n != "full"]

pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.one_thread


def make(name: str, L: int) -> P.Method:
    if V.is_row(name):
        return V.variant(name + GRACE, BUDGET)
    return H.method(name, BUDGET, L, SET)


def same_statistics(a, b):
    """Two observations: every statistic of every layer equal to rounding (fp64)."""
    for la, lb in zip(a.stats, b.stats):
        assert la.keys() == lb.keys()
        for k in la:
            for x, y in zip(*(v if isinstance(v, tuple) else (v,) for v in (la[k], lb[k]))):
                torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-13)
    for name in a.extra:
        for va, vb in zip(a.extra[name], b.extra[name]):
            for x, y in zip(va, vb):
                if isinstance(x, torch.Tensor):
                    torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-13)
                else:
                    assert x == y


@pytest.mark.parametrize("seed", [0, 1])
def test_chunked_observation_equals_the_naive_one_for_every_method(seed):
    m = tiny(seed)
    x = torch.randint(1, 50, (1, T + N), generator=torch.Generator().manual_seed(seed))
    methods = {n: make(n, m.config.n_layers) for n in NAMES}
    needs = OB.union([meth.needs(m) for meth in methods.values()], m.config.n_layers)
    assert needs.chunk == 5 and needs.extra           # several chunks; GraceKV's flow too
    full, fast = OB.observe(m, x[:, :T], needs)
    _, naive = OB.observe(m, x[:, :T], needs, layer_pass=OB.observe_layer_whole)
    same_statistics(fast, naive)
    for name, meth in methods.items():
        a, b = meth.compress(m, full, fast), meth.compress(m, full, naive)
        for la, lb in zip(a.layers, b.layers):
            assert torch.equal(la.pos, lb.pos), name              # the same kept sets
            assert torch.equal(la.bias, lb.bias) or name.startswith("gracekv"), name
            torch.testing.assert_close(la.bias, lb.bias, rtol=1e-9, atol=1e-12)
        la = M.decode(m, x[:, T:], a.fork(), meth.decoder)
        lb = M.decode(m, x[:, T:], b.fork(), meth.decoder)
        torch.testing.assert_close(la, lb, rtol=1e-8, atol=1e-10)


def test_the_naive_layer_pass_reads_the_whole_matrix():
    """observe_layer_naive against a hand computation from model.attention_probs: colsum,
    window and last of one layer."""
    m = tiny(3)
    x = torch.randint(1, 50, (1, 20), generator=torch.Generator().manual_seed(3))
    seen = {}

    def spy(layer, q, q_pos, lc, out):
        seen[layer] = (q, q_pos, lc)
    OB.observe(m, x, P.Needs(), spy=spy)
    q, q_pos, lc = seen[1]
    out, _ = OB.observe_layer_whole(q, q_pos, lc, ("colsum", "window", "last"), 6)[x.shape[1]]
    A = M.attention_probs(q, lc.k, lc.bias, q_pos, lc.pos)                # (1, H, T, T)
    Tn = x.shape[1]
    for h in range(A.shape[1]):
        for j in range(Tn):
            assert out["colsum"][0, h, j] == pytest.approx(sum(float(A[0, h, i, j])
                                                               for i in range(Tn)), abs=1e-12)
            assert out["window"][0, h, j] == pytest.approx(sum(float(A[0, h, i, j])
                                                               for i in range(Tn - 6, Tn)),
                                                           abs=1e-12)
            assert out["last"][0, h, j] == A[0, h, Tn - 1, j]


@pytest.mark.parametrize("seed", [0, 1])
def test_the_fused_kernel_is_the_models_attention(seed):
    """Where the statistics read every query row, the chunked pass computes the layer's
    attention output too (OB.observe_prefixes, fuse): that output is model.attention's, the
    statistics, cache and kept sets those of the pass beside the model's own kernel (fuse=False),
    and the last logits too, to rounding (fp64). H2O's column sums make every layer fused; the
    query rows go in several chunks (FUSED_ROWS > T, so needs.chunk = 5 sets them)."""
    m = tiny(seed)
    x = torch.randint(1, 50, (1, T + N), generator=torch.Generator().manual_seed(seed))
    methods = {n: make(n, m.config.n_layers) for n in NAMES}
    needs = OB.union([meth.needs(m) for meth in methods.values()], m.config.n_layers)
    assert all("colsum" in names for names in needs.stats)
    outs = {}

    def spy(layer, q, q_pos, lc, out):
        outs[layer] = out, M.attention(q, lc.k, lc.v, lc.bias, q_pos, lc.pos)
    full, fused = OB.observe_prefixes(m, x[:, :T], needs, (T,), spy)[T]
    plain_full, plain = OB.observe_prefixes(m, x[:, :T], needs, (T,), fuse=False)[T]
    assert len(outs) == m.config.n_layers
    for out, explicit in outs.values():
        torch.testing.assert_close(out, explicit, rtol=1e-12, atol=1e-14)
    same_statistics(fused, plain)
    torch.testing.assert_close(full.last_logits, plain_full.last_logits, rtol=1e-10, atol=1e-12)
    for name, meth in methods.items():
        a, b = meth.compress(m, full, fused), meth.compress(m, plain_full, plain)
        for la, lb in zip(a.layers, b.layers):
            assert torch.equal(la.pos, lb.pos), name
            torch.testing.assert_close(la.k, lb.k, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("layer_pass", [OB.observe_layer, OB.observe_layer_whole])
@pytest.mark.parametrize("b", [T - 7, T - 5, T - 1])
def test_one_pass_observes_the_prompt_and_its_prefix(layer_pass, b):
    """One prefill of the whole prompt observes the prefix tokens[:, :b] too (the `agnostic`
    protocol's prefix + context; OB.observe_prefixes): its statistics, cache, last logits
    and surprisal, and every method's kept set and decoded logits, equal those of a prefill of
    the prefix alone; the whole prompt's equal a prefill observing it alone. b − T of 7, 5 and 1
    rows: the prefix ends inside a chunk of 5 query rows, at its edge, and one row short."""
    m = tiny(0)
    x = torch.randint(1, 50, (1, T + N), generator=torch.Generator().manual_seed(0))
    methods = {n: make(n, m.config.n_layers) for n in NAMES}
    needs = replace(OB.union([meth.needs(m) for meth in methods.values()], m.config.n_layers),
                    surprisal=True)
    both = OB.observe_prefixes(m, x[:, :T], needs, (T, b), layer_pass=layer_pass)
    for e in (T, b):
        full, obs = both[e]
        alone_full, alone = OB.observe(m, x[:, :e], needs, layer_pass=layer_pass)
        same_statistics(obs, alone)
        torch.testing.assert_close(obs.surprisal, alone.surprisal, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(full.last_logits, alone_full.last_logits, rtol=1e-10,
                                   atol=1e-12)
        assert full.next_pos == alone_full.next_pos == e
        for la, lb in zip(full.layers, alone_full.layers):
            torch.testing.assert_close(la.k, lb.k, rtol=1e-10, atol=1e-12)
            assert torch.equal(la.pos, lb.pos)
        for name, meth in methods.items():
            a, c = meth.compress(m, full, obs), meth.compress(m, alone_full, alone)
            for la, lc in zip(a.layers, c.layers):
                assert torch.equal(la.pos, lc.pos), (name, e)      # the same kept sets
            la = M.decode(m, x[:, e:], a.fork(), meth.decoder)
            lc = M.decode(m, x[:, e:], c.fork(), meth.decoder)
            torch.testing.assert_close(la, lc, rtol=1e-8, atol=1e-10)
    with pytest.raises(M.UsageError, match="prefix lengths"):
        OB.observe_prefixes(m, x[:, :T], needs, (T + 1,))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("variant", ["gracekv", "gracekv-massgain"])
def test_prefetched_budget_flow_equals_the_paper_loop(seed, variant):
    """The same actions in the same order (kind, unit, span, cost), gains equal to rounding, the
    same cache, at budgets from a few entries past the window to most of the prompt."""
    m = tiny(seed)
    x = torch.randint(1, 50, (1, T), generator=torch.Generator().manual_seed(seed))
    method = V.variant(variant + GRACE, BUDGET)
    settings, formulas = method.settings, method.formulas
    full, obs = OB.observe(m, x, method.needs(m))
    flow = GF.flow_of(obs, settings.window)

    def spans(plan):
        return [(k, plan.nodes[v].unit, plan.nodes[v].a, plan.nodes[v].b, c)
                for k, v, g, c in plan.steps]
    for budget in (6, 9, BUDGET, 20, 30):
        fast, a = GK.compress(m, full, flow, budget, settings, True, formulas,
                              budget_flow=GF.allocate_prefetched, node_stats=method.node_stats)
        naive, b = GK.compress(m, full, flow, budget, settings, True, formulas,
                               budget_flow=GK.allocate, node_stats=method.node_stats)
        assert spans(a) == spans(b) and a.dropped == b.dropped, (variant, budget)
        assert [s[2] for s in a.steps] == pytest.approx([s[2] for s in b.steps], rel=1e-12)
        for la, lb in zip(fast.layers, naive.layers):
            assert torch.equal(la.pos, lb.pos)
            torch.testing.assert_close(la.k, lb.k, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(la.bias, lb.bias, rtol=1e-12, atol=1e-14)


def test_the_whole_pipeline_runs_on_the_naive_forms_alone():
    """Every method that needs no calibration, and a mixed per-layer PolyKV policy, run end to
    end on the naive forms alone (the explicit attention and concatenating appends,
    `model.Llama(cfg)` (no speed handed in); each layer's statistics from its whole attention
    matrix,
    `OB.observe_layer_whole`; GraceKV's node statistics and budget flow one node at a time,
    `gracekv.node_statistics`, `gracekv.allocate`)
    keep the same sets and decode the same logits, to rounding, as with every fast path on.
    (KVzip's reconstruction pass has one form, tested against the naive reconstruction in
    tests/test_baselines.py.)"""
    fast_model, naive_model = tiny(4), tiny(4, fast=False)
    assert naive_model.speed is None and fast_model.speed is not None
    L = fast_model.config.n_layers
    x = torch.randint(1, 50, (1, T + N), generator=torch.Generator().manual_seed(4))
    methods = {n: make(n, L) for n in NAMES}
    rules = P.prefill_rules(BL.RULES)
    mixed = P.Policy([P.LayerPolicy((rules[l % len(rules)], BUDGET), ("append", 0))
                      for l in range(L)], BUDGET, SET, rules=BL.RULES)
    methods["polykv (mixed rules)"] = mixed
    needs = OB.union([meth.needs(fast_model) for meth in methods.values()], L)
    full, fast = OB.observe(fast_model, x[:, :T], needs)
    full_naive, naive = OB.observe(naive_model, x[:, :T], needs,
                                  layer_pass=OB.observe_layer_whole)
    same_statistics(fast, naive)
    for name, meth in methods.items():
        slow = meth
        if isinstance(meth, GK.GraceKV):              # the paper's node statistics and flow
            slow = replace(meth, budget_flow=GK.allocate, node_stats=GK.node_statistics)
        a = meth.compress(fast_model, full, fast)
        b = slow.compress(naive_model, full_naive, naive)
        for la, lb in zip(a.layers, b.layers):
            assert torch.equal(la.pos, lb.pos), name              # the same kept sets
            torch.testing.assert_close(la.bias, lb.bias, rtol=1e-9, atol=1e-12)
        la = M.decode(fast_model, x[:, T:], a.fork(), meth.decoder)
        lb = M.decode(naive_model, x[:, T:], b.fork(), slow.decoder)
        torch.testing.assert_close(la, lb, rtol=1e-8, atol=1e-10)
