"""Generic tests every rule of the table passes (baselines.RULES): a new rule is checked by these
with no edit here. Tiny random LLaMA in fp64; naive top-k in Python."""
import functools

import pytest
import torch
from hypothesis import given, strategies as st

import baselines as BL
import model as M
import polykv as P
from conftest import REPEAT, tiny as tiny_llama
from engine import observe as OB

SET = P.RuleSettings(window=4, kernel=3, n_sink=2, chunk=5, repeat=REPEAT)


tiny = functools.partial(tiny_llama, L=2)


def naive_topk(scores, k, protected):
    """Python top-k: protected first, higher score, ties to the later position; sorted."""
    order = sorted(range(len(scores)), key=lambda j: (not protected[j], -scores[j], -j))
    return sorted(order[:k])


@pytest.mark.parametrize("name", list(BL.RULES))
@given(budget=st.integers(5, 16), T=st.integers(18, 40), seed=st.integers(0, 3))
def test_rule_keeps_its_top_scored_protected_and_exact_budget(name, budget, T, seed):
    """For every layer and KV head: exactly `budget` entries, the protected ones among them,
    the rest the highest scores (naive top-k over the rule's own scores), sorted by position."""
    m = tiny(seed)
    x = torch.randint(1, 50, (1, T), generator=torch.Generator().manual_seed(seed))
    pol = P.Policy.uniform(name, budget, m.config.n_layers, settings=SET, rules=BL.RULES)
    full, obs = OB.observe(m, x, pol.needs(m))
    cache = pol.compress(m, full, obs)
    assert cache.entries() == m.config.n_layers * m.config.n_kv_heads * budget
    for l, lc in enumerate(cache.layers):
        sc, prot = P.score(
            name, P.ScoreInput(obs.stats[l], full.layers[l].k, l, SET, full.layers[l].v), BL.RULES
        )
        assert sc.shape == (1, m.config.n_kv_heads, T) and prot.shape == (T,)
        for g in range(m.config.n_kv_heads):
            kept = lc.pos[0, g].tolist()
            assert kept == naive_topk(sc[0, g].tolist(), budget, prot.tolist())
            assert set(prot.nonzero()[:, 0].tolist()) <= set(kept) or int(prot.sum()) > budget
            assert torch.equal(lc.k[0, g], full.layers[l].k[0, g, kept])


@pytest.mark.parametrize("name", list(BL.RULES))
def test_rule_compresses_each_batch_row_as_alone(name):
    """A batch of 2 different prompts keeps, per row, what each prompt keeps alone."""
    m, T, budget = tiny(5), 30, 9
    x = torch.randint(1, 50, (2, T), generator=torch.Generator().manual_seed(5))
    pol = P.Policy.uniform(name, budget, m.config.n_layers, settings=SET, rules=BL.RULES)
    both = pol.prefill(m, x)
    for b in range(2):
        alone = pol.prefill(m, x[b:b + 1])
        for lb, la in zip(both.layers, alone.layers):
            assert torch.equal(lb.pos[b], la.pos[0])
            torch.testing.assert_close(lb.k[b], la.k[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", list(BL.RULES))
def test_rule_record_is_complete(name):
    """Its needs are known statistics, its decode form exists, and a budget >= T + n (prompt
    and continuation) is FullKV, decode form included."""
    r = BL.RULES[name]
    assert r.needs <= set(P.ATTENTION_STATISTICS) | {name for name, _ in r.computed}
    assert r.decode in P.DECODE
    m, T = tiny(1), 20
    x = torch.randint(1, 50, (1, T + 3), generator=torch.Generator().manual_seed(1))
    pol = P.Policy.uniform(name, T + 3, m.config.n_layers, settings=SET, rules=BL.RULES)
    cache = pol.prefill(m, x[:, :T])
    want = M.decode(m, x[:, T:], M.prefill(m, x[:, :T]))
    assert torch.allclose(M.decode(m, x[:, T:], cache, pol.decoder), want, atol=1e-12, rtol=0)


def test_knorm_keeps_the_lowest_key_norms():
    """K-norm (Devoto et al. 2024) from its definition: the b keys of smallest ‖k‖ per KV
    head."""
    m, T, budget = tiny(2), 25, 7
    x = torch.randint(1, 50, (1, T), generator=torch.Generator().manual_seed(2))
    full = M.prefill(m, x)
    pol = P.Policy.uniform("knorm", budget, m.config.n_layers, settings=SET, rules=BL.RULES)
    cache = pol.prefill(m, x)
    for lf, lc in zip(full.layers, cache.layers):
        norms = lf.k[0].norm(dim=-1)                                          # (G, T)
        for g in range(m.config.n_kv_heads):
            want = sorted(sorted(range(T), key=lambda j: (norms[g, j].item(), -j))[:budget])
            assert lc.pos[0, g].tolist() == want


def test_pyramidkv_is_not_a_uniform_rule():
    with pytest.raises(M.UsageError, match="use Policy.pyramid"):
        P.Policy.uniform("pyramidkv", 8, 2, rules=BL.RULES)
