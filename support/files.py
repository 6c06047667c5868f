"""Files a later run reads: written atomically, read back tolerating a run killed mid-line."""
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


def read_rows(jsonl: Path, repair: bool = True) -> list:
    """The finished rows of a JSONL file. A run killed while writing (power loss, OOM killer)
    leaves a torn last line: it is dropped with a one-line warning and cut from the file, so the
    rerun appends after the last complete row. repair=False only reads (a report on the files of
    a run still writing them: its last line may be half written, and it is left alone). A
    complete line that is not a JSON object was not written by a run: a one-line error names
    it, and nothing is cut."""
    if not jsonl.exists():
        return []
    data = jsonl.read_bytes()
    keep = data[:data.rfind(b"\n") + 1]                 # complete lines end with a newline
    rows = []
    for n, line in enumerate(keep.decode(errors="replace").splitlines(), 1):
        if line.strip():
            rows.append(row(line, jsonl, n))
    if len(keep) < len(data) and repair:
        print(f"warning: {jsonl}: dropped a torn last line ({len(data) - len(keep)} bytes) "
              "from an interrupted run; it is recomputed", file=sys.stderr, flush=True)
        with open(jsonl, "r+b") as f:
            f.truncate(len(keep))
    return rows


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
