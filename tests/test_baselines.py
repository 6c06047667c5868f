"""Expected Attention, KVzip and the head-wise allocations (AdaKV, KVzip's global one) against
naive recomputations, and the ragged layer they are stored in against the dense layout. Tiny
random LLaMA in fp64."""
import functools
import math

import pytest
import torch
from hypothesis import given, strategies as st

import baselines as BL
import model as M
import polykv as P
from conftest import REPEAT, tiny as tiny_llama
from engine import observe as OB

SET = P.RuleSettings(window=4, kernel=3, n_sink=2, chunk=5, repeat=REPEAT, future=7)
tiny = functools.partial(tiny_llama, L=2)


def tokens(T, seed):
    return torch.randint(1, 50, (1, T), generator=torch.Generator().manual_seed(seed))


def layer_inputs(m, x):
    """Naive: the normed input of every attention module during a plain forward."""
    seen = {}
    hooks = [blk.self_attn.register_forward_pre_hook(lambda mod, a, l=l: seen.__setitem__(l, a[0]))
             for l, blk in enumerate(m.layers)]
    m(x)
    for h in hooks:
        h.remove()
    return seen


@given(T=st.integers(8, 30), seed=st.integers(0, 3))
def test_expected_scores_equal_naive_gaussian_estimate(T, seed):
    """μ, Σ from the pre-RoPE queries q_proj(x) past the sinks, R̄ = mean of cos·I + sin·P over
    the next `future` positions (kvpress's matrix), score = softmax_j(μ'·k/√D + ½kᵀΣ'k/D)
    over keys past the sinks, group mean, × ‖v‖; sinks kept."""
    m, x = tiny(seed), tokens(T, seed)
    cfg, n = m.config, SET.n_sink
    H, G, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    full, obs = OB.observe(
        m, x, P.Policy.uniform("expected", 4, cfg.n_layers, settings=SET, rules=BL.RULES).needs(m)
    )
    Pm = torch.zeros(D, D, dtype=torch.float64)
    Pm[D // 2:, :D // 2], Pm[:D // 2, D // 2:] = torch.eye(D // 2), -torch.eye(D // 2)
    R = torch.zeros(D, D, dtype=torch.float64)
    for p in range(T, T + SET.future):
        ang = torch.cat([p * m.inv_freq] * 2)
        R += (torch.diag(ang.cos()) + torch.diag(ang.sin()) @ Pm) / SET.future
    with torch.no_grad():
        inputs = layer_inputs(m, x)
    for l, xin in inputs.items():
        # (T−n, H, D) pre-RoPE
        q = m.layers[l].self_attn.q_proj(xin)[0].detach().view(T, H, D)[n:]
        lc = full.layers[l]
        want = torch.zeros(G, T, dtype=torch.float64)
        for h in range(H):
            mu = q[:, h].mean(0)
            cov = sum(torch.outer(r - mu, r - mu) for r in q[:, h]) / q.shape[0]
            mu, cov = R @ mu, R @ cov @ R.T
            k = lc.k[0, h // (H // G), n:]
            logit = torch.tensor(
                [float(kj @ mu) / math.sqrt(D) + float(kj @ cov @ kj) / (2 * D) for kj in k],
                dtype=torch.float64,
            )
            want[h // (H // G), n:] += torch.softmax(logit, 0) / (H // G)
        want[:, n:] *= lc.v[0, :, n:].norm(dim=-1)
        sc, prot = P.score("expected", P.ScoreInput(obs.stats[l], lc.k, l, SET, lc.v), BL.RULES)
        torch.testing.assert_close(sc[0], want, rtol=1e-9, atol=1e-12)
        assert prot.tolist() == [j < n for j in range(T)]


@given(T=st.integers(6, 26), chunk=st.integers(3, 12), seed=st.integers(0, 3))
def test_kvzip_scores_equal_naive_reconstruction(T, chunk, seed):
    """Each chunk's reconstruction prompt run with the prompt in one plain forward (no cache);
    per layer, query head and pass query u: a softmax over the sinks, the chunk and the pass's
    keys up to u, written out; score_j = max over u. The cache is left as it was."""
    m, x = tiny(seed), tokens(T, seed)
    cfg, n_sink, overlap = m.config, 2, 2
    H, G, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    full = M.prefill(m, x)
    before = [lc.k.clone() for lc in full.layers]
    got = BL.reconstruct(m, full, x, REPEAT, list(range(cfg.n_layers)), n_sink, chunk, overlap)
    want = torch.zeros(cfg.n_layers, H, T, dtype=torch.float64)
    for a in range(0, T, chunk):
        b, sink = min(T, a + chunk), min(n_sink, a)
        lead = list(REPEAT[0]) if a == 0 else list(REPEAT[1]) + x[0, a - overlap:a].tolist()
        ids = lead + list(REPEAT[2]) + x[0, a:b].tolist()
        qk = {}
        M.prefill(m, torch.cat((x, torch.tensor([ids])), 1),
                  M.Hooks(pre_kernel=lambda l, q, k, v, pos: qk.__setitem__(l, (q[0], k[0]))))
        for l, (q, k) in qk.items():
            keys = list(range(sink)) + list(range(a, b))
            for h in range(H):
                for u in range(T, T + len(ids)):
                    cols = keys + list(range(T, u + 1))
                    logit = torch.stack([q[h, u] @ k[h // (H // G), j] for j in cols]) / math.sqrt(
                        D
                    )
                    p = torch.softmax(logit, 0)
                    for i, j in enumerate(cols[:len(keys)]):
                        if j >= a:
                            want[l, h, j] = max(want[l, h, j], p[i])
    # the first layer alone: the pass stops after it, its scores the same
    first = BL.reconstruct(m, full, x, REPEAT, [0], n_sink, chunk, overlap)
    assert list(first) == [0]
    torch.testing.assert_close(first[0][0], want[0], rtol=1e-9, atol=1e-12)
    for l in range(cfg.n_layers):
        torch.testing.assert_close(got[l][0], want[l], rtol=1e-9, atol=1e-12)
        assert torch.equal(full.layers[l].k, before[l])


def naive_headwise(scores, prot, budget, scope, alpha):
    """Python: per (layer, head) protected and (with α) each head's top ⌊α·B⌋ (at least 1)
    first, then the best (score, later layer, later head, later position) pairs of the layer (scope
    layer) or of all layers (scope model) up to G·B per layer."""
    L, G, T = len(scores), *scores[0].shape
    key = {}
    for l in range(L):
        for g in range(G):
            s = [math.inf if prot[l][j] else float(scores[l][g, j]) for j in range(T)]
            if alpha:
                top = sorted(range(T), key=lambda j: (-s[j], -j))[:max(1, int(budget * alpha))]
                s = [math.inf if j in top else s[j] for j in range(T)]
            for j in range(T):
                key[l, g, j] = s[j]
    groups = (
        [[k for k in key]]
        if scope == "model"
        else [[k for k in key if k[0] == l] for l in range(L)]
    )
    kept = set()
    for grp in groups:
        order = sorted(grp, key=lambda k: (-key[k], -k[0], -k[1], -k[2]))
        kept |= set(order[: len(grp) // T * budget])
    return [
        [sorted(j for (ll, gg, j) in kept if ll == l and gg == g) for g in range(G)]
        for l in range(L)
    ]


@pytest.mark.parametrize("name", ["adakv", "kvzip", "adakv-knorm", "adakv-expected"])
@given(budget=st.integers(3, 12), T=st.integers(14, 30), seed=st.integers(0, 3))
def test_headwise_keeps_naive_allocation_exact_entries_ragged(name, budget, T, seed):
    """Kept sets equal the naive allocation over the rule's own scores; entries = L·G·B exactly
    and allocated slots = entries (ragged: no padding); protected entries kept in every head."""
    m, x = tiny(seed), tokens(T, seed)
    rule, scope, alpha = BL.allocation(name)
    meth = BL.Headwise(rule, budget, scope, alpha, SET)
    full, obs = OB.observe(m, x, meth.needs(m))
    cache = meth.compress(m, full, obs)
    cfg = m.config
    sc = [
        P.score(rule, P.ScoreInput(obs.stats[l], lc.k, l, SET, lc.v), BL.RULES)
        for l, lc in enumerate(full.layers)
    ]
    want = naive_headwise([s[0][0] for s in sc], [s[1].tolist() for s in sc], budget, scope, alpha)
    got = [
        [lc.pos[0, 0][lc.head[0, 0] == g].tolist() for g in range(cfg.n_kv_heads)]
        for lc in cache.layers
    ]
    assert got == want
    assert cache.entries() == cache.allocated() == cfg.n_layers * cfg.n_kv_heads * budget
    if scope == "layer":
        assert all(lc.size == cfg.n_kv_heads * budget for lc in cache.layers)
    for l, (_, prot) in enumerate(sc):
        for g in range(cfg.n_kv_heads):
            assert set(prot.nonzero()[:, 0].tolist()) <= set(got[l][g]) or int(prot.sum()) > budget


@given(
    budget=st.integers(3, 10), T=st.integers(12, 24), n=st.integers(1, 5), seed=st.integers(0, 3)
)
def test_ragged_layer_attends_as_its_padded_dense_form(budget, T, n, seed):
    """Teacher-forcing n tokens after a ragged AdaKV cache gives the logits of the same kept
    sets stored densely (each head padded to the longest, padding masked), and the dense form
    holds exactly each head's gathered FullKV entries; appends keep the ragged layout."""
    m, x = tiny(seed), tokens(T, seed)
    meth = BL.Headwise("snapkv", budget, "layer", 0.2, SET)
    full, obs = OB.observe(m, x, meth.needs(m))
    ragged = meth.compress(m, full, obs)
    G = m.config.n_kv_heads
    dense = M.Cache([lc.dense(G) for lc in ragged.layers], ragged.next_pos, ragged.last_logits)
    for lr, ld, lf in zip(ragged.layers, dense.layers, full.layers):
        for g in range(G):
            mine = ld.pos[0, g] >= 0
            assert torch.equal(ld.k[0, g, mine], lf.k[0, g, ld.pos[0, g, mine]])
            assert torch.equal(ld.v[0, g, mine], lf.v[0, g, ld.pos[0, g, mine]])
    y = tokens(n, seed + 7)
    a, b = M.decode(m, y, ragged.fork()), M.decode(m, y, dense.fork())
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    c = ragged.fork()
    M.decode(m, y, c)
    assert c.entries() == c.allocated() == ragged.entries() + m.config.n_layers * G * n


@pytest.mark.parametrize("name", ["adakv", "kvzip"])
def test_headwise_budget_at_least_T_is_fullkv(name):
    m, x = tiny(1), tokens(12, 1)
    rule, scope, alpha = BL.allocation(name)
    cache = BL.Headwise(rule, 12, scope, alpha, SET).prefill(m, x)
    full = M.prefill(m, x)
    assert all(torch.equal(a.k, b.k) and a.head is None for a, b in zip(cache.layers, full.layers))


@pytest.mark.parametrize("rows", [256, 3])
def test_scored_attention_is_the_attention_and_the_subset_softmax(rows):
    """KVzip's pass kernel on a cache of T prompt keys + the pass's n own keys: its output is
    model.attention's (every prompt key visible, own keys causal), and its A_rec is the softmax
    over the sinks, the chunk and the own keys up to each query, read at the chunk, max over
    the queries: in one block and in blocks of a few queries."""
    g = torch.Generator().manual_seed(3)
    B, H, G, D, T, n = 1, 4, 2, 8, 20, 7
    sink, a, b = 2, 9, 15
    k, v = (torch.randn(B, G, T + n, D, generator=g, dtype=torch.float64) for _ in range(2))
    q = 3 * torch.randn(B, H, n, D, generator=g, dtype=torch.float64)
    pos = torch.arange(T + n).expand(B, G, T + n)
    lc = M.LayerCache(k, v, pos, torch.zeros(B, G, T + n, dtype=torch.float64))
    q_pos = torch.arange(T, T + n)[None]
    out, rec = BL.scored_attention(q, lc, (sink, a, b), rows)
    torch.testing.assert_close(out, M.attention(q, k, v, lc.bias, q_pos, pos), rtol=1e-12,
                               atol=1e-14)
    for h in range(H):
        for j in range(a, b):
            best = 0.0
            for u in range(n):
                cols = list(range(sink)) + list(range(a, b)) + list(range(T, T + u + 1))
                logit = torch.stack([q[0, h, u] @ k[0, h // (H // G), c] for c in cols])
                best = max(best, float(torch.softmax(logit / math.sqrt(D), 0)[cols.index(j)]))
            assert float(rec[0, h, j - a]) == pytest.approx(best, rel=1e-12)
