"""The benchmark's report: flat summary rows, the Markdown table, PolyKV's gap recovered, the
progress line and the budget-vs-score plot (SPEC.md §6). Pure functions of the per-sample rows
that evaluate.py writes to samples.jsonl.
"""
from __future__ import annotations

import rules

# the uniform baselines a PolyKV row is compared with: every registered rule and PyramidKV
BASELINES = tuple(n for n, r in rules.RULES.items() if r.pool) + ("pyramidkv",)


def summarize(rows: list, names, budgets) -> list:
    """Flat summary rows {method, budget, task, metric, value, n} (means over samples)."""
    acc = {}
    for r in rows:
        task = r["task"]
        vals = {}
        if task == "fidelity":
            vals = {m: r[m] for m in ("kl", "dnll", "top1")}
        else:
            if "score" in r:
                vals[r.get("metric", "string_match_all")] = r["score"]
            if "kl" in r:   # answer fidelity over all RULER samples
                for m in ("kl", "dnll"):
                    acc.setdefault((r["method"], r["budget"], "answer", m), []).append(r[m])
        for m, v in vals.items():
            acc.setdefault((r["method"], r["budget"], task, m), []).append(v)
        acc.setdefault((r["method"], r["budget"], "memory", "kv_fraction"), []).append(r["kv_fraction"])
        if "compress_s" in r:
            acc.setdefault((r["method"], r["budget"], "time", "compress_s"), []).append(r["compress_s"])
    out = [{"method": k[0], "budget": k[1], "task": k[2], "metric": k[3],
            "value": round(sum(v) / len(v), 4), "n": len(v)} for k, v in acc.items()]
    order = {n: i for i, n in enumerate(names)}
    return sorted(out, key=lambda d: (d["budget"], order.get(d["method"], 99), d["task"], d["metric"]))


def table(summary: list, names, budgets, ruler_tasks) -> str:
    """Markdown: one row per (budget, method); RULER tasks, their average, answer and text
    fidelity, KV kept. PolyKV rows add the gap recovered vs the best uniform rule."""
    get = {(d["method"], d["budget"], d["task"], d["metric"]): d["value"] for d in summary}
    cols = [(t, "string_match_all", t, "{:.1f}") for t in ruler_tasks]
    cols += [("ruler_avg", None, "RULER avg", "{:.1f}"), ("answer", "dnll", "ans ΔNLL", "{:.3f}"),
             ("fidelity", "kl", "KL", "{:.4f}"), ("fidelity", "dnll", "ΔNLL", "{:.4f}"),
             ("fidelity", "top1", "top-1 %", "{:.1f}"), ("memory", "kv_fraction", "KV kept %", "{:.1f}"),
             ("time", "compress_s", "compress s", "{:.2f}")]
    lines = ["| budget | method | " + " | ".join(c[2] for c in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for b in budgets:
        for n in names:
            cells = []
            for task, metric, _, fmt in cols:
                if task == "ruler_avg":
                    vs = [get.get((n, b, t, "string_match_all")) for t in ruler_tasks]
                    v = sum(vs) / len(vs) if vs and None not in vs else None
                else:
                    v = get.get((n, b, task, metric))
                    v = 100 * v if v is not None and metric == "kv_fraction" else v
                cells.append("–" if v is None else fmt.format(v))
            lines.append(f"| {b} | {n} | " + " | ".join(cells) + " |")
    lines += gap_lines(get, names, budgets, ruler_tasks)
    return "\n".join(lines)


def gap_lines(get, names, budgets, ruler_tasks) -> list:
    """Gap recovered = (PolyKV − best uniform) / (FullKV − best uniform), per suite (SPEC §6)."""
    out = []
    pool = [n for n in names if n in BASELINES]
    for b in budgets:
        for poly in [n for n in names if n.startswith("polykv")]:
            parts = []
            for label, key, sign in (("fidelity KL", ("fidelity", "kl"), -1),
                                     ("RULER avg", ("ruler", "avg"), 1)):
                def val(n):
                    if key[0] == "ruler":
                        vs = [get.get((n, b, t, "string_match_all")) for t in ruler_tasks]
                        return sum(vs) / len(vs) if vs and None not in vs else None
                    return get.get((n, b) + key)
                vals = {n: val(n) for n in pool if val(n) is not None}
                full, mine = val("full"), val(poly)
                if not vals or full is None or mine is None:
                    continue
                best = max(vals, key=lambda n: sign * vals[n])
                den = full - vals[best]
                gap = "n/a (best uniform = FullKV)" if abs(den) < 1e-12 else f"{100 * (mine - vals[best]) / den:+.1f}%"
                parts.append(f"{label}: {gap} (best uniform {best})")
            if parts:
                out.append(f"\n{poly} @ {b}, gap recovered — " + "; ".join(parts))
    return out


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


def plot(summary, names, out):
    """budget_vs_score.png in out: fidelity KL and answer ΔNLL against the budget, per method."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install matplotlib); no plot written")
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (task, metric, label) in zip(axes, [("fidelity", "kl", "fidelity KL (lower is better)"),
                                                 ("answer", "dnll", "answer ΔNLL (lower is better)")]):
        for n in names:
            pts = sorted((d["budget"], d["value"]) for d in summary
                         if d["method"] == n and d["task"] == task and d["metric"] == metric)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=n)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (entries per layer and KV head)")
        ax.set_title(label)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "budget_vs_score.png", dpi=120)
    print(f"plot: {out / 'budget_vs_score.png'}")
