"""The benchmark's report: flat summary rows with paired bootstrap intervals, the Markdown table,
each method's difference to the best uniform rule, PolyKV's gap recovered, the progress line and
the budget-vs-score plot (docs/protocol.md). Pure functions of the per-sample rows that
evaluate.py writes to samples.jsonl; the paired bootstrap and the comparisons read from the
rows (each method against one, the leader of each measure) are in engine/compare.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from engine.compare import (LOWER_IS_BETTER, aligned, before_after, budget_label,
                             headline_metrics, interval, leader_cell, leaders, leaders_table,
                             leading, resample_index, scored_tasks, values, verdicts, versus,
                             versus_table)
from support import cli
from support.errors import UsageError
from support.files import read_rows

HEADLINE = {("fidelity", "kl"), ("answer", "dnll")}     # plus every RULER / LongBench score
# what the comparisons read of every per-sample row (a line without them is refused)
ROW_KEY = ("method", "budget", "task", "length", "index")


def protocol(row: dict) -> str:
    """A row's protocol; rows written before protocols existed are `prompt`'s."""
    return row.get("protocol", "prompt")


def summarize(rows: list, names, budgets, baselines=(), gap_methods=()) -> list:
    """Flat summary rows {method, budget, task, metric, value, n, ci_low, ci_high}; a method
    that is not the best of the `baselines` (the standalone rules, evaluate.baselines()) at its
    (budget, task, metric) also gets `vs_best` {rule, diff, ci_low, ci_high, tie}; each of
    `gap_methods` (the PolyKV rows) gets task `gap` (gap recovered)."""
    measured = values(rows)
    out = []
    groups = sorted({k[1:] for k in measured})
    for budget, task, metric in groups:
        prompts, X = aligned(
            {m: measured[(m, budget, task, metric)] for m in names
             if (m, budget, task, metric) in measured}
        )
        if not prompts:
            continue
        idx = resample_index(len(prompts))
        # (N_BOOT,)
        boot = {m: x[idx].mean(1) for m, x in X.items()}
        sign = -1 if metric in LOWER_IS_BETTER else 1
        base = [m for m in X if m in baselines]
        ranked = base and task not in ("memory", "time") and not task.endswith(" spread")
        best = max(base, key=lambda m: sign * X[m].mean()) if ranked else None
        for m, x in X.items():
            lo, hi = interval(boot[m])
            row = {"method": m, "budget": budget, "task": task, "metric": metric,
                   "value": round(float(x.mean()), 4), "n": len(prompts),
                   "ci_low": round(lo, 4), "ci_high": round(hi, 4)}
            if best is not None and m != best:
                dlo, dhi = interval(boot[m] - boot[best])
                row["vs_best"] = {"rule": best, "diff": round(float(x.mean() - X[best].mean()), 4),
                                  "ci_low": round(dlo, 4), "ci_high": round(dhi, 4),
                                  "tie": dlo <= 0 <= dhi}
            out.append(row)
        headline = (task, metric) in HEADLINE or task not in (
            "fidelity",
            "answer",
            "memory",
            "time",
        )
        if best is not None and "full" in X and headline:
            for m in [m for m in X if m in gap_methods]:
                out.append(gap_row(m, budget, task, metric, X, boot, best, len(prompts)))
    order = {n: i for i, n in enumerate(names)}
    return sorted(
        out, key=lambda d: (d["budget"], order.get(d["method"], 99), d["task"], d["metric"])
    )


def gap_row(m, budget, task, metric, X, boot, best, n) -> dict:
    """Gap recovered = (method − best uniform) / (FullKV − best uniform) (the PolyKV paper's
    headline measure), with its
    paired interval (the best uniform rule is fixed by the point estimate). The ratio needs a
    gap to divide by: none (value None) where the paired 95 % interval of FullKV − best uniform
    (`full_gap`) holds 0 (they tie), or where that gap is smaller than the half-width h of the
    paired interval of method − best uniform (`half`): the ratio's interval then spans more than
    the whole gap, ±h/|gap| > 100 %, and its value says nothing."""
    den = X["full"].mean() - X[best].mean()
    lo, hi = interval(boot["full"] - boot[best])
    mlo, mhi = interval(boot[m] - boot[best])
    row = {"method": m, "budget": budget, "task": "gap", "metric": f"{task}_{metric}",
           "best_uniform": best, "n": n,
           "full_gap": {"diff": round(float(den), 4), "ci_low": round(lo, 4),
                        "ci_high": round(hi, 4)}, "half": round((mhi - mlo) / 2, 4)}
    if abs(den) < 1e-12 or lo <= 0 <= hi or abs(den) < (mhi - mlo) / 2:
        return {**row, "value": None}
    with np.errstate(divide="ignore", invalid="ignore"):
        g = (boot[m] - boot[best]) / (boot["full"] - boot[best])
    lo, hi = interval(g[np.isfinite(g)])
    return {**row, "value": round(float((X[m].mean() - X[best].mean()) / den), 4),
            "ci_low": round(lo, 4), "ci_high": round(hi, 4)}


# ----------------------------------------------------------------------------- table

def cell(d, fmt, scale=1.0) -> str:
    """'0.050 ±0.008': the mean and the half-width of its 95 % interval."""
    if d is None or d.get("value") is None:
        return "–"
    v = fmt.format(scale * d["value"])
    half = fmt.format(scale * (d.get("ci_high", 0) - d.get("ci_low", 0)) / 2)
    return v if float(half) == 0 else f"{v} ±{half}"


def table(summary: list, names, budgets, ruler_tasks) -> str:
    """Markdown: one row per (budget, method): the scores (RULER tasks, then the LongBench
    datasets the summary holds), answer and text fidelity, memory (prompt entries, peak entries
    while decoding, allocated slots, each vs FullKV), compression time; then the paired
    differences to the best uniform rule and PolyKV's gap recovered."""
    get = {(d["method"], d["budget"], d["task"], d["metric"]): d for d in summary}
    scored = scored_tasks([(d["task"], d["metric"]) for d in summary], ruler_tasks)
    cols = [(u, metric, u, "{:.1f}", 1)
            for t, metric in scored for u in (t, t + " later", t + " spread")]
    cols += [
        (t, "dnll", t.replace("answer", "ans ΔNLL"), "{:.3f}", 1)
        for t in ("answer", "answer later", "answer spread")
    ]
    cols += [("fidelity", "kl", "KL", "{:.4f}", 1), ("fidelity", "dnll", "ΔNLL", "{:.4f}", 1),
             ("fidelity", "top1", "top-1 %", "{:.1f}", 1),
             ("memory", "kv_fraction", "prompt KV %", "{:.1f}", 100),
             ("memory", "peak_fraction", "peak KV %", "{:.1f}", 100),
             ("memory", "alloc_fraction", "alloc KV %", "{:.1f}", 100),
             ("time", "compress_s", "compress s", "{:.2f}", 1)]
    present = [c for c in cols if any(k[2:] == c[:2] for k in get)]
    lines = ["| " + " | ".join(["budget", "method"] + [c[2] for c in present]) + " |",
             "|---|---|" + "---|" * len(present)]
    for b in budgets:
        for n in names:
            cells = [
                cell(get.get((n, b, task, metric)), fmt, sc) for task, metric, _, fmt, sc in present
            ]
            lines.append("| " + " | ".join([str(b), n] + cells) + " |")
    lines += diff_lines(summary, names, budgets, ruler_tasks)
    return "\n".join(lines)


