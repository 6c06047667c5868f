"""PolyKV's joint calibration (engine/calibrate_joint.py): every score it records equals a
naive full-model run
of the policy it stands for, the sweeps never raise the calibration KL, the budgets keep their
sum, and the policy file says which procedure made it. Tiny random LLaMAs in fp64."""
import pytest
import torch
from hypothesis import example, given, settings, strategies as st

import calibrate as C
from engine import calibrate_joint as J
import model as M
from engine import policy_cache as PC
import polykv as P
from engine import policy_tables
from test_calibrate import SET, B, N, T, texts, tiny
import baselines as BL
from engine import policy_tables as PT

pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.one_thread


@torch.no_grad()
def naive_kl(m, tx, policy) -> float:
    """Independent of joint's fast path: FullKV over prompt + continuation in one pass, and a fresh
    polykv.prefill of the prompt followed by the whole model over the continuation (appends)."""
    kls = []
    for p, c in tx:
        p, c = torch.tensor([p]), torch.tensor([c])
        ref = m.step(torch.cat((p, c), 1), m.new_cache())[0, p.shape[1]:].float().log_softmax(-1)
        got = m.step(c, P.prefill(m, p, policy))[0].float().log_softmax(-1)           # (N, V)
        kls.append(float((ref.exp() * (ref - got)).sum(-1).clamp_min(0).mean()))
    return sum(kls) / len(kls)


@torch.no_grad()
def naive_cos(m, tx, policy, layer) -> float:
    """Layer `layer`'s attention output over the continuation, compressed vs FullKV: mean cosine
    over tokens (over H·D), then over prompts (full-model runs, as naive_kl)."""
    coss = []
    for p, c in tx:
        p, c = torch.tensor([p]), torch.tensor([c])
        seen = []
        spy = M.Hooks(
            post_kernel=lambda l, q, q_pos, lc, out: seen.append(out) if l == layer else None
        )
        m.step(torch.cat((p, c), 1), m.new_cache(), spy)
        m.step(c, P.prefill(m, p, policy), spy)
        ref, got = seen[0][:, :, p.shape[1]:], seen[1]                    # (1, H, N, D)
        coss.append(float(torch.nn.functional.cosine_similarity(
            got.transpose(1, 2).flatten(2), ref.transpose(1, 2).flatten(2), dim=-1).mean()))
    return sum(coss) / len(coss)


@pytest.mark.parametrize("signal", ["kl", "cosine"])
@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 100))
@example(seed=0)                                       # the budget step keeps α = 1 here
def test_joint_scores_equal_naive_runs(seed, signal):
    m, tx = tiny(seed), texts(seed)
    L = m.config.n_layers
    sig = J.measure_joint(m, tx, B, signal=signal, settings=SET)
    for r in P.pool(BL.RULES):                                   # every uniform rule, end to end
        assert sig["uniform_kl"][r] == pytest.approx(
            naive_kl(m, tx, P.Policy.uniform(r, B, L, settings=SET, rules=BL.RULES)),
            rel=1e-4, abs=1e-7
        )
    assert sig["uniform_kl"][sig["start"]] == min(sig["uniform_kl"].values())
    uni = J.policy_of(sig["rules"], [B] * L, SET)      # the chosen rules at the uniform budget
    assert sig["sweeps"][-1]["kl"] == pytest.approx(naive_kl(m, tx, uni), rel=1e-4, abs=1e-7)
    # a sweep's score of the rule it kept at the last layer is that of the policy as it then stood
    last = sig["sweeps"][-1]["scores"][L - 1][sig["rules"][L - 1]]
    want = naive_kl(m, tx, uni) if signal == "kl" else -naive_cos(m, tx, uni, L - 1)
    assert last == pytest.approx(want, rel=1e-4, abs=1e-7)
    if signal == "kl":                                 # coordinate descent on the KL: never worse
        kls = [sig["uniform_kl"][sig["start"]]] + [s["kl"] for s in sig["sweeps"]]
        assert all(b <= a for a, b in zip(kls, kls[1:]))
    if not sig["sweeps"][-1]["changed"]:               # converged: every layer holds its best rule
        for l, scores in enumerate(sig["sweeps"][-1]["scores"]):
            assert scores[sig["rules"][l]] <= min(scores.values()) + 1e-12
    pol = J.build_joint(sig, B, SET)
    assert sum(lp.prefill[1] for lp in pol.layers) == L * B
    if sig["budget"]["alpha"] != "0":                  # budgets kept only when they helped
        assert naive_kl(m, tx, pol) == pytest.approx(
            sig["budget"]["kl_by_alpha"][sig["budget"]["alpha"]], rel=1e-4
        )
        assert naive_kl(m, tx, pol) < sig["sweeps"][-1]["kl"]


