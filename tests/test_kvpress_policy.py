"""engine/kvpress_policy.py: a PolyKV policy inside NVIDIA kvpress 0.5.5's pipeline keeps the
entries this project's `Policy.compress` keeps, and answers with the same greedy tokens.

The oracle is the project's own path on its own model (`Policy.prefill`, then the question and
the answer through `Policy.decoder`), on the ids kvpress's pipeline compresses and feeds after.
What kvpress holds is read off its cache from outside: at the first call of the language model
after the prefill (the question's), each layer's keys, matched to this project's FullKV keys of
the same prompt (post-RoPE keys differ by position, so each matches one prompt entry; the two
models' fp32 keys agree to ~1e-5). Two forward passes in fp32 (transformers' and this
project's) round differently, so a kept set may differ by entries whose scores sit at the
selection boundary: a unit passes when its sets are equal, or differ only by entries within
TIE of the boundary in the project's scores (the oracle's near-tie, oracle.first_divergence).

Needs kvpress 0.5.5 and transformers (requirements-kvpress.txt): skipped without them, except in
CI (CI=true), where .ci/run installs them and their absence fails.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import baselines as BL
import model as M
import polykv as P
from engine import observe as OB
from support import tasks as TK
from support.errors import UsageError

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "policies" / "polykv-SmolLM2-135M-Instruct-B128-seed0-dev2.json"
QUESTION = "\n\nWhat is the text above about? Answer in one sentence."
NEW_TOKENS = 8
TIE = 1e-4          # relative score distance to the selection boundary counted as a near-tie

try:
    from engine import kvpress_policy as KP
except ImportError as e:
    if os.environ.get("CI"):
        raise
    pytest.skip(f"kvpress is not installed ({e}): pip install -r requirements-kvpress.txt",
                allow_module_level=True)


def constructed(n_layers: int = 30) -> P.Policy:
    """A policy using every rule the adapter supports on some layer (prefill: full, streaming,
    h2o, tova, snapkv, random, knorm, expected by turns, kvzip on layers 5 and 12 (no deeper
    than the shipped policy's, so the shared observation's KVzip pass stops where it does);
    decode: append, streaming, h2o, tova by turns), budgets differing by layer (sum L·B,
    B = 128). SnapKV with average pooling (kernel 5) and TOVA keeping the last token: kvpress's
    forms, so these run as kvpress's own SnapKVPress and TOVAPress (the shipped policy's paper
    forms run as this project's scorers); the window is the shipped policy's 32, so one
    observation of the prompt serves both."""
    prefill = ["full", "streaming", "h2o", "tova", "snapkv", "random", "knorm", "expected"]
    decode = ["append", "streaming", "h2o", "tova"]
    layers, budgets = [], [96 + 16 * (l % 5) for l in range(n_layers)]        # 96..160
    for l in range(n_layers):
        rule = "kvzip" if l in (5, 12) else prefill[l % len(prefill)]
        layers.append(P.LayerPolicy((rule, budgets[l]), (decode[l % len(decode)], budgets[l])))
    return P.Policy(layers, 128, P.RuleSettings(kernel=5, pool="avg", tova_keep_last=True),
                    rules=BL.RULES)


@pytest.fixture(scope="module")
def pipe(embedded):
    return KP.load_pipeline(M.default_model_dir(), "cpu", torch.float32)


def fitted(pipe, tok, T: int, protocol: str) -> tuple:
    """(context text, question) whose ids under `protocol` compress exactly T tokens: n tokens of
    a test passage from its token `start` on, decoded, for the first (start, n) near T that gives
    T (a decoded text may encode to a token more or fewer, the question's first may merge)."""
    ids = TK.fidelity_text(tok, T + 64, 0)[0]
    for start in range(8):
        n = T - (KP.inputs(pipe, tok.decode(ids[start:start + T]), QUESTION, protocol)[0]
                 .shape[1] - T)
        for size in (n, n - 1, n + 1, n - 2, n + 2):
            context = tok.decode(ids[start:start + size])
            if KP.inputs(pipe, context, QUESTION, protocol)[0].shape[1] == T:
                return context, QUESTION
    raise AssertionError(f"no context of exactly {T} tokens")


def kvpress_run(pipe, press, text, asked) -> tuple:
    """(answer ids, each layer's keys (G, S, D) at the first model call after the prefill)."""
    held = {}

    def first_call(module, args, kwargs):
        """Each layer's keys as the question's call finds them (the compressed context)."""
        if not held:
            cache = kwargs["past_key_values"]
            held.update({l: layer.keys[0].clone() for l, layer in enumerate(cache.layers)})
    spy = pipe.model.register_forward_pre_hook(first_call, with_kwargs=True)
    try:
        _, ids, _ = KP.run(pipe, text, asked, press, NEW_TOKENS)
    finally:
        spy.remove()
    return ids, held


def positions(kept_keys, full_keys) -> list:
    """Per KV head the prompt positions of kept keys (G, S, D) among full keys (G, T, D): each
    kept key's nearest, which must be far nearer than any other."""
    out = []
    for g in range(kept_keys.shape[0]):
        d = torch.cdist(kept_keys[g].double(), full_keys[g].double())           # (S, T)
        two = d.topk(2, largest=False).values                                    # (S, 2)
        assert float((two[:, 0] / two[:, 1]).max()) < 0.05, "a kept key matches no prompt key"
        out.append(set(d.argmin(-1).tolist()))
    return out


def near_tie(scores, ours: set, theirs: set, b: int) -> float:
    """The largest relative distance to the selection boundary (the b-th and (b+1)-th scores
    of the project's order) among the entries only one side keeps."""
    top = scores.double().sort(descending=True).values
    edge = (top[b - 1] + top[min(b, len(top) - 1)]) / 2
    return max(abs(float(scores[j]) - float(edge)) / max(abs(float(edge)), 1e-30)
               for j in ours ^ theirs)


@pytest.mark.embedded
@pytest.mark.parametrize("T, protocol, names", [(1024, "prompt", ("shipped", "constructed")),
                                                (1024, "agnostic", ("shipped", "constructed")),
                                                (2048, "prompt", ("shipped",))],
                         ids=["1024-prompt", "1024-agnostic", "2048-prompt-shipped"])
def test_pipeline_keeps_what_policy_compress_keeps(embedded, pipe, T, protocol, names):
    """kvpress's pipeline with the adapter, for the shipped B = 128 policy and a policy using
    every supported rule (`names`: at 2,048 tokens the shipped one alone, for the suite's time),
    at T tokens under `protocol`: per layer and KV head the entries kvpress holds after the
    prefill are those Policy.compress keeps (near-ties aside, see the module), each layer holds
    exactly its budget, and the greedy answer is the same tokens."""
    m, tok = embedded
    context, question = fitted(pipe, tok, T, protocol)
    ctx, q_ids, text, asked = KP.inputs(pipe, context, question, protocol)
    assert ctx.shape[1] == T
    shipped = P.Policy.load(SHIPPED, n_layers=30, rules=BL.RULES)
    made = {"shipped": lambda: shipped, "constructed": constructed}
    policies = [KP.as_in_kvpress(made[name](), tok) for name in names]
    full, obs = OB.observe_for(m, ctx, policies)       # one observation (and KVzip pass) for all
    for name, policy in zip(names, policies):
        press, _ = KP.policy_press(policy, 30)
        assert {type(p.scorer).__name__ for p in press.prefilling_press.plans} >= (
            {"StreamingLLMPress", "ExpectedAttentionPress", "RuleScorer"}
            | ({"KnormPress", "SnapKVPress", "TOVAPress"} if name == "constructed" else set()))
        ids, held = kvpress_run(pipe, press, text, asked)
        # this project's path on the same ids: compress, feed the question, greedy
        cache = policy.compress(m, full, obs)
        mine = [[set(lc.pos[0, g].tolist()) for g in range(3)] for lc in cache.layers]
        with torch.no_grad():
            m.step(q_ids, cache, policy.decoder)   # one step, evicting once (kvpress's too)
        answer = M.greedy(m, cache, NEW_TOKENS, tok.eos_ids, policy.decoder)
        ties = []
        for l, lp in enumerate(policy.layers):
            b = T if lp.prefill.rule == "full" else min(lp.prefill.budget, T)
            theirs = positions(held[l], full.layers[l].k[0])
            assert [len(h) for h in theirs] == [b] * 3, (l, lp.prefill)
            for g in range(3):
                if theirs[g] != mine[l][g]:
                    scores, protected = P.score(lp.prefill.rule,
                                                P.score_input(obs, full, l, policy.settings))
                    scores = scores[0, g].masked_fill(protected, math.inf)
                    ties.append((l, g, lp.prefill.rule, len(theirs[g] ^ mine[l][g]) // 2,
                                 near_tie(scores, mine[l][g], theirs[g], b)))
        print(f"T={T} {protocol} {name}: {90 - len(ties)}/90 units exact; near-ties {ties}")
        assert all(t[-1] <= TIE for t in ties), ties
        assert [i for i in ids if i not in tok.eos_ids] == answer


@pytest.mark.embedded
def test_kvzip_prompt_is_the_one_kvpress_builds(embedded, pipe):
    """tasks.kvpress_reconstruction on the embedded folder (its chat_template.jinja, rendered by
    this project's jinja2 reader) gives the suffix and the skipped prefix that kvpress's
    KVzipPress computes with transformers' tokenizer when it enters the model."""
    from kvpress import KVzipPress
    _, tok = embedded
    repeat, start = TK.kvpress_reconstruction(tok)
    press = KVzipPress(0.5)
    with press(pipe.model):
        assert start == press.prefix_length == 24
        assert list(repeat[2]) == press._suffix_ids[0].tolist()
    assert repeat[:2] == TK.reconstruction_prompt(tok)[:2]


def test_exact_ratio_keeps_exactly_the_budget():
    """kvpress's count at the converted ratio is the budget, for every b < T up to 4,096 at a
    few T (and b >= T keeps everything)."""
    from kvpress.utils import compute_n_kept
    for T in (1, 7, 1000, 1024, 4096, 131072):
        for b in list(range(1, min(T, 4096))) + [T - 1]:
            if b >= 1:
                assert compute_n_kept(T, KP.exact_ratio(T, b)) == b
        assert KP.exact_ratio(T, T) == 0.0 == KP.exact_ratio(T, T + 5)


def small_policy(n_layers: int = 30) -> P.Policy:
    """B = 48 at most 64 per layer: StreamingLLM, TOVA and SnapKV (this project's forms) by turns,
    TOVA evicting while decoding on every third layer."""
    rules = ["streaming", "tova", "snapkv"]
    layers = [P.LayerPolicy((rules[l % 3], 32 + 16 * (l % 3)),
                            ("tova" if l % 3 == 1 else "append", 32 + 16 * (l % 3)))
              for l in range(n_layers)]
    return P.Policy(layers, 48)


@pytest.mark.embedded
def test_command_reports_the_kept_entries_and_the_answer(embedded, pipe, tmp_path, capsys):
    """`python -m engine.kvpress_policy`: the per-layer table gives each layer's budget as its
    kept entries per KV head, and the answer ids are those of the project's own path."""
    m, tok = embedded
    path = tmp_path / "policy.json"
    small_policy().save(path)
    context = tok.decode(TK.fidelity_text(tok, 300, 0)[0])
    assert KP.main(["--policy", str(path), "--context", context, "--question", QUESTION,
                    "--max-new-tokens", "6", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    policy = P.Policy.load(path, rules=BL.RULES)
    for l, lp in enumerate(policy.layers):
        assert f"| {l} | {lp.prefill.rule} | {lp.prefill.budget} | " \
               f"{', '.join([str(lp.prefill.budget)] * 3)} |" in out
    ctx, q_ids, _, _ = KP.inputs(pipe, context, QUESTION, "agnostic")
    cache = policy.prefill(m, ctx)
    with torch.no_grad():
        m.step(q_ids, cache, policy.decoder)
    answer = M.greedy(m, cache, 6, tok.eos_ids, policy.decoder)
    shown = next(line for line in out.splitlines() if line.startswith("answer ids: "))
    assert [i for i in json.loads(shown[len("answer ids: "):]) if i not in tok.eos_ids] == answer


@pytest.mark.embedded
def test_bad_input_is_one_line(embedded, tmp_path):
    """A policy for another layer count, a layer without a rule or with an unknown one, a budget
    above the prompt, a model folder without a tokenizer: a UsageError of one line each, and
    from the command line one `error:` line and exit 2."""
    context = "The grass is green. The sky is blue. " * 2       # 42 tokens with the template
    policy = small_policy()

    def refused(policy_file, *more):
        with pytest.raises(UsageError) as e:
            KP.main(["--policy", str(policy_file), "--context", context, "--device", "cpu",
                     *more])
        assert "\n" not in str(e.value)
        return str(e.value)
    short = tmp_path / "29.json"
    P.Policy(policy.layers[:29], 48).save(short)
    assert "has 29 layers, the model has 30" in refused(short)
    d = policy.to_json()
    del d["layers"][3]["prefill"]["rule"]
    (tmp_path / "norule.json").write_text(json.dumps(d))
    assert "KeyError 'rule'" in refused(tmp_path / "norule.json")
    d["layers"][3]["prefill"]["rule"] = "oldest"
    (tmp_path / "unknown.json").write_text(json.dumps(d))
    assert "layer 3: unknown prefill rule 'oldest'" in refused(tmp_path / "unknown.json")
    policy.save(tmp_path / "ok.json")
    assert "layer 1: tova budget 48 is above the prompt's" in refused(tmp_path / "ok.json")
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    for f in M.default_model_dir().iterdir():
        if f.name != "tokenizer.json":
            (folder / f.name).symlink_to(f)
    assert "has no tokenizer.json" in refused(tmp_path / "ok.json", "--model", str(folder))
    r = subprocess.run([sys.executable, "-m", "engine.kvpress_policy", "--policy", str(short),
                        "--context", context], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: ") and "has 29 layers" in r.stderr