def diff_lines(summary, names, budgets, ruler_tasks) -> list:
    """Per budget and headline metric: each method minus the best uniform rule, paired 95 %
    interval, 'tie' when it contains 0; then PolyKV's gap recovered with its interval, or why
    there is none. The best uniform is named as its row (`kvzip`, the head-wise allocation, is
    not `kvzip-uniform`)."""
    out = []
    pairs = [(d["task"], d["metric"]) for d in summary]
    for b in budgets:
        for task, metric, label in headline_metrics(ruler_tasks, pairs):
            rows = [
                d
                for d in summary
                if d["budget"] == b and d["task"] == task and d["metric"] == metric
            ]
            vs = [d for d in rows if "vs_best" in d and d["method"] != "full"]
            if not vs:
                continue
            best = vs[0]["vs_best"]["rule"]
            parts = [
                f"{d['method']} {d['vs_best']['diff']:+.4g} [{d['vs_best']['ci_low']:+.4g}, "
                f"{d['vs_best']['ci_high']:+.4g}]" + (" tie" if d["vs_best"]["tie"] else "")
                for d in sorted(
                    vs, key=lambda d: names.index(d["method"]) if d["method"] in names else 99
                )
            ]
            out.append(
                f"\nB = {b}, {label} minus the best uniform (row {best}), paired 95 % CI: "
                + "; ".join(parts)
            )
        for d in summary:
            if d["budget"] == b and d["task"] == "gap":
                out.append(f"\n{d['method']} @ {b}, gap recovered on {d['metric']}: "
                           + gap_text(d))
    return out


