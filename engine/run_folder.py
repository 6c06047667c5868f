"""A run folder (`evaluate.py --out OUT`) and the promise it keeps: every row in it was computed
under the settings it records.

OUT holds the per-sample rows (`samples*.jsonl`, appended as they finish), the summary
(`summary.json`, `summary.md`) and `run.json`, the settings that define the rows. A row's key
names its method, budget, task, length, prompt index and protocol, not the model, the split or
the seed that decide what the prompt and its answer are: a rerun with another seed would find
every key done and print the old rows under the new seed. So every rerun and `--report` checks
the folder first:

- FIXED settings (the model and the hash of its files, dtype, --split, --seed, --cont-len,
  --max-new-tokens, --greedy, --memory, --calibration-length, the --data and --policy files by
  their hashes): another value would relabel or change finished rows, so the command refuses
  with one line naming each difference, before any work.
- The grid (methods, budgets, protocols, tasks, lengths, sample counts): each new value adds
  rows under keys of their own, so a rerun may add to it and computes only what is missing. A
  rerun or --report asks for at least what summary.json summarizes, so that no summary is
  replaced by one with fewer rows; run.json keeps the union of what was asked.
- The code's version (the git commit) of every run that added rows: recorded, not checked
  [choice: a fix elsewhere in the code leaves the rows as they are; refusing would strand a
  long run at every commit].

A folder written before run.json existed (the committed results/) is checked against what its
summary.json records of the fixed settings (older summaries leave out --greedy and
--calibration-length at their defaults, and hold no hashes), then recorded as it is now.

What keeps those promises when files go missing or are edited:
- Every row carries its seed and split and a digest of all the fixed settings (`labels`), so
  a folder that lost run.json and its summary still refuses a rerun that would relabel its
  rows. A run.json that is not what `record` writes (an edit, a half-copied file) is refused,
  never read as "no settings".
- One writer at a time (`lock`): a run holds an exclusive flock on the folder itself while it
  appends, so a second run into the same --out refuses in one line instead of writing every
  row twice. The kernel drops the lock when its process ends, however it ends: a killed run
  leaves nothing that blocks the next one, and no lock file.
- run.json's `wall_s`: the seconds of the runs that added the folder's rows, summed (each run
  adds its own from its start, updated after every prompt), so a resume or --report keeps the
  time the rows cost.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import subprocess
from contextlib import contextmanager
from pathlib import Path

from support.errors import UsageError
from support.files import read_rows, write_atomic

SETTINGS = "run.json"
FORMAT = "polykv-run/1"
# run.json's fixed settings -> how a refusal names them
FIXED = {"model": "model", "model_sha256": "model files (sha256)", "dtype": "dtype",
         "split": "--split", "seed": "--seed", "cont_len": "--cont-len",
         "max_new_tokens": "--max-new-tokens", "greedy": "--greedy", "memory": "--memory",
         "calibration_length": "--calibration-length", "data_sha256": "--data files (sha256)",
         "policy_sha256": "--policy file (sha256)"}
# a summary.json from before run.json names the --data and --policy files by path
LABELS = {**FIXED, "data": "--data", "policy": "--policy"}
# the grid: lists a rerun may extend, and sample counts it may raise
GRID_LISTS = ("methods", "budgets", "protocols", "tasks", "length", "fidelity_length")
GRID_COUNTS = ("samples", "fidelity_samples")


# ----------------------------------------------------------------------------- what a run is

def sha256(paths) -> str:
    """One hash of the files' names, sizes and contents, in the order given (read in 16 MiB
    chunks: a checkpoint of many GB takes seconds, once per run)."""
    h = hashlib.sha256()
    for p in map(Path, paths):
        h.update(f"{p.name}\0{p.stat().st_size}\0".encode())
        with open(p, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def model_files(folder, chat_template: bool) -> list:
    """The files a run reads its model and its prompts from: config.json, tokenizer.json, the
    weights, and tokenizer_config.json where the tokenizer applies its chat template."""
    folder = Path(folder)
    files = [folder / "config.json", folder / "tokenizer.json"]
    files += sorted(folder.glob("*.safetensors"))
    return files + ([folder / "tokenizer_config.json"] if chat_template else [])


def digest(fixed: dict) -> str:
    """The fixed settings in 12 hex digits (sha256 of their sorted JSON)."""
    return hashlib.sha256(json.dumps(fixed, sort_keys=True).encode()).hexdigest()[:12]


def labels(fixed: dict) -> dict:
    """What every row carries of the settings that made it: seed and split by value (what a
    relabelling rerun most often changes, named in its refusal), all fixed settings by digest."""
    return {"seed": fixed["seed"], "split": fixed["split"], "settings": digest(fixed)}


def code_version() -> str:
    """The git commit of the code that runs, `+changes` when tracked files differ from it;
    "unknown" outside a git checkout."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root,
                              capture_output=True, text=True, check=True).stdout.strip()
        changes = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                 cwd=root, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if changes.strip() else "")


