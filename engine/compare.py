"""The paired statistics of the per-sample rows and the comparisons read from them: each row's
values per (method, budget, task, metric), the prompts every method shares, the bootstrap
draw; each method minus one method (`against`: an ablation read against what it ablates), and
the leader of each headline measure with the methods that tie it (`leading`), each as lines and
as a Markdown table (`python -m engine.report SUMMARY --versus M`, `--leaders`), and where
a method stands in each setting: leads, ties or trails (`--verdicts M`).

Uncertainty (docs/protocol.md): every mean gets a 95 % percentile bootstrap
interval over prompts, *paired* — each resample draws one set of prompts and every method is
averaged over those same prompts — so differences between methods get their own, narrower,
intervals. A difference whose interval contains 0 is a tie.
"""
from __future__ import annotations

import numpy as np

LOWER_IS_BETTER = {"kl", "dnll"}
N_BOOT, SEED = 2000, 0


def values(rows: list) -> dict:
    """(method, budget, task, metric) -> {prompt: value}; RULER rows also feed the `answer`
    task (answer fidelity) and every row the `memory` and `time` tasks. A multi-question prompt's
    later questions (rows with turn >= 1) go to "TASK later" and "answer later", their mean per
    prompt (the bootstrap resamples prompts, not questions that share a context), and the
    prompt's first minus that mean to "TASK spread" and "answer spread" (multi-question reuse)."""
    measured, later = {}, {}
    for r in rows:
        turn = r.get("turn", 0)
        prompt = (r["task"], r["length"], r["index"])

        def put(task, metric, v):
            if turn:
                later.setdefault((r["method"], r["budget"], task, metric), {}).setdefault(
                    prompt, []
                ).append(v)
            else:
                measured.setdefault((r["method"], r["budget"], task, metric), {})[prompt] = v
        if r["task"] == "fidelity":
            for m in ("kl", "dnll", "top1"):
                put("fidelity", m, r[m])
        else:
            if "score" in r:
                put(r["task"], r.get("metric", "string_match_all"), r["score"])
            if "kl" in r:
                for m in ("kl", "dnll"):
                    put("answer", m, r[m])
        if turn:
            continue
        for m in ("kv_fraction", "peak_fraction", "alloc_fraction"):
            if m in r:
                put("memory", m, r[m])
        if "compress_s" in r:
            put("time", "compress_s", r["compress_s"])
    # one value per prompt: its later questions' mean
    for (m, b, task, metric), per in later.items():
        first = measured.get((m, b, task, metric), {})
        measured[(m, b, task + " later", metric)] = {p: sum(v) / len(v) for p, v in per.items()}
        measured[(m, b, task + " spread", metric)] = {
            p: first[p] - sum(v) / len(v) for p, v in per.items() if p in first
        }
    return measured


def aligned(per: dict) -> tuple:
    """{method: {prompt: value}} -> (the prompts every method has, sorted; {method: (n,) array of
    its values on them}): the paired sample the bootstrap resamples."""
    prompts = sorted(set.intersection(*(set(v) for v in per.values()))) if per else []
    return prompts, {m: np.array([v[p] for p in prompts], dtype=float) for m, v in per.items()}


def resample_index(n: int, seed: int = SEED) -> np.ndarray:
    """(N_BOOT, n) prompt indices drawn with replacement; the same draw serves every method."""
    return np.random.default_rng(seed).integers(0, n, size=(N_BOOT, n))


def interval(x: np.ndarray) -> tuple:
    lo, hi = np.percentile(x, [2.5, 97.5])
    return float(lo), float(hi)


UNSCORED = ("fidelity", "answer", "memory", "time", "gap")    # the tasks that are not a score


def scored_tasks(pairs, ruler_tasks) -> list:
    """(task, metric) of each scored task: the RULER tasks in their order (string_match_all),
    then, by name, every other task among `pairs` ((task, metric) of rows or summary rows) that
    is a score: LongBench's datasets, each with its own metric."""
    others = {(t, m) for t, m in pairs if t not in ruler_tasks and t not in UNSCORED
              and not t.endswith((" later", " spread"))}
    return [(t, "string_match_all") for t in ruler_tasks] + sorted(others)


