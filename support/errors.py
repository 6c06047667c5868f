"""The one exception the project raises for a user's mistake (bad path, bad budget, unknown
method, prompt too long...). The command lines print it as one line, `error: ...`; it lives in
its own module so that data-side code (support/tasks.py, support/embedded.py) can raise it without
importing
the model."""


class UsageError(Exception):
    """A user mistake: the CLIs print it as one line."""