def gap_text(d: dict) -> str:
    """A gap row as its line says it: the ratio and its interval, over the best uniform's row;
    or why there is none (gap_row): FullKV and the best uniform tie, or their gap is smaller
    than the method's own uncertainty against the best uniform."""
    best = d["best_uniform"]
    if d["value"] is not None:
        return (f"{100 * d['value']:+.1f}% [{100 * d['ci_low']:+.1f}%, {100 * d['ci_high']:+.1f}%]"
                f" (best uniform: row {best})")
    g = d.get("full_gap")
    if g is None:                     # a summary written before full_gap was recorded
        return f"n/a: FullKV and the best uniform (row {best}) score the same, no gap to recover"
    gap = f"full − {best} {g['diff']:+.4g} [{g['ci_low']:+.4g}, {g['ci_high']:+.4g}]"
    if g["ci_low"] <= 0 <= g["ci_high"]:
        return f"n/a: FullKV and the best uniform (row {best}) tie ({gap}), no gap to recover"
    return (f"n/a: the gap to recover ({gap}, best uniform: row {best}) is smaller than "
            f"{d['method']}'s own interval against it (±{d['half']:.4g}): a ratio over it means "
            "nothing")


def progress(rows, item, names, budget, i, n, eta) -> str:
    """One line per item: task, and per method its running score on that task at `budget`."""
    metric = "kl" if item.task == "fidelity" else "score"
    parts = []
    for name in names:
        vs = [r[metric] for r in rows if r["task"] == item.task and r["method"] == name
              and r["budget"] == budget and metric in r]
        if vs:
            parts.append(f"{name} {sum(vs) / len(vs):.3g}")
    return (f"[{i + 1}/{n}] {item.task} #{item.index} T={item.tokens.shape[1]} "
            f"{metric}@{budget}: " + ", ".join(parts) + f" | ETA {eta / 60:.1f} min")


def styles(names, family) -> dict:
    """name -> (colour, marker, line style): every method its own colour and marker; a family
    (family(name) -> "polykv", "gracekv" or anything else) shares a hue, shades of blue for
    PolyKV rows and of red for GraceKV rows; the other methods take distinct colours from a
    qualitative palette without blue or red; FullKV is black."""
    import matplotlib
    hues = {"polykv": matplotlib.colormaps["Blues"], "gracekv": matplotlib.colormaps["Reds"]}
    others = ["tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:gray",
              "tab:olive", "tab:cyan", "gold", "lime", "teal", "indigo", "darkkhaki", "peru",
              "darkgoldenrod", "mediumseagreen", "orchid", "slategray", "yellowgreen", "sienna",
              "turquoise", "darkviolet", "olivedrab", "rosybrown"]
    markers = "osD^vP*Xh<>pd8H+x"
    fam = {n: family(n) for n in names}
    out, k = {}, 0
    for i, n in enumerate(names):
        f = fam[n]
        if n == "full":
            colour = "black"
        elif f in hues:
            members = [m for m in names if fam[m] == f]
            j = members.index(n)
            colour = hues[f](0.9 - 0.55 * j / max(1, len(members) - 1))     # dark -> light
        else:
            colour, k = others[k % len(others)], k + 1
        out[n] = (colour, markers[i % len(markers)], "-" if f in hues else "--")
    return out


def ratio_length(config: dict):
    """The prompt length the plot divides by the budget (a compression ratio), when the run's
    prompts have one length (within 128 tokens: fidelity prompts leave room for their
    continuation); None (plot against the budget) for several lengths or LongBench files."""
    lengths = set((config.get("length") or []) if config.get("tasks") else []) | \
        set((config.get("fidelity_length") or []) if config.get("fidelity_samples", 1) else [])
    one = bool(lengths) and max(lengths) - min(lengths) <= 128 and not config.get("data")
    return max(lengths) if one else None


