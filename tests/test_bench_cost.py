"""bench.py's projection of the reference run's wall time (section 5), on made-up timings."""
import pytest

from engine import bench


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
    assert a.cache_dir.endswith("results/long/policies")
    assert bench.reference_args(700, "full,snapkv").methods == ["full", "snapkv"]
