"""The two layers of the tree: the papers (model, polykv, baselines, calibrate, gracekv) import
each other and the plain helpers of support/, never the engine (engine/) nor the entry point
(evaluate.py); support/ imports nothing of the project above it; the engine imports the papers
and support/, never evaluate.py. Read off every import statement of each file (function-level
ones too)."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAPERS = ("model", "polykv", "baselines", "calibrate", "gracekv")


def imported(path: Path) -> set:
    """The top-level names of every module `path` imports (`engine`, `polykv`, `support`...)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("paper", PAPERS)
def test_a_paper_imports_no_engine(paper):
    got = imported(ROOT / f"{paper}.py")
    assert not got & {"engine", "evaluate"}, f"{paper}.py imports {got & {'engine', 'evaluate'}}"


@pytest.mark.parametrize("path", sorted((ROOT / "support").glob("*.py")), ids=lambda p: p.name)
def test_support_imports_nothing_above_it(path):
    above = set(PAPERS) | {"engine", "evaluate"}
    got = imported(path)
    assert not got & above, f"support/{path.name} imports {got & above}"


@pytest.mark.parametrize("path", sorted((ROOT / "engine").glob("*.py")), ids=lambda p: p.name)
def test_the_engine_imports_no_entry_point(path):
    assert "evaluate" not in imported(path), f"engine/{path.name} imports evaluate.py"


def test_the_top_level_is_the_papers_and_the_entry_point():
    top = {p.stem for p in ROOT.glob("*.py")}
    assert top == set(PAPERS) | {"evaluate"}, sorted(top)
