"""The committed reference runs are whole: every row of results/reference-*/ was computed in its
folder, at the one commit its run.json records, for exactly the grid it asked (no row missing,
none twice, none from elsewhere), and its README states that count and that commit."""
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine import harness as H

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = sorted((ROOT / "results").glob("reference-*/"))


def test_there_is_one_reference_run_per_length():
    assert [f.name for f in FOLDERS] == ["reference-2k", "reference-8k"]


def prompts_asked(asked: dict) -> list:
    """The prompts run.json asked: each task's samples at each length, then the fidelity
    passages (task `fidelity`)."""
    prompts = [SimpleNamespace(task=t, length=n, index=i) for t in asked["tasks"]
               for n in asked["length"] for i in range(asked["samples"])]
    return prompts + [SimpleNamespace(task="fidelity", length=n, index=i)
                      for n in asked["fidelity_length"] for i in range(asked["fidelity_samples"])]


def grid(asked: dict) -> set:
    """The row keys `evaluate.py` writes for what run.json asked (harness.result_key: one per
    method, budget, prompt and protocol). Each prompt's first question only: the reference runs
    ask no `*_turns` task (those add a key per turn)."""
    return {H.result_key(m, b, it, p) for m in asked["methods"] for b in asked["budgets"]
            for it in prompts_asked(asked) for p in asked["protocols"]}


@pytest.mark.parametrize("folder", FOLDERS, ids=[f.name for f in FOLDERS])
def test_reference_run_is_whole_and_from_one_commit(folder):
    run = json.loads((folder / "run.json").read_text())
    assert len(run["code"]) == 1, f"{folder.name}: rows from {len(run['code'])} commits"
    commit = run["code"][0]
    assert re.fullmatch(r"[0-9a-f]{12}", commit), \
        f"{folder.name}: code {commit!r}, not a clean commit"
    keys = [json.loads(line)["key"] for f in sorted(folder.glob("samples*.jsonl"))
            for line in f.read_text().splitlines()]
    assert len(keys) == len(set(keys)), f"{folder.name}: a row written twice"
    assert set(keys) == grid(run["asked"])
    # the summary the docs quote is the whole run's: every prompt, the grid asked
    config = json.loads((folder / "summary.json").read_text())["config"]
    prompts = len(prompts_asked(run["asked"]))
    assert config["prompts"] in (f"{prompts}", f"{prompts} of {prompts} (--report)")
    for field in ("methods", "budgets", "protocols"):
        assert set(config[field]) == set(run["asked"][field]), field
    readme = (folder / "README.md").read_text()
    assert re.search(rf"(?<![\d,]){len(keys):,}(?![\d,])", readme), "README: the row count"
    assert commit[:7] in readme, "README: the commit"
    assert not re.search(r"in progress|\{\{", readme, re.I), "README: unfinished"


def test_no_prose_left_to_write_in_the_docs():
    """A `{{NAME}}` in the README or a doc is prose still to be written from a run."""
    pages = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("results/*/README.md"),
             *ROOT.glob("policies/README.md")]
    left = [f"{p.relative_to(ROOT)}:{i}" for p in pages
            for i, line in enumerate(p.read_text().splitlines(), 1) if "{{" in line]
    assert not left, f"unwritten prose at {left}"