# ----------------------------------------------------------------------------- the checks

def differences(have: dict, asked: dict) -> list:
    """'--seed 0 (asked 7)' for each fixed setting that `have` records and `asked` changes."""
    return [f"{LABELS[k]} {shown(have[k])} (asked {shown(asked[k])})"
            for k in LABELS if k in have and k in asked and have[k] != asked[k]]


def shown(value) -> str:
    """A setting as an error line names it: lists comma-joined, hashes cut to 12 characters."""
    if isinstance(value, list):
        return ",".join(map(str, value)) or "''"
    if isinstance(value, str) and len(value) == 64:
        return value[:12] + "…"
    return str(value)


def legacy_settings(config: dict, defaults: dict) -> dict:
    """The fixed settings a summary.json written before run.json records: its config's values,
    `defaults` for the keys an older config leaves out at their default (greedy,
    calibration_length); the --data and --policy files by path (it holds no hashes)."""
    have = {"model": config.get("model_name")}
    for k in ("dtype", "split", "seed", "cont_len", "max_new_tokens", "memory", "greedy",
              "calibration_length", "data", "policy"):
        if k in config or k in defaults:
            have[k] = config.get(k, defaults.get(k))
    return have


def missing_from(config: dict, grid: dict) -> list:
    """What summary.json summarizes (its config) that `grid` does not ask for: '--methods lacks
    tova', '--samples 2 < 6'. The RULER grid counts only where the summary has RULER prompts,
    the fidelity grid only where it has fidelity prompts."""
    ruler = bool(config.get("tasks")) and config.get("samples", 0) > 0
    fidelity = config.get("fidelity_samples", 0) > 0
    used = {"tasks": ruler, "length": ruler, "samples": ruler,
            "fidelity_length": fidelity, "fidelity_samples": fidelity}
    have = {**config, "protocols": config.get("protocols") or ["prompt"]}
    out = []
    for k in GRID_LISTS:
        lacking = [v for v in have.get(k) or [] if v not in grid[k]]
        if lacking and used.get(k, True):
            out.append(f"{option(k)} lacks {','.join(map(str, lacking))}")
    for k in GRID_COUNTS:
        if used[k] and have.get(k, 0) > grid[k]:
            out.append(f"{option(k)} {grid[k]} < {have[k]}")
    return out


def option(key: str) -> str:
    """The option that sets a grid key: budgets -> --budget, protocols -> --protocol."""
    return "--" + {"budgets": "budget", "protocols": "protocol"}.get(key, key).replace("_", "-")