def test_joint_policy_file_records_its_procedure(tmp_path):
    m, tx = tiny(1), texts(1)
    pol = J.calibrate_joint(m, None, B, texts=tx, settings=SET, probes=0, retrieval=None,
                            model_name="x")
    same = dict(settings=SET, prompt_len=T, cont_len=N)       # what it was made with
    assert pol.meta["procedure"] == "joint" and pol.meta["best_uniform"] in P.pool(BL.RULES)
    f = tmp_path / "p.json"
    pol.save(f)
    again = P.Policy.load(f, n_layers=m.config.n_layers, rules=BL.RULES)
    assert again.layers == pol.layers and again.meta["signals"]["rules"] == [
        lp.prefill[0] for lp in pol.layers
    ]
    assert PC.policy_path("x", 64, 0, tmp_path, "joint") != PC.policy_path("x", 64, 0, tmp_path)
    assert "layers changed per sweep" in policy_tables.table_joint(pol)
    with pytest.raises(M.UsageError, match="procedure"):
        PC.policy_for(m, None, "x", B, cache_dir=tmp_path, procedure="nope")
    # a text-only joint policy is the file of `joint-text`; under the name of `joint` (whose
    # objective uses retrieval probes) it is refused, never silently reused
    pol.save(PC.policy_path("x", B, 0, tmp_path, "joint-text", T))
    assert (
        PC.policy_for(m, None, "x", B, cache_dir=tmp_path, procedure="joint-text", **same).layers
        == pol.layers
    )
    pol.save(PC.policy_path("x", B, 0, tmp_path, "joint", T))
    with pytest.raises(M.UsageError, match="retrieval=None \\(asked 'constraint'\\)"):
        PC.policy_for(m, None, "x", B, cache_dir=tmp_path, procedure="joint", **same)
    # the calibration length: the default's files keep their names; another length has its own
    # file, and a file calibrated at one length is refused under another's name
    assert PC.policy_path("x", B, 0, tmp_path, "joint-text", C.PROMPT_LEN) == PC.policy_path(
        "x", B, 0, tmp_path, "joint-text"
    )
    longer = PC.policy_path("x", B, 0, tmp_path, "joint-text", 8000)
    assert longer.name == f"polykv-joint-text-x-B{B}-T8000-seed0-{C.TEXT_VERSION}.json"
    pol.save(longer)
    with pytest.raises(
        M.UsageError, match=f"prompt_len={pol.meta['calibration']['prompt_len']} \\(asked 8000\\)"
    ):
        PC.policy_for(m, None, "x", B, cache_dir=tmp_path, procedure="joint-text",
                     **{**same, "prompt_len": 8000})
    # needle prompts in the calibration set are the joint procedure's option, not the paper's
    with pytest.raises(SystemExit) as e:
        C.main(["--needles", "1", "--out", str(tmp_path / "q.json")])
    assert e.value.code == 2


@torch.no_grad()
def naive_probe(m, probes, policy) -> float:
    """A retrieval probe's answer ΔNLL per token (answer tokens 1..n−1), full-model runs as
    naive_kl."""
    out = []
    for p, a in probes:
        p, a = torch.tensor([p]), torch.tensor([a])
        ref = m.step(torch.cat((p, a), 1), m.new_cache())[0, p.shape[1]:].float().log_softmax(-1)
        got = m.step(a, P.prefill(m, p, policy))[0].float().log_softmax(-1)           # (n, V)
        tgt = a[0, 1:, None]
        out.append(float((ref[:-1].gather(1, tgt) - got[:-1].gather(1, tgt)).mean()))
    return sum(out) / len(out)


