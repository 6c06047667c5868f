"""PolyKV at 8K on dev: the rows of the run with the 2,048-token policies (out-2k/) against the
run with the 8,000-token policies (out-8k/), same prompts, same code. Prints, per headline
metric, each 8K-calibrated row minus its 2K-calibrated one with the paired 95 % bootstrap
interval (support.compare.versus). Run from the repository root:

    python results/polykv-8k/compare.py results/polykv-8k
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from support import compare, report  # noqa: E402
from support.files import read_rows  # noqa: E402


def rows(out: Path, suffix: str = "") -> list:
    """The per-sample rows of one run; with a suffix, its PolyKV rows alone, renamed (FullKV's
    and SnapKV's rows are the same in both runs)."""
    got = [r for f in sorted(out.glob("samples*.jsonl")) for r in read_rows(f, repair=False)]
    return [{**r, "method": r["method"] + suffix} for r in got if r["method"].startswith("polykv")] if suffix else got


def main(root: Path):
    cfg = json.loads((root / "out-2k" / "summary.json").read_text())["config"]
    both = rows(root / "out-2k") + rows(root / "out-8k", "@8k")
    for ref in ("polykv", "polykv-joint"):
        print("\n".join(compare.versus(both, ref, [ref + "@8k"], cfg["budgets"], cfg["tasks"])))
    names = ["snapkv", "polykv", "polykv@8k", "polykv-joint", "polykv-joint@8k"]
    print(report.table(report.summarize(both, ["full"] + names, cfg["budgets"]), ["full"] + names,
                       cfg["budgets"], cfg["tasks"]).split("\n\n")[0])


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent))
