"""Every Python block of the README and of docs/ runs as written on the embedded model (each in
its own process). A block that starts with `def ` is an excerpt of baselines.py and must
appear there verbatim. The README's sample of
what the first command prints is what its committed run printed, and this code prints its
table from that run's rows. Every report a page (or a results/ folder's README) quotes under
`<!-- printed by: python -m engine.report ARGS -->` is what that command prints from the
committed rows."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
BLOCKS = [(p.relative_to(ROOT).as_posix(), i, code) for p in PAGES
          for i, code in enumerate(re.findall(r"```python\n(.*?)```", p.read_text(), re.S))]


def test_pages_have_blocks():
    assert {page for page, _, _ in BLOCKS} >= {"README.md", "docs/design.md"}


@pytest.mark.embedded
@pytest.mark.parametrize("page,i,code", BLOCKS, ids=[f"{p}#{i}" for p, i, _ in BLOCKS])
def test_block_runs(page, i, code, embedded):
    if code.startswith("def "):
        assert code in (ROOT / "baselines.py").read_text()
        return
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert r.returncode == 0, f"{page} block {i}: " + r.stderr[-2000:]


def readme_sample() -> list:
    """The lines of the README's sample of what the first command prints (its ```text block
    under "The first command"), without the lines that say some were left out."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## The first command"):]
    block = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and line.strip() != "…"]


def test_the_first_commands_sample_is_from_its_run():
    """Every line of the README's sample is a line the committed run of the first command
    printed (results/quick/stdout.txt), in the same order."""
    printed = iter((ROOT / "results" / "quick" / "stdout.txt").read_text().splitlines())
    for line in readme_sample():
        assert any(line == p for p in printed), f"not printed (in this order): {line}"


@pytest.mark.embedded
def test_this_code_prints_the_samples_table_from_its_rows(tmp_path, embedded):
    """This code prints the sample's table from the committed run's rows: `evaluate.py
    --report` on a copy of results/quick gives each table line of the README's sample."""
    run = tmp_path / "quick"
    shutil.copytree(ROOT / "results" / "quick", run)
    r = subprocess.run([sys.executable, "evaluate.py", "--budget", "512", "--out", str(run),
                        "--report"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
    printed = set(r.stdout.splitlines())
    table = [line for line in readme_sample() if line.startswith("| ")]
    assert len(table) >= 3
    for line in table:
        assert line in printed, f"--report does not print: {line}"


def test_ci_runs_the_readmes_test_command_and_says_why_tests_skip():
    """.ci/run's pytest line is the README's test command, which prints the reason of every
    skip (-rs): a bare "1 skipped" says nothing."""
    documented = re.search(r"## Test\n\n```bash\n(.*?)\n```", (ROOT / "README.md").read_text(),
                           re.S).group(1)
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.startswith("python -m pytest")]
    assert ci == [documented] and "-rs" in documented.split()


def test_the_readmes_reference_files_are_ignored_by_git():
    """The files the README's oracle example writes into the repository stay out of commits."""
    outs = sorted(set(re.findall(r"--out (\S+\.safetensors)", (ROOT / "README.md").read_text())))
    r = subprocess.run(["git", "check-ignore", *outs], cwd=ROOT, capture_output=True, text=True)
    assert len(outs) == 3 and sorted(r.stdout.split()) == outs


# the command, then its lines: in a ```text block, or up to a blank line
QUOTE = re.compile(r"<!-- printed by: python -m engine\.report (.*?) -->\n"
                   r"(?:```text\n)?(.*?)(?:\n```|\n\n|\Z)", re.S)
QUOTES = [(p.relative_to(ROOT).as_posix(), args, block)
          for p in PAGES + sorted((ROOT / "results").glob("*/README.md"))
          for args, block in QUOTE.findall(p.read_text())]


def test_pages_quote_the_reports_of_the_reference_runs():
    assert any(page == "docs/leaders.md" for page, _, _ in QUOTES)


@pytest.mark.parametrize("page,args,block", QUOTES, ids=[f"{p}: {a}" for p, a, _ in QUOTES])
def test_quoted_report_is_what_the_committed_rows_give(page, args, block, capsys, monkeypatch):
    """A block a page marks `<!-- printed by: python -m engine.report ARGS -->` (the lines
    after it, in a ```text block or up to a blank line) is printed, line for line in that
    order, by that command on the committed rows: the leaders and verdicts the docs quote are
    the committed runs', not copied by hand."""
    from engine import report
    monkeypatch.chdir(ROOT)
    report.main(args.split())
    printed = iter(capsys.readouterr().out.splitlines())
    for line in block.splitlines():
        assert any(line == p for p in printed), f"{page}: not printed (in this order): {line}"
