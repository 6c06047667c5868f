"""Files a later run reads: written atomically, read back tolerating a run killed mid-line; and
whether a path can be written, asked before the work that would write there."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from support.errors import UsageError


def write_atomic(path, text: str):
    """Write text to path through a temporary file in the same folder and a rename, so that a
    later run never reads a half-written file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_rows(jsonl: Path, repair: bool = True, need=()) -> list:
    """The finished rows of a JSONL file. A run killed while writing (power loss, OOM killer)
    leaves a torn last line: it is dropped with a one-line warning and cut from the file, so the
    rerun appends after the last complete row. repair=False only reads (a report on the files of
    a run still writing them: its last line may be half written, and it is left alone). A
    complete line that is not a JSON object, or one that lacks a field of `need`, was not written
    by a run: a one-line error names it, and nothing is cut."""
    if not jsonl.exists():
        return []
    data = jsonl.read_bytes()
    keep = data[:data.rfind(b"\n") + 1]                 # complete lines end with a newline
    rows = []
    for n, line in enumerate(keep.decode(errors="replace").splitlines(), 1):
        if line.strip():
            rows.append((n, row(line, jsonl, n)))
    for n, d in rows:                          # (after every line is known to be JSON)
        lacking = [k for k in need if k not in d]
        if lacking:
            raise UsageError(f"{jsonl}:{n}: a row without {', '.join(lacking)}; fix or delete "
                             "that line (its row is then computed again)")
    if len(keep) < len(data) and repair:
        print(f"warning: {jsonl}: dropped a torn last line ({len(data) - len(keep)} bytes) "
              "from an interrupted run; it is recomputed", file=sys.stderr, flush=True)
        with open(jsonl, "r+b") as f:
            f.truncate(len(keep))
    return [d for _, d in rows]


def row(line: str, jsonl: Path, n: int) -> dict:
    """Line n of a rows file as a dict, or a UsageError naming the file and the line."""
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise UsageError(f"{jsonl}:{n}: not a JSON row ({e.msg}); "
                         "fix or delete that line (its row is then computed again)") from None
    if not isinstance(d, dict):
        raise UsageError(f"{jsonl}:{n}: not a JSON object; fix or delete that line")
    return d


def writable_file(path, option: str):
    """A UsageError naming `option` unless a file can be written at path: not a folder, in an
    existing folder this process may write into (and the file itself writable, if it exists)."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"cannot write {str(path)!r}: it is a folder")
    if not path.absolute().parent.is_dir():
        raise UsageError(f"cannot write {str(path)!r}: no such folder")
    if not os.access(path.absolute().parent, os.W_OK | os.X_OK) or \
            (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"cannot write {str(path)!r} ({option}): its folder is not writable")


def writable_folder(path, option: str):
    """A UsageError naming `option` unless files can be written into the folder `path`: it is
    a writable folder, or the nearest folder above it that exists is one (where it is made)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{option} {str(path)!r} is a file, not a folder")
    above = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())
    if not above.is_dir():
        raise UsageError(f"{option} {str(path)!r}: {str(above)!r} is a file, not a folder")
    if not os.access(above, os.W_OK | os.X_OK):
        what = "the folder is not writable" if above == path.absolute() else \
            f"cannot create the folder ({str(above)!r} is not writable)"
        raise UsageError(f"{option} {str(path)!r}: {what}")
