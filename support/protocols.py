"""Where a prompt's question sits, in tokens: the split the `context` and `agnostic`
protocols cut at (prompt = prefix + context + question; tasks.Sample carries the text).

The token split is found on the encoded prompt itself, never by encoding the pieces apart (a
tokenizer may merge across a piece's edge): the prefix is the longest run of tokens the prompt
shares with the encoded prefix text, the question the longest run it shares at its end with
the encoded question text. A token that merges across an edge differs from the piece's own
token there, so it ends the run and goes to the context [choice: the context is what a
protocol compresses; the prefix and question keep only tokens that are theirs alone]."""
from __future__ import annotations

from os.path import commonprefix      # the longest common start of lists, too

from support.errors import UsageError


def split(tok, ids: list, sample) -> tuple:
    """(n_prefix, n_question) tokens of the encoded prompt ids (BOS included in the prefix when
    the prompt's encoding has one); n_prefix + n_question < len(ids) (the context is not empty)."""
    if not sample.question:
        raise UsageError(f"{sample.task} #{sample.index}: the sample has no question to split at")
    special = not sample.templated
    n_prefix = len(commonprefix([ids, tok.encode(sample.prefix, add_special_tokens=special)]))   # BOS included
    q = tok.encode(sample.question, add_special_tokens=False)
    n_question = len(commonprefix([ids[::-1], q[::-1]]))
    if n_question < 1 or n_prefix + n_question >= len(ids):
        raise UsageError(f"{sample.task} #{sample.index}: cannot split the prompt at its question")
    return n_prefix, n_question
