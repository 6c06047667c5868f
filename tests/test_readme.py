"""Every Python block of the README runs as written on the embedded model (each in its own
process: a block may register a rule)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


@pytest.mark.embedded
@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_block_runs(i, embedded):
    code = BLOCKS[i]
    if code.startswith("@rule("):                    # an excerpt of rules.py: it is the code there
        assert code in (ROOT / "rules.py").read_text()
        return
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
