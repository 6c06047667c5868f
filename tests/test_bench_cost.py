"""bench.py's projection of the reference run's wall time (section 5), on made-up timings, and
its per-stage split (section 6) on a tiny model."""
from pathlib import Path

import pytest
import torch

from engine import bench

ROOT = Path(__file__).resolve().parent.parent


def test_mean_task_prompt_weights_each_measured_prompt_by_the_prompts_it_stands_for():
    # 16 prompts at 90 s, 96 at 40 s: (1440 + 3840) / 112 = 47.142857... s
    assert bench.mean_task_s(16, 90.0, 96, 40.0) == pytest.approx(5280 / 112)
    assert bench.mean_task_s(3, 10.0, 1, 2.0) == pytest.approx(8.0)       # (30 + 2) / 4
    assert bench.mean_task_s(0, 99.0, 5, 7.0) == pytest.approx(7.0)


def test_project_run_is_the_prompts_seconds_over_the_ranks_in_hours():
    # (112 × 600 s + 16 × 450 s) / 2 ranks = (67200 + 7200) / 2 = 37200 s = 10.333... h
    assert bench.project_run(112, 600.0, 16, 450.0, 2) == pytest.approx(37200 / 3600)
    # one rank: (10 × 36 + 5 × 72) / 1 = 720 s = 0.2 h
    assert bench.project_run(10, 36.0, 5, 72.0, 1) == pytest.approx(0.2)
    # four ranks, no fidelity prompts: 8 × 1800 / 4 = 3600 s = 1 h
    assert bench.project_run(8, 1800.0, 0, 999.0, 4) == pytest.approx(1.0)
    # no task prompts: 3 × 2400 / 2 = 3600 s = 1 h
    assert bench.project_run(0, 999.0, 3, 2400.0, 2) == pytest.approx(1.0)


def test_the_reference_run_parses_as_evaluate_parses_it():
    a = bench.reference_args(8000)
    assert a.length == [8000] and a.fidelity_length == [7936] and a.budget == [64, 128, 512]
    assert a.protocol == ["prompt", "context", "agnostic"] and a.greedy == ["niah_single_1"]
    assert len(a.methods) == 15 and len(a.tasks) == 7 and a.samples == a.fidelity_samples == 16
    # the run's own 8,000-token policies, both procedures at each budget
    assert a.calibration_length == 8000
    files = sorted(f.name for f in Path(a.cache_dir).glob("*.json"))
    assert Path(a.cache_dir) == ROOT / "results" / "reference-8k" / "policies"
    assert files == sorted(f"polykv{p}-SmolLM2-135M-Instruct-B{b}-T8000-seed0-dev2.json"
                           for p in ("", "-joint") for b in (64, 128, 512))
    assert bench.reference_args(700, "full,snapkv").methods == ["full", "snapkv"]


def test_stages_split_a_prompts_cpu_time_and_leave_the_harness_as_it_was(tiny_dir):
    """bench.Stages on a tiny model: every stage the prompt runs is timed under its protocol,
    their own times add up to at most the whole call's CPU time, KVzip's passes and GraceKV's
    compressions are apart from the observation and the other compressions, and every patched
    function is back afterwards."""
    import model as M
    from engine import harness as H
    from engine import observe as OB
    before = (OB.observe_prefixes, M.teacher_force, M.greedy, H.run_protocol)
    m, tok = M.load(tiny_dir, dtype=torch.float64)
    a = H.parse(["--model", str(tiny_dir), "--dtype", "float64", "--budget", "16,32",
                 "--protocol", "prompt,agnostic", "--methods", "full,snapkv,kvzip,gracekv",
                 "--tasks", "niah_single_1", "--length", "480", "--samples", "1",
                 "--fidelity-samples", "0", "--max-new-tokens", "2"])
    items = H.build_items(tok, a, m)
    a.allowance = H.run_allowance(a, items)
    by, cpu, wall = bench.staged_item(m, tok, H.Methods(m, tok, a), a, items[0])
    assert set(by) == {"prompt", "agnostic"}
    for stage in ("observation", "KVzip passes", "GraceKV compression", "other compressions",
                  "teacher forcing FullKV", "teacher forcing compressed", "greedy FullKV",
                  "greedy compressed"):
        assert by["prompt"][stage] > 0, stage
    assert by["agnostic"]["question fed"] > 0 and by["agnostic"]["observation"] == 0
    assert by["prompt"]["question fed"] == 0          # teacher forcing's own decode steps
    assert by["agnostic"]["KVzip passes"] == 0        # both prefixes' passes in the observation
    assert sum(sum(s.values()) for s in by.values()) <= cpu + 1e-3
    assert before == (OB.observe_prefixes, M.teacher_force, M.greedy, H.run_protocol)


def test_the_stage_table_has_a_row_per_protocol_and_prompt(tiny_dir, capsys, monkeypatch):
    """bench.print_stages on a tiny model: the three prompts (fidelity, the answered task, the
    stand-in task; here niah_multikey_3, as vt needs more tokens than the tiny model holds),
    each with a row per protocol it ran and its total."""
    import model as M
    from engine import harness as H
    monkeypatch.setattr(bench, "STAND_IN", "niah_multikey_3")
    m, tok = M.load(tiny_dir, dtype=torch.float64)
    a = H.parse(["--model", str(tiny_dir), "--dtype", "float64", "--budget", "16",
                 "--protocol", "prompt,agnostic", "--methods", "full,snapkv",
                 "--tasks", "niah_single_1,niah_multikey_3", "--greedy", "niah_single_1",
                 "--length", "700",
                 "--samples", "1", "--fidelity-length", "120", "--fidelity-samples", "1",
                 "--max-new-tokens", "2"])
    bench.print_stages(m, tok, a)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("| ")]
    labels = [x.split(" | ")[0][2:] + " / " + x.split(" | ")[1] for x in lines[1:]]
    assert labels == ["fidelity #0 / prompt", "fidelity #0 / all",
                      "niah_single_1 #0 (answers decoded) / prompt",
                      "niah_single_1 #0 (answers decoded) / agnostic",
                      "niah_single_1 #0 (answers decoded) / all",
                      "niah_multikey_3 #0 / prompt", "niah_multikey_3 #0 / agnostic",
                      "niah_multikey_3 #0 / all"]