def headline_metrics(ruler_tasks, pairs=()) -> list:
    """(task, metric, label) of the headline comparisons: fidelity KL, answer ΔNLL, then each
    task's score (`scored_tasks`: the RULER tasks and the LongBench datasets among `pairs`)."""
    return [("fidelity", "kl", "fidelity KL"), ("answer", "dnll", "answer ΔNLL")] + \
        [(t, m, t) for t, m in scored_tasks(pairs, ruler_tasks)]



def against(rows: list, ref: str, names, budgets, ruler_tasks) -> list:
    """From per-sample rows: each method minus `ref` per budget and headline metric, over the
    prompts both have, with its paired 95 % bootstrap interval — an ablation read against the
    method it ablates. Returns dicts {budget, label, diffs: [(method, diff, lo, hi)]}."""
    measured = values(rows)
    out = []
    for b in budgets:
        for task, metric, label in headline_metrics(ruler_tasks, [k[2:] for k in measured]):
            base = measured.get((ref, b, task, metric))
            if base is None:
                continue
            diffs = []
            for m in names:
                other = measured.get((m, b, task, metric))
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


def before_after(rows: list, before: list, names, budgets, ruler_tasks) -> list:
    """Each method minus itself in another run of the same prompts (`before`: its per-sample
    rows, e.g. the code before a change), paired over the prompts both have: one line per
    method, budget and headline metric, as `versus` prints them."""
    lines = []
    for m in names:
        tagged = [dict(r, method=m + "@before") for r in before if r["method"] == m]
        mine = [r for r in rows if r["method"] == m]
        if tagged and mine:
            lines += versus(mine + tagged, m + "@before", [m], budgets, ruler_tasks)
    return lines


def budget_label(b: int, length=None) -> str:
    """A budget, with its compression ratio when the prompt length is given: '64 (125×)'."""
    return f"{b}" + (f" ({length / b:.0f}×)" if length else "")


def versus_table(rows: list, ref: str, names, budgets, ruler_tasks, length=None) -> str:
    """`against` as a Markdown table: a row per headline metric and budget (its ratio when the
    prompt length is given), a column per method: difference [interval], 2 decimals."""
    got = against(rows, ref, names, budgets, ruler_tasks)
    labels = list(dict.fromkeys(d["label"] for d in got))
    cols = [m for m in names if any(m == x[0] for d in got for x in d["diffs"])]

    def num(x):
        """x signed, 2 decimals, with a typographic minus: '+0.12', '−0.03'."""
        return f"{x:+.2f}".replace("-", "−")

    def cell(v):
        """A (difference, lo, hi) as 'd [lo, hi]', ' tie' when the interval holds 0; '' if None."""
        return (
            ""
            if v is None
            else f"{num(v[0])} [{num(v[1])}, {num(v[2])}]" + (" tie" if v[1] <= 0 <= v[2] else "")
        )
    lines = ["| measure | budget | " + " | ".join(cols) + " |", "|---" * (len(cols) + 2) + "|"]
    # measure by measure (stable)
    for d in sorted(got, key=lambda d: labels.index(d["label"])):
        by = {m: (x, lo, hi) for m, x, lo, hi in d["diffs"]}
        lines.append(f"| {d['label']} | {budget_label(d['budget'], length)} | "
                     + " | ".join(cell(by.get(m)) for m in cols) + " |")
    return "\n".join(lines)


def leading(rows: list, names, budgets, ruler_tasks, skip=("full",)) -> list:
    """From per-sample rows: per budget and headline metric, the method with the best mean (FullKV
    aside) and every other method minus it over the prompts all share, paired 95 % bootstrap
    interval; the methods whose interval contains 0 tie the leader. Returns dicts {budget,
    label, n, top, mean, ties, behind}, ties and behind [(method, diff, lo, hi)] best first."""
    measured = values(rows)
    out = []
    for b in budgets:
        for task, metric, label in headline_metrics(ruler_tasks, [k[2:] for k in measured]):
            prompts, X = aligned({m: measured[(m, b, task, metric)] for m in names
                                  if m not in skip and (m, b, task, metric) in measured})
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
            out.append(
                {"budget": b, "label": label, "n": len(prompts), "top": top, "mean": X[top].mean(),
                 "ties": ties, "behind": behind}
            )
    return out


