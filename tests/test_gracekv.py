"""GraceKV against naive recomputations and exact invariants (tiny random LLaMA, fp64)."""
import functools
import math

import pytest
import torch
from hypothesis import given, strategies as st

import gracekv as GK
from engine import fast_attention as FA
from engine import gracekv_fast as GF
from engine import gracekv_variants as V
import model as M
from conftest import tiny as tiny_llama
from engine import harness as H
from engine import observe as OB

SET = GK.Settings(
    window=4, slot_min=3, slot_max=8, slot_target=5, bend_widths=(2, 3), prefetch=3, seeds=3
)


tiny = functools.partial(tiny_llama, L=2)


def tokens(seed, T):
    return torch.randint(1, 50, (1, T), generator=torch.Generator().manual_seed(seed))


def copy(c):
    return M.Cache(list(c.layers), c.next_pos, c.last_logits)


# ----------------------------------------------------------------------------- kernel properties

@given(st.integers(1, 5), st.integers(2, 9), st.integers(0, 10**6), st.booleans())
def test_bias_log_m_attends_like_m_copies(m, S, seed, sdpa):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, 3, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, S, 8, generator=g, dtype=torch.float64) for _ in range(2))
    pos = torch.arange(S).expand(1, 2, S)
    j = int(torch.randint(S, (1,), generator=g))
    bias = torch.zeros(1, 2, S, dtype=torch.float64)
    bias[..., j] = math.log(m)
    rep = torch.cat((torch.arange(S), torch.full((m - 1,), j)))            # entry j m times
    kernel = FA.attention_sdpa if sdpa else M.attention
    qp = torch.full((1, 3), S)
    got = kernel(q, k, v, bias, qp, pos)
    want = kernel(q, k[:, :, rep], v[:, :, rep], torch.zeros(1, 2, len(rep), dtype=torch.float64),
                  qp, pos[:, :, rep])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@given(st.integers(0, 10**6))
def test_unrotate_rerotate_is_identity(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 7, 64, generator=g, dtype=torch.float64) * 10
    pos = torch.randint(0, 8192, (5, 7), generator=g)
    inv = M.rope_inv_freq(M.Config(head_dim=64))
    back = M.apply_rope(M.apply_rope(x, -pos, inv), pos, inv)
    torch.testing.assert_close(back, x, rtol=0, atol=1e-11)


# ----------------------------------------------------------------------------- naive oracles

def attention_maps(m, x):
    """Every layer's full A (H, T, T), its queries and head outputs, from the explicit kernel."""
    maps, qs, outs = {}, {}, {}

    def post(layer, q, q_pos, lc, out):
        maps[layer] = M.attention_probs(q, lc.k, lc.bias, q_pos, lc.pos)[0]
        qs[layer], outs[layer] = q[0], out[0]
    full = M.prefill(m, x, M.Hooks(post_kernel=post))
    return full, maps, qs, outs


def naive_propagate(s_bar, A, n, hops, decay):
    """Python: seeds by (value, later token); each hop the seeds' weighted rows of A, every
    chosen seed zeroed, the next seeds its best; d = Σ decay^(k−1)·d_k, normalised."""
    def rank(v):
        """The n best tokens of v with v > 0, by (value, later token)."""
        return [
            i for i in sorted(range(len(v)), key=lambda i: (-float(v[i]), -i)) if v[i] > 0
        ][:n]
    chosen, front = [], rank(s_bar)
    w, d = [float(s_bar[i]) for i in front], torch.zeros_like(s_bar)
    chosen += front
    for k in range(1, hops + 1):
        if not front:
            break
        mass = sum(wi * A[j] for wi, j in zip(w, front))
        mass = torch.tensor(
            [0.0 if t in chosen else float(mass[t]) for t in range(len(s_bar))], dtype=s_bar.dtype
        )
        d += decay ** (k - 1) * mass
        front = rank(mass)
        w = [float(mass[i]) for i in front]
        chosen += front
    return (d / d.sum() if d.sum() > 0 else s_bar), chosen


@given(st.integers(12, 40), st.integers(0, 3), st.integers(0, 3), st.sampled_from([0.0, 0.5, 1.0]),
       st.sampled_from([0, 3, 32]))
