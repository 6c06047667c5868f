"""The benchmark runner on a tiny random model: exact FullKV invariants and resumption."""
import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import evaluate as E
import model as M
from engine import compare, report, run_folder
from engine import harness as H
from engine import observe as OB
import baselines as BL
from support import cli

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory):
    """A heterogeneous 2-layer PolyKV policy at B = 24 (the runner rescales it to 48)."""
    import polykv as P
    f = tmp_path_factory.mktemp("pol") / "policy.json"
    P.Policy(
        [P.LayerPolicy(("tova", 32), ("tova", 32)), P.LayerPolicy(("snapkv", 16), ("h2o", 16))],
        24,
        meta={"best_uniform": "streaming"},
    ).save(f)
    return f


def run(tiny_dir, out, *extra):
    args = ["--model", str(tiny_dir), "--device", "cpu", "--out", str(out), "--budget", "24,48",
            "--methods", "full,streaming,snapkv,h2o,polykv,polykv-pattern,polykv-budget,gracekv",
            "--tasks", "niah_single_1", "--length", "480", "--samples", "2", "--fidelity-length",
            "120", "--fidelity-samples", "2", "--cont-len", "8", "--max-new-tokens", "4", *extra]
    E.main(args)
    return json.loads((out / "summary.json").read_text())


def test_fullkv_fidelity_is_exact_and_interrupted_run_resumes(
    tiny_dir, policy_file, tmp_path, monkeypatch
):
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
            if "kl" in r:            # unpadded caches that grow by the same tokens as FullKV
                n = 8 - 1 if r["task"] == "fidelity" else None
                assert r["alloc_fraction"] == r["peak_fraction"]
                if n is not None:
                    assert r["peak_fraction"] == pytest.approx(
                        (min(r["budget"], r["n_tokens"]) + n) / (r["n_tokens"] + n)
                        if r["method"] != "full"
                        else 1.0
                    )
        else:
            assert r["kv_fraction"] <= r["budget"] / r["n_tokens"] + 1e-12

    # interrupt after 2 of the 4 prompts: finished ones are on disk, the rerun does the rest
    real, calls = H.run_item, []

    def flaky(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **kw)
    monkeypatch.setattr(H, "run_item", flaky)
    with pytest.raises(KeyboardInterrupt):
        run(tiny_dir, tmp_path / "b", "--policy", str(policy_file))
    assert len((tmp_path / "b" / "samples.jsonl").read_text().splitlines()) == 2 * 8 * 2
    # --report on a copy missing the last 3 rows: only the prompt finished for every row counts
    (tmp_path / "c").mkdir()
    part = (tmp_path / "b" / "samples.jsonl").read_text().splitlines()[:-3]
    (tmp_path / "c" / "samples.jsonl").write_text("\n".join(part) + "\n")
    monkeypatch.setattr(H, "run_item", None)                       # nothing may run
    got = run(tiny_dir, tmp_path / "c", "--policy", str(policy_file), "--report")
    kept = [json.loads(l) for l in part]
    kept = [r for r in kept if (r["task"], r["index"]) == (kept[0]["task"], kept[0]["index"])]
    assert len(kept) == 8 * 2 and len(part) == 2 * 8 * 2 - 3       # one whole prompt, one torn
    names = "full,streaming,snapkv,h2o,polykv,polykv-pattern,polykv-budget,gracekv".split(",")
    want = report.summarize(
        kept, names, [24, 48], H.baselines(), [n for n in names if n.startswith("polykv")]
    )
    # a folder that never recorded its wall time: the seconds its rows record (a lower bound)
    assert (
        got["rows"] == [{**d, "protocol": "prompt"} for d in want]
        and got["config"]["wall_s"] == round(E.rows_cost(kept), 1)
    )
    assert got["config"]["prompts"] == "1 of 4 (--report)"
    assert len((tmp_path / "c" / "samples.jsonl").read_text().splitlines()) == len(part)
    monkeypatch.setattr(H, "run_item", real)
    calls.clear()
    resumed = run(tiny_dir, tmp_path / "b", "--policy", str(policy_file))

    def timeless(summary):
        """The summary's rows but the wall-clock ones, which differ from run to run."""
        return [r for r in summary["rows"] if r["task"] != "time"]
    assert timeless(resumed) == timeless(whole) and len(timeless(whole)) < len(whole["rows"])
    lines = (tmp_path / "b" / "samples.jsonl").read_text().splitlines()
    # nothing done twice
    assert len(lines) == len({json.loads(l)["key"] for l in lines}) == 4 * 8 * 2


# ----------------------------------------------------------------------------- the run folder

def small(tiny_dir, out, *extra):
    """evaluate.py's argv for a small run of the tiny model: FullKV and SnapKV at B = 24 on two
    fidelity prompts of 120 tokens (+8); extra options override these."""
    return ["--model", str(tiny_dir), "--device", "cpu", "--dtype", "float64", "--threads", "1",
            "--methods", "full,snapkv", "--budget", "24", "--tasks", "",
            "--fidelity-length", "120", "--fidelity-samples", "2", "--cont-len", "8",
            "--out", str(out), *extra]


