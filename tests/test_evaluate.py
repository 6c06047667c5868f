"""The benchmark runner on a tiny random model: exact FullKV invariants and resumption."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import evaluate as E
import model as M
import report

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A random LLaMA in HF layout with a byte-level tokenizer (any text encodes)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    d = tmp_path_factory.mktemp("tiny")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(BPE({c: i for i, c in enumerate(sorted(alphabet))}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(d / "tokenizer.json"))
    torch.manual_seed(0)
    cfg = M.Config(vocab_size=len(alphabet), dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                   hidden_dim=48, max_seq_len=1024, tie_embeddings=False, eos_ids=(300,))
    M.save(M.Llama(cfg), d)
    return d


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory):
    """A heterogeneous 2-layer PolyKV policy at B = 24 (the runner rescales it to 48)."""
    import polykv as P
    f = tmp_path_factory.mktemp("pol") / "policy.json"
    P.Policy([P.LayerPolicy(("tova", 32), ("tova", 32)), P.LayerPolicy(("snapkv", 16), ("h2o", 16))],
             24, meta={"best_uniform": "streaming"}).save(f)
    return f


def run(tiny_dir, out, *extra):
    args = ["--model", str(tiny_dir), "--device", "cpu", "--out", str(out), "--budget", "24,48",
            "--methods", "full,streaming,snapkv,h2o,polykv,polykv-pattern,polykv-budget,gracekv",
            "--tasks", "niah_single_1", "--length", "480",
            "--samples", "2", "--fidelity-length", "120", "--fidelity-samples", "2", "--cont-len", "8",
            "--max-new-tokens", "4", *extra]
    E.main(args)
    return json.loads((out / "summary.json").read_text())


def test_fullkv_fidelity_is_exact_and_interrupted_run_resumes(tiny_dir, policy_file, tmp_path, monkeypatch):
    whole = run(tiny_dir, tmp_path / "a", "--policy", str(policy_file))
    rows = {(r["method"], r["budget"], r["task"], r["metric"]): r for r in whole["rows"]}
    for b in (24, 48):
        assert rows[("full", b, "fidelity", "kl")]["value"] == 0
        assert rows[("full", b, "fidelity", "dnll")]["value"] == 0
        assert rows[("full", b, "fidelity", "top1")]["value"] == 100
        assert rows[("full", b, "answer", "dnll")]["value"] == 0
        assert rows[("full", b, "memory", "kv_fraction")]["value"] == 1
        assert rows[("snapkv", b, "fidelity", "kl")]["n"] == 2
    assert rows[("streaming", 24, "fidelity", "kl")]["value"] > 0      # a real compression
    for line in (tmp_path / "a" / "samples.jsonl").read_text().splitlines():
        r = json.loads(line)         # uniform rules keep exactly B of T; the others at most B
        if r["method"] in ("full", "streaming", "snapkv", "h2o", "polykv-pattern"):
            want = 1.0 if r["method"] == "full" else min(r["budget"], r["n_tokens"]) / r["n_tokens"]
            assert r["kv_fraction"] == pytest.approx(want, rel=1e-12)
        else:
            assert r["kv_fraction"] <= r["budget"] / r["n_tokens"] + 1e-12

    # interrupt after 2 of the 4 prompts: finished ones are on disk, the rerun does the rest
    real, calls = E.run_item, []

    def flaky(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **kw)
    monkeypatch.setattr(E, "run_item", flaky)
    with pytest.raises(KeyboardInterrupt):
        run(tiny_dir, tmp_path / "b", "--policy", str(policy_file))
    assert len((tmp_path / "b" / "samples.jsonl").read_text().splitlines()) == 2 * 8 * 2
    monkeypatch.setattr(E, "run_item", real)
    calls.clear()
    resumed = run(tiny_dir, tmp_path / "b", "--policy", str(policy_file))
    timeless = lambda s: [r for r in s["rows"] if r["task"] != "time"]    # wall-clock rows differ
    assert timeless(resumed) == timeless(whole) and len(timeless(whole)) < len(whole["rows"])
    lines = (tmp_path / "b" / "samples.jsonl").read_text().splitlines()
    assert len(lines) == len({json.loads(l)["key"] for l in lines}) == 4 * 8 * 2   # nothing done twice


def test_summary_table_and_gap():
    rows = []
    for m, kl, sc in (("full", 0.0, 100), ("snapkv", 0.2, 50), ("tova", 0.1, 40), ("polykv", 0.05, 70)):
        rows.append({"method": m, "budget": 64, "task": "fidelity", "kl": kl, "dnll": kl, "top1": 90, "kv_fraction": 0.1})
        rows.append({"method": m, "budget": 64, "task": "niah_single_1", "score": sc, "metric": "string_match_all",
                     "kl": kl, "dnll": 2 * kl, "kv_fraction": 0.1})
    names = ["full", "snapkv", "tova", "polykv"]
    summary = report.summarize(rows, names, [64])
    get = {(d["method"], d["task"], d["metric"]): d["value"] for d in summary}
    assert get[("tova", "answer", "dnll")] == 0.2 and get[("polykv", "niah_single_1", "string_match_all")] == 70
    md = report.table(summary, names, [64], ["niah_single_1"])
    # best uniform by KL is tova (0.1): (0.05 − 0.1)/(0 − 0.1) = +50%; by RULER snapkv (50): (70−50)/(100−50) = +40%
    assert "fidelity KL: +50.0% (best uniform tova)" in md
    assert "RULER avg: +40.0% (best uniform snapkv)" in md
    assert "| 64 | polykv | 70.0 | 70.0 | 0.100 | 0.0500 |" in md


@pytest.mark.parametrize("argv, msg", [
    (["--methods", "full,magic"], "error: unknown method 'magic'; choose from full, streaming"),
    (["--budget", "0"], "error: budget must be >= 1, got 0"),
    (["--tasks", "nope"], "error: unknown task 'nope'; choose from niah_single_1"),
    (["--model", "/nonexistent/dir"], "error: model folder '/nonexistent/dir' does not exist"),
])
def test_cli_errors_are_one_line(argv, msg):
    r = subprocess.run([sys.executable, "evaluate.py", *argv], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and r.stderr.strip().startswith(msg)
