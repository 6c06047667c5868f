"""PolyKV calibration: budget allocation invariants, signals against naive full-model probes,
a planted layer whose rule choice matters, uniform policies, ablations and the policy cache.
Tiny random LLaMAs in fp64 on CPU."""
import json
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import calibrate as C
from engine import policy_cache as PC
import model as M
import polykv as P
from model import UsageError
from conftest import REPEAT, tiny as tiny_llama
import baselines as BL
from engine import calibration as EC

pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.one_thread


SET = P.RuleSettings(window=4, kernel=3, n_sink=2, chunk=7, repeat=REPEAT)
T, N, B = 40, 8, 10                     # prompt, continuation, budget of the tiny probes


tiny = tiny_llama


def texts(seed, n=2, lo=1, hi=50):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(lo, hi, (T,), generator=g).tolist(),
         torch.randint(lo, hi, (N,), generator=g).tolist())
        for _ in range(n)
    ]


# ----------------------------------------------------------------------------- allocation

def waterfill_oracle(s, total, b_min, cap):
    """Independent: b_l = min(cap, b_min + λ·s_l) with λ found by bisection (all s = 0:
    uniform)."""
    s = s if sum(s) > 0 else [1.0] * len(s)
    n_pos = sum(x > 0 for x in s)
    if n_pos * cap + (len(s) - n_pos) * b_min < total:      # signalled layers all at cap:
        rest = (total - n_pos * cap) / (len(s) - n_pos)       # the zero-signal ones share the rest
        return [cap if x > 0 else rest for x in s]
    lo, hi = 0.0, 1.0
    while sum(min(cap, b_min + hi * x) for x in s) < total:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(min(cap, b_min + mid * x) for x in s) < total else (lo, mid)
    return [min(cap, b_min + hi * x) for x in s]


signals = st.lists(st.one_of(st.just(0.0), st.floats(1e-6, 100)), min_size=1, max_size=40)


@given(signals, st.integers(1, 600), st.floats(0, 1), st.floats(1, 4))
def test_allocate_invariants_and_formula(s, budget, f_min, f_cap):
    L, total = len(s), len(s) * budget
    b_min, cap = int(f_min * budget), int(f_cap * budget)
    b = C.allocate(s, total, b_min, cap)
    assert all(isinstance(x, int) for x in b) and sum(b) == total
    assert all(b_min <= x <= cap for x in b)
    for i in range(L):
        for j in range(L):
            if s[i] > s[j]:
                assert b[i] >= b[j]
    want = waterfill_oracle(s, total, b_min, cap)
    assert all(abs(x - w) < 1 + 1e-6 for x, w in zip(b, want))
    # no cap binds: exactly b_min + (L·B − L·b_min)·s_l/Σs up to rounding
    if max(want) < cap:
        ss = s if sum(s) > 0 else [1.0] * L
        assert all(
            abs(x - (b_min + (total - L * b_min) * v / sum(ss))) < 1 + 1e-6 for x, v in zip(b, ss)
        )


