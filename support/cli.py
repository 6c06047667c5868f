"""What every command line of the project shares: how a mistake is reported and what the exit
status says.

- A user's mistake (a bad option value, a missing or unreadable file, a run folder that holds
  other settings) is one line on stderr, `error: ...`, naming the option and what it accepts;
  never a traceback. argparse's own errors (an unknown option, a value of the wrong kind) take
  the same form.
- Exit status: 0 done; 1 the command ran and its answer is "no" (`engine/oracle.py compare`: FAIL);
  2 the command could not run (`error: ...`); 130 interrupted (Ctrl-C), after what was finished
  was saved.
"""
from __future__ import annotations

import argparse
import sys

from support.errors import UsageError

FAILED = 1          # the command ran and its verdict is negative (oracle.py compare: FAIL)
USAGE_ERROR = 2     # the command could not run: a bad option, an unreadable file (argparse's too)
INTERRUPTED = 130   # Ctrl-C: 128 + SIGINT, as a shell reports it


def fail(message) -> None:
    """Print `error: message` as one line and exit with USAGE_ERROR."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(USAGE_ERROR)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors read like the others: one `error: ...` line, exit 2 (argparse
    itself prints the whole usage block first)."""

    def error(self, message):
        fail(f"{message} (see --help)")


def run(main, interrupted: str = "interrupted") -> None:
    """main() as a command: its return value is the exit status (None: 0); a UsageError is one
    `error:` line and exit 2; Ctrl-C prints `interrupted` (what was kept) and exits 130."""
    try:
        status = main()
    except UsageError as e:
        fail(e)
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr, flush=True)
        sys.exit(INTERRUPTED)
    sys.exit(status or 0)


def int_list(text: str) -> list:
    """An argparse type: a comma list of integers, `128,512`, duplicates dropped (the first kept);
    anything else (an empty list, `64,abc`, `1.5`) is argparse's one-line error."""
    parts = [p.strip() for p in text.split(",")]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers such as 128,512, "
                                         f"got {text!r}") from None
    return list(dict.fromkeys(values))


def at_least(low: int, **values) -> None:
    """Raise a UsageError naming the first option below `low`: at_least(1, threads=n)
    checks --threads (None: not given)."""
    for name, v in values.items():
        if v is not None and v < low:
            raise UsageError(f"--{name.replace('_', '-')} must be >= {low}, got {v}")


def split_names(text: str, option: str) -> list:
    """A comma list of method names, split at the commas outside brackets (a GraceKV row's
    settings, `gracekv[hop_depths=(0.5,1.0)]`, keep theirs); names stripped, duplicates dropped
    (the first kept). An unclosed or stray bracket is a UsageError naming `option`."""
    names, depth, start = [], 0, 0
    for i, c in enumerate(text + ","):
        depth += {"[": 1, "]": -1}.get(c, 0)
        if depth < 0:
            raise UsageError(f"{option} {text!r}: a ']' without its '['")
        if c == "," and depth == 0:
            names.append(text[start:i].strip())
            start = i + 1
    if depth:
        raise UsageError(f"{option}: {text[start:].strip()!r} has no closing ']'")
    return list(dict.fromkeys(n for n in names if n))