@pytest.mark.parametrize("retrieval", ["constraint", 0.05])
@settings(max_examples=2, deadline=None)
@given(seed=st.integers(0, 100))
def test_retrieval_objective_equals_naive_runs(seed, retrieval):
    """With retrieval probes: every probe loss the file records, and the final policy's KL and
    probe loss, equal naive full-model runs; under the constraint the start and the final policy
    are admissible (probe loss <= τ, the best uniform rule's)."""
    m, tx = tiny(seed), texts(seed)
    g = torch.Generator().manual_seed(seed + 7)
    probes = [
        (torch.randint(1, 50, (40,), generator=g).tolist(),
         torch.randint(1, 50, (5,), generator=g).tolist())
        for _ in range(2)
    ]
    L = m.config.n_layers
    pol = J.calibrate_joint(
        m, None, B, texts=tx, probe_pairs=probes, retrieval=retrieval, settings=SET
    )
    sig = pol.meta["signals"]
    for r in P.pool(BL.RULES):
        assert sig["uniform_probe"][r] == pytest.approx(
            naive_probe(m, probes, P.Policy.uniform(r, B, L, settings=SET, rules=BL.RULES)),
            rel=1e-4, abs=1e-7
        )
    assert sig["final"]["kl"] == pytest.approx(naive_kl(m, tx, pol), rel=1e-4, abs=1e-7)
    assert sig["final"]["probe"] == pytest.approx(naive_probe(m, probes, pol), rel=1e-4, abs=1e-7)
    assert (
        pol.meta["calibration"]["probes"] == 2 and pol.meta["calibration"]["retrieval"] == retrieval
    )
    if retrieval == "constraint":
        assert sig["tau"] == min(sig["uniform_probe"].values())
        assert sig["uniform_probe"][sig["start"]] <= sig["tau"] + 1e-12
        assert sig["final"]["probe"] <= sig["tau"] + 1e-9
        last = sig["sweeps"][-1]                       # each layer kept the best admissible rule
        for l, (sc, pr) in enumerate(zip(last["scores"], last["probe_scores"])):
            kept = sig["rules"][l]
            assert pr[kept] <= sig["tau"] + 1e-12
            assert sc[kept] <= min(sc[r] for r in pr if pr[r] <= sig["tau"] + 1e-12) + 1e-12
    else:                                              # the weighted start: KL + w·probe
        w = retrieval
        assert sig["start"] == min(
            P.pool(BL.RULES), key=lambda r: sig["uniform_kl"][r] + w * sig["uniform_probe"][r]
        )



def test_shuffled_routes_keep_counts_and_budgets():
    m = tiny(3)
    pol = J.calibrate_joint(m, None, B, texts=texts(3), settings=SET, probes=0, retrieval=None)
    routes = PT.shuffled(pol, 6, seed=1)
    pairs = sorted((lp.prefill.rule, lp.decode.rule) for lp in pol.layers)
    for r in routes:
        assert sorted((lp.prefill.rule, lp.decode.rule) for lp in r.layers) == pairs
        assert [(lp.prefill.budget, lp.decode.budget) for lp in r.layers] == \
            [(lp.prefill.budget, lp.decode.budget) for lp in pol.layers]
    assert [r.layers for r in PT.shuffled(pol, 6, seed=1)] == [r.layers for r in routes]


@torch.no_grad()
def naive_harness_kl(m, tx, policy) -> float:
    """evaluate.py's fidelity KL, naively: the n rows after the prompt and after each of the first
    n − 1 continuation tokens (the first row is the full-attention prefill's, for both)."""
    kls = []
    for p, c in tx:
        p, c = torch.tensor([p]), torch.tensor([c])
        ref = (
            m.step(torch.cat((p, c[:, :-1]), 1), m.new_cache())[0, p.shape[1] - 1 :]
            .float()
            .log_softmax(-1)
        )
        cache = P.prefill(m, p, policy)
        # (n, V)
        got = torch.cat((cache.last_logits, m.step(c[:, :-1], cache)[0])).float().log_softmax(-1)
        kls.append(float((ref.exp() * (ref - got)).sum(-1).clamp_min(0).mean()))
    return sum(kls) / len(kls)


def test_placement_control_scores_equal_naive_runs():
    """Every route's KL is a naive full-model run of it (at equal memory: the continuation is
    within its decode budgets), and the rank counts the shuffled routes at or below the route."""
    m, tx = tiny(4), texts(4)
    L = m.config.n_layers
    pol = J.policy_of(["tova", "snapkv", "streaming"][:L], [B] * L, SET)
    res = PT.placement_control(m, None, pol, n=5, texts=tx, seed=2)
    routes = [pol] + PT.shuffled(pol, 5, seed=2)
    want = [naive_harness_kl(m, tx, r.with_allowance(8)) for r in routes]
    assert res["route_kl"] == pytest.approx(want[0], rel=1e-4, abs=1e-7)
    assert res["shuffled_kl"] == pytest.approx(want[1:], rel=1e-4, abs=1e-7)
    assert res["rank"] == 1 + sum(w <= res["route_kl"] for w in res["shuffled_kl"])
