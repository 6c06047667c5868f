"""PolyKV: per layer and phase, an eviction rule and a budget; the rules; the policy that runs them.

Implements the framework of Fei & Kalnis, "PolyKV: Heterogeneous Retention and Allocation for
KV Cache Compression" (arXiv 2606.15157, 2026; its later version "Exploring a Layer-Wise Design
Space for KV Cache Eviction"): a *policy* Π assigns every layer l and phase
φ ∈ {prefill, decode} an eviction rule r_{l,φ} and a budget b_{l,φ} with Σ_l b_{l,φ} <= L·B,
built offline (calibrate.py) and then only executed. Read top to bottom:

 1. The method interface (the paper's hooks: pre-kernel, post-kernel, cache update;
    model.Hooks): what a method observes during the full-attention prefill (`Needs`), how it
    compresses the FullKV cache once (`Method.compress`) and evicts while decoding (`decoder`).
 2. The naive observation: each layer's whole attention matrix A from `model.attention_probs`,
    and the statistics the rules read off it.
 3. The rules (the design space): one scoring function each, in the table `RULES`.
 4. Selection: one shared top-k.
 5. The decode forms: what a rule does after each generated token.
 6. The policy (`Policy`: per layer a prefill and a decode `Phase`) and PyramidKV's layer
    schedule (`Pyramid`).

This module is the paper's path: a method called alone observes naively and compresses. The
engine (`engine/`) observes several methods and prefixes in one chunked pass and hands its
observation to the same `compress` (tested equal). The newer baselines (baselines.py) extend
`RULES` with their own rules and statistics.

Notation: B batch, T prompt tokens, S cached entries, H query heads, G KV heads, g = H/G,
L layers, w observation window, A[h,i,j] = softmax_j(q_i·k_j/√D + bias_j), causal, in fp32.
Design notes (GQA reduction, ties, departures from the original code): docs/design.md.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

import model as M
from model import Cache, Hooks, attention_probs
from support.errors import UsageError
from support.files import write_atomic


# ======================================================================= 1. the method interface

@dataclass(frozen=True)
class Statistic:
    """A statistic that is not read off the prompt's attention (section 2), computed either per
    layer from its queries during the prefill, per_layer(q, q_pos, model, needs) -> value, or by
    an extra pass after it, after(model, full, tokens, needs, layers) -> {layer: value} (the
    pass's time is reported in Observation.seconds under the statistic's name)."""
    per_layer: Optional[Callable] = None
    after: Optional[Callable] = None

    def __post_init__(self):
        if (self.per_layer is None) == (self.after is None):
            raise UsageError("a statistic has exactly one of per_layer and after")


@dataclass(frozen=True)
class Needs:
    """What a method must observe during the prefill."""
    stats: tuple = ()     # per layer, a frozenset of statistic names
    window: int = 32      # w of the `window` statistic
    computed: tuple = ()  # ((name, Statistic), ...): the statistics not read off A
    n_sink: int = 4       # `queries`: the first n_sink queries left out; `recon`: sinks kept
    future: int = 512     # `queries`: the next positions whose mean rotation is applied
    # `recon`: the reconstruction prompt's ids (support.tasks.reconstruction_prompt)
    repeat: tuple = ()
    repeat_from: int = 0  # `recon`: the first prompt position reconstructed (RuleSettings)
    surprisal: bool = False  # −log p of each prompt token (model.surprisal; GraceKV's boundaries)
    # the engine's shared pass only: query rows per chunk (memory), and a method's own per-layer
    # statistics ((name, statistic), ...; GraceKV's value flow, engine/observe.py)
    chunk: int = 256
    extra: tuple = ()

    @property
    def used(self) -> frozenset:
        """Every statistic some layer reads."""
        return frozenset().union(*self.stats)


@dataclass
class Observation:
    stats: list                     # [dict name -> (B, H, T)] * L
    extra: dict = field(default_factory=dict)   # name -> [value per layer] (Needs.extra)
    seconds: dict = field(default_factory=dict)  # name -> time of an extra pass (KVzip's `recon`)
    surprisal: Optional[torch.Tensor] = None     # (B, T) if Needs.surprisal
    # the prompt position of the observed keys' first one: 0, or under the `context` protocol
    # the context's start (engine/protocols.cut), so that rules protect the prompt's own edges
    first: int = 0


class Method:
    """The interface every compression method implements (the shape of NVIDIA kvpress's presses):
      needs(model)               what it must observe during the full-attention prefill (`Needs`);
      compress(model, full, obs) (FullKV cache, `Observation`) -> its compressed cache; `full` is
                                 left untouched, so several methods share one prefill;
      decoder                    None = append every generated token, else hooks whose
                                 cache_update evicts after each step (model.decode);
      prefill(model, tokens)     the naive `observe` + compress, this method alone.
    Subclasses: Policy, Pyramid, baselines.Headwise, gracekv.GraceKV."""

    def needs(self, model) -> Needs:
        return Needs()

    def compress(self, model, full: Cache, obs: Observation) -> Cache:
        raise NotImplementedError

    @property
    def decoder(self) -> Optional[Hooks]:
        return None

    def evicts_within(self, T: int, n: int) -> bool:
        """Whether the decoder can evict while n tokens follow a prompt of T tokens (if not,
        decoding is plain appending and may run in one step)."""
        return False

    @torch.no_grad()
    def prefill(self, model, tokens) -> Cache:
        """Full prefill of tokens (1, T) observing what this method needs, then compression."""
        full, obs = observe(model, tokens, self.needs(model))
        return self.compress(model, full, obs)


# ======================================================================= 2. the naive observation
# The statistics read off A, the causal attention of the prompt (B, H, T, T), per query head:

def colsum(A, w: int):             # Σ_{all i} A[h,i,j]: H2O's heavy-hitter scores (B, H, T)
    return A.sum(2)


def window(A, w: int):             # Σ_{i ≥ T−w} A[h,i,j]: SnapKV's window (B, H, T)
    return A[:, :, -w:].sum(2)


def last(A, w: int):               # A[h,T−1,j]: TOVA's last query (B, H, T)
    return A[:, :, -1]


ATTENTION_STATISTICS = {"colsum": colsum, "window": window, "last": last}


@torch.no_grad()
def observe(model, tokens, needs: Needs) -> tuple:
    """One full-attention prefill of tokens (B, T) recording what `needs` asks for, the naive
    way: at each layer the whole attention matrix A (B, H, T, T) of the prompt's queries over
    its keys (`model.attention_probs`), each statistic read off it; the statistics computed per
    layer from the queries; then the extra passes (KVzip's). Returns (FullKV cache,
    Observation). Memory: one layer's A at a time (B·H·T² floats); the engine's pass reads the
    same statistics in query chunks (engine/observe.py, tested equal)."""
    L = model.config.n_layers
    per_layer = needs.stats or (frozenset(),) * L
    computed = dict(needs.computed)
    unknown = needs.used - set(ATTENTION_STATISTICS) - set(computed)
    if unknown:
        raise UsageError(f"no statistic named {sorted(unknown)[0]!r} is defined "
                         f"(a rule declares the statistics it computes: polykv.Rule)")
    if needs.extra or needs.surprisal:
        raise UsageError("a method's own statistics (Needs.extra, surprisal) are read by the "
                         "engine's shared observation (engine/observe.py); the method observes "
                         "its own prefill on the paper's path")
    obs = Observation([dict() for _ in range(L)])

    def post_kernel(layer, q, q_pos, lc, out):
        names = per_layer[layer]
        if names & set(ATTENTION_STATISTICS):
            A = attention_probs(q, lc.k, lc.bias, q_pos, lc.pos)            # (B, H, T, T)
            w = min(needs.window, A.shape[2])
        for name in names:
            if name in ATTENTION_STATISTICS:
                obs.stats[layer][name] = ATTENTION_STATISTICS[name](A, w)
            elif computed[name].per_layer is not None:
                obs.stats[layer][name] = computed[name].per_layer(q, q_pos, model, needs)

    full = M.prefill(model, tokens, Hooks(post_kernel=post_kernel))
    for name, statistic in computed.items():      # the extra passes after the prefill
        layers = [l for l in range(L) if name in per_layer[l]]
        if statistic.after is not None and layers:
            t0 = time.perf_counter()
            for l, value in statistic.after(model, full, tokens, needs, layers).items():
                obs.stats[l][name] = value
            obs.seconds[name] = time.perf_counter() - t0
    return full, obs


# ================================================================================= 3. the rules
# A rule is one small scoring function under its formula and citation. It reads a `ScoreInput`
# and returns (scores (B, G, T) or broadcastable to it, higher = keep; protected (T,) bool,
# always kept). GQA: a score per query head is reduced to its KV head by the mean over its g
# query heads (kvpress convention); TOVA averages over all H heads (one kept set per layer, as
# `tova_cache.py`). Departures from the original code (docs/design.md): H2O and TOVA score once
# after a full prefill (KVCache-Factory's form), not token by token; StreamingLLM's kept keys
# keep their rotation; PyramidKV is SnapKV with a layer schedule (`pyramid_budgets`).

@dataclass(frozen=True)
class RuleSettings:
    # w: SnapKV paper's LongBench configs (KVCache-Factory uses 8); H2O's recent r = w
    window: int = 32
    kernel: int = 7       # SnapKV max-pool kernel (SnapKV paper, KVCache-Factory)
    n_sink: int = 4       # StreamingLLM attention sinks (Xiao et al. 2023, §3.2)
    beta: float = 20.0    # PyramidKV's ratio max/min of selected tokens (KVCache-Factory default)
    seed: int = 0         # the `random` floor's seed
    chunk: int = 256      # queries per chunk when reducing H2O's column sums
    # SnapKV's pooling over j: "max" (SnapKV, KVCache-Factory) or "avg" (kvpress)
    pool: str = "max"
    tova_keep_last: bool = False  # TOVA scores keys < T−1 and always keeps the last (kvpress)
    future: int = 512     # Expected Attention's future positions (kvpress default)
    repeat: tuple = ()    # KVzip's reconstruction prompt, ids (support.tasks.reconstruction_prompt)
    # KVzip: the prompt's first repeat_from tokens are not reconstructed (score 0 but the sinks):
    # kvpress's KVzipPress skips a chat template's prefix (support.tasks.kvpress_reconstruction)
    repeat_from: int = 0

    def __post_init__(self):
        # JSON lists back to tuples
        object.__setattr__(self, "repeat", tuple(tuple(r) for r in self.repeat))
        for name in ("window", "kernel", "chunk"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_sink < 0 or self.beta <= 1 or self.repeat_from < 0:
            raise UsageError(f"need n_sink >= 0, beta > 1 and repeat_from >= 0, got "
                             f"{self.n_sink}, {self.beta}, {self.repeat_from}")
        if self.pool not in ("max", "avg"):
            raise UsageError(f"pool must be 'max' or 'avg', got {self.pool!r}")


# NVIDIA kvpress 0.5.5's conventions where they differ from the papers' code that the defaults
# follow (docs/design.md has the table): SnapKV's window, kernel and average pooling; TOVA's last
# token.
KVPRESS = RuleSettings(window=64, kernel=5, n_sink=4, pool="avg", tova_keep_last=True)


@dataclass
class ScoreInput:
    """What a scoring function may read about one layer after the prefill: the statistics its
    rule declared, each (B, H, T) per query head, and the layer's keys and values.

    Positions: key i sits at prompt position first + i, and the prompt ends before position
    `end`. When the whole prompt is scored (the paper's case) first = 0 and end = T, so
    `sinks(n)` are the first n keys, `recent(w)` the last w and `before(end − w)` = T − w.
    (Under the engine's `context` protocol the keys are the context alone: its sinks sit in the
    free prefix and its window in the free question, so neither protects a context token.)"""
    stats: dict           # the statistics the rule declared, each (B, H, T) per query head
    k: torch.Tensor       # (B, G, T, D) post-RoPE keys of the layer
    layer: int
    settings: RuleSettings
    v: Optional[torch.Tensor] = None   # (B, G, T, D) values of the layer
    first: int = 0                     # the prompt position of key 0
    end: Optional[int] = None          # one past the prompt's last position (None: first + T)

    @property
    def shape(self):      # (B, G, T)
        return self.k.shape[:3]

    @property
    def T(self) -> int:   # the prompt's length, in positions
        return self.first + self.k.shape[2] if self.end is None else self.end

    def positions(self) -> torch.Tensor:                 # (T,) the keys' prompt positions
        return torch.arange(self.first, self.first + self.k.shape[2], device=self.k.device)

    def sinks(self, n: int) -> torch.Tensor:             # (T,) keys among the first n positions
        return self.positions() < n

    def recent(self, w: int) -> torch.Tensor:            # (T,) keys among the last w positions
        return self.positions() >= self.T - w

    def before(self, p: int) -> int:                     # how many keys sit at positions < p
        return max(0, min(self.k.shape[2], p - self.first))


def score_input(obs: Observation, full: Cache, layer: int, settings) -> ScoreInput:
    """Layer `layer`'s ScoreInput from a FullKV cache and its observation."""
    lc = full.layers[layer]
    return ScoreInput(obs.stats[layer], lc.k, layer, settings, lc.v, obs.first, full.next_pos)


def group_mean(s: torch.Tensor, G: int) -> torch.Tensor:
    """(B, H, S) per query head -> (B, G, S): mean over each KV head's g query heads."""
    B, H, S = s.shape
    return s.view(B, G, H // G, S).mean(2)


def none_protected(T: int, device=None) -> torch.Tensor:      # (T,) nothing protected
    return torch.zeros(T, dtype=torch.bool, device=device)


def streaming(x: ScoreInput):
    """StreamingLLM (Xiao et al. 2023, `streaming_llm/kv_cache.py`): the first n_sink tokens
    (attention sinks) + the most recent; score = position."""
    B, G, T = x.shape
    dev = x.k.device
    return (torch.arange(T, dtype=torch.float64, device=dev).expand(B, G, T),
            x.sinks(x.settings.n_sink))


def h2o(x: ScoreInput):
    """H2O (Zhang et al. 2023, `h2o_hf/utils_hh/modify_llama.py`; KVCache-Factory's one-shot
    form): s_j = Σ_{all i} A[h,i,j], group mean; the recent r = w tokens kept."""
    B, G, T = x.shape
    return group_mean(x.stats["colsum"], G), x.recent(x.settings.window)


def tova(x: ScoreInput):
    """TOVA (Oren et al. 2024, `src/tova_cache.py`): s_j = mean_h A[h,T−1,j] over all H heads
    of the layer, one kept set shared by its KV heads."""
    B, G, T = x.shape
    sc = x.stats["last"].mean(1, keepdim=True).expand(B, G, T)
    if x.settings.tova_keep_last:        # kvpress: scores of keys < T−1, the last token kept
        return sc, x.recent(1)
    return sc, none_protected(T, x.k.device)


def snapkv(x: ScoreInput):
    """SnapKV (Li et al. 2024, `snapkv/monkeypatch/snapkv_utils.py`): s_j = Σ_{i in last w}
    A[h,i,j] for j < T−w, max-pooled over j (kernel k, stride 1, padding k//2), group mean;
    the window itself is kept."""
    B, G, T = x.shape
    s = x.settings
    win = x.stats["window"][:, :, : x.before(x.T - s.window)]               # (B, H, T−w)
    if win.shape[2]:
        pool = F.max_pool1d if s.pool == "max" else F.avg_pool1d              # avg: kvpress
        win = pool(win, s.kernel, stride=1, padding=s.kernel // 2)            # (B, H, T−w)
    sc = torch.cat((group_mean(win, G), win.new_zeros(B, G, T - win.shape[2])), 2)
    return sc, x.recent(s.window)


def random(x: ScoreInput):
    """A floor: uniform random scores from (seed, layer), drawn on the CPU's generator whatever
    the model's device (the same scores on every device), then moved to the keys' device."""
    B, G, T = x.shape
    g = torch.Generator("cpu").manual_seed(x.settings.seed * 100003 + x.layer)
    sc = torch.rand(1, G, T, generator=g, dtype=torch.float64, device="cpu").to(x.k.device)
    return sc.expand(B, G, T), none_protected(T, x.k.device)


@dataclass(frozen=True)
class Rule:
    score: Callable       # ScoreInput -> (scores (B, G, T), protected (T,))
    needs: frozenset = frozenset()  # the statistics it reads, by name
    decode: str = "append"          # its own decode form, a key of DECODE ("append": grow)
    pool: bool = True     # a candidate of PolyKV's calibration pool (not the random floor)
    computed: tuple = ()  # ((name, Statistic), ...): those of its statistics not read off A


# The paper's design space. baselines.RULES adds the newer baselines (K-norm, Expected
# Attention, KVzip); a policy, the harness and calibration are handed the table they use.
RULES = {
    "streaming": Rule(streaming, decode="streaming"),
    "h2o": Rule(h2o, frozenset({"colsum"}), decode="h2o"),
    "tova": Rule(tova, frozenset({"last"}), decode="tova"),
    "snapkv": Rule(snapkv, frozenset({"window"})),
    "random": Rule(random, pool=False),
}


# ================================================================================ 4. selection

def score(name: str, x: ScoreInput, rules: Optional[dict] = None):
    """Scores (B, G, T) and protected (T,) of rule `name` of the table `rules` (RULES if None)."""
    rules = RULES if rules is None else rules
    if name not in rules:
        raise UsageError(f"unknown rule {name!r}; choose from {', '.join(rules)}")
    sc, prot = rules[name].score(x)
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


# ============================================================================ 5. decode forms

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


def recent(S: int, w: int, device=None) -> torch.Tensor:     # (S,) the last w entries
    return torch.arange(S, device=device) >= S - w


def sinks(S: int, n: int, device=None) -> torch.Tensor:      # (S,) the first n entries
    return torch.arange(S, device=device) < n


def _stream_decode(lc, last, s):       # rolling: drop the oldest non-sink (lowest position)
    return lc.pos.double(), sinks(lc.size, s.n_sink, lc.k.device)


def _h2o_decode(lc, last, s):          # lowest running Σ_i A outside the recent r = w entries
    return lc.acc, recent(lc.size, s.window, lc.k.device)


def _tova_decode(lc, last, s):         # lowest attention of the current query, mean over H
    B, G = lc.k.shape[:2]
    return last.mean(1, keepdim=True).expand(B, G, -1), none_protected(lc.size, lc.k.device)


DECODE = {"append": DecodeRule("append", None),
          "streaming": DecodeRule("streaming", _stream_decode),
          "h2o": DecodeRule("h2o", _h2o_decode, uses_last=True, acc_from="colsum"),
          "tova": DecodeRule("tova", _tova_decode, uses_last=True)}


# ================================================================================ 6. the policy

def prefill_rules(rules: Optional[dict] = None) -> tuple:
    """"full" (keep every entry) and every rule of the table (RULES if None)."""
    return ("full",) + tuple(RULES if rules is None else rules)


def pool(rules: Optional[dict] = None) -> tuple:
    """PolyKV's prefill patterns: every rule of the table (RULES if None) but a floor."""
    return tuple(name for name, r in (RULES if rules is None else rules).items() if r.pool)


def decode_pool() -> tuple:
    """Decode patterns that evict at a fixed budget (every decode form but append)."""
    return tuple(name for name, d in DECODE.items() if d.score is not None)


POLICY_FORMAT = "polykv-policy/1"      # the policy file's layout (Policy.to_json)


class Phase(NamedTuple):
    """One phase of one layer: its rule and its budget (entries per KV head)."""
    rule: str
    budget: int


@dataclass
class LayerPolicy:
    prefill: Phase    # rule in prefill_rules()
    decode: Phase     # rule in DECODE; "append" grows without bound

    def __post_init__(self):
        self.prefill, self.decode = Phase(*self.prefill), Phase(*self.decode)


def largest_remainder(reals, total: int) -> list:
    """Integers summing to total: floor each, give the leftover units to the largest
    fractional parts (ties to the lower index). Hamilton's method."""
    floors = [int(x // 1) for x in reals]
    order = sorted(range(len(reals)), key=lambda i: (-(reals[i] - floors[i]), i))
    for i in order[: total - sum(floors)]:
        floors[i] += 1
    return floors


def pyramid_budgets(budget: int, T: int, n_layers: int, window: int = 32, beta: float = 20.0):
    """PyramidKV per-layer sizes (window included), averaging exactly `budget`.

    KVCache-Factory `PyramidKVCluster.update_kv`: with C = budget, min = (C−w)/β,
    max = 2(C−w) − min; if max > T−w: max = T−w, min = 2(C−w) − max;
    c_l = max − l·(max − min)/(L − 1); layer l keeps c_l + w."""
    C, w, L = budget, window, n_layers
    if T <= C or C <= w or L == 1:
        return [C] * L       # no compression, or no room for a pyramid: uniform
    lo = (C - w) / beta
    hi = 2 * (C - w) - lo
    if hi > T - w:
        hi = T - w
        lo = 2 * (C - w) - hi
    c = [hi - l * (hi - lo) / (L - 1) for l in range(L)]
    return [x + w for x in largest_remainder(c, L * (C - w))]


@dataclass
class Policy(Method):
    """Per layer a prefill (rule, budget) and a decode (rule, budget); `budget` = average B."""
    layers: list
    budget: int
    settings: RuleSettings = field(default_factory=RuleSettings)
    meta: dict = field(default_factory=dict)   # e.g. calibration signals, model name
    allowance: int = 0    # generated tokens every layer may add on top of its decode budget
    # the rule table its layers name: RULES if None (baselines.RULES holds the newer rules too)
    rules: Optional[dict] = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        self.rules = RULES if self.rules is None else self.rules
        if isinstance(self.budget, bool) or not isinstance(self.budget, int):
            raise UsageError(f"budget must be an integer >= 1, got {self.budget!r}")
        if self.budget < 1:
            raise UsageError(f"budget must be >= 1, got {self.budget}")
        L = len(self.layers)
        for phase, names in (("prefill", prefill_rules(self.rules)), ("decode", tuple(DECODE))):
            for l, lp in enumerate(self.layers):
                rule, b = getattr(lp, phase)
                if rule not in names:
                    raise UsageError(
                        f"layer {l}: unknown {phase} rule {rule!r}; choose from {', '.join(names)}"
                    )
                if not isinstance(b, int) or b < 0:
                    raise UsageError(
                        f"layer {l}: {phase} budget must be a non-negative integer, got {b!r}"
                    )
            total = sum(getattr(lp, phase).budget for lp in self.layers
                        if getattr(lp, phase).rule not in ("full", "append"))
            cap = L * (self.budget + (self.allowance if phase == "decode" else 0))
            if total > cap:
                raise UsageError(
                    f"{phase} budgets sum to {total} > L·B = {L}·{self.budget}"
                    + (
                        f" + L·{self.allowance} generated"
                        if phase == "decode" and self.allowance
                        else ""
                    )
                )

    @classmethod
    def uniform(cls, rule: str, budget: int, n_layers: int, decode: Optional[str] = None,
                settings: RuleSettings = RuleSettings(), rules: Optional[dict] = None) -> "Policy":
        """Every layer: (rule, budget) at prefill and the rule's own decode form; rules: the
        table `rule` is in (RULES if None)."""
        rules = RULES if rules is None else rules
        if rule == "pyramidkv":
            raise UsageError(
                "pyramidkv is SnapKV scoring with a layer schedule: use Policy.pyramid"
            )
        if rule not in prefill_rules(rules):
            raise UsageError(
                f"unknown rule {rule!r}; choose from {', '.join(prefill_rules(rules))}"
            )
        dec = decode or ("append" if rule == "full" else rules[rule].decode)
        return cls([LayerPolicy((rule, budget), (dec, budget)) for _ in range(n_layers)],
                   budget, settings, rules=rules)

    @classmethod
    def pyramid(cls, budget: int, n_layers: int, prompt_len: int,
                settings: RuleSettings = RuleSettings()) -> "Policy":
        """PyramidKV: SnapKV scoring with the pyramid layer schedule for a prompt of T tokens."""
        bs = pyramid_budgets(budget, prompt_len, n_layers, settings.window, settings.beta)
        return cls([LayerPolicy(("snapkv", b), ("append", b)) for b in bs], budget, settings)

    def with_allowance(self, n: int) -> "Policy":
        """Equal memory (docs/protocol.md): every decode budget raised by n generated tokens, so a
        layer may grow by the generated tokens as an appending method does, and its decode rule
        evicts only beyond that. The paper's protocol is n = 0."""
        layers = [
            LayerPolicy(lp.prefill, (lp.decode.rule, lp.decode.budget + n)) for lp in self.layers
        ]
        return Policy(layers, self.budget, self.settings, dict(self.meta), self.allowance + n,
                      self.rules)

    def rescaled(self, budget: int) -> "Policy":
        """The same rules with every phase's budgets scaled to average `budget` (exact sum L·B)."""
        L = len(self.layers)
        scaled = {}
        for phase in ("prefill", "decode"):
            old = [getattr(lp, phase).budget for lp in self.layers]
            tot = sum(old) or 1
            scaled[phase] = largest_remainder([b * L * budget / tot for b in old], L * budget)
        layers = [
            LayerPolicy(
                (lp.prefill.rule, scaled["prefill"][l]), (lp.decode.rule, scaled["decode"][l])
            )
            for l, lp in enumerate(self.layers)
        ]
        return Policy(layers, budget, self.settings, dict(self.meta), rules=self.rules)

    # -- the method interface ----------------------------------------------------------------
    def needs(self, model) -> Needs:
        """Per layer, what its prefill rule scores with and what its decode rule starts from."""
        if len(self.layers) != model.config.n_layers:
            raise UsageError(
                f"policy has {len(self.layers)} layers, the model has {model.config.n_layers}"
            )
        per_layer, computed = [], {}
        for lp in self.layers:
            rule = self.rules.get(lp.prefill.rule)       # None for "full"
            reads = set(rule.needs) if rule else set()
            if DECODE[lp.decode.rule].acc_from:
                reads.add(DECODE[lp.decode.rule].acc_from)
            per_layer.append(frozenset(reads))
            computed.update(rule.computed if rule else ())
        s = self.settings
        return Needs(tuple(per_layer), s.window, tuple(computed.items()), n_sink=s.n_sink,
                     future=s.future, repeat=s.repeat, repeat_from=s.repeat_from,
                     chunk=s.chunk)

    def compress(self, model, full: Cache, obs: Observation) -> Cache:
        """A new cache: layer l keeps min(b_l, T) entries per KV head chosen by its rule.

        `full` is left untouched, so several methods can share one FullKV prefill."""
        layers = []
        for l, (lc, lp) in enumerate(zip(full.layers, self.layers)):
            rule, b = lp.prefill
            B, G, T, _ = lc.k.shape
            if rule == "full" or b >= T:
                idx = torch.arange(T, device=lc.k.device).expand(B, G, T)
                kept = lc        # nothing evicted: share the tensors (appends never overwrite them)
            else:
                sc, prot = score(rule, score_input(obs, full, l, self.settings), self.rules)
                idx = select(sc.to(lc.k.device), b, prot).to(lc.k.device)    # (B, G, b)
                kept = lc.gather(idx)
            # a decode rule's running sums, kept entries
            start = DECODE[lp.decode.rule].acc_from
            if start:
                st = obs.stats[l][start]
                kept = replace(kept, acc=group_mean(st, G).gather(2, idx.to(st.device)))
            layers.append(kept)
        return Cache(layers, full.next_pos, full.last_logits)

    @property
    def decoder(self) -> Optional[Hooks]:
        """None when every layer appends; else hooks evicting back to the decode budgets."""
        if all(lp.decode.rule == "append" for lp in self.layers):
            return None
        return Hooks(cache_update=self.decode_update)

    def evicts_within(self, T: int, n: int) -> bool:
        """Some layer's decode rule evicts before n tokens have followed a T-token prompt."""
        for lp in self.layers:
            (rule, b), (dec, bd) = lp.prefill, lp.decode
            size = T if rule == "full" or b >= T else b
            if DECODE[dec].score is not None and bd < size + n:
                return True
        return False

    def decode_update(self, layer, q, q_pos, lc):
        """After a generated token: update the layer's decode state, evict down to its budget.

        streaming: drop the oldest non-sink; h2o: add the new query's attention (group mean) to
        the running column sums lc.acc, evict the lowest outside the recent r = w; tova: evict
        the lowest under the current query (mean over all H heads). `append` just grows."""
        rule, b = self.layers[layer].decode
        d = DECODE[rule]
        if d.score is None:
            return lc
        last = None
        if d.uses_last:
            # (B, H, S)
            last = attention_probs(q[:, :, -1:], lc.k, lc.bias, q_pos[:, -1:], lc.pos)[:, :, 0]
        if d.acc_from:
            lc = replace(lc, acc=lc.acc + group_mean(last, lc.k.shape[1]))
        if lc.size <= b:
            return lc
        sc, prot = d.score(lc, last, self.settings)
        return lc.gather(select(sc, b, prot))                                  # (B, G, b)

    # -- JSON -----------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": POLICY_FORMAT, "budget": self.budget, **self.meta,
                "settings": self.settings.__dict__,
                "layers": [{"prefill": lp.prefill._asdict(), "decode": lp.decode._asdict()}
                           for lp in self.layers]}

    def save(self, path):
        """Atomically: a later run never reads a half-written policy (temporary file + rename)."""
        write_atomic(path, json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path, n_layers: Optional[int] = None, rules: Optional[dict] = None) -> "Policy":
        """Read a policy file; n_layers (the model's) is checked when given; rules: the table
        its rules are in (RULES if None)."""
        try:
            d = json.loads(Path(path).read_text())
            layers = [
                LayerPolicy((x["prefill"]["rule"], x["prefill"]["budget"]),
                            (x["decode"]["rule"], x["decode"]["budget"]))
                for x in d["layers"]
            ]
            budget, settings = d["budget"], RuleSettings(**d.get("settings", {}))
        except OSError as e:
            raise UsageError(f"cannot read policy {str(path)!r}: {e.strerror}")
        except (ValueError, KeyError, TypeError) as e:
            raise UsageError(f"malformed policy {str(path)!r}: {type(e).__name__} {e}")
        if n_layers is not None and len(layers) != n_layers:
            raise UsageError(
                f"policy {str(path)!r} has {len(layers)} layers, the model has {n_layers}"
            )
        meta = {k: v for k, v in d.items() if k not in ("format", "budget", "settings", "layers")}
        return cls(layers, budget, settings, meta, rules=rules)


@dataclass
class Pyramid(Method):
    """PyramidKV: SnapKV scoring, per-layer budgets decreasing with depth (`pyramid_budgets`,
    which depend on the prompt length T, so the policy is made at compression time); append."""
    budget: int
    settings: RuleSettings = field(default_factory=RuleSettings)

    def needs(self, model) -> Needs:
        return Policy.uniform(
            "snapkv", self.budget, model.config.n_layers, "append", self.settings
        ).needs(model)

    def compress(self, model, full: Cache, obs: Observation) -> Cache:
        T = full.layers[0].k.shape[2]
        return Policy.pyramid(self.budget, model.config.n_layers, T, self.settings).compress(
            model, full, obs
        )




@torch.no_grad()
def prefill(model, tokens, policy: Policy) -> Cache:
    """Full prefill of tokens (1, T), then each layer compressed to its prefill budget."""
    return policy.prefill(model, tokens)