def name_prefix(name: str) -> str:
    """A method's name up to its first '-' ('gracekv-hole' -> 'gracekv'): plot's default family."""
    return name.split("-")[0]


def plot(summary, names, out, family=name_prefix, length=None):
    """budget_vs_score.png in out: fidelity KL and answer ΔNLL against the budget (or, given the
    prompt `length`, the compression ratio length / budget), per method, with the 95 % interval
    as a band (`styles`); one row of panels per protocol in the summary, a panel per measure the
    run has. Returns the figure; evaluate.py checks for matplotlib first."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    style = styles(list(names), family)
    protocols = list(dict.fromkeys(protocol(d) for d in summary)) or ["prompt"]
    panels = [
        (t, m, label)
        for t, m, label in [("fidelity", "kl", "fidelity KL (lower is better)"),
                            ("answer", "dnll", "answer ΔNLL (lower is better)")]
        if any(d["task"] == t and d["metric"] == m for d in summary)
    ] or [
        ("fidelity", "kl", "fidelity KL (lower is better)")
    ]  # a run without one has no panel
    fig, grid = plt.subplots(
        len(protocols), len(panels), figsize=(6 * len(panels), 4.5 * len(protocols)), squeeze=False
    )
    for axes, proto in zip(grid, protocols):
        for ax, (task, metric, label) in zip(axes, panels):
            for n in names:
                pts = sorted(
                    (length / d["budget"] if length else d["budget"], d["value"], d["ci_low"],
                     d["ci_high"])
                    for d in summary
                    if d["method"] == n
                    and d["task"] == task
                    and d["metric"] == metric
                    and protocol(d) == proto
                )
                if pts and n != "full":
                    b, v, lo, hi = zip(*pts)
                    colour, marker, ls = style[n]
                    ax.plot(b, v, marker=marker, ls=ls, color=colour, label=n)
                    ax.fill_between(b, lo, hi, color=colour, alpha=0.12)
            ax.set_xscale("log", base=2)
            if metric == "kl":
                ax.set_yscale("log")
            ax.set_xlabel(f"compression ratio ({length} tokens / budget)" if length else
                          "budget (entries per layer and KV head)")
            ax.set_title(f"{label} · protocol {proto}" if len(protocols) > 1 else label)
        axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "budget_vs_score.png", dpi=120)
    print(f"plot: {out / 'budget_vs_score.png'}")
    return fig


def main(argv=None):
    """`python -m engine.report OUT/summary.json [--methods a,b] [--budgets 128,512] [--protocol P]
    [--no-diff] [--versus METHOD] [--before SUMMARY] [--plot]`: the table of a finished run again,
    for a subset of its
    rows (one protocol: the run's first unless named); --versus
    reads the per-sample rows beside it (OUT/samples*.jsonl) and prints each method minus METHOD
    (lines, then a Markdown table),
    --leaders the leader of each measure and who ties it (lines, then a Markdown table);
    --verdicts M1,M2 where each of those methods stands in each setting (leads, ties, trails);
    --across SUMMARY2 [--across SUMMARY3]: the leaders of this run and of the others in one
    table, every protocol of each (and nothing else);
    --before each method minus itself in another run of the same prompts (paired lines);
    --with DIR: a run that pairs with another's rows (the same prompts, the other methods computed
    there) reads that folder's per-sample rows of the methods it does not compute itself, by
    key, never copied;
    --plot redraws OUT/budget_vs_score.png for those rows (a paper's rows: the name before the
    first "-")."""
    ap = cli.ArgumentParser(description="Print the table of a finished run (its summary.json).")
    ap.add_argument("summary")
    ap.add_argument("--with", dest="paired", action="append", default=[], metavar="DIR",
                    help="another run folder whose per-sample rows this run pairs with (by key)")
    ap.add_argument("--methods", default=None,
                    help="comma list of the run's methods (default: all)")
    ap.add_argument("--budgets", type=cli.int_list, default=None,
                    help="comma list of the run's budgets (default: all)")
    ap.add_argument("--protocol", default=None,
                    help="the protocol whose rows to show (default: the run's first)")
    ap.add_argument(
        "--no-diff", action="store_true", help="leave out the differences and gap lines"
    )
    ap.add_argument(
        "--versus", default=None, help="each method minus this one, from OUT/samples*.jsonl"
    )
    ap.add_argument(
        "--leaders",
        action="store_true",
        help="per budget and headline metric, the leading method "
        "and every other minus it (paired intervals), from OUT/samples*.jsonl",
    )
    ap.add_argument(
        "--verdicts",
        default=None,
        metavar="M1,M2",
        help="comma list of methods: per method, the settings (budget, headline metric) it "
        "leads, ties and trails (paired intervals against the leader), from OUT/samples*.jsonl",
    )
    ap.add_argument(
        "--across",
        action="append",
        default=[],
        metavar="SUMMARY",
        help="another run's summary.json: print the leaders of this run and of each one given in "
        "one table, a column per run and budget, a row per measure and protocol",
    )
    ap.add_argument(
        "--before",
        default=None,
        help="another run's summary.json (the same prompts, e.g. the code before a change): each "
        "method minus itself there, from both folders' samples*.jsonl",
    )
    ap.add_argument(
        "--plot",
        action="store_true",
        help="redraw budget_vs_score.png beside the summary (matplotlib): "
        "one row of panels per protocol of the run, against the compression ratio at one length",
    )
    a = ap.parse_args(argv)
    d = read_summary(a.summary)
    cfg = run_config(d, a.summary)
    names = pick("--methods", cli.split_names(a.methods, "--methods") if a.methods else None,
                 cfg["methods"])
    budgets = pick("--budgets", a.budgets, cfg["budgets"])
    run = cfg.get("protocols") or ["prompt"]
    proto = a.protocol or run[0]
    if proto not in run:
        raise UsageError(f"--protocol {proto!r}: the run has {', '.join(run)}")
    if a.across:
        runs = [(a.summary, cfg)] + [(f, run_config(read_summary(f), f)) for f in a.across]
        print(leaders_across([(f, samples_beside(f, "--across"), c) for f, c in runs], names))
        return
    rows = [r for r in d["rows"] if r["method"] in names and r["budget"] in budgets
            and protocol(r) == proto]
    md = table(rows, names, budgets, cfg["tasks"])
    print(md.split("\n\n")[0] if a.no_diff else md)
    judged = pick("--verdicts", cli.split_names(a.verdicts, "--verdicts"), names) \
        if a.verdicts else []
    if a.versus or a.leaders or a.before or judged:
        flag = "--versus" if a.versus else "--leaders" if a.leaders else \
            "--before" if a.before else "--verdicts"
        samples = [r for r in samples_beside(a.summary, flag) if protocol(r) == proto]
        samples += paired_rows(a.paired, samples, proto)
        if a.versus and a.versus not in {r["method"] for r in samples}:
            raise UsageError(f"--versus {a.versus!r}: no such method in the per-sample rows")
        if a.versus:
            print("\n" + "\n\n".join(versus(samples, a.versus, names, budgets, cfg["tasks"])))
            print(
                "\n"
                + versus_table(samples, a.versus, names, budgets, cfg["tasks"], ratio_length(cfg))
            )
        if a.before:
            before = [r for r in samples_beside(a.before, "--before") if protocol(r) == proto]
            print("\n" + "\n".join(before_after(samples, before, names, budgets, cfg["tasks"])))
        if a.leaders:
            print("\n" + "\n".join(leaders(samples, names, budgets, cfg["tasks"])))
            print("\n" + leaders_table(samples, names, budgets, cfg["tasks"], ratio_length(cfg)))
        if judged:
            print("\n" + "\n".join(verdicts(samples, judged, names, budgets, cfg["tasks"],
                                             ratio_length(cfg))))
    if a.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib (pip install matplotlib)") from None
        every = [r for r in d["rows"] if r["method"] in names and r["budget"] in budgets]
        plot(every if a.protocol is None else rows, names, Path(a.summary).parent,
             length=ratio_length(cfg))


def leaders_across(runs: list, names) -> str:
    """The leaders of several runs in one Markdown table (the 2K and 8K references side by
    side): a column per run and budget ('reference-8k 64 (125×)': the run's folder, the budget
    and its ratio to the run's longest prompt), a row per headline measure and protocol
    ('answer ΔNLL, `context`'; one row 'every protocol' where, run by run, every protocol
    it has gives the same cell, as the fidelity passages do), a cell as `leaders_table`'s;
    blank where a run lacks the measure or the protocol. runs: [(summary path, per-sample rows,
    config)]; names: the methods to rank (each run ranks those it has)."""
    cols, got = [], {}
    for path, rows, cfg in runs:
        run = Path(path).parent.name
        lengths = (cfg.get("length") or []) + (cfg.get("fidelity_length") or [])
        ranked = [m for m in names if m in cfg["methods"]]
        for proto in cfg.get("protocols") or ["prompt"]:
            mine = [r for r in rows if protocol(r) == proto]
            for one in leading(mine, ranked, cfg["budgets"], cfg["tasks"]):
                got[(one["label"], proto, run, one["budget"])] = one
        cols += [(run, b, f"{run} {budget_label(b, max(lengths) if lengths else None)}")
                 for b in cfg["budgets"]]
    lines = ["| measure | " + " | ".join(c[2] for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    protocols = list(dict.fromkeys(k[1] for k in got))
    for label in dict.fromkeys(k[0] for k in got):
        per = {}                                    # protocol -> its cells, where it has one
        for proto in protocols:
            cells = [leader_cell(got.get((label, proto, run, b))) for run, b, _ in cols]
            if any(cells):
                per[proto] = cells
        # one row where, column by column, every protocol a run has gives the same cell
        columns = [{c[i] for c in per.values() if c[i]} for i in range(len(cols))]
        if len(per) > 1 and all(len(c) <= 1 for c in columns):
            per = {"every protocol": [next(iter(c), "") for c in columns]}
        for proto, cells in per.items():
            name = proto if proto == "every protocol" else f"`{proto}`"
            lines.append(f"| {label}, {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def read_summary(path) -> dict:
    """A summary.json's JSON, or a UsageError saying why it cannot be read."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {str(path)!r}: {e}") from None


def samples_beside(path, flag: str) -> list:
    """The per-sample rows beside a summary.json (samples*.jsonl), or a UsageError naming the
    option (`flag`) that needs them."""
    files = sorted(Path(path).parent.glob("samples*.jsonl"))
    if not files:
        raise UsageError(f"{flag} needs the per-sample rows beside {str(path)!r} (samples*.jsonl)")
    return [r for f in files for r in read_rows(f, repair=False, need=ROW_KEY)]


def paired_rows(folders, mine: list, proto: str) -> list:
    """The per-sample rows of each folder in `folders` (another run of the same prompts) that
    pair with this run's rows `mine`: of protocol `proto`, of a method this run does not compute
    itself (its own rows, finished or not, are never mixed with another code's), under a key it
    has not. The rows a run pairs with, read where they were computed, never copied."""
    if not folders:
        return []
    have = {r["key"] for r in mine}
    own = {r["method"] for r in mine}
    out = []
    for folder in folders:
        files = sorted(Path(folder).glob("samples*.jsonl"))
        if not files:
            raise UsageError(f"--with {folder!r}: no per-sample rows there (samples*.jsonl)")
        for f in files:
            for r in read_rows(f, repair=False, need=ROW_KEY):
                if r["method"] not in own and r["key"] not in have and protocol(r) == proto:
                    have.add(r["key"])
                    out.append(r)
    return out


def run_config(d, path) -> dict:
    """The config of a summary.json as evaluate.py writes it ({"config": {...}, "rows": [...]}),
    or a UsageError saying what the file lacks."""
    if not isinstance(d, dict) or not isinstance(d.get("config"), dict) \
            or not isinstance(d.get("rows"), list):
        raise UsageError(f"{path!r} is not a summary.json of evaluate.py (a JSON object with "
                         "'config' and 'rows')")
    lacking = [k for k in ("methods", "budgets", "tasks")
               if not isinstance(d["config"].get(k), list)]
    if lacking:
        raise UsageError(f"{path!r}: its config lacks {', '.join(lacking)}")
    return d["config"]


def pick(option: str, asked, run: list) -> list:
    """The subset `asked` of the run's values (None: all of them), or a UsageError naming the
    values the run does not have."""
    if asked is None:
        return run
    unknown = [v for v in asked if v not in run]
    if unknown:
        raise UsageError(f"{option}: the run has no {', '.join(map(str, unknown))}; it has "
                         f"{', '.join(map(str, run))}")
    return asked


if __name__ == "__main__":
    cli.run(main)