def leaders(rows: list, names, budgets, ruler_tasks, skip=("full",)) -> list:
    """`leading` as one line per budget and headline metric: the leader, its ties, the rest."""
    def diffs(xs):
        """[(method, diff, lo, hi)] as 'method +d [lo, hi]; ...'."""
        return "; ".join(f"{m} {d:+.4g} [{lo:+.4g}, {hi:+.4g}]" for m, d, lo, hi in xs)
    return [f"B = {d['budget']}, {d['label']} (n = {d['n']}): {d['top']} {d['mean']:.4g} "
            + ("leads" if not d["ties"] else "ties " + diffs(d["ties"]))
            + (" | behind: " + diffs(d["behind"]) if d["behind"] else "")
            for d in leading(rows, names, budgets, ruler_tasks, skip)]


def standing(rows: list, method: str, names, budgets, ruler_tasks, skip=("full",)) -> list:
    """Where `method` stands in each setting `leading` ranks (a budget and a headline measure):
    [(budget, label, place, alone)], place 'leads' (the best mean, FullKV aside), 'ties' (its
    paired 95 % interval against the leader holds 0) or 'trails' (it does not); `alone` says
    whether the leader is tied by no method. Settings without a row of `method` are left out."""
    out = []
    for d in leading(rows, names, budgets, ruler_tasks, skip):
        tied = {m for m, *_ in d["ties"]}
        behind = {m for m, *_ in d["behind"]}
        if method == d["top"]:
            place = "leads"
        elif method in tied:
            place = "ties"
        elif method in behind:
            place = "trails"
        else:
            continue
        out.append((d["budget"], d["label"], place, not d["ties"]))
    return out


def verdicts(rows: list, methods, names, budgets, ruler_tasks, length=None,
             skip=("full",)) -> list:
    """`standing` of each of `methods` as one line: how many settings it leads, ties and trails,
    then which ('leads: answer ΔNLL at 512 (4×) alone; ties: ...'), the count a paper's "first in
    k of n settings" is read against."""
    lines = []
    for m in methods:
        got = standing(rows, m, names, budgets, ruler_tasks, skip)
        count = {p: [s for s in got if s[2] == p] for p in ("leads", "ties", "trails")}
        head = f"{m}: " + ", ".join(f"{p} {len(v)}" for p, v in count.items()) + \
            f" of {len(got)} settings"
        parts = [f"{p}: " + ", ".join(f"{label} at {budget_label(b, length)}"
                                       + (" alone" if p == "leads" and alone else "")
                                       for b, label, _, alone in v)
                 for p, v in count.items() if v]
        lines.append(head + ("; " + "; ".join(parts) if parts else ""))
    return lines


def leaders_table(rows: list, names, budgets, ruler_tasks, length=None, skip=("full",)) -> str:
    """`leading` as a Markdown table: a row per headline metric, a column per budget (its
    compression ratio when the prompt length is given); a cell holds the leader, its mean and the
    methods that tie it ('alone' when none does), with the number of prompts."""
    got = leading(rows, names, budgets, ruler_tasks, skip)
    head = [f"B = {budget_label(b, length)}" for b in budgets]
    lines = ["| measure | " + " | ".join(head) + " |", "|---" * (len(budgets) + 1) + "|"]
    for label in dict.fromkeys(d["label"] for d in got):
        by = {d["budget"]: d for d in got if d["label"] == label}
        lines.append(f"| {label} | " + " | ".join(leader_cell(by.get(b)) for b in budgets) + " |")
    return "\n".join(lines)


def leader_cell(d) -> str:
    """A `leading` dict as 'leader mean; its ties (n = prompts)' ('alone' when none ties it);
    '' if None."""
    if d is None:
        return ""
    return (f"{d['top']} {d['mean']:.3g}"
            + ("; " + ", ".join(m for m, *_ in d["ties"]) if d["ties"] else " alone")
            + f" (n = {d['n']})")
