"""The benchmark: every method against FullKV at one or several budgets, offline.

`python evaluate.py --budget 512` runs the default suite on the embedded model and prints one
Markdown table (rows = methods, columns = tasks). Suites (docs/protocol.md, data from
support/tasks.py):
- fidelity: natural-text prompts, compressed, then the real next tokens teacher-forced;
  KL(FullKV ‖ method) of the next-token distributions, ΔNLL vs FullKV, top-1 agreement.
- RULER-style retrieval: greedy answers scored with `string_match_all`, and *answer fidelity*:
  the gold answer teacher-forced after the answer prefix, its ΔNLL and KL vs FullKV.
- LongBench (`--data DIR`): greedy answers scored with the official metrics.

Protocols (`--protocol`, several at once; engine/protocols.py): `prompt` (SnapKV / PyramidKV /
KVCache-Factory, the default): the whole prompt is prefilled with full attention, then compressed
once and charged; so the first generated token is always predicted from full attention,
identically for every method, and only later tokens see the compressed cache. `context`: the
same prefill, but only the context between the prompt's prefix and question is compressed and
charged; prefix and question stay exact and free. `agnostic`: prefix + context are prefilled and
compressed without the question, which is then fed to every cache (FullKV's too) and appended.
Every row records its protocol; the summary and table are per protocol. All methods and
protocols of one sample share one prefill (and its attention statistics; agnostic's are read over
the rows and keys before the question: engine/observe.observe_prefixes); each method costs only its
compression and decoding. Teacher-forced distributions count from the first continuation token
(predicted from the last logits of the prompt) on.

A fair comparison (docs/protocol.md):
- Equal memory (`--memory equal`, the default): every method may grow by the tokens that follow
  the prompt (under context / agnostic also by the free prefix and question); a policy's decode
  budgets are its prefill budgets plus that allowance, so an
  evicting decode rule (TOVA, H2O, StreamingLLM, PolyKV's) evicts only beyond it and every
  method's peak equals its prompt cache plus the same tokens. Each row records the prompt cache
  after compression (`kv_fraction`), the peak real entries while teacher-forcing
  (`peak_fraction`) and the peak allocated slots, padding included (`alloc_fraction`), each
  relative to FullKV after the same tokens. `--memory budget` is the papers' protocol (evicting
  decode rules hold their prompt budget).
- Same numerical path: FullKV and every method of an item are teacher-forced the same way — in
  one step, or token by token for all when some method's decoder evicts within the continuation.
- Intervals: each mean gets a paired bootstrap 95 % interval over prompts (engine/compare.py), and
  each method's difference to the best uniform rule its own (the summary: engine/report.py).
- Splits: `--split test` (default) scores the test passages (even topics) and RULER seeds
  + 1000; `--split dev` the dev passages (odd topics, where calibration reads too) and the
  seeds as given. Defaults are chosen on dev, tables reported on test.
- `--suite reference`: 32 fidelity prompts (1,792 tokens, disjoint passages) and 32
  `niah_single_1` prompts at budgets 64, 128, 512 and 1024, the default methods plus PolyKV's
  joint calibration and its ablations: the README's headline run.

PolyKV's rows use a calibrated policy: `--policy FILE`, else one calibration per budget and
procedure on 2,048-token dev prompts whatever --length is (`--calibration-length T` for others),
cached in --cache-dir under a name that says budget, procedure, seed and length. For the
embedded model the repository ships those of B = 64, 128 and 512 (policies/), read where
--cache-dir has none; `--recalibrate` calibrates again.

`torchrun --nproc_per_node N evaluate.py ...` shards the items over N processes (gloo on CPU,
nccl on GPU, one GPU per rank): rank 0 calibrates, the items left to do are dealt round-robin,
rank r appends to OUT/samples.rank{r}.jsonl, and rank 0 merges every samples*.jsonl into the
same summary one process writes.

Every finished (method, budget, sample) is appended and flushed to OUT/samples.jsonl; a rerun
with the same arguments skips what is there (a torn last line, from a run killed while writing,
is dropped with a warning and recomputed). OUT/summary.json (flat rows for scripts) and
OUT/summary.md (the table) are written at the end. OUT/run.json records the settings that
define the rows: a rerun or --report whose settings would change or relabel them refuses, one
that adds methods, budgets or prompts resumes (engine/run_folder.py). A run holds its folder
alone (a second run into it refuses), every row carries its seed, split and a digest of its
settings, and a row without a field its prompt measures, or with a value that is not a finite
number, is refused, never summarized over fewer prompts.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
from pathlib import Path

import torch

import calibrate
import model as M
from engine import harness as H
from engine import longbench as LB
from engine import report, run_folder
from engine.fast import SPEED
from support import cli
from support.errors import UsageError
from support.files import read_rows, write_atomic


# ----------------------------------------------------------------------------- main

def distributed(args):
    """(rank, world size): under `torchrun --nproc_per_node N evaluate.py ...` each rank joins
    one process group (gloo on CPU, nccl on GPU: rank r uses cuda:LOCAL_RANK); else (0, 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist
    gpu = torch.cuda.is_available() and (args.device or "cuda").startswith("cuda")
    if gpu:
        args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    dist.init_process_group("nccl" if gpu else "gloo")
    return dist.get_rank(), world


def barrier(world):
    if world > 1:
        import torch.distributed as dist
        dist.barrier()


def main(argv=None):
    args = H.parse(argv)
    with contextlib.ExitStack() as held:      # the run folder's lock, dropped however it ends
        return execute(args, held)


def execute(args, held: contextlib.ExitStack):
    """The run of parsed args: check the folder, compute what is missing, summarize. Rank 0 of a
    run that writes holds the folder's lock (run_folder.lock) in `held`: from the start when the
    folder exists, else from when it is made (then it must still hold no rows: a run that made
    and filled it meanwhile is refused, its rows untouched)."""
    t_start = time.time()
    rank, world = distributed(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    m, tok = M.load(args.model, device=args.device, dtype=dtype, speed=SPEED)
    torch.manual_seed(args.seed)
    keyed = {
        k: getattr(args, k)
        for k in ("model_name", "tasks", "length", "samples", "fidelity_length", "fidelity_samples",
                  "cont_len", "max_new_tokens", "data", "policy", "seed", "split", "memory")
    }
    keyed["dtype"] = str(m.dtype)
    # (absent by default: earlier runs keep their folders)
    if args.greedy is not None:
        keyed["greedy"] = args.greedy
    if args.calibration_length != calibrate.PROMPT_LEN:                 # (likewise)
        keyed["calibration_length"] = args.calibration_length
    digest = hashlib.sha1(json.dumps(keyed, sort_keys=True).encode()).hexdigest()
    out = Path(args.out or f"runs/{args.model_name}-{digest[:8]}")
    # the folder M.load checked (the embedded one: converted and completed once per command)
    args.model_dir = Path(args.model) if args.model else M.default_model_dir()
    model_files = run_folder.model_files(args.model_dir, tok.has_chat_template)
    fixed, grid = run_settings(args, str(m.dtype), run_folder.sha256(model_files)), run_grid(args)
    writer = rank == 0 and not args.report
    locked = writer and out.is_dir()
    if locked:                            # one writer per folder, before its rows are read
        held.enter_context(run_folder.lock(out))
    rows = read_folder_rows(out, repair=writer)
    recorded = run_folder.check(out, fixed, {"data": args.data, "policy": args.policy}, grid,
                                LEGACY_DEFAULTS, args.report, rows)
    spent = run_folder.wall(recorded, out)   # what the folder's rows cost so far (None: unknown)
    config = {**keyed, "budgets": args.budget, "methods": args.methods, "protocols": args.protocol,
              "device": str(m.device), "out": str(out)}
    if rank == 0:
        print("config: " + json.dumps(config), flush=True)
        print(f"output folder: {out}", flush=True)
    items = H.build_items(tok, args, m)
    args.allowance = H.run_allowance(args, items)
    check_rows(rows, items, args, out)
    done = {r["key"] for r in rows}
    def every(it):       # every row key the run asks of an item
        return {k for n in args.methods for b in args.budget for p in args.protocol
                for k in H.keys(n, b, it, p)}
    if args.report:                       # the prompts every row of which is there, nothing run
        finished = [it for it in items if every(it) <= done]
        wanted = set().union(*map(every, finished))
        rows = [r for r in rows if r["key"] in wanted]
        config["prompts"] = f"{len(finished)} of {len(items)} (--report)"
        return summarize(args, config, out, rows, m, rows_cost(rows) if spent is None else spent)
    barrier(world)                        # every rank has read the files before any appends
    methods = H.Methods(m, tok, args)
    for turn in (0, 1):                   # PolyKV calibrates here, once (rank 0), before the loop
        if (rank == 0) == (turn == 0):
            for b in args.budget:
                for n in args.methods:
                    methods.get(n, b)
        barrier(world)
    # the items left to do, sample 0 of every suite first, then sample 1, ... (a run stopped early
    # has as many prompts of each suite), dealt round-robin to the ranks; each rank appends to its
    # own file
    items = sorted(items, key=lambda it: it.index)
    todo = [it for it in items if not every(it) <= done]
    spent = rows_cost(rows) if spent is None else spent
    make_folder(out)                      # every check passed: the folder records this run
    if writer and not locked:             # made here: held from now on, still empty
        held.enter_context(run_folder.lock(out))
        if rows != read_folder_rows(out, repair=False) or (out / run_folder.SETTINGS).exists():
            raise UsageError(f"another run wrote into {str(out)!r} while this one started: rerun "
                             "the command (it resumes from the rows there)")
    if rank == 0:
        note = run_folder.record(out, recorded, fixed, grid, run_folder.code_version(),
                                 adds_rows=bool(todo), had_rows=bool(rows), wall_s=spent)
        if note:
            print(note, flush=True)
    mine = {id(it) for it in todo[rank::world]}
    jsonl = out / ("samples.jsonl" if world == 1 else f"samples.rank{rank}.jsonl")
    labels = run_folder.labels(fixed)
    t0, n_run = time.time(), 0
    with open(jsonl, "a") as f:
        for i, item in enumerate(items):
            if id(item) not in mine:
                continue
            new = [
                {**r, **({"metric": item.sample.metric} if item.sample is not None else {}),
                 **labels}
                for r in H.run_item(
                    m, tok, methods, args.methods, args.budget, item, done, args.protocol
                )
                # a partly finished item: its missing rows only
                if r["key"] not in done
            ]
            f.write("".join(row_line(r, item) + "\n" for r in new))
            f.flush()
            rows += new
            done |= {r["key"] for r in new}
            n_run += 1
            if rank == 0:                 # the time the rows cost, kept past a kill
                run_folder.spent(out, spent + time.time() - t_start)
            eta = (time.time() - t0) / n_run * (len(mine) - n_run)
            print(
                ("" if world == 1 else f"rank {rank} ")
                + report.progress([r for r in rows if report.protocol(r) == args.protocol[0]], item,
                                  args.methods, args.budget[0], i, len(items), eta),
                flush=True,
            )
    barrier(world)
    if rank != 0:
        return
    rows = read_folder_rows(out, repair=False)
    config["prompts"] = str(len(items))
    if todo:
        spent += time.time() - t_start
        run_folder.spent(out, spent)
    summarize(args, config, out, rows, m, spent)


# the fields of every row (the key's parts, the prompt's length, the memory and time measures)
ROW_FIELDS = ("key", "method", "budget", "task", "length", "index", "n_tokens", "kv_fraction",
              "compress_s", "prefill_s")
# what a teacher-forced question adds, and a greedy answer
FORCED = ("kl", "dnll", "top1", "peak_fraction", "alloc_fraction")
ANSWERED = ("pred", "score")


def read_folder_rows(out: Path, repair: bool) -> list:
    """The rows of every OUT/samples*.jsonl, each holding ROW_FIELDS (support/files.read_rows;
    repair: cut a torn last line, done by the run that holds the folder)."""
    return [r for f in sorted(out.glob("samples*.jsonl"))
            for r in read_rows(f, repair=repair, need=ROW_FIELDS)]


def check_rows(rows, items, args, out: Path):
    """A UsageError naming the first row of this run's prompts that lacks a measure its question
    takes (FORCED where a continuation or gold answer is teacher-forced; ANSWERED where the
    answer is generated, --greedy) or holds one that is not a finite number: summarized, it
    would silently count one prompt fewer, or raise."""
    need = {}
    for it in items:
        greedy = args.greedy is None or it.task in args.greedy
        questions = [(it.target, it.sample)] + [(gold, smp) for _, smp, gold in it.turns]
        for turn, (target, sample) in enumerate(questions):
            fields = (FORCED if target is not None else ()) + \
                (ANSWERED if sample is not None and greedy else ())
            for n in args.methods:
                for b in args.budget:
                    for p in args.protocol:
                        need[H.result_key(n, b, it, p, turn)] = fields
    for r in rows:
        bad = [k for k in need.get(r["key"], ()) if k not in r or
               (k != "pred" and not finite(r[k]))]
        if bad:
            raise UsageError(f"the row {r['key']!r} of {str(out)!r} lacks a finite "
                             f"{', '.join(bad)}: delete its line from samples*.jsonl (its row "
                             "is then computed again)")


def finite(x) -> bool:
    """x is a finite number (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def row_line(r: dict, item) -> str:
    """A row as its JSONL line: strict JSON (a NaN or infinity is refused, never written bare)."""
    try:
        return json.dumps(r, allow_nan=False)
    except ValueError:
        bad = [k for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)]
        raise UsageError(f"{item.task} #{item.index}: {r['method']} at {r['budget']} measured "
                         f"{', '.join(f'{k}={r[k]}' for k in bad)}: not a finite number; nothing "
                         "written for this prompt") from None


def rows_cost(rows) -> float:
    """The seconds the rows themselves record, for a folder that never recorded its wall time: each
    prompt's shared prefill once and every row's compression (a lower bound: decoding is not
    timed per row)."""
    prefill = {(r["task"], r["length"], r["index"], report.protocol(r) == "agnostic"):
               r["prefill_s"] for r in rows}
    return sum(prefill.values()) + sum(r["compress_s"] for r in rows)


LEGACY_DEFAULTS = {"greedy": None, "calibration_length": calibrate.PROMPT_LEN}


def run_settings(args, dtype: str, model_sha256: str) -> dict:
    """The settings that define this run's rows (engine/run_folder.py: FIXED): the model by
    name and by the hash of its files, and every option that changes a row's prompt or answer."""
    return {"model": args.model_name, "model_sha256": model_sha256,
            "dtype": dtype, "split": args.split, "seed": args.seed,
            "cont_len": args.cont_len, "max_new_tokens": args.max_new_tokens,
            "greedy": args.greedy, "memory": args.memory,
            "calibration_length": args.calibration_length,
            "data_sha256": run_folder.sha256(LB.dataset_files(args.data)) if args.data else None,
            "policy_sha256": run_folder.sha256([args.policy]) if args.policy else None}


def run_grid(args) -> dict:
    """What this run asks for that adds rows under keys of their own (engine/run_folder.py)."""
    return {"methods": args.methods, "budgets": args.budget, "protocols": args.protocol,
            "tasks": args.tasks, "length": args.length, "fidelity_length": args.fidelity_length,
            "samples": args.samples, "fidelity_samples": args.fidelity_samples}


def make_folder(out: Path):
    """Create the run folder (and its parents), or say in one line why it cannot be."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {str(out)!r}: cannot create the folder ({e.strerror})") from None
    if not os.access(out, os.W_OK):
        raise UsageError(f"--out {str(out)!r}: the folder is not writable")


# printed under a table with `agnostic` beside another protocol (docs/protocol.md)
KL_ACROSS_PROTOCOLS = (
    "Answer KL and ΔNLL compare within a protocol, not across: under prompt and context the "
    "answer's first token is scored on the full prefill's last logits (FullKV's own, KL 0), "
    "under agnostic on the compressed cache after the question is fed.")


def summarize(args, config, out, rows, m, wall_s: float):
    """summary.json, summary.md (+ the plot) of a run's per-sample rows, one table per protocol;
    wall_s: the seconds the folder's rows cost (run_folder.wall, a resume's and --report's
    too)."""
    summary = []              # per protocol
    for p in args.protocol:
        mine = [r for r in rows if report.protocol(r) == p]
        summary += [
            {**d, "protocol": p}
            for d in report.summarize(mine, args.methods, args.budget, H.baselines(),
                                      [n for n in args.methods if H.family(n) == "polykv"])
        ]
    config["wall_s"] = round(wall_s, 1)
    # one observation per prompt serves every protocol; rows written before it was so record
    # an own pass for `agnostic` (without the question): each kind is averaged on its own
    seen = {"shared": {}, "agnostic": {}}
    for r in rows:
        if "prefill_s" in r:
            kind = "agnostic" if report.protocol(r) == "agnostic" else "shared"
            seen[kind][(r["task"], r["length"], r["index"])] = r["prefill_s"]
    mean = {kind: round(sum(v.values()) / len(v), 2) for kind, v in seen.items() if v}
    config["prefill_s"] = mean.get("shared", mean.get("agnostic", 0.0))
    if len(mean) == 2 and mean["agnostic"] != mean["shared"]:
        config["prefill_agnostic_s"] = mean["agnostic"]
    if args.report:                   # a summary is never replaced by one with fewer rows
        lost = run_folder.lost(run_folder.read_summary(out).get("rows", []), summary)
        if lost:
            more = f" and {len(lost) - 1} more" if len(lost) > 1 else ""
            raise UsageError(f"--report would replace {str(out / 'summary.json')!r} with fewer "
                             f"rows ({lost[0]}{more}); nothing written")
    write_atomic(out / "summary.json", json.dumps({"config": config, "rows": summary}, indent=1))
    header = (
        f"model {args.model_name} · device {m.device} · dtype {m.dtype} · seed {args.seed} · "
        f"split {args.split} · memory {args.memory} · "
        f"RULER {','.join(args.tasks) or '–'} at {args.length} × {args.samples} · fidelity "
        f"{args.fidelity_length} × {args.fidelity_samples} (+{args.cont_len}) · "
        + (f"LongBench {args.data} · " if args.data else "")
        + f"prompts {config['prompts']} · "
        f"wall {config['wall_s']} s · shared prefill "
        f"{config['prefill_s']} s per prompt"
        + (
            f" (agnostic's own {config['prefill_agnostic_s']} s)"
            if "prefill_agnostic_s" in config
            else ""
        )
    )
    tables = [
        (f"protocol {p}\n\n" if len(args.protocol) > 1 else "")
        + report.table(
            [d for d in summary if d["protocol"] == p], args.methods, args.budget, args.tasks
        )
        for p in args.protocol
    ]
    md = header + f" · protocol {','.join(args.protocol)}\n\n" + "\n\n".join(tables)
    if len(args.protocol) > 1 and "agnostic" in args.protocol and args.tasks:
        md += "\n\n" + KL_ACROSS_PROTOCOLS
    write_atomic(out / "summary.md", md + "\n")
    print("\n" + md)
    if args.plot:
        report.plot(summary, args.methods, out, H.family, length=report.ratio_length(config))


ON_CTRL_C = "interrupted: finished samples are in samples.jsonl; rerun the same command to resume"

if __name__ == "__main__":
    cli.run(main, ON_CTRL_C)