def check(out: Path, fixed: dict, paths: dict, grid: dict, legacy_defaults: dict,
          report: bool, rows=()) -> dict:
    """Refuse (UsageError, one line) a rerun or --report of `out` whose fixed settings differ
    from the folder's (its run.json; without one, its rows' labels and its summary), or whose
    grid asks for less than its summary holds; --report also needs a folder with rows. paths:
    the --data and --policy paths as given (what a summary from before run.json records of
    them); rows: the folder's rows. Returns the folder's run.json ({} when it has none)."""
    if report and not out.is_dir():
        raise UsageError(f"--out {str(out)!r}: no such run folder (--report summarizes the rows "
                         "of a run; it creates no folder)")
    if report and not any(read_rows(f, repair=False) for f in sorted(out.glob("samples*.jsonl"))):
        raise UsageError(f"--out {str(out)!r} holds no rows (samples*.jsonl) to report")
    recorded = read_record(out)
    summary = read_summary(out)
    config = summary.get("config", {})
    if recorded:
        diff = differences(recorded["settings"], fixed)
    else:                                   # a folder from before run.json: its summary's word
        diff = differences(legacy_settings(config, legacy_defaults) if config else {},
                           {**fixed, **paths}) or relabelled(rows, fixed)
    if diff:
        raise UsageError(f"{str(out)!r} holds rows of other settings: {'; '.join(diff)}; run "
                         "with the folder's settings, or give another --out")
    lacking = missing_from(config, grid) if config else []
    if lacking:
        what = "--report" if report else "this run"
        raise UsageError(f"{str(out / 'summary.json')!r} summarizes more than {what} asks for "
                         f"({'; '.join(lacking)}): ask for at least that (a rerun computes only "
                         "what is missing), or give another --out")
    return recorded


def relabelled(rows, fixed: dict) -> list:
    """What the labels of rows made under other settings than `fixed` say of them ('--seed 0
    (asked 1)'; their settings digest where seed and split agree); rows written before rows
    carried labels are not checked here."""
    mine = labels(fixed)
    other = next((r for r in rows if "settings" in r and r["settings"] != mine["settings"]), None)
    if other is None:
        return []
    named = [f"{FIXED[k]} {shown(other.get(k))} (asked {shown(mine[k])})"
             for k in ("seed", "split") if other.get(k) != mine[k]]
    return named or [f"settings {other['settings']} (asked {mine['settings']}; the folder has no "
                     f"{SETTINGS} to name them)"]


def lost(old: list, new: list) -> list:
    """What a summary `new` would lose of `old` (flat summary rows): each (method, budget, task,
    metric, protocol) that it leaves out or holds over fewer prompts, as 'snapkv at 512 on
    fidelity kl (6 prompts, now 0)'."""
    now = {group(d): d.get("n", 0) for d in new}
    out = []
    for d in old:
        if now.get(group(d), 0) < d.get("n", 0):
            method, budget, task, metric, protocol = group(d)
            where = "" if protocol in (None, "prompt") else f" ({protocol})"
            out.append(f"{method} at {budget} on {task} {metric}{where} "
                       f"({d['n']} prompts, now {now.get(group(d), 0)})")
    return out


def group(d: dict) -> tuple:
    """A flat summary row's group: (method, budget, task, metric, protocol)."""
    return d.get("method"), d.get("budget"), d.get("task"), d.get("metric"), d.get("protocol")


def record(out: Path, recorded: dict, fixed: dict, grid: dict, code: str, adds_rows: bool,
           had_rows: bool, wall_s: float = 0.0) -> str:
    """Write run.json: the fixed settings, the union of the grid asked so far, the code
    version of each run that added rows (a folder that had rows before it had run.json starts
    with "before run.json") and wall_s, the seconds those runs took so far (`spent` adds this
    run's). Returns a note to print when this run's code differs from the code of the rows so
    far, else ""."""
    asked = recorded.get("asked", {})
    union = {k: list(dict.fromkeys([*asked.get(k, []), *grid[k]])) for k in GRID_LISTS}
    union.update({k: max(asked.get(k, 0), grid[k]) for k in GRID_COUNTS})
    codes = list(recorded.get("code", ["before run.json"] if had_rows else []))
    note = ""
    if adds_rows and (not codes or codes[-1] != code):
        if codes:
            note = (f"note: {str(out)!r}: its rows so far come from code {codes[-1]}, this run "
                    f"adds rows from {code} ({SETTINGS} lists both)")
        codes.append(code)
    body = {"format": FORMAT, "settings": fixed, "asked": union, "code": codes,
            "wall_s": round(wall_s, 1)}
    write_atomic(out / SETTINGS, json.dumps(body, indent=1) + "\n")
    return note


