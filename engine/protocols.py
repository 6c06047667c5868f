"""The three protocols: what of a prompt is compressed, what is charged, what compression sees.

- `prompt`: the whole prompt is observed, compressed and charged (SnapKV, PyramidKV,
  KVCache-Factory's LongBench runs).
- `context`: prompt = prefix + context + question; the whole prompt is observed (compression
  sees the question), only the context is compressed and charged; prefix and question stay
  exact and free for every method (GraceKV's eq. 2): `cut`, then the method, then `join`.
- `agnostic`: prefix + context are observed and compressed without the question, which is then
  fed to the compressed cache and appended like generated tokens (NVIDIA kvpress's pipeline:
  a document cached before its questions arrive).
evaluate.py runs them (`--protocol`); a fidelity prompt has no question, the three coincide.

Where a prompt's question sits, in tokens (`split`; tasks.Sample carries the text):
The token split is found on the encoded prompt itself, never by encoding the pieces apart (a
tokenizer may merge across a piece's edge): the prefix is the longest run of tokens the prompt
shares with the encoded prefix text, the question the longest run it shares at its end with
the encoded question text. A token that merges across an edge differs from the piece's own
token there, so it ends the run and goes to the context [choice: the context is what a
protocol compresses; the prefix and question keep only tokens that are theirs alone]."""
from __future__ import annotations

from dataclasses import replace
from os.path import commonprefix      # the longest common start of lists, too

import torch

from support.errors import UsageError

PROTOCOLS = ("prompt", "context", "agnostic")


def split(tok, ids: list, sample) -> tuple:
    """(n_prefix, n_question) tokens of the encoded prompt ids (BOS included in the prefix when
    the prompt's encoding has one); n_prefix + n_question < len(ids) (the context is not empty)."""
    if sample.unsplit:
        raise UsageError(f"{sample.task} #{sample.index}: {sample.unsplit}")
    if not sample.question:
        raise UsageError(f"{sample.task} #{sample.index}: the sample has no question to split at")
    special = not sample.templated
    # BOS included
    n_prefix = len(commonprefix([ids, tok.encode(sample.prefix, add_special_tokens=special)]))
    q = tok.encode(sample.question, add_special_tokens=False)
    n_question = len(commonprefix([ids[::-1], q[::-1]]))
    if n_question < 1 or n_prefix + n_question >= len(ids):
        raise UsageError(f"{sample.task} #{sample.index}: cannot split the prompt at its question")
    return n_prefix, n_question


# ----------------------------------------------------------------- the context's share of a prefill

def cut(full, obs, needs, a: int, b: int):
    """The `context` protocol's input to a method: the FullKV cache of keys a..b−1 alone (their
    positions kept; next_pos and last_logits the whole prompt's, so probes and windows read from
    the question sit where they were) and the observation of the whole prompt over those keys:
    every per-key statistic (B, H, T) sliced, Expected Attention's query statistics (μ, Σ) whole,
    each extra statistic (polykv.Needs.extra) through its own `cut(value, a, b)`. So compression
    sees the question (its queries' attention to the context) but keeps and is charged for
    context tokens only. The observation records where the cut starts (`first` = a), so the
    rules' positional protections stay at the prompt's own edges (polykv.ScoreInput): the
    attention sinks are the prompt's first tokens, already kept free in the prefix, and the
    observation window its last w, the question's; no context token is protected for being at
    the cut's ends (a question shorter than w leaves the window's rest protected in the
    context). Every method is still charged exactly the budget B per head on the context."""
    Cache = type(full)                                                      # model.Cache
    T = full.layers[0].size
    layers = [lc.span(a, b) for lc in full.layers]

    def sliced(x):
        """A per-key statistic (..., T) over keys a..b−1 alone; anything else as it is."""
        return x[..., a:b] if hasattr(x, "shape") and x.shape[-1] == T else x
    stats = [{n: sliced(x) for n, x in d.items()} for d in obs.stats]
    extra = {}
    for name, statistic in needs.extra:
        if not hasattr(statistic, "cut"):
            raise UsageError(
                f"statistic {name!r} cannot be cut to the context (it has no cut method)"
            )
        extra[name] = [statistic.cut(v, a, b) for v in obs.extra[name]]
    surprisal = None if obs.surprisal is None else obs.surprisal[:, a:b]
    return Cache(layers, full.next_pos, full.last_logits), type(obs)(
        stats, extra, dict(obs.seconds), surprisal, first=a
    )


def join(full, comp, a: int, b: int, question: bool = True):
    """The prompt's cache under the `context` protocol: per layer and KV head the prefix (keys
    < a) and the question (keys >= b) exact from the FullKV cache `full`, around the compressed
    context `comp` (dense or ragged, as the method left it; a ragged one stays ragged). A decode
    rule's state (H2O's acc) starts at 0 on the free entries; it is read only when a decoder
    evicts, which equal memory rules out (evaluate.py). question=False: without the question,
    ending at b (what a later question is fed after)."""
    Cache, LayerCache = type(full), type(full.layers[0])
    end = full.layers[0].size if question else b
    layers = []

    def around(x, full_x):
        """The compressed context x (B, G, S) between the exact prefix and question of full_x."""
        return torch.cat((full_x[:, :, :a], x, full_x[:, :, b:end]), 2)
    for exact, kept in zip(full.layers, comp.layers):       # a layer of `full`, of `comp`
        if kept.head is None:                                                 # dense (B, G, S)
            acc = (
                None
                if kept.acc is None
                else around(kept.acc, torch.zeros_like(exact.bias, dtype=kept.acc.dtype))
            )
            layers.append(
                LayerCache(around(kept.k, exact.k), around(kept.v, exact.v),
                           around(kept.pos, exact.pos), around(kept.bias, exact.bias), acc)
            )
        else:                                                                 # ragged, batch 1
            heads = []
            for g in range(exact.k.shape[1]):
                mine = kept.head[0, 0] == g
                pairs = ((exact.k, kept.k), (exact.v, kept.v), (exact.pos, kept.pos),
                         (exact.bias, kept.bias))
                heads.append(
                    tuple(
                        torch.cat((full_x[0, g, :a], comp_x[0, 0, mine], full_x[0, g, b:end]))
                        for full_x, comp_x in pairs
                    )
                )
            layers.append(LayerCache.pack(heads))
    return Cache(layers, full.next_pos, full.last_logits) if question else Cache(layers, b, None)


# ----------------------------------------------------------------------------- later questions

def turns(tok, ids: list, sample, at) -> list:
    """A multi-question sample's later questions (tasks.Sample.asks), each as (its tokens as
    they follow the context, its own Sample, its gold answer's tokens): question i's prompt is
    prefix + context + question i, split like the first; its prefix and context tokens must be
    the first prompt's (else the context would not be the same to reuse); at: the first's split."""
    out = []
    head = sample.prompt[:len(sample.prompt) - len(sample.question)]
    for ask in sample.asks:
        s = replace(sample, prompt=head + ask.question, question=ask.question,
                    answers=list(ask.answers), gold=ask.gold, asks=())
        own = tok.encode(s.prompt)
        n_q = split(tok, own, s)[1]
        if own[:len(own) - n_q] != ids[:len(ids) - at[1]]:
            raise UsageError(
                f"{sample.task} #{sample.index}: a later question changes the context's tokens"
            )
        out.append((own[len(own) - n_q:], s, tok.encode(s.prompt + s.gold)[len(own):]))
    return out
