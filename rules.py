"""Eviction rules: one record per rule, one shared selection.

A rule is one small scoring function under its formula and citation, registered with its needs
(which prefill statistics it reads, methods.STATS) and its decode form (what it does while
decoding, SPEC.md §3). Everything else picks it up from the registry: `polykv.Policy`,
`evaluate.py --methods`, calibration's pool and the generic rule tests. Adding a rule is one
function and one `@rule(...)` line; README "Add your own rule" walks through it.

Notation (SPEC.md): B batch, T prompt tokens, S cached entries, H query heads, G KV heads,
g = H/G, w observation window, A[h,i,j] the causal attention (fp32).

A scoring function takes a `ScoreInput` and returns (scores (B, G, T) or broadcastable to it,
higher = keep; protected (T,) bool, always kept). `select` keeps the top-`budget` (protected
first, ties toward the later position) sorted by position. GQA: a score per query head is
reduced to its KV head by the mean over its g query heads (kvpress convention); TOVA averages
over all H heads of the layer (one kept set shared by the layer's KV heads, as in TOVA's
`tova_cache.py`).

Departures from the original code (SPEC.md §3):
- H2O and TOVA evict token by token during prefill in their original code; here, as in
  KVCache-Factory and the PolyKV framework, they score once after a full-attention prefill.
- StreamingLLM re-assigns cache positions to the kept tokens; here kept keys keep their
  original rotation and queries their true positions (the cache contract).
- PyramidKV is not a rule: at a fixed layer budget it is SnapKV; its layer schedule is
  `polykv.pyramid_budgets` (the `pyramidkv` method).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from errors import UsageError


@dataclass(frozen=True)
class RuleSettings:
    window: int = 32      # w: SnapKV paper's LongBench configs (KVCache-Factory uses 8); H2O's recent r = w
    kernel: int = 7       # SnapKV max-pool kernel (SnapKV paper, KVCache-Factory)
    n_sink: int = 4       # StreamingLLM attention sinks (Xiao et al. 2023, §3.2)
    beta: float = 20.0    # PyramidKV's ratio max/min of selected tokens (KVCache-Factory default)
    seed: int = 0         # the `random` floor's seed
    chunk: int = 256      # queries per chunk when reducing H2O's column sums
    pool: str = "max"     # SnapKV's pooling over j: "max" (SnapKV, KVCache-Factory) or "avg" (kvpress)
    tova_keep_last: bool = False  # TOVA scores keys < T−1 and always keeps the last (kvpress)

    def __post_init__(self):
        for name in ("window", "kernel", "chunk"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_sink < 0 or self.beta <= 1:
            raise UsageError(f"need n_sink >= 0 and beta > 1, got {self.n_sink}, {self.beta}")
        if self.pool not in ("max", "avg"):
            raise UsageError(f"pool must be 'max' or 'avg', got {self.pool!r}")


# NVIDIA kvpress 0.5.5's conventions (kvpress/presses/*_press.py), where they differ from the
# papers' reference code that the defaults follow:
#   SnapKV        window 64 (ours 32), kernel 5 (ours 7), *average* pooling with zero padding
#                 counted (ours: max), window attention averaged rather than summed (the same
#                 ranking: a constant factor 1/w on every score);
#   StreamingLLM  4 sinks + the most recent: the same kept set;
#   TOVA          the last query's attention over keys < T−1, mean over all heads, the last
#                 token always kept (ours scores all T keys and protects none);
#   K-norm        −‖k‖: the same.
# kvpress picks the kept set with torch.topk (ties unspecified) for n_kept = max(1, int(T·(1 − r)))
# at compression ratio r; this project's `select` breaks ties toward the later position.
KVPRESS = RuleSettings(window=64, kernel=5, n_sink=4, pool="avg", tova_keep_last=True)


@dataclass
class ScoreInput:
    """What a scoring function may read about one layer after the prefill."""
    stats: dict           # the statistics the rule declared, each (B, H, T) per query head
    k: torch.Tensor       # (B, G, T, D) post-RoPE keys of the layer
    layer: int
    settings: RuleSettings

    @property
    def shape(self):      # (B, G, T)
        return self.k.shape[:3]


@dataclass(frozen=True)
class Rule:
    name: str
    score: Callable       # ScoreInput -> (scores (B, G, T), protected (T,))
    needs: frozenset      # prefill statistics it reads (methods.STATS)
    decode: str           # its own decode form, a key of DECODE ("append": grow)
    pool: bool            # a candidate of PolyKV's calibration pool (not the random floor)


RULES: dict = {}          # name -> Rule, in registration order


def rule(name: str, needs=(), decode: str = "append", pool: bool = True):
    """Register a scoring function as rule `name` (the one line a new rule adds)."""
    def register(fn):
        RULES[name] = Rule(name, fn, frozenset(needs), decode, pool)
        return fn
    return register


def group_mean(s: torch.Tensor, G: int) -> torch.Tensor:
    """(B, H, S) per query head -> (B, G, S): mean over each KV head's g query heads."""
    B, H, S = s.shape
    return s.view(B, G, H // G, S).mean(2)


def none_protected(T: int) -> torch.Tensor:
    return torch.zeros(T, dtype=torch.bool)


def recent(T: int, w: int) -> torch.Tensor:
    """(T,) the last w positions."""
    return torch.arange(T) >= T - w


# ----------------------------------------------------------------------------- the rules

@rule("streaming", decode="streaming")
def streaming(x: ScoreInput):
    """StreamingLLM (Xiao et al. 2023, `streaming_llm/kv_cache.py`): the first n_sink tokens
    (attention sinks) + the most recent; score = position."""
    B, G, T = x.shape
    return torch.arange(T, dtype=torch.float64).expand(B, G, T), torch.arange(T) < x.settings.n_sink


@rule("h2o", needs={"colsum"}, decode="h2o")
def h2o(x: ScoreInput):
    """H2O (Zhang et al. 2023, `h2o_hf/utils_hh/modify_llama.py`; KVCache-Factory's one-shot
    form): s_j = Σ_{all i} A[h,i,j], group mean; the recent r = w tokens kept."""
    B, G, T = x.shape
    return group_mean(x.stats["colsum"], G), recent(T, x.settings.window)


@rule("tova", needs={"last"}, decode="tova")
def tova(x: ScoreInput):
    """TOVA (Oren et al. 2024, `src/tova_cache.py`): s_j = mean_h A[h,T−1,j] over all H heads
    of the layer, one kept set shared by its KV heads."""
    B, G, T = x.shape
    sc = x.stats["last"].mean(1, keepdim=True).expand(B, G, T)
    if x.settings.tova_keep_last:        # kvpress: scores of keys < T−1, the last token kept
        return sc, torch.arange(T) == T - 1
    return sc, none_protected(T)


@rule("snapkv", needs={"window"})
def snapkv(x: ScoreInput):
    """SnapKV (Li et al. 2024, `snapkv/monkeypatch/snapkv_utils.py`): s_j = Σ_{i in last w}
    A[h,i,j] for j < T−w, max-pooled over j (kernel k, stride 1, padding k//2), group mean;
    the window itself is kept."""
    B, G, T = x.shape
    s = x.settings
    win = x.stats["window"][:, :, : max(T - s.window, 0)]                     # (B, H, T−w)
    if win.shape[2]:
        pool = F.max_pool1d if s.pool == "max" else F.avg_pool1d              # avg: kvpress
        win = pool(win, s.kernel, stride=1, padding=s.kernel // 2)            # (B, H, T−w)
    sc = torch.cat((group_mean(win, G), win.new_zeros(B, G, T - win.shape[2])), 2)
    return sc, recent(T, s.window)


@rule("knorm")
def knorm(x: ScoreInput):
    """K-norm (Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
    Compression"; kvpress `KnormPress`): keys with a *low* L2 norm draw more attention, so
    s_j = −‖k_j‖ per KV head; no protected tokens (as kvpress). RoPE is a rotation, so the norm
    of the post-RoPE key is the norm of the key."""
    B, G, T = x.shape
    return -x.k.double().norm(dim=-1), none_protected(T)


@rule("random", pool=False)
def random(x: ScoreInput):
    """A floor: uniform random scores from (seed, layer)."""
    B, G, T = x.shape
    g = torch.Generator().manual_seed(x.settings.seed * 100003 + x.layer)
    return torch.rand(1, G, T, generator=g, dtype=torch.float64).expand(B, G, T), none_protected(T)


# ----------------------------------------------------------------------------- selection

def score(name: str, x: ScoreInput):
    """Scores (B, G, T) and protected (T,) of rule `name` (checked against the contract)."""
    if name not in RULES:
        raise UsageError(f"unknown rule {name!r}; choose from {', '.join(RULES)}")
    sc, prot = RULES[name].score(x)
    return sc.expand(*x.shape), prot


def select(scores: torch.Tensor, budget: int, protected: torch.Tensor) -> torch.Tensor:
    """Indices (B, G, budget) of the kept entries, ascending by position.

    Protected entries first, then the highest scores; ties go to the later position (a stable
    descending sort over the position-reversed scores)."""
    B, G, S = scores.shape
    sc = scores.double().masked_fill(protected.to(scores.device), float("inf"))
    order = torch.sort(sc.flip(-1), dim=-1, descending=True, stable=True).indices  # (B, G, S)
    keep = (S - 1) - order[..., :budget]                                   # (B, G, budget)
    return keep.sort(-1).values


# ----------------------------------------------------------------------------- decode forms

@dataclass(frozen=True)
class DecodeRule:
    """What a layer does after each generated token once it holds more than its decode budget.

    score(lc, last, settings) -> (scores (B, G, S), protected (S,)), where lc is the layer cache
    (its `acc` holds the running sums when `acc_from` is set) and last (B, H, S) the newest query's
    attention (None unless `uses_last`)."""
    name: str
    score: Optional[Callable]
    uses_last: bool = False
    acc_from: Optional[str] = None  # the prefill statistic lc.acc starts from (group mean, kept
                                    # entries); then lc.acc += group mean of `last`, every step


def _stream_decode(lc, last, s):       # rolling: drop the oldest non-sink (lowest position)
    return lc.pos.double(), torch.arange(lc.size) < s.n_sink


def _h2o_decode(lc, last, s):          # lowest running Σ_i A outside the recent r = w entries
    return lc.acc, torch.arange(lc.size) >= lc.size - s.window


def _tova_decode(lc, last, s):         # lowest attention of the current query, mean over H
    B, G = lc.k.shape[:2]
    return last.mean(1, keepdim=True).expand(B, G, -1), none_protected(lc.size)


DECODE = {"append": DecodeRule("append", None),
          "streaming": DecodeRule("streaming", _stream_decode),
          "h2o": DecodeRule("h2o", _h2o_decode, uses_last=True, acc_from="colsum"),
          "tova": DecodeRule("tova", _tova_decode, uses_last=True)}