def spent(out: Path, wall_s: float):
    """Set run.json's wall_s: the seconds the runs that added the folder's rows took so far."""
    body = json.loads((out / SETTINGS).read_text())
    write_atomic(out / SETTINGS, json.dumps({**body, "wall_s": round(wall_s, 1)}, indent=1) + "\n")


def wall(recorded: dict, out: Path):
    """The seconds the folder's rows cost so far: run.json's wall_s; for a folder from before it
    was recorded, its summary's (a number); else None."""
    for value in (recorded.get("wall_s"), read_summary(out).get("config", {}).get("wall_s")):
        if isinstance(value, (int, float)) and not isinstance(value, bool) and \
                math.isfinite(value):
            return float(value)
    return None


@contextmanager
def lock(out: Path):
    """Hold the run folder `out` while the block runs: an exclusive, non-blocking flock on the
    folder itself (no lock file). A folder another run holds is a UsageError; the kernel drops
    the lock when the holder's process ends, killed or not, so a stale lock cannot exist."""
    fd = os.open(out, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(f"{str(out)!r} is in use by another run (one writer per run "
                             "folder): wait until it ends, or give another --out") from None
        yield
    finally:
        os.close(fd)


def read_record(out: Path) -> dict:
    """The folder's run.json as `record` writes it; {} when there is none; a one-line error
    when it is anything else (an edit, a truncated copy), which would otherwise read as a
    folder without settings and let a rerun relabel the rows."""
    path = out / SETTINGS
    if not path.is_file():
        return {}
    d = read_json(path)
    settings, asked = d.get("settings"), d.get("asked")
    fits = {"format": d.get("format") == FORMAT,
            "settings": isinstance(settings, dict) and FIXED.keys() <= settings.keys(),
            "asked": isinstance(asked, dict)
            and all(isinstance(asked.get(k), list) for k in GRID_LISTS)
            and all(isinstance(asked.get(k), int) for k in GRID_COUNTS),
            "code": isinstance(d.get("code"), list)}
    bad = [k for k, ok in fits.items() if not ok]
    if bad:
        raise UsageError(f"{str(path)!r} is not a run record of this code ({bad[0]!r} is missing "
                         "or malformed): restore it, or give another --out")
    return d


def read_summary(out: Path) -> dict:
    """The folder's summary.json as evaluate.py writes it ({"config": {...}, "rows": [...]});
    {} when there is none; a one-line error when its config or rows are of another shape."""
    path = out / "summary.json"
    d = read_json(path)
    config, rows = d.get("config", {}), d.get("rows", [])
    ok = isinstance(config, dict) and isinstance(rows, list) \
        and all(isinstance(r, dict) for r in rows) \
        and all(isinstance(config.get(k, []), list) or config.get(k) is None
                for k in GRID_LISTS) \
        and all(isinstance(config.get(k, 0), int) for k in GRID_COUNTS)
    if not ok:
        raise UsageError(f"{str(path)!r} is not a summary of evaluate.py (a JSON object with "
                         "'config' and a list of 'rows'): delete it (rerun or --report writes "
                         "it again)")
    return d


def read_json(path: Path) -> dict:
    """A JSON object from path; {} when there is none; a one-line error when it is unreadable."""
    if not path.is_file():
        return {}
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {str(path)!r}: {e}") from None
    if not isinstance(d, dict):
        raise UsageError(f"{str(path)!r} is not a JSON object")
    return d