@pytest.fixture(scope="module")
def finished(tiny_dir, tmp_path_factory):
    """A finished small run's folder (copy it before changing it)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    E.main(small(tiny_dir, out))
    return out


def contents(folder) -> dict:
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir())}


def lines(folder) -> list:
    return (folder / "samples.jsonl").read_text().splitlines()


@pytest.mark.parametrize("change, named", [
    (["--seed", "7", "--split", "dev"], ["--seed 0 (asked 7)", "--split test (asked dev)"]),
    (["--cont-len", "6"], ["--cont-len 8 (asked 6)"]),
    (["--dtype", "float32"], ["dtype torch.float64 (asked torch.float32)"]),
    (["--memory", "budget", "--max-new-tokens", "4"], ["--memory equal (asked budget)",
                                                       "--max-new-tokens 24 (asked 4)"]),
    (["--report", "--seed", "7"], ["--seed 0 (asked 7)"]),
])
def test_a_folder_refuses_settings_that_would_relabel_its_rows(tiny_dir, finished, tmp_path,
                                                               change, named):
    """A rerun (or --report) into a finished folder with another seed, split, continuation...:
    every row key is there, so the run would print the old rows under the new settings; it
    refuses in one line naming each difference, and the folder stays as it was."""
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    before = contents(out)
    with pytest.raises(M.UsageError) as e:
        E.main(small(tiny_dir, out, *change))
    assert str(e.value).startswith(f"{str(out)!r} holds rows of other settings: ")
    assert all(n in str(e.value) for n in named) and "\n" not in str(e.value)
    assert contents(out) == before


def test_a_folder_refuses_another_model_of_the_same_name(tiny_dir, finished, tmp_path):
    """The model is checked by the hash of its files, not only by its folder's name."""
    other = tmp_path / "elsewhere" / tiny_dir.name
    shutil.copytree(tiny_dir, other)
    m, _ = M.load(other, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        m.norm.weight.mul_(2)
    M.save(m, other)
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    with pytest.raises(M.UsageError, match=r"holds rows of other settings: model files "
                                           r"\(sha256\) \w{12}… \(asked \w{12}…\); run with"):
        E.main(small(other, out))


def test_adding_methods_budgets_and_prompts_resumes(tiny_dir, finished, tmp_path):
    """More methods, budgets and prompts: only the new rows are computed, after the old ones,
    which stay byte for byte; run.json keeps the union of what was asked."""
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    old = lines(out)
    E.main(small(tiny_dir, out, "--methods", "full,snapkv,tova", "--budget", "24,48",
                 "--fidelity-samples", "3"))
    new = lines(out)
    assert new[:len(old)] == old and len(old) == 2 * 2
    assert len(new) == len({json.loads(line)["key"] for line in new}) == 3 * 2 * 3
    rec = json.loads((out / "run.json").read_text())
    assert rec["asked"]["methods"] == ["full", "snapkv", "tova"]
    assert rec["asked"]["budgets"] == [24, 48]
    assert rec["asked"]["fidelity_samples"] == 3 and len(rec["code"]) == 1
    assert rec["settings"]["seed"] == 0 and rec["settings"]["dtype"] == "torch.float64"


def test_report_never_shrinks_a_summary_nor_creates_a_folder(tiny_dir, finished, tmp_path):
    """--report with other methods and budgets would replace the run's summary with an empty
    one; with a mistyped --out it would create the folder: both refuse, nothing written. Its
    own options give the same summary; a folder that lost rows keeps its fuller summary."""
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    before = contents(out)
    with pytest.raises(M.UsageError, match=r"summary.json' summarizes more than --report asks for "
                                           r"\(--methods lacks snapkv; --budget lacks 24\)"):
        E.main(small(tiny_dir, out, "--methods", "full,tova", "--budget", "48", "--report"))
    assert contents(out) == before
    typo = tmp_path / "rnu"
    with pytest.raises(M.UsageError, match="no such run folder"):
        E.main(small(tiny_dir, typo, "--report"))
    assert not typo.exists()
    E.main(small(tiny_dir, out, "--report"))
    again = json.loads((out / "summary.json").read_text())
    assert again["rows"] == json.loads(before["summary.json"])["rows"]
    assert again["config"]["prompts"] == "2 of 2 (--report)"
    kept = [line for line in lines(out) if json.loads(line)["index"] == 0]   # prompt 1's rows lost
    (out / "samples.jsonl").write_text("\n".join(kept) + "\n")
    summary = (out / "summary.json").read_bytes()
    with pytest.raises(M.UsageError, match=r"--report would replace .* with fewer rows "
                                           r"\(full at 24 on fidelity dnll \(2 prompts, now 1\) "
                                           r"and \d+ more\)"):
        E.main(small(tiny_dir, out, "--report"))
    assert (out / "summary.json").read_bytes() == summary


def test_a_folder_from_before_run_json_is_checked_against_its_summary(tiny_dir, finished,
                                                                     tmp_path):
    """A folder without run.json (written before it existed): its summary's config says what
    its rows are; the same command resumes and records the folder, another seed is refused."""
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    (out / "run.json").unlink()
    with pytest.raises(M.UsageError, match=r"--seed 0 \(asked 7\)"):
        E.main(small(tiny_dir, out, "--seed", "7"))
    assert not (out / "run.json").exists()
    old = lines(out)
    E.main(small(tiny_dir, out))
    rec = json.loads((out / "run.json").read_text())
    assert lines(out) == old and rec["code"] == ["before run.json"]
    assert rec["settings"]["seed"] == 0


def test_one_writer_per_folder_and_a_killed_runs_lock_blocks_nothing(tiny_dir, finished,
                                                                     tmp_path):
    """Two runs into one --out: while a process holds the folder (an flock on it, as a run
    holds it while it appends), another run refuses in one line and writes nothing; once the
    holder is killed (SIGKILL: no cleanup), the next run goes on and adds each row once."""
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    before = contents(out)
    hold = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(out)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(M.UsageError, match=r" is in use by another run \(one writer per run "
                                               r"folder\): wait until it ends, or give another"):
            E.main(small(tiny_dir, out, "--fidelity-samples", "3"))
        assert contents(out) == before
    finally:
        holder.kill()
        holder.wait()
    E.main(small(tiny_dir, out, "--fidelity-samples", "3"))
    assert len(lines(out)) == len({json.loads(line)["key"] for line in lines(out)}) == 3 * 2


def drop_record(out):
    for name in ("run.json", "summary.json", "summary.md"):
        (out / name).unlink()


@pytest.mark.parametrize("damage, change, named", [
    (lambda out: (out / "run.json").write_text(json.dumps(
        {**json.loads((out / "run.json").read_text()), "settings": [1]})), ["--seed", "1"],
     "is not a run record of this code ('settings' is missing or malformed)"),
    (drop_record, ["--seed", "1"], "holds rows of other settings: --seed 0 (asked 1)"),
    (drop_record, ["--split", "dev", "--report"], "holds rows of other settings: --split test "
                                                  "(asked dev)"),
    (drop_record, ["--cont-len", "6"], "holds rows of other settings: settings "),
])
def test_rows_that_lost_their_record_are_not_relabelled(tiny_dir, finished, tmp_path, damage,
                                                         change, named):
    """run.json edited into another shape, or run.json and the summary deleted: the rows still
    say what made them (seed, split, a digest of every fixed setting), so a rerun or --report
    with another seed, split or continuation refuses in one line, the folder as it was."""
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    damage(out)
    before = contents(out)
    with pytest.raises(M.UsageError) as e:
        E.main(small(tiny_dir, out, *change))
    assert named in str(e.value) and "\n" not in str(e.value)
    assert contents(out) == before


@pytest.fixture(scope="module")
def answered(tiny_dir, tmp_path_factory):
    """A finished small run of two needle prompts (answers generated and scored)."""
    out = tmp_path_factory.mktemp("answered") / "run"
    E.main(small(tiny_dir, out, "--tasks", "niah_single_1", "--length", "400", "--samples", "2",
                 "--fidelity-samples", "0", "--max-new-tokens", "4"))
    return out


def without(field, line=1):
    """An edit of a run folder: its rows' line `line` (0-based) without `field`."""
    def edit(out):
        rows = lines(out)
        rows[line] = json.dumps({k: v for k, v in json.loads(rows[line]).items() if k != field})
        (out / "samples.jsonl").write_text("\n".join(rows) + "\n")
    return edit


def middle_line(text):
    def edit(out):
        rows = lines(out)
        rows[1] = text
        (out / "samples.jsonl").write_text("\n".join(rows) + "\n")
    return edit


@pytest.mark.parametrize("folder, edit, extra, message", [
    ("finished", middle_line("{}"), [], r"samples.jsonl:2: a row without key, method, budget, "),
    ("finished", middle_line("{}"), ["--report"], r"samples.jsonl:2: a row without key, "),
    ("finished", without("kv_fraction"), [], r"samples.jsonl:2: a row without kv_fraction; "),
    ("finished", without("kl"), [], r"the row 'snapkv\|24\|fidelity\|120\|0' of '.*' lacks a "
                                    r"finite kl: delete its line from samples\*.jsonl"),
    ("answered", without("score"), ["--tasks", "niah_single_1", "--length", "400", "--samples",
                                    "2", "--fidelity-samples", "0", "--max-new-tokens", "4"],
     r"the row 'snapkv\|24\|niah_single_1\|400\|0' of '.*' lacks a finite score"),
    ("finished", lambda out: (out / "summary.json").write_text('{"rows": 5}'), ["--report"],
     r"summary.json' is not a summary of evaluate.py \(a JSON object with 'config' and a list "),
])
def test_a_row_that_lost_a_field_is_refused_never_summarized_over_fewer(
        tiny_dir, request, tmp_path, folder, edit, extra, message):
    """A row without a field every row has (a middle line `{}`, no kv_fraction), or without a
    measure its prompt takes (a fidelity row's kl, a needle row's score), and a summary.json of
    another shape: a rerun or --report refuses in one line, the folder as it was (before, it
    raised KeyError, or rewrote the summary over one prompt fewer)."""
    out = tmp_path / "run"
    shutil.copytree(request.getfixturevalue(folder), out)
    edit(out)
    before = contents(out)
    with pytest.raises(M.UsageError, match=message) as e:
        E.main(small(tiny_dir, out, *extra))
    assert "\n" not in str(e.value) and contents(out) == before


def test_the_wall_time_of_the_rows_is_kept_across_resumes_and_reports(tiny_dir, finished,
                                                                       tmp_path, capsys):
    """A rerun with nothing to do and a --report keep the seconds the rows cost (summary.json's
    wall_s, from run.json); a rerun that adds rows adds its own. The output folder is named on
    a line of its own."""
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    for name in ("run.json", "summary.json"):
        d = json.loads((out / name).read_text())
        if name == "run.json":
            d["wall_s"] = 447.8
        else:
            d["config"]["wall_s"] = 447.8
        (out / name).write_text(json.dumps(d))

    def wall():
        return json.loads((out / "summary.json").read_text())["config"]["wall_s"]
    E.main(small(tiny_dir, out))
    assert wall() == 447.8 and f"output folder: {out}" in capsys.readouterr().out.splitlines()
    E.main(small(tiny_dir, out, "--report"))
    assert wall() == 447.8
    E.main(small(tiny_dir, out, "--fidelity-samples", "3"))
    assert wall() > 447.8 and json.loads((out / "run.json").read_text())["wall_s"] == wall()


def test_a_prompt_whose_logits_or_measures_are_not_finite_writes_nothing(tiny_dir, tmp_path):
    """Finite weights whose logits overflow on a prompt (the LM head at 1e38), or whose
    measures do (the final norm at 1e38: ΔNLL = inf − inf): one line naming the prompt, and
    samples.jsonl never holds a bare NaN (strict JSON, nothing of that prompt)."""
    for name, weight in (("head", "lm_head.weight"), ("norm", "norm.weight")):
        folder = tmp_path / name
        shutil.copytree(tiny_dir, folder)
        m, _ = M.load(folder, device="cpu", dtype=torch.float32)
        with torch.no_grad():
            m.get_parameter(weight).fill_(1e38)
        M.save(m, folder)
        out = tmp_path / f"run-{name}"
        with pytest.raises(M.UsageError, match=r"^fidelity #0: .* not (a )?finite") as e:
            E.main(small(folder, out, "--dtype", "float32"))
        assert "\n" not in str(e.value)
        for line in (out / "samples.jsonl").read_text().splitlines():
            json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in {line}"))


@pytest.mark.parametrize("folder, argv", [
    ("results/baselines-b64-1024", ["--suite", "reference", "--threads", "1", "--budget", "64,1024",
                                    "--methods", "full,streaming,h2o,tova,snapkv,knorm,pyramidkv,"
                                    "expected,kvzip-uniform,adakv,kvzip"]),
    ("results/gracekv-2k", ["--split", "test", "--seed", "0", "--tasks", "niah_single_1",
                            "--length", "2048", "--budget", "64,128,512,1024",
                            "--fidelity-samples", "12", "--samples", "12",
                            "--fidelity-length", "1792", "--max-new-tokens", "24",
                            "--threads", "1", "--methods",
                            "full,snapkv,tova,pyramidkv,adakv,kvzip,gracekv,gracekv-massgain"]),
])
def test_committed_results_take_their_documented_command(folder, argv):
    """The committed results/ folders hold no run.json: the command their README documents
    passes the check (it reads their summary.json and writes nothing), another seed does not."""
    out = ROOT / folder
    before = sorted(p.name for p in out.iterdir())
    for extra, refused in (([], False), (["--seed", "5"], True)):
        args = H.parse(argv + extra + ["--out", str(out)])
        fixed = E.run_settings(args, "torch.float32", "0" * 64)
        check = functools.partial(run_folder.check, out, fixed, {"data": None, "policy": None},
                                  E.run_grid(args), E.LEGACY_DEFAULTS, False)
        if refused:
            with pytest.raises(M.UsageError, match=r"--seed 0 \(asked 5\)"):
                check()
        else:
            assert check() == {}
    assert sorted(p.name for p in out.iterdir()) == before


def test_longbench_scores_are_in_every_table(tiny_dir, tmp_path, capsys):
    """A LongBench run: its scores are columns of summary.md, of the table it prints and of
    `python -m engine.report`'s, as in summary.json."""
    data = tmp_path / "data"
    data.mkdir()
    row = {"input": "Who met Bob?", "context": "Ann met Bob. " * 8, "answers": ["Ann"]}
    (data / "hotpotqa.jsonl").write_text((json.dumps(row) + "\n") * 2)
    out = tmp_path / "run"
    E.main(small(tiny_dir, out, "--data", str(data), "--fidelity-samples", "0",
                 "--max-new-tokens", "4"))
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    score = {d["method"]: d for d in summary["rows"] if d["task"] == "hotpotqa"}
    assert set(score) == {"full", "snapkv"} and score["full"]["metric"] == "qa_f1_score"
    md = (out / "summary.md").read_text()
    for table in (md, printed):
        head = next(line for line in table.splitlines() if line.startswith("| budget | method |"))
        assert head.split(" | ")[2] == "hotpotqa"
        assert f"| 24 | full | {report.cell(score['full'], '{:.1f}')} |" in table
    report.main([str(out / "summary.json")])
    assert "| budget | method | hotpotqa |" in capsys.readouterr().out


def fake_rows(kl, score, n=6):
    """Per-sample rows: kl[method] and score[method] are functions of the prompt index."""
    rows = []
    for m in kl:
        for i in range(n):
            base = {"method": m, "budget": 64, "length": 100, "index": i, "kv_fraction": 0.1}
            rows.append({**base, "task": "fidelity", "kl": kl[m](i), "dnll": kl[m](i), "top1": 90})
            rows.append(
                {**base, "task": "niah_single_1", "score": score[m](i),
                 "metric": "string_match_all", "kl": kl[m](i), "dnll": 2 * kl[m](i)}
            )
    return rows


def spread(i):
    """A fake KL of prompt i: the prompts differ a lot."""
    return 0.1 + 0.05 * i


def test_paired_bootstrap_known_cases():
    """Identical methods: a difference of exactly 0, a tie; a constant shift c: the difference
    interval is [c, c] (pairing removes the prompt-to-prompt spread); means and intervals."""
    kl = {"full": lambda i: 0.0, "snapkv": spread, "tova": spread,
          "polykv": lambda i: spread(i) - 0.02}
    score = {"full": lambda i: 100, "snapkv": lambda i: 50, "tova": lambda i: 50 * (i % 2),
             "polykv": lambda i: 75}
    names = list(kl)
    summary = report.summarize(fake_rows(kl, score), names, [64], H.baselines(), ["polykv"])
    get = {(d["method"], d["task"], d["metric"]): d for d in summary}
    sn, tv, pk = (get[(m, "fidelity", "kl")] for m in ("snapkv", "tova", "polykv"))
    assert sn["value"] == pytest.approx(0.225) and sn["ci_low"] < 0.225 < sn["ci_high"]
    assert sn["n"] == 6
    best = "snapkv" if "vs_best" in tv else "tova"                   # a tie at the top: either
    other = tv if best == "snapkv" else sn
    assert other["vs_best"] == {"rule": best, "diff": 0.0, "ci_low": 0.0, "ci_high": 0.0,
                                "tie": True}
    assert pk["vs_best"]["diff"] == pytest.approx(-0.02) and not pk["vs_best"]["tie"]
    assert pk["vs_best"]["ci_low"] == pytest.approx(-0.02) and pk["vs_best"][
        "ci_high"
    ] == pytest.approx(-0.02)
    # the gap recovered: (0.205 − 0.225)/(0 − 0.225) = +8.9 %, interval around it
    gap = get[("polykv", "gap", "fidelity_kl")]
    assert (
        gap["value"] == pytest.approx(0.02 / 0.225, abs=1e-4)
        and gap["ci_low"] <= gap["value"] <= gap["ci_high"]
    )
    md = report.table(summary, names, [64], ["niah_single_1"])
    assert "| 64 | snapkv | 50.0 | " in md                           # a constant score: no ± part
    assert "polykv @ 64, gap recovered on fidelity_kl: +8.9%" in md
    assert "polykv -0.02 [-0.02, -0.02]" in md and " tie" in md


def test_gap_recovered_needs_a_gap_and_the_best_uniform_is_named_by_its_row():
    """The lines under the table name the best uniform by its row (`kvzip`, the head-wise
    allocation, beside its own `kvzip-uniform`) and say why there is no gap recovered instead
    of a ratio over a gap near zero: FullKV and the best tie (the score), or their gap (KL
    0.0045) is smaller than PolyKV's own interval against the best (±0.15 or so)."""
    kl = {"full": lambda i: 0.0, "kvzip-uniform": spread,
          "kvzip": lambda i: 0.004 + 0.001 * (i % 2), "polykv": lambda i: 0.3 * (i % 2)}
    score = {"full": lambda i: 100, "kvzip-uniform": lambda i: 100, "kvzip": lambda i: 100,
             "polykv": lambda i: 50}
    names = list(kl)
    summary = report.summarize(fake_rows(kl, score), names, [64], H.baselines(), ["polykv"])
    md = report.table(summary, names, [64], ["niah_single_1"])
    assert "B = 64, fidelity KL minus the best uniform (row kvzip), paired 95 % CI: " in md
    gap = {line.split(": ")[0]: line for line in md.splitlines() if " gap recovered on " in line}
    kl_line = gap["polykv @ 64, gap recovered on fidelity_kl"]
    assert kl_line.startswith("polykv @ 64, gap recovered on fidelity_kl: n/a: the gap to recover "
                              "(full − kvzip -0.0045 [")
    assert "is smaller than polykv's own interval against it (±" in kl_line and "%" not in kl_line
    assert gap["polykv @ 64, gap recovered on niah_single_1_string_match_all"] == (
        "polykv @ 64, gap recovered on niah_single_1_string_match_all: n/a: FullKV and the best "
        "uniform (row kvzip-uniform) tie (full − kvzip-uniform +0 [+0, +0]), no gap to recover")
    assert all(line.count("best uniform") == 1 for line in gap.values())


def test_leaders_known_cases():
    """The leader is the best mean (FullKV aside); a method shifted by a constant is behind by
    exactly that (paired), one equal on average but noisy ties; lower is better for KL."""
    kl = {"full": lambda i: 0.0, "snapkv": spread, "tova": lambda i: spread(i) + 0.03,
          "h2o": lambda i: spread(i) + (0.02 if i % 2 else -0.02)}
    score = {"full": lambda i: 100, "snapkv": lambda i: 50, "tova": lambda i: 80,
             "h2o": lambda i: 70 + 20 * (i % 2)}
    got = compare.leaders(fake_rows(kl, score), list(kl), [64], ["niah_single_1"])
    assert got[0].startswith("B = 64, fidelity KL (n = 6): snapkv 0.225 ties h2o +0 [-0.0")
    assert got[0].endswith("] | behind: tova +0.03 [+0.03, +0.03]")
    assert (
        got[2].startswith("B = 64, niah_single_1 (n = 6): tova 80 ties h2o +0 [-")
        and "behind: snapkv -30 [-30, -30]" in got[2]
    )
    table = compare.leaders_table(
        fake_rows(kl, score), list(kl), [64], ["niah_single_1"], length=8000
    ).splitlines()
    assert table[0] == "| measure | B = 64 (125×) |"
    assert table[2:] == ["| fidelity KL | snapkv 0.225; h2o (n = 6) |",
                         "| answer ΔNLL | snapkv 0.45; h2o (n = 6) |",
                         "| niah_single_1 | tova 80; h2o (n = 6) |"]


def test_verdicts_count_where_a_method_leads_ties_and_trails(tmp_path, capsys):
    """A method leads a setting where its mean is the best (FullKV aside), ties where its paired
    interval against the leader holds 0, trails where it does not: snapkv is best on KL (and on
    answer ΔNLL = 2 KL) with h2o tied, tova is best on needles with h2o tied, snapkv 30 behind."""
    kl = {"full": lambda i: 0.0, "snapkv": spread, "tova": lambda i: spread(i) + 0.03,
          "h2o": lambda i: spread(i) + (0.02 if i % 2 else -0.02)}
    score = {"full": lambda i: 100, "snapkv": lambda i: 50, "tova": lambda i: 80,
             "h2o": lambda i: 70 + 20 * (i % 2)}
    rows = fake_rows(kl, score)
    names = list(kl)
    got = compare.verdicts(rows, ["snapkv", "tova", "h2o", "full"], names, [64],
                           ["niah_single_1"], length=8000)
    assert got[0] == ("snapkv: leads 2, ties 0, trails 1 of 3 settings; leads: fidelity KL at "
                      "64 (125×), answer ΔNLL at 64 (125×); trails: niah_single_1 at 64 (125×)")
    assert got[1] == ("tova: leads 1, ties 0, trails 2 of 3 settings; leads: niah_single_1 at "
                      "64 (125×); trails: fidelity KL at 64 (125×), answer ΔNLL at 64 (125×)")
    assert got[2].startswith("h2o: leads 0, ties 3, trails 0 of 3 settings; ties: fidelity KL")
    assert got[3] == "full: leads 0, ties 0, trails 0 of 0 settings"      # never ranked
    # a leader no method ties is marked alone
    alone = {m: f for m, f in kl.items() if m != "h2o"}
    line = compare.verdicts(fake_rows(alone, score), ["tova"], list(alone), [64],
                            ["niah_single_1"])[0]
    assert line.startswith("tova: leads 1, ties 0, trails 2 of 3 settings; leads: "
                           "niah_single_1 at 64 alone; trails: ")
    # the command line reads the rows beside the summary; a method the run lacks is refused
    f = tmp_path / "summary.json"
    f.write_text(json.dumps({"config": {"methods": names, "budgets": [64],
                                        "tasks": ["niah_single_1"]}, "rows": []}))
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report.main([str(f), "--no-diff", "--verdicts", "snapkv,tova"])
    assert capsys.readouterr().out.strip().splitlines()[-2:] == [
        v.replace(" (125×)", "") for v in got[:2]]
    with pytest.raises(M.UsageError, match="--verdicts: the run has no bogus"):
        report.main([str(f), "--verdicts", "bogus"])


def test_leaders_across_runs_put_each_run_and_protocol_in_one_table(tmp_path, capsys):
    """--across: a column per run and budget (the folder, the ratio to its longest prompt), a
    row per measure and protocol; a measure whose leaders every protocol computes the same (the
    fidelity passages) is one row. Run `two` has `prompt` and `agnostic`: under `agnostic` snapkv
    keeps every needle, so the needle row splits; its KL rows are the same under both."""
    kl = {"full": lambda i: 0.0, "snapkv": spread, "tova": lambda i: spread(i) + 0.03}
    score = {"full": lambda i: 100, "snapkv": lambda i: 50, "tova": lambda i: 80}
    later = {**score, "snapkv": lambda i: 100}
    runs = {"one": fake_rows(kl, score),
            "two": [dict(r, protocol="prompt") for r in fake_rows(kl, score)]
            + [dict(r, protocol="agnostic") for r in fake_rows(kl, later)]}
    for name, rows in runs.items():
        (tmp_path / name).mkdir()
        cfg = {"methods": list(kl), "budgets": [64], "tasks": ["niah_single_1"], "length": [100],
               "protocols": ["prompt"] + (["agnostic"] if name == "two" else [])}
        (tmp_path / name / "summary.json").write_text(json.dumps({"config": cfg, "rows": []}))
        (tmp_path / name / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report.main([str(tmp_path / "one" / "summary.json"), "--across",
                 str(tmp_path / "two" / "summary.json")])
    assert capsys.readouterr().out.strip().splitlines() == [
        "| measure | one 64 (2×) | two 64 (2×) |", "|---|---|---|",
        "| fidelity KL, every protocol | snapkv 0.225 alone (n = 6) | snapkv 0.225 alone (n = 6) |",
        "| answer ΔNLL, every protocol | snapkv 0.45 alone (n = 6) | snapkv 0.45 alone (n = 6) |",
        "| niah_single_1, `prompt` | tova 80 alone (n = 6) | tova 80 alone (n = 6) |",
        "| niah_single_1, `agnostic` |  | snapkv 100 alone (n = 6) |"]
    (tmp_path / "summary.json").write_text((tmp_path / "one" / "summary.json").read_text())
    with pytest.raises(M.UsageError, match="--across needs the per-sample rows beside"):
        report.main([str(tmp_path / "one" / "summary.json"), "--across",
                     str(tmp_path / "summary.json")])
    with pytest.raises(M.UsageError, match="cannot read"):
        report.main([str(tmp_path / "one" / "summary.json"), "--across",
                     str(tmp_path / "nope.json")])


def test_plot_has_a_panel_per_measure_the_run_has(tmp_path):
    """A run without fidelity prompts (RULER only) plots its answer panel alone, with a legend."""
    pytest.importorskip("matplotlib")
    kl = {"full": lambda i: 0.0, "snapkv": lambda i: 0.1, "tova": lambda i: 0.2}
    rows = [r for r in fake_rows(kl, {m: (lambda i: 50) for m in kl}) if r["task"] != "fidelity"]
    summary = [{**d, "protocol": p} for p in ("prompt", "agnostic")
               for d in report.summarize(rows, list(kl), [64], H.baselines())]
    fig = report.plot(summary, list(kl), tmp_path)
    assert len(fig.axes) == 2 and all("answer" in ax.get_title() for ax in fig.axes)
    assert all(len(ax.get_lines()) == 2 and ax.get_legend() is not None for ax in fig.axes)
    assert (tmp_path / "budget_vs_score.png").stat().st_size > 0


def test_torn_last_line_is_dropped_and_the_run_resumes(tmp_path, capsys):
    f = tmp_path / "samples.jsonl"
    f.write_text('{"key": "a", "x": 1}\n{"key": "b", "x": 2}\n{"key": "c", "x"')
    text = f.read_text()                   # a report reads a live run's file: nothing is cut
    assert [r["key"] for r in E.read_rows(f, repair=False)] == ["a", "b"] and f.read_text() == text
    rows = E.read_rows(f)
    assert [r["key"] for r in rows] == ["a", "b"]
    err = capsys.readouterr().err.strip()
    assert err.startswith("warning:") and "torn last line" in err and "\n" not in err
    # appends continue cleanly
    assert f.read_text() == '{"key": "a", "x": 1}\n{"key": "b", "x": 2}\n'
    assert E.read_rows(f) == rows and capsys.readouterr().err == ""


def test_policy_and_summary_writes_are_atomic(tmp_path, monkeypatch):
    """A write killed before its rename leaves the old file whole (no half-written JSON)."""
    import polykv as P
    from support import files
    f = tmp_path / "policy.json"
    pol = P.Policy.uniform("tova", 8, 2, rules=BL.RULES)
    pol.save(f)
    before = f.read_text()
    real = files.os.replace
    monkeypatch.setattr(files.os, "replace", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        P.Policy.uniform("h2o", 8, 2, rules=BL.RULES).save(f)
    monkeypatch.setattr(files.os, "replace", real)
    assert f.read_text() == before and P.Policy.load(f, rules=BL.RULES).layers == pol.layers


def test_memory_allocated_equals_entries_and_peaks_are_equal(tiny_dir):
    """An unpadded cache allocates exactly its entries; under --memory equal an appending
    method (SnapKV) and an evicting one (TOVA) reach the same peak while decoding."""
    import polykv as P
    m, _ = M.load(tiny_dir, device="cpu", dtype=torch.float64)
    x = torch.randint(0, 200, (1, 60), generator=torch.Generator().manual_seed(0))
    cont = torch.randint(0, 200, (1, 9), generator=torch.Generator().manual_seed(1))
    L, G = m.config.n_layers, m.config.n_kv_heads
    snap = P.Policy.uniform("snapkv", 16, L, rules=BL.RULES).with_allowance(9)
    tova = P.Policy.uniform("tova", 16, L, rules=BL.RULES).with_allowance(9)
    bare = P.Policy.uniform("tova", 16, L, rules=BL.RULES)                 # no allowance
    full, obs = OB.observe_for(m, x, [snap, tova])
    peaks = []
    for pol in (snap, tova):
        cache = pol.compress(m, full, obs)
        assert cache.allocated() == cache.entries() == L * G * 16
        assert not pol.evicts_within(60, 9) and bare.evicts_within(60, 9)
        _, peak = M.teacher_force(m, cache, cont, pol.decoder, stepwise=True)
        peaks.append(peak)
    assert peaks[0] == peaks[1] == (L * G * (16 + 8), L * G * (16 + 8))
    _, evicting = M.teacher_force(m, bare.compress(m, full, obs), cont, bare.decoder,
                                  stepwise=True)
    assert evicting == (L * G * 16, L * G * 16)                       # the paper's protocol


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--methods", "full,magic"], "error: unknown method 'magic'; choose from full, streaming"),
        (["--budget", "0"], "error: budget must be >= 1, got 0"),
        (["--tasks", "nope"], "error: unknown task 'nope'; choose from niah_single_1"),
        (["--model", "/nonexistent/dir"], "error: model folder '/nonexistent/dir' does not exist"),
        (["--device", "cuda"], "error: --device cuda: no CUDA device is available here"),
        (["--protocol", "prompt,later"],
         "error: unknown protocol 'later'; choose from prompt, context, agnostic"),
        (["--memory", "budget", "--protocol", "context"],
         "error: --memory budget runs the prompt protocol only"),
        (["--greedy", "vt"], "error: --greedy 'vt' is not among --tasks (niah_single_1)"),
    ],
)
def test_cli_errors_are_one_line(argv, msg, capsys):
    """Each bad argument: exit 2 and one `error:` line. The first case runs `python evaluate.py`
    in a process of its own; the others call its main as the script does (support.cli.run)."""
    if argv[0] == "--methods":
        r = subprocess.run(
            [sys.executable, "evaluate.py", *argv], cwd=ROOT, capture_output=True, text=True
        )
        code, err = r.returncode, r.stderr
    else:
        with pytest.raises(SystemExit) as e:
            cli.run(lambda: E.main(argv), E.ON_CTRL_C)
        code, err = e.value.code, capsys.readouterr().err
    assert code == 2 and "Traceback" not in err                  # could not run (support/cli.py)
    assert err.strip().splitlines() == [err.strip()] and err.strip().startswith(msg)


def test_calibration_beyond_the_window_and_report_under_torchrun_stop_before_any_work(
    tiny_dir, tmp_path, monkeypatch
):
    out = tmp_path / "a"
    out.mkdir()
    kept = json.dumps({"key": "kept", "method": "full", "budget": 24, "task": "fidelity",
                       "length": 120, "index": 9, "n_tokens": 120, "kv_fraction": 1.0,
                       "compress_s": 0.0, "prefill_s": 0.0}) + "\n"
    (out / "samples.jsonl").write_text(kept)
    with pytest.raises(
        M.UsageError,
        match=r"^calibration prompts of 1000 \(\+64\) tokens exceed the model's " r"maximum 1024$",
    ):
        run(tiny_dir, out, "--calibration-length", "1000")
    assert (out / "samples.jsonl").read_text() == kept and [
        f.name for f in out.iterdir()
    ] == ["samples.jsonl"]
    # no PolyKV row: no check
    run(tiny_dir, tmp_path / "b", "--calibration-length", "1000", "--methods", "full,snapkv")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(M.UsageError, match=r"--report runs in one process \(no torchrun\)"):
        H.parse(["--report"])


def test_torchrun_two_ranks_equal_one_process(tiny_dir, policy_file, tmp_path):
    """torchrun --nproc_per_node 2 (gloo, CPU): every item written once, by one rank, and the
    merged summary equals a single process's (rows identical apart from time)."""
    common = ["--model", str(tiny_dir), "--device", "cpu", "--dtype", "float64", "--threads", "1",
              "--budget", "24", "--methods", "full,streaming,tova,snapkv,polykv,gracekv", "--tasks",
              "niah_single_1", "--length", "400", "--samples", "3", "--fidelity-length", "100",
              "--fidelity-samples", "3", "--cont-len", "6", "--max-new-tokens", "3", "--policy",
              str(policy_file)]
    E.main(common + ["--out", str(tmp_path / "one")])
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "evaluate.py", *common, "--out", str(tmp_path / "two")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    files = sorted((tmp_path / "two").glob("samples*.jsonl"))
    assert [f.name for f in files] == ["samples.rank0.jsonl", "samples.rank1.jsonl"]
    keys = [json.loads(l)["key"] for f in files for l in f.read_text().splitlines()]
    assert len(keys) == len(set(keys)) == 6 * 6 and all(f.read_text() for f in files)

    def timeless(folder):
        """The rows of folder's summary.json but the wall-clock ones."""
        return [
            x for x in json.loads((folder / "summary.json").read_text())["rows"]
            if x["task"] != "time"
        ]
    assert timeless(tmp_path / "two") == timeless(tmp_path / "one")


def test_report_cli_reprints_a_subset(tmp_path, capsys):
    kl = {"full": lambda i: 0.0, "snapkv": lambda i: 0.1 + 0.01 * i, "tova": lambda i: 0.2}
    score = {m: (lambda i: 50) for m in kl}
    summary = report.summarize(fake_rows(kl, score), list(kl), [64], H.baselines())
    f = tmp_path / "summary.json"
    f.write_text(
        json.dumps(
            {"config": {"methods": list(kl), "budgets": [64], "tasks": ["niah_single_1"]},
             "rows": summary}
        )
    )
    report.main([str(f), "--methods", "full,tova", "--no-diff"])
    out = capsys.readouterr().out.strip().splitlines()
    assert (
        len(out) == 4
        and out[2].startswith("| 64 | full |")
        and out[3].startswith("| 64 | tova | 50.0 |")
    )


def test_versus_is_the_paired_difference(tmp_path, capsys):
    """A method that is another plus a constant c on every prompt: difference c, interval [c, c];
    itself plus noise around 0 on alternate prompts: a tie. The CLI reads the rows beside the
    summary."""
    kl = {"gracekv": spread, "gracekv-hbar": lambda i: spread(i) + 0.03,
          "gracekv-unit": lambda i: spread(i) + (-1) ** i * 0.01}
    score = {"gracekv": lambda i: 50, "gracekv-hbar": lambda i: 50,
             "gracekv-unit": lambda i: 100 * (i % 2)}
    rows = fake_rows(kl, score)
    lines = compare.versus(rows, "gracekv", list(kl), [64], ["niah_single_1"])
    assert "gracekv-hbar +0.03 [+0.03, +0.03]" in lines[0] and "gracekv-unit" in lines[0]
    assert lines[0].split("gracekv-unit ")[1].endswith("tie")
    assert "gracekv-hbar +0.06 [+0.06, +0.06]" in lines[1]            # answer ΔNLL = 2·kl
    assert (
        lines[2].startswith("B = 64, niah_single_1 minus gracekv")
        and "gracekv-hbar +0 [+0, +0] tie" in lines[2]
    )
    f = tmp_path / "summary.json"
    f.write_text(
        json.dumps(
            {"config": {"methods": list(kl), "budgets": [64], "tasks": ["niah_single_1"]},
             "rows": report.summarize(rows, list(kl), [64], H.baselines())}
        )
    )
    with pytest.raises(M.UsageError, match="needs the per-sample rows"):
        report.main([str(f), "--versus", "gracekv"])
    (tmp_path / "samples.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    report.main([str(f), "--versus", "gracekv"])
    out = capsys.readouterr().out
    assert "fidelity KL minus gracekv, paired 95 % CI: gracekv-hbar +0.03 [+0.03, +0.03]" in out
    table = compare.versus_table(rows, "gracekv", list(kl), [64], ["niah_single_1"]).splitlines()
    assert table[0] == "| measure | budget | gracekv-hbar | gracekv-unit |" and table[-3] in out
    assert table[2].startswith("| fidelity KL | 64 | +0.03 [+0.03, +0.03] | ") and table[
        2
    ].endswith(" tie |")
    assert table[3].startswith("| answer ΔNLL | 64 | +0.06 [+0.06, +0.06] | ")
    with pytest.raises(M.UsageError, match="no such method"):
        report.main([str(f), "--versus", "snapkv"])


def test_before_is_each_method_minus_itself_in_another_run(tmp_path, capsys):
    """Two runs of the same prompts, the second every method's KL plus 0.02: each method minus
    itself before is +0.02 [+0.02, +0.02]; a method the other run lacks is left out."""
    before = fake_rows({"gracekv": spread, "gracekv-unit": spread},
                       {"gracekv": lambda i: 50, "gracekv-unit": lambda i: 50})
    after = fake_rows({"gracekv": lambda i: spread(i) + 0.02, "gracekv-hbar": spread},
                      {"gracekv": lambda i: 50, "gracekv-hbar": lambda i: 50})
    lines = compare.before_after(after, before, ["gracekv", "gracekv-hbar"], [64],
                                 ["niah_single_1"])
    assert lines[0] == ("B = 64, fidelity KL minus gracekv@before, paired 95 % CI: "
                        "gracekv +0.02 [+0.02, +0.02]")
    assert not any("gracekv-hbar" in line for line in lines)
    for name, rows in (("old", before), ("new", after)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "samples.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        methods = sorted({r["method"] for r in rows})
        (tmp_path / name / "summary.json").write_text(json.dumps(
            {"config": {"methods": methods, "budgets": [64], "tasks": ["niah_single_1"]},
             "rows": report.summarize(rows, methods, [64], H.baselines())}))
    report.main([str(tmp_path / "new" / "summary.json"), "--before",
                 str(tmp_path / "old" / "summary.json")])
    assert lines[0] in capsys.readouterr().out
