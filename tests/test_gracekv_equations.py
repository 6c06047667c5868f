"""GraceKV's equations, each transcribed from docs/gracekv.md ("The equations") in plain loops
and compared with gracekv.py on a tiny random LLaMA (fp64). A transcription reads the model's
own queries, keys and values (through a hook) and never calls the function it checks; where
it needs a quantity another equation defines (R^tok in eq. 7, D in eq. 12), that quantity has
its own transcription test here or in tests/test_gracekv.py. `gracekv` keeps no departure from
these equations; the rows that do (gracekv_variants.py) are named where a test
exercises one (the eq. 12 mutation check: `gracekv-massgain`)."""
import math
import statistics
from dataclasses import replace

import pytest
import torch
from hypothesis import given, strategies as st

import gracekv as GK
import model as M
from conftest import tiny as tiny_llama
from engine import gracekv_variants as V
from test_gracekv import naive_propagate, tokens

L, H, G, D = 2, 4, 2, 8                   # the tiny model: g = 2 query heads per KV head
g = H // G
U = L * G
R_WIN = 4                                 # r: the exact recent window = the probes U
SET = GK.Settings(window=R_WIN, slot_min=3, slot_max=8, slot_target=5, bend_widths=(2, 3), seeds=3,
                  hop_depths=(0.0, 1.0), evidence=0, lambda_s=0.7, prefetch=3)


def tiny(seed):
    return tiny_llama(seed, L=L)


def observed(m, x):
    """Every layer's post-RoPE queries q[l] (H, T, D), keys k[l] (G, T, D), values v[l] (G, T, D)
    and attention outputs out[l] (H, T, D), read through the model's hook."""
    q, k, v, out = {}, {}, {}, {}

    def post(layer, qq, q_pos, lc, o):
        q[layer], k[layer], v[layer], out[layer] = qq[0], lc.k[0], lc.v[0], o[0]
    M.prefill(m, x, M.Hooks(post_kernel=post))
    return q, k, v, out


def rope(x, p, inv_freq, sign=1.0):
    """RoPE (rotate_half layout) of one vector x (D,) at position p, written out: pairs (i, i+D/2)
    turned by the angle sign·p·θ_i."""
    half, y = len(x) // 2, [0.0] * len(x)
    for i in range(half):
        a = sign * p * float(inv_freq[i])
        y[i] = float(x[i]) * math.cos(a) - float(x[i + half]) * math.sin(a)
        y[i + half] = float(x[i + half]) * math.cos(a) + float(x[i]) * math.sin(a)
    return torch.tensor(y, dtype=torch.float64)


def dot(a, b):
    return sum(float(x) * float(y) for x, y in zip(a, b))


def norm(a):
    return math.sqrt(dot(a, a))


def setup(seed, T, s=SET):
    m, x = tiny(seed), tokens(seed, T)
    full, flow = GK.observe(m, x, s)
    ctx = GK.context(m, full, flow, s.window, s)
    return m, x, full, flow, ctx


# ----------------------------------------------------------------------------- eq. (4)-(5)

def bends_eq4(h, w):
    """Eq. (4): h̄_i = h_i/‖h_i‖; μ₋ = mean(h̄_{i−w+1..i}), μ₊ = mean(h̄_{i+1..i+w})
    (windows clipped at the ends), δ₋ = h̄_i − μ₋, δ₊ = μ₊ − h̄_i,
    κ_i = 1 − cos(δ₋, δ₊); κ = 0 at the two ends, where δ₊ or δ₋ has no tokens."""
    T = len(h)
    hb = [[float(c) / norm(row) for c in row] for row in h]
    kappa = [0.0] * T
    for i in range(1, T - 1):
        before = [j for j in range(i - w + 1, i + 1) if j >= 0]
        after = [j for j in range(i + 1, i + w + 1) if j < T]
        mu_m = [sum(hb[j][f] for j in before) / len(before) for f in range(len(hb[i]))]
        mu_p = [sum(hb[j][f] for j in after) / len(after) for f in range(len(hb[i]))]
        dm = [hb[i][f] - mu_m[f] for f in range(len(hb[i]))]
        dp = [mu_p[f] - hb[i][f] for f in range(len(hb[i]))]
        cos = dot(dm, dp) / max(norm(dm) * norm(dp), 1e-8)   # as torch's cosine_similarity
        kappa[i] = 1 - cos
    return kappa


