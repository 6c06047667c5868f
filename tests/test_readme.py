"""Every Python block of the README and of docs/ runs as written on the embedded model (each in
its own process: a block may register a rule). A block that starts with a decorator line
`@P.rule(` is an excerpt of baselines.py and must appear there verbatim."""
import os
import re
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
    if code.startswith("@P.rule("):
        assert code in (ROOT / "baselines.py").read_text()
        return
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert r.returncode == 0, f"{page} block {i}: " + r.stderr[-2000:]
