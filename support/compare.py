"""Comparisons read from the per-sample rows (`python -m support.report SUMMARY --versus M`,
`--leaders`): each method minus one method (`against`: an ablation read against what it
ablates), and the leader of each headline measure with the methods that tie it (`leading`);
each as lines and as a Markdown table. Every difference is paired — the same bootstrap draw of
prompts for both methods (support/report.py) — and a difference whose 95 % interval contains 0
is a tie.
"""
from __future__ import annotations

from support.report import LOWER_IS_BETTER, aligned, headline_metrics, interval, resample_index, values


def against(rows: list, ref: str, names, budgets, ruler_tasks) -> list:
    """From per-sample rows: each method minus `ref` per budget and headline metric, over the
    prompts both have, with its paired 95 % bootstrap interval — an ablation read against the
    method it ablates. Returns dicts {budget, label, diffs: [(method, diff, lo, hi)]}."""
    acc = values(rows)
    out = []
    for b in budgets:
        for task, metric, label in headline_metrics(ruler_tasks):
            base = acc.get((ref, b, task, metric))
            if base is None:
                continue
            diffs = []
            for m in names:
                other = acc.get((m, b, task, metric))
                if m == ref or other is None:
                    continue
                _, X = aligned({ref: base, m: other})
                d = X[m] - X[ref]                                           # (n,) paired
                diffs.append((m, d.mean(), *interval(d[resample_index(len(d))].mean(1))))
            out.append({"budget": b, "label": label, "diffs": diffs})
    return out


def versus(rows: list, ref: str, names, budgets, ruler_tasks) -> list:
    """`against` as one line per budget and headline metric ('tie' when the interval contains 0)."""
    return [f"B = {d['budget']}, {d['label']} minus {ref}, paired 95 % CI: "
            + "; ".join(f"{m} {x:+.4g} [{lo:+.4g}, {hi:+.4g}]" + (" tie" if lo <= 0 <= hi else "")
                        for m, x, lo, hi in d["diffs"])
            for d in against(rows, ref, names, budgets, ruler_tasks)]


def budget_label(b: int, length=None) -> str:
    """A budget, with its compression ratio when the prompt length is given: '64 (125×)'."""
    return f"{b}" + (f" ({length / b:.0f}×)" if length else "")


def versus_table(rows: list, ref: str, names, budgets, ruler_tasks, length=None) -> str:
    """`against` as a Markdown table: a row per headline metric and budget (its ratio when the
    prompt length is given), a column per method: difference [interval], 2 decimals."""
    got = against(rows, ref, names, budgets, ruler_tasks)
    labels = list(dict.fromkeys(d["label"] for d in got))
    cols = [m for m in names if any(m == x[0] for d in got for x in d["diffs"])]
    num = lambda x: f"{x:+.2f}".replace("-", "−")
    cell = lambda v: "" if v is None else f"{num(v[0])} [{num(v[1])}, {num(v[2])}]" + (" tie" if v[1] <= 0 <= v[2] else "")
    lines = ["| measure | budget | " + " | ".join(cols) + " |", "|---" * (len(cols) + 2) + "|"]
    for d in sorted(got, key=lambda d: labels.index(d["label"])):       # measure by measure (stable)
        by = {m: (x, lo, hi) for m, x, lo, hi in d["diffs"]}
        lines.append(f"| {d['label']} | {budget_label(d['budget'], length)} | "
                     + " | ".join(cell(by.get(m)) for m in cols) + " |")
    return "\n".join(lines)


def leading(rows: list, names, budgets, ruler_tasks, skip=("full",)) -> list:
    """From per-sample rows: per budget and headline metric, the method with the best mean (FullKV
    aside) and every other method minus it over the prompts all share, paired 95 % bootstrap
    interval; the methods whose interval contains 0 tie the leader. Returns dicts {budget,
    label, n, top, mean, ties, behind}, ties and behind [(method, diff, lo, hi)] best first."""
    acc = values(rows)
    out = []
    for b in budgets:
        for task, metric, label in headline_metrics(ruler_tasks):
            prompts, X = aligned({m: acc[(m, b, task, metric)] for m in names
                                  if m not in skip and (m, b, task, metric) in acc})
            if len(X) < 2:
                continue
            sign = -1 if metric in LOWER_IS_BETTER else 1
            top = max(X, key=lambda m: sign * X[m].mean())
            idx, ties, behind = resample_index(len(prompts)), [], []
            for m in sorted(X, key=lambda m: -sign * X[m].mean()):
                if m == top:
                    continue
                lo, hi = interval((X[m] - X[top])[idx].mean(1))
                (ties if lo <= 0 <= hi else behind).append((m, X[m].mean() - X[top].mean(), lo, hi))
            out.append({"budget": b, "label": label, "n": len(prompts), "top": top, "mean": X[top].mean(),
                        "ties": ties, "behind": behind})
    return out


def leaders(rows: list, names, budgets, ruler_tasks, skip=("full",)) -> list:
    """`leading` as one line per budget and headline metric: the leader, its ties, the rest."""
    diffs = lambda xs: "; ".join(f"{m} {d:+.4g} [{lo:+.4g}, {hi:+.4g}]" for m, d, lo, hi in xs)
    return [f"B = {d['budget']}, {d['label']} (n = {d['n']}): {d['top']} {d['mean']:.4g} "
            + ("leads" if not d["ties"] else "ties " + diffs(d["ties"]))
            + (" | behind: " + diffs(d["behind"]) if d["behind"] else "")
            for d in leading(rows, names, budgets, ruler_tasks, skip)]


def leaders_table(rows: list, names, budgets, ruler_tasks, length=None, skip=("full",)) -> str:
    """`leading` as a Markdown table: a row per headline metric, a column per budget (its
    compression ratio when the prompt length is given); a cell holds the leader, its mean and the
    methods that tie it ('alone' when none does), with the number of prompts."""
    got = leading(rows, names, budgets, ruler_tasks, skip)
    head = [f"B = {budget_label(b, length)}" for b in budgets]
    lines = ["| measure | " + " | ".join(head) + " |", "|---" * (len(budgets) + 1) + "|"]
    for label in dict.fromkeys(d["label"] for d in got):
        by = {d["budget"]: d for d in got if d["label"] == label}
        cell = lambda d: "" if d is None else f"{d['top']} {d['mean']:.3g}" + (
            "; " + ", ".join(m for m, *_ in d["ties"]) if d["ties"] else " alone") + f" (n = {d['n']})"
        lines.append(f"| {label} | " + " | ".join(cell(by.get(b)) for b in budgets) + " |")
    return "\n".join(lines)