@pytest.mark.parametrize("w", [2, 3, 5])   # w = 1 leaves δ₋ = 0: Settings refuses it
def test_eq4_bends(w):
    h = torch.randn(30, 6, generator=torch.Generator().manual_seed(w), dtype=torch.float64)
    want = bends_eq4(h, w)
    got = GK.bends(h, w)
    for i in range(30):
        assert float(got[i]) == pytest.approx(want[i], abs=1e-10)


def median_lower(xs):
    """The median as the code's choice reads it: the lower middle value (docs/gracekv.md)."""
    return sorted(xs)[(len(xs) - 1) // 2]


def robust_z(xs):
    """z(x) = (x − median) / (1.4826·MAD) with MAD = median |x − median| (+1e-12)."""
    med = median_lower(xs)
    mad = median_lower([abs(x - med) for x in xs])
    return [(x - med) / (1.4826 * mad + 1e-12) for x in xs]


@given(st.integers(20, 36), st.integers(0, 3))
def test_eq5_boundary_score(T, seed):
    """Eq. (5): κ_i = mean_{l,w} κ_i^{(l,w)} − λ_stab·std_{l,w} κ_i^{(l,w)} (std over the
    (l, w) pairs, population form), b_i = z(κ_i) + λ_s·z(surprisal_i),
    surprisal_i = −log p(x_i | x_<i); the trajectory at layer l: h_t = the un-rotated keys k°_t
    and values v_t of every KV head, each L2-normalised, concatenated (a linear image of the
    hidden state; docs/gracekv.md)."""
    m, x, full, flow, ctx = setup(seed, T)
    s, Tc = SET, T - R_WIN
    _, k, v, _ = observed(m, x)
    kappas = []
    for layer in GK.depths(s.bend_depths, L):
        h = []
        for t in range(T):
            row = []
            for head in range(G):
                kr = rope(k[layer][head, t], t, m.inv_freq, sign=-1.0)
                row += [float(c) / norm(kr) for c in kr]
                row += [float(c) / norm(v[layer][head, t]) for c in v[layer][head, t]]
            h.append(row)
        for w in s.bend_widths:
            kappas.append(bends_eq4(h, w)[:Tc])
    kappa = []
    for i in range(Tc):
        vals = [kk[i] for kk in kappas]
        kappa.append(statistics.fmean(vals) - s.lambda_stab * statistics.pstdev(vals))
    logp = torch.log_softmax(m.forward(x), -1)[0].detach()                    # (T, V)
    surprisal = [0.0] + [-float(logp[t - 1, x[0, t]]) for t in range(1, T)]
    b = [zk + s.lambda_s * zs for zk, zs in zip(robust_z(kappa), robust_z(surprisal[:Tc]))]
    got = GK.slot_bends(m, full, Tc, s, torch.float64, flow.surprisal)
    for i in range(Tc):
        assert float(got[i]) == pytest.approx(b[i], rel=1e-8, abs=1e-8)


# ----------------------------------------------------------------------------- eq. (6)-(8)

def node_eq6_8(m, q, k, v, R, T, unit, toks, s=SET):
    """Eqs. (6)-(8) for the node over tokens `toks` of unit (l, g), its probes U = the last r
    queries of the group's g heads:
    (6) k°_t = RoPE⁻¹(k_t, t), p_v = round(mean t), k̃ = RoPE(mean k°_t, p_v);
    (7) β_v = 0.1·mean_{t∈v} R_t, ṽ = Σ (R_t + β_v) v_t / Σ (R_t + β_v),
        ħ = ‖mean k°‖ / (mean ‖k°‖ + ε), m_v = clamp(n·ħ², 1, n);
    (8) per probe u (max-subtracted): Z = Σ_t e^{q·k_t/√d}, M = Σ_t e^{q·k_t/√d} v_t,
        Z̃ = m e^{q·k̃/√d}, M̃ = Z̃ ṽ,
        D_u = λ_Z (Z − Z̃)²/(Z² + ε) + λ_M ‖M − M̃‖²/(‖M‖² + ε);
        D = Σ_u a_u D_u / Σ_u a_u with a_u the attention mass u pays the node;
        D(drop): Z̃ = M̃ = 0."""
    layer, head = divmod(unit, G)
    n = len(toks)
    kr = [rope(k[layer][head, t], t, m.inv_freq, sign=-1.0) for t in toks]
    kbar = [sum(float(kt[f]) for kt in kr) / n for f in range(D)]
    p = round(sum(toks) / n)
    key = rope(torch.tensor(kbar, dtype=torch.float64), p, m.inv_freq)
    Rt = [float(R[unit, t]) for t in toks]
    beta = s.beta * sum(Rt) / n
    wsum = sum(r_ + beta for r_ in Rt)
    val = [sum((Rt[i] + beta) * float(v[layer][head, t][f]) for i, t in enumerate(toks)) / wsum
           for f in range(D)]
    hbar = norm(kbar) / (sum(norm(kt) for kt in kr) / n + s.eps)
    mult = min(max(n * hbar ** 2, 1.0), n)
    Dsum = Ddrop = mass = 0.0
    for h in range(head * g, head * g + g):
        for u in range(T - R_WIN, T):
            qu = q[layer][h, u]
            logits = [dot(qu, k[layer][head, t]) / math.sqrt(D) for t in range(u + 1)]
            top = max(logits)
            A = [math.exp(x_ - top) for x_ in logits]
            a_u = sum(A[t] for t in toks) / sum(A)
            shift = max(logits[t] for t in toks)
            Z = sum(math.exp(logits[t] - shift) for t in toks)
            Mv = [sum(math.exp(logits[t] - shift) * float(v[layer][head, t][f]) for t in toks)
                  for f in range(D)]
            Zt = mult * math.exp(dot(qu, key) / math.sqrt(D) - shift)
            Mt = [Zt * val[f] for f in range(D)]
            M2 = dot(Mv, Mv)
            err = sum((Mv[f] - Mt[f]) ** 2 for f in range(D))
            Du = s.lambda_z * (Z - Zt) ** 2 / (Z ** 2 + s.eps) + s.lambda_m * err / (M2 + s.eps)
            Dd = s.lambda_z * Z ** 2 / (Z ** 2 + s.eps) + s.lambda_m * M2 / (M2 + s.eps)
            Dsum, Ddrop, mass = Dsum + a_u * Du, Ddrop + a_u * Dd, mass + a_u
    return dict(key=key, val=torch.tensor(val, dtype=torch.float64), pos=p, logm=math.log(mult),
                R=sum(Rt),
                D=Dsum / mass if n > 1 else 0.0, Ddrop=Ddrop / mass)


def per_node(ctx, j, toks, f=GK.Formulas()):
    """gracekv.py's per-node functions (f: the paper's, or a variant's) on the node `toks` of
    unit j: key (6), log m and value (7), D and D^drop (8)."""
    node = GK.node_view(ctx.units, j, toks)
    key = f.key(node)
    log_m = f.multiplicity(node, key)
    val = GK.value(node, f.value_beta(node, SET.beta))
    D_v, D_drop = GK.distortion(node, key, log_m, val, SET)
    return dict(key=key, val=val, pos=int(node.position), logm=float(log_m),
                D=float(D_v) if len(toks) > 1 else 0.0, Ddrop=float(D_drop))


def random_nodes(seed, Tc, count=6):
    """count random nodes (unit, tokens) of at most 7 tokens."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.randint(U, (count,), generator=gen)
    a = torch.randint(Tc - 1, (count,), generator=gen)
    b = torch.minimum(a + 1 + torch.randint(7, (count,), generator=gen), torch.tensor(Tc))
    return u, a, b


def agree(got, want) -> bool:
    """The fields of eqs. 6-8 of one node equal (key, value, position, log m, D, D^drop)."""
    close = [torch.allclose(got[f], want[f], rtol=1e-9, atol=1e-11) for f in ("key", "val")]
    close += [got["pos"] == want["pos"]]
    close += [got[f] == pytest.approx(want[f], rel=1e-8, abs=1e-11)
              for f in ("logm", "D", "Ddrop")]
    return all(close)


@given(st.integers(16, 32), st.integers(0, 3))
def test_eq6_7_8_prototype_and_distortion(T, seed):
    """gracekv.py's per-node functions (key_unrotated, multiplicity_hbar, beta_local and
    value, distortion) and node_statistics, which runs them node by node, against the
    transcription."""
    m, x, full, flow, ctx = setup(seed, T)
    q, k, v, _ = observed(m, x)
    u, a, b = random_nodes(seed, T - R_WIN)
    stats = GK.node_statistics(ctx.units, u, a, b)
    for i in range(6):
        j, toks = int(u[i]), list(range(int(a[i]), int(b[i])))
        want = node_eq6_8(m, q, k, v, ctx.units.R, T, j, toks)
        got = per_node(ctx, j, toks)
        torch.testing.assert_close(got["key"], want["key"], rtol=1e-9, atol=1e-11)     # eq. 6
        torch.testing.assert_close(got["val"], want["val"], rtol=1e-9, atol=1e-11)     # eq. 7
        assert got["pos"] == want["pos"] == int(stats["pos"][i])
        for f in ("logm", "D", "Ddrop"):                                               # eqs. 7, 8
            assert got[f] == pytest.approx(want[f], rel=1e-8, abs=1e-11), f
        for f in ("logm", "R", "D", "Ddrop"):
            assert float(stats[f][i]) == pytest.approx(want[f], rel=1e-8, abs=1e-11), f
        torch.testing.assert_close(stats["key"][i], want["key"], rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(stats["val"][i], want["val"], rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("over", [{"key": V.key_post}, {"multiplicity": V.multiplicity_n},
                                  {"value_beta": V.beta_global}])
def test_eq6_7_8_mutation_check(over):
    """A node formula other than the paper's (a variant row's key, m or β) fails the same
    comparison with the transcription on some node of longer than one token."""
    m, x, full, flow, ctx = setup(0, 30)
    q, k, v, _ = observed(m, x)
    f = GK.Formulas(**over)
    u, a, b = random_nodes(0, 30 - R_WIN, 12)
    nodes = [(int(j), list(range(int(s), int(e)))) for j, s, e in zip(u, a, b) if e - s > 1]
    assert nodes
    want = [node_eq6_8(m, q, k, v, ctx.units.R, 30, j, toks) for j, toks in nodes]
    assert all(agree(per_node(ctx, j, toks), w) for (j, toks), w in zip(nodes, want))
    assert not all(agree(per_node(ctx, j, toks, f), w) for (j, toks), w in zip(nodes, want))


# ----------------------------------------------------------------------------- eq. (9)-(11)

@given(st.integers(14, 30), st.integers(0, 3), st.integers(0, 2))
def test_eq9_10_relevance(T, seed, hops):
    """(9) s_{l,g,t} = Σ_{u∈U} Σ_{h∈H(g)} softmax_τ(q_u^{l,h}·k_τ^{l,g}/√d)_t over the
    context, normalised per unit to ŝ; the multi-hop's d̂ from the seeds of the mean ŝ along the
    sampled layers' attention (its transcription: test_gracekv.naive_propagate); (10) R^tok =
    (1 − λ_graph)·ŝ + λ_graph·d̂, each unit its own ŝ."""
    s = replace(SET, hops=hops, hop_forward=0.5)
    m, x, full, flow, ctx = setup(seed, T, s)
    q, k, _, _ = observed(m, x)
    Tc = T - R_WIN

    def attn(layer, h, i):                      # softmax_τ(q_i·k_τ/√d) over τ <= i, head h
        logits = [dot(q[layer][h, i], k[layer][h // g, t]) / math.sqrt(D) for t in range(i + 1)]
        top = max(logits)
        e = [math.exp(x_ - top) for x_ in logits]
        return [x_ / sum(e) for x_ in e]
    s_hat = []
    for layer in range(L):
        for head in range(G):
            sv = [0.0] * Tc
            for h in range(head * g, head * g + g):
                for u in range(T - R_WIN, T):
                    row = attn(layer, h, u)
                    for t in range(Tc):
                        sv[t] += row[t]
            s_hat.append([x_ / sum(sv) for x_ in sv])
    s_bar = torch.tensor([sum(r_[t] for r_ in s_hat) / U for t in range(Tc)], dtype=torch.float64)
    Amap = torch.zeros(Tc, Tc, dtype=torch.float64)             # the sampled layers' map
    sampled = GK.depths(s.hop_depths, L)
    for layer in sampled:
        for h in range(H):
            for i in range(Tc):
                row = attn(layer, h, i)
                for t in range(i + 1):
                    Amap[i, t] += row[t] / (H * len(sampled))
    Amap = (1 - s.hop_forward) * Amap + s.hop_forward * Amap.T
    d_hat, seeds = naive_propagate(s_bar / s_bar.sum(), Amap, s.seeds, hops, s.decay)
    assert ctx.seeds == seeds
    for j in range(U):
        for t in range(Tc):
            assert float(ctx.sal[j, t]) == pytest.approx(s_hat[j][t], rel=1e-9, abs=1e-13)
            want = (1 - s.lambda_graph) * s_hat[j][t] + s.lambda_graph * float(d_hat[t])
            assert float(ctx.units.R[j, t]) == pytest.approx(want, rel=1e-9, abs=1e-13)


@given(st.integers(14, 30), st.integers(0, 3))
def test_eq11_head_weights(T, seed):
    """(11) a_{l,g} = (Σ_{h∈H(g)} ‖W_O^{l,h}‖_F²)^{1/2},
    b_{l,g} = mean_{u∈U} ‖Σ_{h∈H(g)} W_O^{l,h} o_u^{l,h}‖, ω = √(a·b); W_O^{l,h} the
    columns of o_proj that read head h."""
    m, x, full, flow, ctx = setup(seed, T)
    _, _, _, out = observed(m, x)
    for layer in range(L):
        Wo = m.layers[layer].self_attn.o_proj.weight.detach()                 # (dim, H·D)
        for head in range(G):
            heads = range(head * g, head * g + g)
            a = math.sqrt(sum(float(Wo[r_, h * D + c] ** 2) for h in heads
                              for r_ in range(Wo.shape[0]) for c in range(D)))
            b = 0.0
            for u in range(T - R_WIN, T):
                y = [sum(float(Wo[r_, h * D + c]) * float(out[layer][h, u, c]) for h in heads
                         for c in range(D)) for r_ in range(Wo.shape[0])]
                b += norm(y) / R_WIN
            assert float(ctx.omega[layer * G + head]) == pytest.approx(math.sqrt(a * b), rel=1e-10)


# ------------------------------------------------------------------------ eq. (2), floor, (12)-(13)

def plan_for(seed, T, B, s=SET, f=None):
    m, x = tiny(seed), tokens(seed, T)
    full, flow = GK.observe(m, x, s, f)
    cache, plan = GK.compress(m, full, flow, B, s, return_plan=True, formulas=f)
    ctx = GK.context(m, full, flow, s.window, s, f)                          # the same steps, fresh
    return m, x, full, cache, plan, ctx


@given(st.integers(20, 40), st.data(), st.integers(0, 3), st.sampled_from([0.0, 0.5, 1.0]))
def test_eq2_budget_and_the_floor(T, data, seed, phi):
    """(2) B_total = U·B (B per unit = N_ctx/x), the window's U·r entries charged,
    B_floor = |E_floor|, B_alloc = B_total − U·r − B_floor, at most B_total entries. The floor,
    "chosen from the high-scoring seeds" with a budget-dependent size: each unit's own top
    ⌊φ·(B − r)⌋ seeds by its R^tok (ties to the later token)."""
    B = data.draw(st.integers(R_WIN + 1, T - 1))
    s = replace(SET, floor_frac=phi)
    m, x, full, cache, plan, ctx = plan_for(seed, T, B, s)
    per_unit = int(phi * (B - R_WIN))
    floor = 0
    for j in range(U):
        ranked = sorted(ctx.seeds, key=lambda t: (float(ctx.units.R[j, t]), t), reverse=True)
        want = sorted(ranked[:per_unit])
        assert plan.floor[j].nonzero()[:, 0].tolist() == want
        floor += len(want)
    assert plan.B_alloc == U * B - U * R_WIN - floor
    assert cache.entries() <= U * B


def leaf_tokens(plan, node):
    """The tokens a node stands for: its span minus its unit's floor (the paper's extraction
    leaves no other hole)."""
    nd = plan.nodes[node]
    return [t for t in range(nd.a, nd.b) if not plan.floor[nd.unit, t]]


def eq12_mismatches(seed, T, B, s, f=None):
    """Count the gains of the plan that differ from eq. (12) computed on the eq. (6)-(8)
    transcription: Δ_add(root) = ω·R(root)·(D^drop − D(root));
    Δ_split(v) = ω·R(v)·(D(v) − Σ_{u∈child(v)} D(u))."""
    m, x, full, cache, plan, ctx = plan_for(seed, T, B, s, f)
    q, k, v, _ = observed(m, x)
    memo = {}

    def node(i):
        if i not in memo:
            toks = leaf_tokens(plan, i)
            assert len(toks) == plan.nodes[i].n
            memo[i] = node_eq6_8(m, q, k, v, ctx.units.R, T, plan.nodes[i].unit, toks, s)
        return memo[i]
    bad = checked = 0
    for i, gain in plan.add_gain.items():
        w = float(ctx.omega[plan.nodes[i].unit])
        want = w * node(i)["R"] * (node(i)["Ddrop"] - node(i)["D"])
        bad += not math.isclose(gain, want, rel_tol=1e-7, abs_tol=1e-12)
        checked += 1
    for i, split in plan.split.items():
        w = float(ctx.omega[plan.nodes[i].unit])
        want = w * node(i)["R"] * (node(i)["D"] - sum(node(c)["D"] for c in split.children))
        bad += not math.isclose(split.gain, want, rel_tol=1e-7, abs_tol=1e-12)
        checked += 1
    assert checked > 0
    return bad, len(plan.split)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_eq12_gains_and_the_mutation_check(seed):
    """gracekv's gains are eq. (12); the earlier mass-weighted split gain (`gracekv-massgain`,
    ω·(R(v)D(v) − Σ_u R(u)D(u))) must fail the same check."""
    T, B = 36, 14
    bad, splits = eq12_mismatches(seed, T, B, SET)
    assert bad == 0 and splits > 0
    mass = GK.Formulas(**V.VARIANTS["gracekv-massgain"])
    bad, splits = eq12_mismatches(seed, T, B, SET, mass)
    assert bad > 0, "the mass-weighted gain passed the eq. (12) check: it cannot tell them apart"


def greedy_eq13(plan):
    """(13) one max-priority queue over every unit's actions by U(a) = Δ(a)/c(a): every root's
    add (cost 1) at the start; a node's split (cost |child| − 1) enters once the node is in the
    cache; pop the best until B_alloc is spent; an action that no longer fits is dropped
    [choice]; ties to the action queued first (roots in node order)."""
    def cost_of(entry):
        return 1 if entry[2] == "add" else plan.split[entry[3]].cost
    queue = [(gain, i, "add", i) for i, gain in plan.add_rank.items()]
    order, left, steps = len(queue), plan.B_alloc, []
    while queue and left > 0:
        best = max(queue, key=lambda e: (e[0] / cost_of(e), -e[1]))
        queue.remove(best)
        _, _, kind, v = best
        cost = cost_of(best)
        if cost > left:
            continue
        left -= cost
        steps.append((kind, v))
        for c in ([v] if kind == "add" else plan.split[v].children):
            if plan.nodes[c].n > 1:
                queue.append((plan.split[c].gain, order, "split", c))
                order += 1
    return steps


@given(st.integers(20, 44), st.data(), st.integers(0, 3))
def test_eq13_one_queue(T, data, seed):
    B = data.draw(st.integers(R_WIN + 1, T - 1))
    _, _, _, _, plan, _ = plan_for(seed, T, B)
    assert [(kind, v) for kind, v, *_ in plan.steps] == greedy_eq13(plan)
