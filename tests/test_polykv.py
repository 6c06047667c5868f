"""Eviction rules and policies against naive recomputations (tiny random LLaMA, fp64)."""
import json

import pytest
import torch
from hypothesis import given, strategies as st

import baselines as BL
import model as M
import polykv as P
from engine.observe import causal_probs
from model import UsageError
from conftest import REPEAT, tiny as tiny_llama
from engine import observe as OB

# small enough for tiny prompts
SET = P.RuleSettings(window=4, kernel=3, n_sink=2, chunk=3, repeat=REPEAT)
COMPRESSING = tuple(BL.RULES) + ("pyramidkv",)     # every registered rule + the pyramid schedule
ALL = ("full",) + COMPRESSING


tiny = tiny_llama


def policy(rule, budget, m, T):
    if rule == "pyramidkv":
        return P.Policy.pyramid(budget, m.config.n_layers, T, SET)
    return P.Policy.uniform(rule, budget, m.config.n_layers, settings=SET, rules=BL.RULES)


def full_attention_maps(m, tokens):
    """Naive: every layer's full A (B, H, T, T) from the explicit kernel."""
    maps = {}

    def post(layer, q, q_pos, lc, out):
        maps[layer] = M.attention_probs(q, lc.k, lc.bias, q_pos, lc.pos)
    M.prefill(m, tokens, M.Hooks(post_kernel=post))
    return maps


def naive_topk(scores, k, protected):
    """Python top-k: protected first, higher score, ties to the later position; sorted."""
    S = len(scores)
    order = sorted(range(S), key=lambda j: (not protected[j], -scores[j], -j))
    return sorted(order[:k])


@given(st.sampled_from(ALL), st.integers(12, 30), st.integers(0, 3))
def test_budget_at_least_T_is_fullkv(rule, T, seed):
    m = tiny(seed)
    tokens = torch.randint(1, 50, (1, T + 4), generator=torch.Generator().manual_seed(seed))
    prompt, cont = tokens[:, :T], tokens[:, T:]
    ref = M.prefill(m, prompt)
    first = ref.last_logits
    want = M.decode(m, cont, ref)
    pol = policy(rule, T + 4, m, T)
    cache = P.prefill(m, prompt, pol)
    # the observation's prefill: the model's kernel, or where the statistics read every query
    # row the chunked pass's own A·V (OB.observe_prefixes), the same to fp64 rounding
    assert torch.allclose(cache.last_logits, first, atol=1e-12, rtol=0)
    # rules with a decoder feed the continuation token by token, FullKV in one step:
    # the same attention up to fp64 summation order (MKL blocks by row count)
    assert torch.allclose(M.decode(m, cont, cache, pol.decoder), want, atol=1e-12, rtol=0)


@given(st.sampled_from(ALL), st.integers(5, 20), st.integers(12, 40), st.integers(0, 3))
def test_kept_counts_sorted_and_protected(rule, budget, T, seed):
    m = tiny(seed)
    tokens = torch.randint(1, 50, (1, T), generator=torch.Generator().manual_seed(seed))
    pol = policy(rule, budget, m, T)
    cache = P.prefill(m, tokens, pol)
    for l, lc in enumerate(cache.layers):
        b = min(pol.layers[l].prefill[1], T) if rule != "full" else T
        assert lc.pos.shape == (1, m.config.n_kv_heads, b) and lc.k.shape[2] == b
        assert (lc.pos[..., 1:] > lc.pos[..., :-1]).all()            # sorted, no duplicates
        kept = set(lc.pos[0, 0].tolist())
        if rule in ("h2o", "snapkv", "pyramidkv") and b < T and b >= SET.window:
            assert set(range(T - SET.window, T)) <= kept
        if rule == "streaming" and b < T:
            assert kept == set(range(SET.n_sink)) | set(range(T - (b - SET.n_sink), T))
    if rule != "full":   # the budget contract: at most L·G·B entries in all
        assert cache.entries() <= m.config.n_layers * m.config.n_kv_heads * budget