@given(st.integers(1, 40), st.integers(1, 600), st.floats(1e-3, 10))
def test_equal_signals_give_uniform_budgets(L, budget, v):
    assert C.allocate([v] * L, L * budget, budget // 4, 2 * budget) == [budget] * L
    assert C.allocate([0.0] * L, L * budget, budget // 4, budget) == [budget] * L


@given(signals, st.integers(8, 600), st.integers(1, 1000))
def test_rescaling_preserves_proportions(s, budget, budget2):
    L = len(s)
    b = C.allocate(s, L * budget, budget // 4, 4 * budget)
    pol = P.Policy([P.LayerPolicy(("snapkv", x), ("h2o", x)) for x in b], budget)
    r = pol.rescaled(budget2)
    for phase in ("prefill", "decode"):
        got = [getattr(lp, phase)[1] for lp in r.layers]
        assert sum(got) == L * budget2
        assert all(abs(g - x * budget2 / budget) < 1 for g, x in zip(got, b))


def test_allocate_errors():
    for args, msg in ((([1.0, -1.0], 20, 2, 20), "non-negative"),
                      (([1.0, 2.0], 50, 2, 20), "cannot give 2"),
                      (([1.0, 2.0], 20, 12, 20), "cannot give 2")):
        with pytest.raises(UsageError, match=msg):
            C.allocate(*args)


# ----------------------------------------------------------------------------- signals

@torch.no_grad()
def naive_probe(m, prompt, cont, layer, pre, dec):
    """Independent of calibrate's fast path: a fresh polykv.prefill, then the whole model over
    the continuation (model.decode, token by token when the decode rule evicts)."""
    pol = C.probe_policy(m.config.n_layers, layer, pre, dec, B, SET)
    cache = P.prefill(m, prompt, pol)
    seen = []

    def spy(l, q, q_pos, lc, out):
        """Keep the attention output of `layer`."""
        if l == layer:
            seen.append(out)
    dh = pol.decoder
    if dh is None:
        logits = m.step(cont, cache, M.Hooks(post_kernel=spy))
    else:
        logits = M.decode(m, cont, cache, M.Hooks(post_kernel=spy, cache_update=dh.cache_update))
    return torch.cat(seen, 2), float(F.cross_entropy(logits[0, :-1], cont[0, 1:], reduction="sum"))


@torch.no_grad()
def naive_reference(m, prompt, cont):
    """FullKV over prompt + continuation in one pass: per-layer output and entropy of the
    continuation rows of the full attention matrix, and the continuation's NLL."""
    outs, ent = {}, {}

    def spy(l, q, q_pos, lc, out):
        A = M.attention_probs(q, lc.k, lc.bias, q_pos, lc.pos)[:, :, T:]       # (1, H, N, T+N)
        ent[l] = float(-(A * A.clamp_min(1e-300).log()).sum(-1).mean())
        outs[l] = out[:, :, T:]
    logits = m.step(torch.cat((prompt, cont), 1), m.new_cache(), M.Hooks(post_kernel=spy))
    return outs, ent, float(F.cross_entropy(logits[0, T - 1:-1][1:], cont[0, 1:], reduction="sum"))


@settings(max_examples=3)
@given(st.integers(0, 100))
def test_signals_equal_naive_probes(seed):
    m, tx = tiny(seed), texts(seed)
    L = m.config.n_layers
    refs_measured = C.references(m, tx, SET)
    sig = C.measure(m, refs_measured, B, "cosine", SET)
    sig.update(EC.uniform_baselines(m, refs_measured, B, SET))
    pairs = [(torch.tensor([p]), torch.tensor([c])) for p, c in tx]
    refs = [naive_reference(m, p, c) for p, c in pairs]
    count = len(tx) * (N - 1)

    def ppl(nll):
        """PPL = exp(mean NLL)."""
        return math.exp(nll / count)
    ppl_full = ppl(sum(r[2] for r in refs))
    tol = 2e-5 * ppl_full         # logits are fp32 (model.step), the rest fp64
    assert sig["ppl_full"] == pytest.approx(ppl_full, abs=tol)
    for l in range(L):
        assert sig["entropy"][l] == pytest.approx(sum(r[1][l] for r in refs) / len(refs), rel=1e-9)
    pool = P.pool(BL.RULES)
    chosen = C.best_rules(sig["prefill"], pool, "cosine")
    assert chosen == [
        max(pool, key=lambda r: (sig["prefill"]["cosine"][r][l], -pool.index(r)))
        for l in range(L)
    ]
    # uniform baselines at equal memory: a fresh prefill compressed by the rule, then the
    # continuation appended by every rule (model.decode without a decoder), whatever its own
    # decode form; every rule then holds the same entries, L·G·(B + N)
    held = L * m.config.n_kv_heads * (B + N)
    for r in P.pool(BL.RULES):
        nll = 0.0
        for p, c in pairs:
            cache = P.Policy.uniform(r, B, L, settings=SET, rules=BL.RULES).prefill(m, p)
            logits = M.decode(m, c, cache)
            assert cache.entries() == held, r
            nll += float(F.cross_entropy(logits[0, :-1], c[0, 1:], reduction="sum"))
        assert sig["uniform_dppl"][r] == pytest.approx(ppl(nll) - ppl_full, abs=tol)
    assert sig["uniform_memory"] == EC.UNIFORM_MEMORY
    ref = C.reference(m, *pairs[0], SET)
    assert {EC.uniform_run(m, ref, r, B, SET)[1].entries() for r in P.pool(BL.RULES)} == {held}
    best = EC.calibrate_paper(m, None, B, texts=tx, settings=SET).meta["best_uniform"]
    assert sig["uniform_dppl"][best] == min(sig["uniform_dppl"].values())
    for phase, pool in (("prefill", P.pool(BL.RULES)), ("decode", P.decode_pool())):
        for l in range(L):
            for r in pool:
                pre, dec = (
                    ((r, B), ("append", B)) if phase == "prefill" else ((chosen[l], B), (r, B))
                )
                cos, nll = [], 0.0
                for (p, c), (outs, _, _) in zip(pairs, refs):
                    o, nl = naive_probe(m, p, c, l, pre, dec)
                    cos.append(
                        F.cosine_similarity(
                            o.transpose(1, 2).flatten(2), outs[l].transpose(1, 2).flatten(2), dim=-1
                        ).mean()
                    )
                    nll += nl
                assert sig[phase]["cosine"][r][l] == pytest.approx(
                    float(sum(cos) / len(cos)), abs=1e-9
                )
                assert sig[phase]["dppl"][r][l] == pytest.approx(ppl(nll) - ppl_full, abs=tol)


SINK, LO_CUE = 1, 40      # token 1 opens every prompt; ids >= 40 appear only in continuations


def planted(seed, layer=1, a=6.0, gamma=2.0):
    """Layer `layer` attends from continuation tokens to position 0 only, while prompt queries
    avoid it: residual dims 0, 1 are written by the embedding only (sink flag, ±cue flag), and the
    layer's RoPE pair (3, 7) (rotation ≈ 2e-4 rad per position) carries
    q·k = ±γ²·flag·flag."""
    m = tiny(seed, bias=True)
    D, H, G = 8, 4, 2
    with torch.no_grad():
        for blk in m.layers:                      # nothing but the embedding writes dims 0, 1
            blk.self_attn.o_proj.weight[:2] = 0
            blk.self_attn.o_proj.bias[:2] = 0
            blk.mlp.down_proj.weight[:2] = 0
        E = m.embed_tokens.weight
        E[:, :2] = 0
        E[SINK, 0] = a
        E[:LO_CUE, 1] = -a                        # prompt tokens: query away from the sink
        E[LO_CUE:, 1] = a                         # continuation tokens: query towards it
        at = m.layers[layer].self_attn
        for h in range(H):
            at.q_proj.weight[[h * D + 3, h * D + 7]] = 0
            at.q_proj.bias[[h * D + 3, h * D + 7]] = 0
            at.q_proj.weight[h * D + 3, 1] = gamma
        for g in range(G):
            at.k_proj.weight[[g * D + 3, g * D + 7]] = 0
            at.k_proj.bias[[g * D + 3, g * D + 7]] = 0
            at.k_proj.weight[g * D + 3, 0] = gamma
    return m


@settings(max_examples=5)
@given(st.integers(0, 100))
def test_planted_sink_layer_chooses_a_rule_that_keeps_position_0(seed):
    m, layer = planted(seed), 1
    tx = [([SINK] + p[1:], [LO_CUE + x % 10 for x in c]) for p, c in texts(seed, lo=2, hi=LO_CUE)]
    pol = C.calibrate(m, None, B, texts=tx, settings=SET, cont_len=N)
    cos = pol.meta["signals"]["prefill"]["cosine"]
    ref = C.reference(m, torch.tensor([tx[0][0]]), torch.tensor([tx[0][1]]), SET)
    keeps = {
        r: bool(
            (
                C.probe_policy(3, layer, (r, B), ("append", B), B, SET)
                .compress(m, ref["full"], ref["obs"])
                .layers[layer]
                .pos
                == 0
            ).any()
        )
        for r in P.pool(BL.RULES)
    }
    assert keeps["streaming"] and not keeps["h2o"] and not keeps["tova"]      # the plant works
    assert keeps[pol.layers[layer].prefill[0]]
    assert min(cos[r][layer] for r in P.pool(BL.RULES) if keeps[r]) > max(
        cos[r][layer] for r in P.pool(BL.RULES) if not keeps[r]
    )


# ----------------------------------------------------------------------------- construction

def fake_signals(L, best, best_dec, entropy=None):
    pre = {r: [0.9 if r == best else 0.5] * L for r in P.pool(BL.RULES)}
    dec = {r: [0.9 if r == best_dec else 0.5] * L for r in P.decode_pool()}
    dp = {r: [0.0] * L for r in P.pool(BL.RULES)}
    dd = {r: [0.0] * L for r in P.decode_pool()}
    return {"entropy": entropy or [2.0] * L, "ppl_full": 3.0,
            "prefill": {"cosine": pre, "dppl": dp}, "decode": {"cosine": dec, "dppl": dd}}


@pytest.mark.parametrize("rule", P.pool(BL.RULES))
def test_one_rule_uniform_budgets_equals_uniform_policy(rule):
    m = tiny(3)
    L = m.config.n_layers
    tokens = torch.randint(1, 50, (1, T + N), generator=torch.Generator().manual_seed(3))
    uni = P.Policy.uniform(rule, B, L, settings=SET, rules=BL.RULES)
    dec = uni.layers[0].decode[0] if rule in P.decode_pool() else "tova"
    pol = C.build(fake_signals(L, rule, dec), B, settings=SET, cap=T)
    assert [lp.prefill for lp in pol.layers] == [lp.prefill for lp in uni.layers]
    if dec != uni.layers[0].decode[0]:        # PolyKV's decode pool has no append: compare so
        uni = P.Policy.uniform(rule, B, L, decode="tova", settings=SET, rules=BL.RULES)
    assert pol.layers == uni.layers
    pairs = [(pol, uni), (EC.pattern_only(pol), uni),
             (EC.budget_only(pol, rule),
              P.Policy.uniform(rule, B, L, settings=SET, rules=BL.RULES)),
             (EC.prefill_only(pol),
              P.Policy.uniform(rule, B, L, decode="append", settings=SET, rules=BL.RULES))]
    for p, q in pairs:
        a, b = P.prefill(m, tokens[:, :T], p), P.prefill(m, tokens[:, :T], q)
        for la, lb in zip(a.layers, b.layers):
            assert (
                torch.equal(la.pos, lb.pos) and torch.equal(la.k, lb.k) and torch.equal(la.v, lb.v)
            )
        assert torch.equal(
            M.decode(m, tokens[:, T:], a, p.decoder), M.decode(m, tokens[:, T:], b, q.decoder)
        )


def test_build_budgets_append_and_ablations():
    L = 4
    sig = fake_signals(L, "h2o", "streaming", entropy=[1.0, 2.0, 3.0, 4.0])
    sig["prefill"]["dppl"]["tova"] = [0.0, 0.0, 0.0, 9.0]     # ppl sensitivity: layer 3 worst
    sig["decode"]["dppl"]["h2o"] = [9.0, 0.0, 0.0, 0.0]       # decode: layer 0 worst
    pol = C.build(sig, 100, sensitivity="entropy", cap=400)
    assert [lp.prefill[1] for lp in pol.layers] == [100 - 75 + 30, 100 - 75 + 60, 100 - 75 + 90,
                                                    100 - 75 + 120]
    assert [lp.prefill[1] for lp in pol.layers] == [lp.decode[1] for lp in pol.layers]
    assert all(lp.decode[0] == "streaming" for lp in pol.layers)   # decode budget binds
    pp = C.build(sig, 100, sensitivity="ppl", cap=400)
    assert [lp.prefill[1] for lp in pp.layers] == [25, 25, 25, 325]
    assert [lp.decode[1] for lp in pp.layers] == [325, 25, 25, 25]
    # every layer keeps its decode rule (layer 0's binds later), so the decode total is L·B
    assert [lp.decode[0] for lp in pp.layers] == ["streaming"] * 4
    assert sum(lp.decode[1] for lp in pp.layers) == 4 * 100
    po = EC.pattern_only(pp)
    assert [(lp.prefill, lp.decode) for lp in po.layers] == [
        (("h2o", 100), ("streaming", 100))
    ] * 4
    pf = EC.prefill_only(pp)
    assert [(lp.prefill, lp.decode) for lp in pf.layers] == [
        (lp.prefill, ("append", lp.prefill[1])) for lp in pp.layers
    ]
    dw = EC.decode_with(pp, "tova")               # one decode rule, the same phases' budgets
    assert [(lp.prefill, lp.decode) for lp in dw.layers] == [
        (lp.prefill, ("tova", lp.decode[1])) for lp in pp.layers
    ]
    with pytest.raises(UsageError, match="unknown decode rule 'snapkv'"):
        EC.decode_with(pp, "snapkv")
    bo = EC.budget_only(pp, "tova")
    assert [(lp.prefill, lp.decode) for lp in bo.layers] == [(("tova", 25), ("tova", 325)),
                                                             (("tova", 25), ("tova", 25)),
                                                             (("tova", 25), ("tova", 25)),
                                                             (("tova", 325), ("tova", 25))]
    # all ΔPPL 0: tie -> first
    assert C.build(sig, 100, preference="ppl").layers[0].prefill[0] == "streaming"
    with pytest.raises(UsageError, match="unknown rule 'x'"):
        EC.budget_only(pp, "x")
    with pytest.raises(UsageError, match="preference must be"):
        C.build(sig, 100, preference="kl")


# what a cached policy of the tiny calibration was made with, besides its texts
SAME = dict(settings=SET, prompt_len=T, cont_len=N)


def test_policy_for_caches_and_checks_layers(tmp_path):
    m, tx = tiny(4), texts(4)
    first = PC.policy_for(m, None, "tiny/x", B, seed=7, cache_dir=tmp_path, texts=tx, **SAME)
    files = list(tmp_path.iterdir())
    assert [f.name for f in files] == [f"polykv-tiny_x-B10-T{T}-seed7-{C.TEXT_VERSION}.json"]
    marked = P.Policy(first.layers, first.budget, first.settings, {**first.meta, "mark": 1},
                      rules=BL.RULES)
    marked.save(files[0])                         # a later call loads the file, no recalibration
    again = PC.policy_for(m, None, "tiny/x", B, seed=7, cache_dir=tmp_path, **SAME)
    assert again.layers == first.layers and again.meta["mark"] == 1
    assert again.meta["signals"] == first.meta["signals"]
    with pytest.raises(UsageError, match=r"calibrated with sensitivity='entropy' \(asked 'ppl'\)"):
        PC.policy_for(m, None, "tiny/x", B, seed=7, cache_dir=tmp_path, sensitivity="ppl", **SAME)
    with pytest.raises(UsageError, match="has 3 layers, the model has 4") as e:
        PC.policy_for(tiny(4, L=4), None, "tiny/x", B, seed=7, cache_dir=tmp_path, **SAME)
    assert "\n" not in str(e.value)


def test_policy_for_reads_shipped_policies_and_recalibrates(tmp_path):
    """A shipped folder is read where the cache has no file (nothing is written); a recorded
    setting other than the one asked is refused; recalibrate ignores both and writes the cache."""
    m, tx = tiny(4), texts(4)
    shipped, cache = tmp_path / "shipped", tmp_path / "cache"
    made = PC.policy_for(m, None, "tiny/x", B, seed=7, cache_dir=shipped, texts=tx, **SAME)
    [file] = shipped.iterdir()
    marked = P.Policy(made.layers, made.budget, made.settings, {**made.meta, "mark": 1},
                      rules=BL.RULES)
    marked.save(file)
    got = PC.policy_for(m, None, "tiny/x", B, seed=7, cache_dir=cache, shipped=shipped, **SAME)
    assert got.meta["mark"] == 1 and got.layers == made.layers and not cache.exists()
    with pytest.raises(UsageError, match=r"sensitivity='entropy' \(asked 'ppl'\)"):
        PC.policy_for(m, None, "tiny/x", B, seed=7, cache_dir=cache, shipped=shipped,
                     sensitivity="ppl", **SAME)
    again = PC.policy_for(m, None, "tiny/x", B, seed=7, cache_dir=cache, shipped=shipped,
                         recalibrate=True, texts=tx, **SAME)
    assert "mark" not in again.meta and again.layers == made.layers
    assert [f.name for f in cache.iterdir()] == [file.name]


@pytest.mark.parametrize("change,named", [
    (dict(b_min=0), "b_min=2 (asked 0)"),
    (dict(preference="ppl"), "preference='cosine' (asked 'ppl')"),
    (dict(sensitivity="ppl"), "sensitivity='entropy' (asked 'ppl')"),
    (dict(settings=replace(SET, window=6)), "settings="),
    (dict(settings=replace(SET, kernel=5)), "settings="),
    (dict(cont_len=N + 1), f"cont_len={N} (asked {N + 1})"),
    (dict(n_prompts=3), "n_prompts=2 (asked 3)"),
])
def test_a_cached_policy_is_refused_for_any_other_argument(tmp_path, change, named):
    """The cache is keyed on every argument that makes a policy: a file made with other b_min,
    preference, sensitivity, rule settings, lengths or number of prompts is refused with one line
    naming the difference, never silently reused (the procedure, model, budget, seed and prompt
    length are in the file's name, so another one is another file; they are compared too)."""
    m, tx = tiny(4), texts(4)
    PC.policy_for(m, None, "tiny/x", B, seed=7, cache_dir=tmp_path, texts=tx, **SAME)
    with pytest.raises(UsageError) as e:
        PC.policy_for(m, None, "tiny/x", B, seed=7, cache_dir=tmp_path, **{**SAME, **change})
    assert named in str(e.value) and "\n" not in str(e.value)
    file = next(tmp_path.iterdir())
    record = json.loads(file.read_text())
    file.write_text(json.dumps({**record, "format": "polykv-policy/0"}))
    with pytest.raises(UsageError, match="format='polykv-policy/0'"):
        PC.policy_for(m, None, "tiny/x", B, seed=7, cache_dir=tmp_path, **SAME)
    # a file whose uniform baselines ran at unequal memory (made before they appended)
    signals = {k: v for k, v in record["signals"].items() if k != "uniform_memory"}
    file.write_text(json.dumps({**record, "signals": signals}))
    with pytest.raises(UsageError, match="uniform_memory=None"):
        PC.policy_for(m, None, "tiny/x", B, seed=7, cache_dir=tmp_path, **SAME)


def test_build_refuses_a_preference_the_decode_probes_did_not_run_under():
    """The decode signals are measured under the prefill rules `measure`'s preference chose;
    building with a preference that chooses other prefill rules is refused."""
    m, tx = tiny(4), texts(4)
    sig = C.measure(m, C.references(m, tx, SET), B, "cosine", SET)
    other = C.best_rules(sig["prefill"], list(sig["prefill"]["cosine"]), "ppl")
    if other == sig["decode_probe_prefill"]:
        pytest.skip("both preferences choose the same prefill rules on this model")
    with pytest.raises(UsageError, match="preference='ppl'"):
        C.build(sig, B, preference="ppl", settings=SET)
    C.build(sig, B, preference="cosine", settings=SET)


def test_cli_errors_are_one_line(capsys):
    for argv, msg in ((["--budget", "0"], "budget"),
                      (["--budget", "512", "--prompt-len", "300"], "longer than the budget"),
                      (["--budget", "64", "--b-min", "65"], "b_min"),
                      (["--out", "/no/such/dir/p.json"], "no such folder")):
        with pytest.raises(UsageError) as e:
            C.main(argv)
        assert msg in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("sensitivity", ["entropy", "ppl"])
def test_decode_total_held_at_L_B_over_a_long_generation(sensitivity):
    """A calibrated policy generating 3·B tokens under the papers' protocol (no allowance):
    after every token each layer holds at most its decode budget, so the cache holds at most
    Σ_l b_{l,dec}·G = L·G·B entries however long the generation (no layer is left growing)."""
    m = tiny(5, L=4)
    L, G = m.config.n_layers, m.config.n_kv_heads
    pol = C.calibrate(m, None, B, texts=texts(5), sensitivity=sensitivity, settings=SET)
    assert sum(lp.decode.budget for lp in pol.layers) == L * B
    assert all(lp.decode.rule in P.decode_pool() for lp in pol.layers)
    tokens = torch.randint(1, 50, (1, T + 3 * B), generator=torch.Generator().manual_seed(5))
    cache = P.prefill(m, tokens[:, :T], pol)
    for i in range(T, T + 3 * B):
        M.decode(m, tokens[:, i:i + 1], cache, pol.decoder)
        assert cache.entries() <= L * G * B
        for lc, lp in zip(cache.layers, pol.layers):
            assert lc.size <= max(lp.decode.budget, lp.prefill.budget)
    assert cache.entries() == L * G * B
