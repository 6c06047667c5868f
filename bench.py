"""What compression costs next to the prefill (SPEC.md §7): one prompt, every method, wall times.

`python bench.py` on the embedded model: a 2,048-token natural-text prompt (the fidelity suite's
first), median of `--repeat` runs of
- the plain FullKV prefill;
- the prefill with the statistics one method observes (H2O's column sums, SnapKV's window,
  TOVA's last row; GraceKV's probes and multi-hop value flow);
- the compression itself (scores + selection + gather; GraceKV: slots, trees, greedy, assembly),
  at each `--budget`.
Figures, not tests: the numbers depend on the machine and its load.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import evaluate as E
import methods as MT
import model as M
import tasks as TK


def timed(fn, repeat: int):
    """(median seconds, last result) over `repeat` calls."""
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


@torch.no_grad()
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--budget", default="128,512")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    budgets = [int(b) for b in args.budget.split(",")]
    m, tok = M.load(args.model)
    x = torch.tensor([TK.fidelity_text(tok, args.length, 1, 0, 0)[0]], device=m.device)   # (1, T)
    T = x.shape[1]
    print(f"model {m.config.n_layers} layers · T = {T} · {torch.get_num_threads()} threads · "
          f"device {m.device} · median of {args.repeat}")
    M.prefill(m, x)                                                           # warm-up, untimed
    t_full, _ = timed(lambda: M.prefill(m, x), args.repeat)
    rows = [("full", t_full, {})]
    made = E.Methods(m, None, args)
    for name in [n for n in E.DEFAULT_METHODS if n not in ("full", "random", "polykv")]:
        ms = {b: made.get(name, b) for b in budgets}
        t_obs, (full, obs) = timed(lambda: MT.observe_for(m, x, [ms[budgets[0]]]), args.repeat)
        rows.append((name, t_obs, {b: timed(lambda: ms[b].compress(m, full, obs), args.repeat)[0]
                                   for b in budgets}))
    print("| method | prefill + statistics s | " + " | ".join(f"compress s @ {b}" for b in budgets) + " |")
    print("|---|---|" + "---|" * len(budgets))
    for name, t, comp in rows:
        cells = " | ".join(f"{comp[b]:.3f}" if b in comp else "–" for b in budgets)
        print(f"| {name} | {t:.2f} | {cells} |")


if __name__ == "__main__":
    try:
        main()
    except M.UsageError as e:
        raise SystemExit(f"error: {e}")