@given(st.integers(14, 40), st.integers(0, 3))
def test_scores_equal_naive_recomputation(T, seed):
    m = tiny(seed)
    tokens = torch.randint(1, 50, (1, T), generator=torch.Generator().manual_seed(seed))
    maps = full_attention_maps(m, tokens)
    needs = P.Needs((frozenset(OB.ATTENTION_STATS),) * m.config.n_layers, SET.window,
                    chunk=SET.chunk)
    full, obs = OB.observe(m, tokens, needs)                  # chunk=3: several query chunks
    stats = obs.stats
    H, G = m.config.n_heads, m.config.n_kv_heads
    w, k = SET.window, SET.kernel
    for l, A in maps.items():
        A = A[0]                                               # (H, T, T)
        assert torch.allclose(stats[l]["colsum"][0], A.sum(1), atol=1e-12)
        assert torch.allclose(stats[l]["last"][0], A[:, -1], atol=1e-12)
        assert torch.allclose(stats[l]["window"][0], A[:, -w:].sum(1), atol=1e-12)
        # H2O: group mean of column sums; SnapKV: window sums on j < T−w, max-pooled, group mean
        for rule in ("h2o", "snapkv", "tova"):
            sc, prot = P.score(
                rule, P.ScoreInput(stats[l], full.layers[l].k, l, SET, full.layers[l].v)
            )
            for gk in range(G):
                heads = range(gk * H // G, (gk + 1) * H // G)
                if rule == "h2o":
                    want = [
                        sum(float(A[h, :, j].sum()) for h in heads) / len(heads) for j in range(T)
                    ]
                elif rule == "tova":
                    want = [sum(float(A[h, -1, j]) for h in range(H)) / H for j in range(T)]
                else:
                    raw = [[float(A[h, -w:, j].sum()) for j in range(T - w)] for h in heads]
                    pool = [
                        [max(r[max(0, j - k // 2) : j + k // 2 + 1]) for j in range(T - w)]
                        for r in raw
                    ]
                    want = [sum(p[j] for p in pool) / len(pool) for j in range(T - w)] + [0.0] * w
                assert torch.allclose(sc[0, gk], torch.tensor(want, dtype=sc.dtype), atol=1e-12)
                budget = T // 2
                got = P.select(sc, budget, prot)[0, gk].tolist()
                assert got == naive_topk(want, budget, prot.tolist())


@given(st.lists(st.integers(0, 3), min_size=6, max_size=30), st.integers(1, 30))
def test_select_top_k_ties_to_later(scores, k):
    k = min(k, len(scores))
    prot = torch.zeros(len(scores), dtype=torch.bool)
    prot[0] = True
    got = P.select(torch.tensor(scores, dtype=torch.float64).view(1, 1, -1), k, prot)[0, 0].tolist()
    assert got == naive_topk(scores, k, prot.tolist())


@given(st.integers(40, 600), st.integers(33, 400), st.integers(2, 40))
def test_pyramid_budgets_formula(T, budget, L):
    w, beta = 32, 20.0
    bs = P.pyramid_budgets(budget, T, L, w, beta)
    assert sum(bs) == L * budget                               # average exactly B
    assert all(a >= b for a, b in zip(bs, bs[1:]))             # decreasing with depth
    if T > budget:
        lo, hi = (budget - w) / beta, 2 * (budget - w) - (budget - w) / beta
        if hi > T - w:
            hi, lo = T - w, 2 * (budget - w) - (T - w)
        for l, b in enumerate(bs):
            assert abs(b - (hi - l * (hi - lo) / (L - 1) + w)) < 1  # formula up to rounding


@given(st.sampled_from(COMPRESSING), st.integers(6, 14), st.integers(16, 32), st.integers(0, 2))
def test_decode_over_kept_equals_masked_full_attention(rule, budget, T, seed):
    """Decoding with a gathered (smaller) cache = full cache with the other keys at −inf."""
    m = tiny(seed, fast=False)
    tokens = torch.randint(1, 50, (1, T + 1), generator=torch.Generator().manual_seed(seed))
    pol = policy(rule, budget, m, T)
    pol = P.Policy([P.LayerPolicy(lp.prefill, ("append", lp.decode[1])) for lp in pol.layers],
                   pol.budget, pol.settings, rules=pol.rules)
    cache = P.prefill(m, tokens[:, :T], pol)
    kept = [lc.pos for lc in cache.layers]
    got = M.decode(m, tokens[:, T:], cache)
    full = M.prefill(m, tokens[:, :T])
    for lc_full, pos in zip(full.layers, kept):
        keep = torch.zeros_like(lc_full.bias, dtype=torch.bool)
        keep.scatter_(2, pos, True)
        lc_full.bias.masked_fill_(~keep, float("-inf"))
    want = M.decode(m, tokens[:, T:], full)
    assert torch.allclose(got, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("rule", ["streaming", "h2o", "tova"])
def test_decode_rules_stay_in_budget(rule):
    m = tiny(1)
    T, b, n = 20, 10, 12
    tokens = torch.randint(1, 50, (1, T + n), generator=torch.Generator().manual_seed(1))
    pol = policy(rule, b, m, T)
    cache = P.prefill(m, tokens[:, :T], pol)
    for i in range(n):
        M.decode(m, tokens[:, T + i:T + i + 1], cache, pol.decoder)
        for l, lc in enumerate(cache.layers):
            assert lc.size == b and (lc.pos[..., 1:] > lc.pos[..., :-1]).all()
            assert int(lc.pos.max()) == T + i or rule == "tova"
            if rule == "streaming":
                assert lc.pos[0, 0].tolist() == [0, 1] + list(range(T + i + 1 - (b - 2), T + i + 1))
            if rule == "h2o":        # the recent window is never evicted
                assert set(range(T + i + 1 - SET.window, T + i + 1)) <= set(lc.pos[0, 0].tolist())


def test_tova_decode_keeps_top_under_current_query():
    m = tiny(2, fast=False)
    T, b = 20, 8
    tokens = torch.randint(1, 50, (1, T + 1), generator=torch.Generator().manual_seed(2))
    pol = policy("tova", b, m, T)
    cache = P.prefill(m, tokens[:, :T], pol)
    seen = {}

    def spy(layer, q, q_pos, lc, out):   # naive A of the new query over the b+1 entries
        seen[layer] = (M.attention_probs(q, lc.k, lc.bias, q_pos, lc.pos)[0, :, -1].mean(0),
                       lc.pos[0, 0].clone())
    M.decode(
        m, tokens[:, T:], cache, M.Hooks(post_kernel=spy, cache_update=pol.decoder.cache_update)
    )
    for l, lc in enumerate(cache.layers):
        a, pos = seen[l]
        want = sorted(pos[j].item() for j in naive_topk(a.tolist(), b, [False] * len(a)))
        assert lc.pos[0, 0].tolist() == want


def test_policy_json_round_trip_and_errors(tmp_path):
    L = 4
    pol = P.Policy(
        [P.LayerPolicy(("snapkv", 30), ("append", 30)), P.LayerPolicy(("tova", 10), ("tova", 10)),
         P.LayerPolicy(("h2o", 20), ("h2o", 20)),
         P.LayerPolicy(("streaming", 20), ("streaming", 20))],
        20,
        SET,
        {"model": "tiny"},
    )
    f = tmp_path / "p.json"
    pol.save(f)
    back = P.Policy.load(f, n_layers=L, rules=BL.RULES)
    assert (
        back.layers == pol.layers
        and back.budget == 20
        and back.settings == SET
        and back.meta == {"model": "tiny"}
    )
    assert back.rescaled(40).layers[0].prefill == ("snapkv", 60)
    assert [lp.prefill[1] for lp in back.rescaled(40).layers] == [60, 20, 40, 40]

    def bad(edit, msg):
        d = json.loads(f.read_text())
        edit(d)
        g = tmp_path / "bad.json"
        g.write_text(json.dumps(d))
        with pytest.raises(UsageError, match=msg) as e:
            P.Policy.load(g, n_layers=L, rules=BL.RULES)
        assert "\n" not in str(e.value)
    bad(lambda d: d["layers"].pop(), "has 3 layers, the model has 4")
    bad(lambda d: d["layers"][0]["prefill"].update(rule="magic"), "unknown prefill rule 'magic'")
    bad(lambda d: d["layers"][0]["decode"].update(rule="snapkv"), "unknown decode rule 'snapkv'")
    bad(lambda d: d["layers"][1]["prefill"].update(budget=-1), "non-negative")
    bad(lambda d: d["layers"][1]["prefill"].update(budget=11), "sum to 81 > L·B")
    bad(lambda d: d.pop("layers"), "malformed policy")
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(UsageError, match="malformed policy"):
        P.Policy.load(tmp_path / "junk.json", rules=BL.RULES)
    with pytest.raises(UsageError, match="budget must be >= 1"):
        P.Policy.uniform("snapkv", 0, 3, rules=BL.RULES)
    with pytest.raises(UsageError, match="unknown rule 'x'; choose from full"):
        P.Policy.uniform("x", 8, 3, rules=BL.RULES)


@given(st.integers(3, 30), st.integers(1, 7), st.integers(0, 3))
def test_causal_probs_equal_attention_probs(T, chunk, seed):
    """The observation pass's reduced-mask probabilities = the explicit attention's, every chunk."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 4, T, 8, generator=g, dtype=torch.float64), torch.randn(
        2, 2, T, 8, generator=g, dtype=torch.float64
    )
    pos = torch.arange(T).expand(2, T)
    for c1 in range(T, 0, -chunk):
        c0 = max(0, c1 - chunk)
        want = M.attention_probs(q[:, :, c0:c1], k[:, :, :c1],
                                 torch.zeros(2, 2, c1, dtype=torch.float64), pos[:, c0:c1],
                                 pos[:, None, :c1].expand(2, 2, c1))
        assert torch.allclose(
            causal_probs(q[:, :, c0:c1], k[:, :, :c1], c0), want, atol=1e-14, rtol=0
        )


def test_causal_probs_flush_only_subnormal_probabilities():
    """fp32: a row dominated by one key (logit gaps of 80-110, so that exp lands below the
    smallest normal number) gives 0 exactly where the explicit attention's probability is
    subnormal, and the explicit attention's value to fp32 rounding everywhere else."""
    T, D = 12, 16
    q = torch.zeros(1, 2, T, D)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, T, D)
    k[0, 0, :, 0] = torch.linspace(-110.0, 0.0, T) * D ** 0.5          # logits −110 .. 0
    k[0, 0, 0, 0] = 0.0
    got = causal_probs(q, k, 0)
    pos = torch.arange(T).expand(1, T)
    want = M.attention_probs(q, k, torch.zeros(1, 1, T), pos, pos[:, None, :])
    tiny = torch.finfo(torch.float32).tiny
    subnormal = (want > 0) & (want < tiny)
    assert subnormal.any() and (want >= tiny).sum() > 2 * T      # both kinds occur
    assert torch.equal(got[subnormal], torch.zeros_like(got[subnormal]))
    torch.testing.assert_close(got[~subnormal], want[~subnormal], rtol=1e-6, atol=0)