def test_relevance_per_unit_seeds_and_head_weight_equal_naive(T, seed, hops, fwd, n_ev):
    """ŝ per unit = the unit's query heads' attention from the probe rows, normalised; d̂ from
    the seeds of the mean ŝ walked along the sampled layers' mean attention (naive maps; the
    forward share f walks Aᵀ); R = 0.7·ŝ + 0.3·d̂ for each unit on its own; the dense
    variant's x^k; ω (eq. 11) from U alone; the evidence probes: the strided queries in the
    slots of highest peak R (past token 4), U's first, with their positions."""
    m = tiny(seed)
    s = GK.Settings(**{**SET.__dict__, "hops": hops, "hop_depths": (0.0, 1.0),
                       "hop_forward": fwd, "evidence": n_ev, "evidence_stride": 2})
    x = tokens(seed, T)
    full, maps, qs, outs = attention_maps(m, x)
    _, stats = GF.Shared(V.DenseFlow).observe(m, x, s, chunk=3)       # DenseFlow.of: s.hops
    G, H, r = 2, 4, 4
    Tc = T - r
    shat = []
    for l in range(2):
        Abar = maps[l].view(G, H // G, T, T).mean(1)                          # (G, T, T) group mean
        # x^0 = Σ_{u∈U} Ā[u, :]
        xk = Abar[:, T - r:].sum(1)
        for k in range(hops + 1):
            torch.testing.assert_close(stats.flow[l][k], xk, rtol=1e-10, atol=1e-12)
            # x^k = x^{k−1} Ā (dense)
            xk = (xk[:, None, :] @ Abar)[:, 0]
        torch.testing.assert_close(stats.probes[l], qs[l][:, T - r:])
        # this unit's own heads
        for g in range(G):
            own = maps[l][g * 2:(g + 1) * 2, T - r:, :Tc].sum((0, 1))
            shat.append(own / own.sum())
    ctx = GK.context(m, full, stats, r, s)
    # sampled: layers 0 and 1
    A = sum(maps[l][:, :Tc, :Tc].mean(0) for l in (0, 1)) / 2
    # A[j]: what j reads / who reads j
    A = (1 - fwd) * A + fwd * A.T
    s_bar = torch.stack(shat).mean(0)
    d_hat, seeds = naive_propagate(s_bar / s_bar.sum(), A, s.seeds, hops, s.decay)
    assert ctx.seeds == seeds
    for j in range(4):
        torch.testing.assert_close(
            ctx.units.R[j, :Tc], 0.7 * shat[j] + 0.3 * d_hat, rtol=1e-9, atol=1e-13
        )
        torch.testing.assert_close(ctx.sal[j], shat[j], rtol=1e-10, atol=1e-14)
    for l in range(2):
        Wo = m.layers[l].self_attn.o_proj.weight.detach()                     # (dim, H·D)
        for g in range(G):
            cols = slice(g * 2 * 8, (g + 1) * 2 * 8)
            a = Wo[:, cols].norm()
            contrib = (
                outs[l][2 * g : 2 * g + 2, T - r :].transpose(0, 1).reshape(r, 16) @ Wo[:, cols].T
            )
            b = contrib.norm(dim=-1).mean()
            torch.testing.assert_close(ctx.omega[l * G + g], (a * b).sqrt(), rtol=1e-10, atol=0)
        peak = ctx.units.R[l * G:(l + 1) * G, :Tc].mean(0).clone()
        peak[:4] = 0
        best = sorted(ctx.slots, key=lambda ab: -float(peak[ab[0]:ab[1]].max()))
        ev = [t for a, b in best for t in range(a, b) if t % 2 == 0][:n_ev]
        at = list(range(T - r, T)) + ev
        for g in range(G):
            torch.testing.assert_close(
                ctx.units.q[l * G + g], qs[l][2 * g : 2 * g + 2, at].reshape(-1, 8)
            )
            assert ctx.units.qpos[l * G + g].tolist() == at * 2


@given(st.integers(3, 12), st.integers(1, 3), st.integers(0, 3), st.integers(0, 10**6))
def test_propagate_seeds_and_hop_removal_on_a_hand_built_map(Tc, n, hops, seed):
    """On a hand-built (causal) token attention map: the seeds, their order and d̂ equal the
    naive walk; no token is a seed twice; with one hop from a single seed d̂ is its row, minus
    itself."""
    g = torch.Generator().manual_seed(seed)
    A = torch.rand(Tc, Tc, generator=g, dtype=torch.float64).tril()
    A = A / A.sum(1, keepdim=True)
    s_bar = torch.rand(Tc, generator=g, dtype=torch.float64)
    s_bar /= s_bar.sum()
    d, seeds = GK.propagate(s_bar, lambda idx: A[idx], n, hops, 0.5)
    want_d, want_seeds = naive_propagate(s_bar, A, n, hops, 0.5)
    assert seeds == want_seeds and len(set(seeds)) == len(seeds)
    torch.testing.assert_close(d, want_d, rtol=1e-12, atol=1e-15)
    j = int(s_bar.argmax())
    d1, _ = GK.propagate(s_bar, lambda idx: A[idx], 1, 1, 0.5)
    row = A[j].clone()
    row[j] = 0
    if row.sum() > 0:
        torch.testing.assert_close(d1, row / row.sum(), rtol=1e-12, atol=1e-15)


def test_bends_equal_naive_and_greedy_cut():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(60, 5, generator=g, dtype=torch.float64)
    k = GK.bends(h, 3)
    hn = torch.nn.functional.normalize(h, dim=-1)
    for i in range(1, 59):
        before = hn[max(0, i - 2):i + 1].mean(0)                             # eq. 4: i−w+1..i
        after = hn[i + 1:i + 4].mean(0)
        want = 1 - torch.nn.functional.cosine_similarity(hn[i] - before, after - hn[i], dim=0)
        torch.testing.assert_close(k[i], want)
    # the variant's greedy cut
    for Tc in (0, 5, 8, 9, 17, 40, 57):
        slots = V.greedy_slots(k, Tc, SET)
        assert [a for a, _ in slots] == ([0] + [b for _, b in slots[:-1]] if Tc else [])
        assert not slots or slots[-1][1] == Tc
        # cut at the first max κ
        for a, b in slots[:-1]:
            assert 3 <= b - a <= 8
            window = k[a + 3:min(a + 8, Tc - 3) + 1]
            assert b == a + 3 + int(window.argmax())


def test_surprisal_term_of_the_boundaries_equals_naive():
    """Eq. 5's surprisal term: the observation's −log p of each token equals a naive
    log-softmax of the full forward (0 for the first token); b(λ_s) = b(0) + λ_s·z(surprisal)
    over the context; the `context` protocol's cut keeps the context's own values."""
    from dataclasses import replace
    from engine import protocols as PR
    m, x = tiny(), tokens(3, 41)
    s, off = replace(SET, lambda_s=0.7), replace(SET, lambda_s=0.0)
    full, obs = OB.observe(m, x, GF.needs(s, m.config.n_layers))
    lp = torch.log_softmax(m.forward(x), -1)                                  # (1, T, V)
    want = torch.cat(
        (torch.zeros(1, 1, dtype=lp.dtype), -lp[:, :-1].gather(-1, x[:, 1:, None])[..., 0]), 1
    )
    torch.testing.assert_close(obs.surprisal, want, rtol=1e-12, atol=1e-12)
    # λ_s = 0: not observed
    assert OB.observe(m, x, GF.needs(off, m.config.n_layers))[1].surprisal is None
    Tc = x.shape[1] - s.window
    b0, b1 = (GK.slot_bends(m, full, Tc, st_, torch.float64, obs.surprisal) for st_ in (off, s))
    torch.testing.assert_close(b1, b0 + 0.7 * GK.robust_z(want[0, :Tc]), rtol=1e-12, atol=1e-12)
    assert torch.equal(PR.cut(full, obs, GF.needs(s, m.config.n_layers), 5, 30)[1].surprisal,
                       obs.surprisal[:, 5:30])


@given(st.integers(0, 40), st.integers(0, 10**6), st.integers(2, 4), st.integers(0, 3))
def test_dp_slots_optimal_against_brute_force(Tc, seed, lo, extra):
    """Eq. 5: the DP's K slots tile [0, Tc), each lo..hi tokens (hi = 2·lo + extra), K =
    n_slots(Tc), and no other such segmentation has a larger sum of b at its cuts."""
    hi = 2 * lo + extra
    s = GK.Settings(
        **{**SET.__dict__, "slot_min": lo, "slot_max": hi, "slot_target": (lo + hi) // 2}
    )
    b = torch.randn(Tc, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    slots = GK.dp_slots(b, Tc, s)
    K = GK.n_slots(Tc, s)
    if Tc == 0:
        assert slots == []
        return
    assert (
        slots[0][0] == 0
        and slots[-1][1] == Tc
        and all(x[1] == y[0] for x, y in zip(slots, slots[1:]))
    )
    assert len(slots) == K
    if K == 1:
        return
    assert all(lo <= bb - a <= hi for a, bb in slots)

    def best(start, k):                   # brute force: the best sum of cuts for k slots from start
        if k == 1:
            return 0.0 if lo <= Tc - start <= hi else -math.inf
        return max(
            [
                float(b[c]) + best(c, k - 1)
                for c in range(start + lo, min(start + hi, Tc) + 1)
                if c < Tc
            ]
            or [-math.inf]
        )
    got = sum(float(b[a]) for a, _ in slots[1:])
    assert got == pytest.approx(best(0, K), abs=1e-12)


def naive_node(units, j, toks, s, f):
    """Prototype and distortion of node `toks` of unit j straight from the write-up's formulas."""
    kr, v, R = units.kr[j, toks], units.v[j, toks], units.R[j, toks]
    kbar = kr.mean(0)
    p = torch.tensor(toks, dtype=torch.float64).mean().round()
    key = M.apply_rope(kbar, p, units.inv_freq)
    if f.key is V.key_post:
        key = M.apply_rope(kr, torch.tensor(toks), units.inv_freq).mean(0)    # mean post-RoPE key
    hb = kbar.norm() / (kr.norm(dim=-1).mean() + s.eps)
    mm = min(max(len(toks) * hb.item() ** 2, 1.0), len(toks))
    logit = units.q[j] @ key / math.sqrt(key.shape[-1]) - units.c[j]    # (P,) q·k̃/√D − c
    if f.multiplicity is V.multiplicity_n:
        mm = len(toks)
    # log m = Σ_u w_u (log Z_u − logit_u), w ∝ Z, in [0, log n + c]
    elif f.multiplicity is V.multiplicity_fit:
        lZ = units.lg[j, toks].exp().sum(0).log()
        seen = units.qpos[j] >= toks[-1]
        fit = float((torch.softmax(lZ[seen], 0) * (lZ - logit)[seen]).sum())
        mm = math.exp(min(max(fit, 0.0), math.log(len(toks)) + V.FIT_SLACK))
    # β: the node's own, 0.1·mean of R over its tokens (eq. 7); the variant's: 0.1·mean over the
    # context
    w = R + s.beta * (units.R[j, :units.Tc].mean() if f.value_beta is V.beta_global else R.mean())
    val = (w[:, None] * v).sum(0) / w.sum()
    lg = units.lg[j, toks]                                                       # (n, P) log A
    Z = lg.exp().sum(0)                                                       # (P,) attention mass
    sh = lg.max(0).values                                     # each probe's max-subtraction
    Zs, Mx = (lg - sh).exp().sum(0), (lg - sh).exp().T @ v                    # (P,), (P, D)
    Zp = mm * torch.exp(logit - sh)
    # D_u = (Z − Z̃)²/(Z² + ε) + ‖M − M̃‖²/(‖M‖² + ε), in the probe's
    # max-subtracted scale
    denom = (Mx ** 2).sum(-1) + s.eps
    Dq = (Zs - Zp) ** 2 / (Zs ** 2 + s.eps) + ((Mx - Zp[:, None] * val) ** 2).sum(-1) / denom
    Dd = Zs ** 2 / (Zs ** 2 + s.eps) + (Mx ** 2).sum(-1) / denom
    # a probe reads a node only from at or after its last token
    seen = units.qpos[j] >= toks[-1]
    wq = Z * seen / (Z * seen).sum()
    return dict(key=key, val=val, logm=math.log(mm), pos=int(p), D=float((wq * Dq)[seen].sum()),
                Ddrop=float((wq * Dd)[seen].sum()), R=float(R.sum()))


VARIANTS = [
    {},
    {"key": V.key_post, "multiplicity": V.multiplicity_fit},
    {"multiplicity": V.multiplicity_n},
    {"key": V.key_post, "value_beta": V.beta_global, "rank_adds": V.rank_with_lookahead,
     "relevance": V.shared_relevance, "extract": V.extract_hole, "split": V.splits_with_holes,
     "floor": V.row_floor},
]
# the node statistics: the paper's, node by node, and the engine's batches
NODE_STATS = [GK.node_statistics, GF.NodeStats(V.FAST)]


@given(st.integers(16, 40), st.integers(0, 3), st.sampled_from(VARIANTS),
       st.sampled_from(NODE_STATS))
def test_prototype_and_distortion_equal_naive(T, seed, over, node_stats):
    m, (s, f) = tiny(seed), V.build({**SET.__dict__, **over})
    full, stats = GK.observe(m, tokens(seed, T), s)
    ctx = GK.context(m, full, stats, 4, s, f)
    g = torch.Generator().manual_seed(seed)
    U, Tc = ctx.units.kr.shape[0], ctx.Tc
    u = torch.randint(U, (12,), generator=g)
    a = torch.randint(Tc - 1, (12,), generator=g)
    b = torch.minimum(a + 1 + torch.randint(8, (12,), generator=g), torch.tensor(Tc))
    got = node_stats(ctx.units, u, a, b)
    for i in range(12):
        toks = list(range(int(a[i]), int(b[i])))
        want = naive_node(ctx.units, int(u[i]), toks, s, f)
        assert int(got["n"][i]) == len(toks)
        for k in ("key", "val"):
            torch.testing.assert_close(got[k][i], want[k], rtol=1e-10, atol=1e-12)
        for k in ("logm", "pos", "Ddrop", "R") + (("D",) if len(toks) > 1 else ()):
            assert got[k][i].item() == pytest.approx(want[k], rel=1e-9, abs=1e-12)
        if len(toks) == 1:                    # a single-token node is its token: no distortion
            assert got["D"][i] == 0 and got["pos"][i] == toks[0]
            torch.testing.assert_close(
                got["key"][i], full.layers[int(u[i]) // 2].k[0, int(u[i]) % 2, toks[0]]
            )


def test_distortion_zero_when_exact_and_finite_for_extreme_logits():
    mu = torch.randn(3, 1, 8, dtype=torch.float64)
    # prototype = exact: ṽ = μ
    mu2 = mu.pow(2).sum(-1)
    logZ = torch.tensor([[0.3], [-700.0], [900.0]], dtype=torch.float64)
    D, Dd = GF.distortion(logZ, torch.ones_like(logZ), mu2, mu2, logZ.clone(), mu2[:, 0],
                          GK.Settings())
    assert torch.all(D.abs() < 1e-12) and torch.all(Dd > 1.9)
    for big in (1e4, -1e4, 1e30):             # log Z̃ − log Z far beyond exp's range
        lz = torch.tensor([[0.0, -1e4], [big, 5.0]])
        D, Dd = GF.distortion(lz, 1 + torch.rand(2, 2), torch.rand(2, 2), torch.randn(2, 2),
                              lz + big,
                              torch.rand(2), GK.Settings())
        assert torch.isfinite(D).all() and torch.isfinite(Dd).all()


# ----------------------------------------------------------------------------- budget flow

def replay(plan, B_alloc):
    """Check the trace: only added nodes split, each step the best affordable action then, in
    entries (the cache is ragged); a split costs its children − 1 (a bisection 1, a three-way
    extraction 2); a dropped action was not affordable when dropped."""
    added_roots, frontier, spent, gone = set(), set(), 0, set()
    n = [v.n for v in plan.nodes]
    drops = {}
    for i, kind, v in plan.dropped:
        drops.setdefault(i, []).append((kind, v))
    for i, (kind, v, gain, cost) in enumerate(plan.steps + [(None,) * 4]):
        for dk, dv in drops.get(i, []):
            assert (1 if dk == "add" else plan.split[dv].cost) > B_alloc - spent
            gone.add(dv)
        if kind is None:
            break
        # what the heap compared
        rank = plan.add_rank[v] if kind == "add" else gain / cost
        avail = [plan.add_rank[r] for r in plan.add_gain if r not in added_roots and r not in gone
                 and 1 <= B_alloc - spent]
        avail += [
            plan.split[f].gain / plan.split[f].cost
            for f in frontier
            if n[f] > 1 and f not in gone and plan.split[f].cost <= B_alloc - spent
        ]
        assert rank >= max(avail) and cost <= B_alloc - spent
        if kind == "add":
            assert v in plan.add_gain and v not in added_roots and cost == 1
            added_roots.add(v)
            frontier.add(v)
        else:
            # split only what was added
            assert v in frontier and n[v] > 1
            kids = plan.split[v].children
            assert (
                (gain, cost) == plan.split[v][:2] and cost == len(kids) - 1 and len(kids) in (2, 3)
            )
            # the children tile the node
            assert sum(n[c] for c in kids) == n[v]
            # extraction: the middle is one token
            if len(kids) == 3:
                assert sorted(n[c] == 1 for c in kids).count(True) >= 1
            frontier.remove(v)
            frontier.update(kids)
        spent += cost
    assert frontier == plan.frontier and spent <= B_alloc
    return frontier


@given(st.integers(14, 48), st.data(), st.integers(0, 3), st.sampled_from([0.1, 0.95]),
       st.sampled_from(VARIANTS))
def test_budget_contract_and_greedy_trace(T, data, seed, floor_frac, over):
    """Also with the one-step lookahead: it never spends more than the budget."""
    B = data.draw(st.integers(1, T - 1))
    m, (s, f) = tiny(seed), V.build({**SET.__dict__, "floor_frac": floor_frac, **over})
    full, stats = GK.observe(m, tokens(seed, T), s)
    cache, plan = GK.compress(m, full, stats, B, s, return_plan=True, formulas=f)
    L, G = 2, 2
    r, U = s.window, L * G
    if plan is None:                          # B ≥ T: identity; B ≤ r: the window alone
        assert cache.entries() == U * min(B, T)
        return
    # ragged: slots = entries
    assert cache.entries() == cache.allocated() <= L * G * B
    dense = [lc.dense(G) for lc in cache.layers]
    for lc in dense:
        real = lc.pos >= 0
        assert torch.all(lc.bias[~real] == -math.inf)
        assert all(torch.all(p[r_].diff() >= 0) for p, r_ in zip(lc.pos[0], real[0]))
    frontier = replay(plan, plan.B_alloc)
    per_unit = int(s.floor_frac * (B - r))
    # the same seeds, fresh
    ctx = GK.context(m, full, stats, r, s, f)
    if f.floor is GK.seed_floor:              # each unit's own best seeds, within its reservation
        k = min(max(per_unit, 0), len(ctx.seeds))
        for j in range(U):
            best = sorted(ctx.seeds, key=lambda t: (-float(ctx.units.R[j, t]), -t))[:k]
            assert plan.floor[j].nonzero()[:, 0].tolist() == sorted(best)
        n_floor = U * k
    else:
        n_floor = int(plan.floor.sum())
    assert n_floor <= U * per_unit
    assert plan.B_alloc == U * (B - r) - n_floor and int(plan.floor.sum()) == n_floor
    assert cache.entries() == U * r + n_floor + len(frontier)
    everything = all(plan.nodes[i].n == 1 for i in frontier) and set(plan.add_gain) <= {
        i for k, i, *_ in plan.steps if k == "add"}
    # the greedy spends the whole budget but the entries no action fits (a cost-2 split with
    # 1 left) or stops when everything is exact
    assert U * B - cache.entries() <= 1 or everything

    def spans(p):
        """The plan's steps as (kind, unit, a, b, cost)."""
        return [(k, p.nodes[v].unit, p.nodes[v].a, p.nodes[v].b, c) for k, v, g, c in p.steps]
    # the engine's forms (batched node statistics, prefetched flow): the same actions
    same = GK.compress(m, full, stats, B, GK.Settings(**{**s.__dict__, "prefetch": 1000}),
                       return_plan=True, formulas=f, budget_flow=GF.allocate_prefetched,
                       node_stats=GF.NodeStats(V.FAST))[1]
    assert spans(same) == spans(plan)
    # gains equal up to the last bits (other batch shapes, other summation order)
    assert all(math.isclose(g0, g1, rel_tol=1e-12, abs_tol=1e-15)
               for (*_, g0, _), (*_, g1, _) in zip(same.steps, plan.steps))
    nd, Tc = plan.nodes, T - r
    for j in range(U):
        lc, g = dense[j // G], j % G
        mine = [i for i in frontier if nd[i].unit == j]
        leaves = [nd[i].a for i in mine if nd[i].n == 1]
        # every context token is held at most once: by the floor, a leaf, or one prototype (its
        # span minus the floor and the leaves punched out of it, exactly n tokens)
        held = plan.floor[j].long().clone()
        held[leaves] += 1
        for i in mine:
            if nd[i].n > 1:
                inside = torch.zeros(Tc, dtype=torch.bool)
                inside[nd[i].a:nd[i].b] = True
                inside &= ~plan.floor[j]
                inside[leaves] = False
                assert int(inside.sum()) == nd[i].n
                held += inside.long()
        assert int(held.max()) <= 1
        pic = "".join(line.split("|")[1] for line in GK.picture(plan, j, Tc))
        assert (
            len(pic) == Tc
            and pic.count("F") == int(plan.floor[j].sum())
            and pic.count("x") == len(leaves)
        )
        assert sum(c.isalpha() and c not in "Fx" for c in pic) == sum(
            nd[i].n for i in mine if nd[i].n > 1
        )
        exact = [t for t in range(Tc) if plan.floor[j, t]] + list(range(Tc, T)) + leaves
        assert int((lc.pos[0, g] >= 0).sum()) == len(mine) + int(plan.floor[j].sum()) + r
        for t in exact:                                                       # bit for bit
            hit = ((lc.pos[0, g] == t) & (lc.bias[0, g] == 0)).nonzero()[:, 0]
            assert any(torch.equal(lc.k[0, g, i], full.layers[j // G].k[0, g, t]) and
                       torch.equal(lc.v[0, g, i], full.layers[j // G].v[0, g, t]) for i in hit)


@given(st.integers(12, 36), st.integers(0, 3))
def test_budget_at_least_T_is_fullkv(T, seed):
    m, x = tiny(seed), tokens(seed, T + 5)
    ref = M.prefill(m, x[:, :T])
    first, want = ref.last_logits, M.decode(m, x[:, T:], copy(ref))
    for B in (T, T + 7):
        cache = GK.prefill(m, x[:, :T], B, SET)
        assert torch.equal(cache.last_logits, first)
        assert torch.equal(M.decode(m, x[:, T:], cache), want)


@given(st.integers(12, 36), st.integers(0, 3))
def test_greedy_to_all_leaves_is_fullkv(T, seed):
    """With B_alloc = every context token of every unit, the greedy ends in exact leaves only."""
    m, x, s = tiny(seed), tokens(seed, T + 5), SET
    full, stats = GK.observe(m, x[:, :T], s)
    want = M.decode(m, x[:, T:], copy(full))
    ctx = GK.context(m, full, stats, s.window, s)
    plan = GK.allocate(ctx, ctx.units.kr.shape[0] * ctx.Tc)
    replay(plan, plan.B_alloc)
    assert all(plan.nodes[i].n == 1 for i in plan.frontier)
    # a ragged layer: another kernel
    got = M.decode(m, x[:, T:], GK.assemble(ctx, full, plan))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_bad_input():
    m = tiny()
    with pytest.raises(M.UsageError):
        GK.prefill(m, tokens(0, 20), 0)
    with pytest.raises(M.UsageError):
        GK.Settings(slot_min=10, slot_max=12)
    full, stats = GK.observe(m, tokens(0, 20), SET)
    with pytest.raises(M.UsageError):
        GK.compress(m, full, stats, 10, GK.Settings())                        # other window


def test_rows_with_settings_in_brackets():
    got = V.variant("gracekv-v1[seeds=64;hop_depths=(0.5, 1.0)]", 128)
    base = V.variant("gracekv-v1", 128)
    assert got.budget == 128 and got.settings.seeds == 64 and got.settings.hop_depths == (0.5, 1.0)
    assert got.formulas == base.formulas and got.settings.floor_frac == base.settings.floor_frac
    assert H.method_list("full,gracekv[seeds=8;hop_depths=(0.5,1.0)],snapkv") == \
        ["full", "gracekv[seeds=8;hop_depths=(0.5,1.0)]", "snapkv"]
    for bad in ("gracekv[nope=1]", "gracekv[key=1]", "gracekv[seeds=x]", "gracekv[seeds=1",
                "nokv[seeds=1]"):
        with pytest.raises(M.UsageError):
            V.variant(bad, 128)
    assert V.is_row("gracekv[seeds=1]") and not V.is_row("snapkv")


# ----------------------------------------------------------------------------- embedded model

@pytest.mark.embedded
def test_embedded_generate(embedded):
    m, tok = embedded
    prompt = (
        "The grass is green. The sky is blue. " * 12
        + "The magic number is 4172. The magic number is"
    )
    T = len(tok.encode(prompt))
    assert M.generate(m, tok, prompt, GK.GraceKV(T), 8) == M.generate(m, tok, prompt, None, 8)
    cache = GK.GraceKV(48, GK.Settings(window=8, slot_min=8, slot_max=32)).prefill(
        m, torch.tensor([tok.encode(prompt)]))
    assert (
        GK.GraceKV(48).decoder is None
        and cache.entries() <= m.config.n_layers * m.config.n_kv_heads * 48
    )


@given(st.integers(16, 40), st.integers(0, 3))
def test_post_rope_prototype_logit_is_the_mean_logit(T, seed):
    """prototype_key = "post": for any query (at any later position) the prototype's logit is
    exactly the mean of its tokens' logits, q·k̃ = mean_t q·k_t."""
    m, s, f = tiny(seed), SET, GK.Formulas(key=V.key_post)
    full, stats = GK.observe(m, tokens(seed, T), s)
    ctx = GK.context(m, full, stats, s.window, s, f)
    g = torch.Generator().manual_seed(seed)
    U, Tc, G = ctx.units.kr.shape[0], ctx.Tc, m.config.n_kv_heads
    u = torch.randint(U, (10,), generator=g)
    a = torch.randint(Tc - 1, (10,), generator=g)
    b = torch.minimum(a + 2 + torch.randint(8, (10,), generator=g), torch.tensor(Tc))
    for node_stats in NODE_STATS:
        key = node_stats(ctx.units, u, a, b)["key"]                             # (10, D)
        for i in range(10):
            # (n, D) post-RoPE
            k = full.layers[int(u[i]) // G].k[0, int(u[i]) % G, int(a[i]):int(b[i])]
            q = M.apply_rope(torch.randn(5, k.shape[1], generator=g, dtype=torch.float64),
                             torch.randint(T, 2 * T, (5,), generator=g), m.inv_freq)  # later
            torch.testing.assert_close(q @ key[i], (q @ k.T).mean(1), rtol=1e-12, atol=1e-12)


def test_budget_within_the_window_keeps_the_sink():
    """B <= r: the first token (attention sink) and the last B − 1, in every unit."""
    m, T, B = tiny(1), 30, 3
    full, stats = GK.observe(m, tokens(1, T), SET)
    cache = GK.compress(m, full, stats, B, SET)
    for lc in cache.layers:
        assert (
            lc.dense(m.config.n_kv_heads).pos[0].tolist()
            == [[0, T - 2, T - 1]] * m.config.n_kv_heads
        )


@given(st.lists(st.floats(-5, 5), max_size=40), st.integers(0, 50))
def test_peek_is_nsmallest_and_leaves_the_pop_order(gains, k):
    """engine.gracekv_fast.peek: the k best heap entries, and the heap pops in the same order
    after it."""
    import heapq
    heap = [(-g, i, "add", i) for i, g in enumerate(gains)]
    heapq.heapify(heap)
    twin = list(heap)
    assert GF.peek(heap, k) == heapq.nsmallest(k, twin)
    assert [heapq.heappop(heap) for _ in range(len(heap))] == sorted(twin)
