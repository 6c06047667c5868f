"""PolyKV: per layer and phase, an eviction rule and a budget; the rules; the hooks that run them.

Implements the framework of Fei & Kalnis, "PolyKV: Heterogeneous Retention and Allocation for
KV Cache Compression" (arXiv 2606.15157, 2026; its later version "Exploring a Layer-Wise Design
Space for KV Cache Eviction"): a *policy* Π assigns every layer l and phase
φ ∈ {prefill, decode} an eviction rule r_{l,φ} and a budget b_{l,φ} with Σ_l b_{l,φ} <= L·B,
built offline (calibrate.py) and then only executed. Read top to bottom:

 1. The framework (the paper's hooks: pre-kernel, post-kernel, cache update; model.Hooks). Every
    compression method is a `Method`: it says what it must observe during the one shared
    full-attention prefill (`Needs`), compresses the FullKV cache once (`compress`) and may evict
    while decoding (`decoder`, a cache-update hook). `observe` runs the prefill for several
    methods at once, each layer's attention computed once in query chunks.
 2. The rules (the design space): one scoring function and one `@rule` record each, a shared
    top-k `select`, and each rule's decode form. Adding a rule is one function and one line;
    baselines.py adds the newer ones (K-norm, Expected Attention, KVzip) that way, with the
    statistics they observe, and the head-wise allocations (AdaKV, KVzip's).
 3. The policy that runs them (`Policy`: per layer a prefill and a decode `Phase`) and
    PyramidKV's layer schedule (`Pyramid`).

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
from support.fast_observe import ATTENTION_STATS, fused_kernel, observe_layer, prefix_layer
from support.files import write_atomic


# ============================================================================= 1. the framework

# Statistics a rule can read, per query head (B, H, T), read off A, the causal attention of the
# prompt during the prefill:
#   colsum   Σ_{all i} A[h,i,j]         H2O's heavy-hitter scores
#   window   Σ_{i in last w} A[h,i,j]   SnapKV's observation window
#   last     A[h,T−1,j]                 TOVA's last query
# A rule may read other statistics, registered by name where they are defined (`statistic`:
# baselines.py adds Expected Attention's `queries` and KVzip's `recon`).
# A method may add its own per-layer statistic (`Needs.extra`, e.g. GraceKV's value flow): an
# object with lowest(T) (the first query row it reads), begin(q, lc, layer) -> state,
# add(state, c0, c1, A) for each chunk of rows [c0, c1) with A (B, H, c, c1), end(state) -> value,
# and merge(other) -> the one statistic that serves both.


@dataclass(frozen=True)
class Statistic:
    """A statistic that is not a sum over the prompt's attention, computed either per layer from
    its queries during the prefill, per_layer(q, q_pos, model, needs) -> value, or by an extra
    pass after it, after(model, full, tokens, needs, layers) -> {layer: value} (the pass's time
    is reported in Observation.seconds under the statistic's name)."""
    per_layer: Optional[Callable] = None
    after: Optional[Callable] = None


STATISTICS: dict = {}     # name -> Statistic, in registration order


def statistic(name: str, per_layer: Optional[Callable] = None, after: Optional[Callable] = None):
    """Register the statistic `name` (one of per_layer and after)."""
    if (per_layer is None) == (after is None):
        raise UsageError(f"statistic {name!r}: give exactly one of per_layer and after")
    STATISTICS[name] = Statistic(per_layer, after)


@dataclass(frozen=True)
class Needs:
    """What a method must observe during the shared prefill."""
    stats: tuple = ()     # per layer, a frozenset of statistic names
    window: int = 32      # w of the `window` statistic
    chunk: int = 256      # query rows per chunk of the observation pass (memory only)
    extra: tuple = ()     # ((name, statistic), ...): a method's own per-layer statistics
    n_sink: int = 4       # `queries`: the first n_sink queries left out; `recon`: sinks kept
    future: int = 512     # `queries`: the next positions whose mean rotation is applied
    # `recon`: the reconstruction prompt's ids (support.tasks.reconstruction_prompt)
    repeat: tuple = ()
    repeat_from: int = 0  # `recon`: the first prompt position reconstructed (RuleSettings)
    surprisal: bool = False  # −log p of each prompt token (model.surprisal; GraceKV's boundaries)
    @property
    def used(self) -> frozenset:
        """Every statistic some layer reads."""
        return frozenset().union(*self.stats)


# which statistic each parameter of Needs serves (methods sharing a prefill must agree on it)
PARAMS = {"window": "window", "n_sink": "queries", "future": "queries", "repeat": "recon",
          "repeat_from": "recon"}


def union(needs: list, n_layers: int) -> Needs:
    """For all of `needs`: per layer the union of the statistics, extras merged by name, the
    smallest chunk; methods reading a statistic must agree on its parameters (PARAMS)."""
    stats = [frozenset()] * n_layers
    params, extra, chunk = {}, {}, min([n.chunk for n in needs] or [256])
    for n in needs:
        for p, stat in PARAMS.items():
            if stat in n.used:
                if params.setdefault(p, getattr(n, p)) != getattr(n, p):
                    raise UsageError(
                        f"methods observe with different {p}: {params[p]} vs {getattr(n, p)}"
                    )
        if any(n.stats):
            stats = [a | b for a, b in zip(stats, n.stats)]
        for name, st in n.extra:
            extra[name] = st if name not in extra else extra[name].merge(st)
    return Needs(tuple(stats), chunk=chunk, extra=tuple(extra.items()),
                 surprisal=any(n.surprisal for n in needs), **params)


@dataclass
class Observation:
    stats: list                     # [dict name -> (B, H, T)] * L
    extra: dict = field(default_factory=dict)   # name -> [value per layer] (Needs.extra)
    seconds: dict = field(default_factory=dict)  # name -> time of an extra pass (KVzip's `recon`)
    surprisal: Optional[torch.Tensor] = None     # (B, T) if Needs.surprisal
    # the prompt position of the observed keys' first one: 0, or under the `context` protocol
    # the context's start (support/protocols.cut), so that rules protect the prompt's own edges
    first: int = 0


class Method:
    """The interface every compression method implements (the shape of NVIDIA kvpress's presses):
      needs(model)               what it must observe during the full-attention prefill (`Needs`);
      compress(model, full, obs) (FullKV cache, `Observation`) -> its compressed cache; `full` is
                                 left untouched, so several methods share one prefill;
      decoder                    None = append every generated token, else hooks whose
                                 cache_update evicts after each step (model.decode);
      prefill(model, tokens)     observe + compress for this method alone.
    Subclasses: Policy, Pyramid, gracekv.GraceKV."""

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


def observe_layer_naive(q, q_pos, lc, names, window: int, chunk: int = 0,
                        extra=(), layer: int = 0, ends=None):
    """Every requested statistic of one layer from its whole attention matrix, the naive form:
    A (B, H, T, T) = model.attention_probs of the prompt's queries q (B, H, T, D) over its fresh
    cache lc, then the column sums, the window sums and the last row, and each extra statistic
    fed the rows it reads in one piece. support/fast_observe.py computes the same in query
    chunks, never holding A (the default of `observe`; tested equal). chunk: unused here.

    ends: the prompt lengths e to read statistics for (default T alone). Attention is causal, so
    the rows i < e of A over keys j < e are the attention of the prefix tokens[:, :e] itself:
    a prefix's statistics are those of A[:, :, :e, :e] (`observe_prefixes`).
    Returns {e: ({name: (B, H, e)}, {extra name: value})}."""
    B, H, T, D = q.shape
    names = [k for k in names if k in ATTENTION_STATS]
    A = attention_probs(q, lc.k, lc.bias, q_pos, lc.pos)                 # (B, H, T, T) causal
    result = {}
    for e in ends or (T,):
        Ae = A[:, :, :e, :e]                                             # (B, H, e, e)
        out = {}
        if "colsum" in names:
            out["colsum"] = Ae.sum(2)                                      # Σ_{all i} A[h,i,j]
        if "window" in names:
            out["window"] = Ae[:, :, e - min(window, e):].sum(2)         # Σ_{i ≥ e−w} A[h,i,j]
        if "last" in names:
            out["last"] = Ae[:, :, -1]                                     # A[h,e−1,j]
        values = {}
        for name, st in extra:
            lo = st.lowest(e, layer)
            state = st.begin(q[:, :, :e], prefix_layer(lc, e), layer)
            st.add(state, lo, e, Ae[:, :, lo:])                            # rows lo..e−1
            values[name] = st.end(state)
        result[e] = out, values
    return result


@torch.no_grad()
def observe(model, tokens, needs: Needs, spy=None, layer_pass=observe_layer):
    """One full-attention prefill of tokens (B, T) recording what `needs` asks for, each layer's
    attention computed once (then the extra passes of the statistics read, e.g. KVzip's):
    (FullKV cache, Observation). spy: an extra post-kernel callable (layer, q, q_pos, lc, out);
    layer_pass: how a layer's statistics are read off its attention, in query chunks
    (support/fast_observe.py) or `observe_layer_naive`."""
    T = tokens.shape[1]
    return observe_prefixes(model, tokens, needs, (T,), spy, layer_pass)[T]


@torch.no_grad()
def observe_prefixes(model, tokens, needs: Needs, ends, spy=None, layer_pass=observe_layer,
                     fuse: bool = True):
    """`observe` of each prefix tokens[:, :e], e in ends, from one prefill of tokens (B, T):
    {e: (FullKV cache of the prefix, its Observation)}. Attention is causal, so the first e
    query rows and keys of the prefill are those of the prefix's own prefill: each statistic of
    a prefix is read over its own rows and keys in the same pass (the `agnostic` protocol's
    prefix + context within the whole prompt: evaluate.py). The prefix's cache is the first e
    entries of each layer (views), its last_logits those after token e−1. The extra passes
    after the prefill (KVzip's reconstruction) run once per prefix: theirs is another prompt.
    fuse (the fast layer pass on a fast model only): a layer whose statistics read every query
    row computes its attention output in the same chunks, instead of the model's kernel."""
    T, L = tokens.shape[1], model.config.n_layers
    ends = sorted(set(ends), reverse=True)
    if not ends or not all(0 < e <= T for e in ends):
        raise UsageError(f"prefix lengths {ends} must lie in 1..{T}")
    per_layer = needs.stats or (frozenset(),) * L
    obs = {e: Observation([dict() for _ in range(L)], {name: [None] * L for name, _ in needs.extra})
           for e in ends}
    last_logits = {}

    unknown = set().union(*per_layer) - set(ATTENTION_STATS) - set(STATISTICS)
    if unknown:
        raise UsageError(f"no statistic named {sorted(unknown)[0]!r} is registered "
                         f"(import the module that defines it, e.g. baselines)")
    during = [n for n, st in STATISTICS.items() if st.per_layer is not None]

    def layer_read(layer, q, q_pos, lc, chunk=needs.chunk, **out):
        return layer_pass(q, q_pos, lc, per_layer[layer], needs.window, chunk, needs.extra,
                          layer, ends, **out)

    # the fast path's kernel (support/fast_observe.fused_kernel): where the statistics read every
    # query row, the chunked pass also computes the layer's attention output, so the attention
    # is computed once, not twice
    fused = fuse and layer_pass is observe_layer and model.fast
    read = {}                                     # layer -> what the fused kernel read

    def post_kernel(layer, q, q_pos, lc, out):
        names = per_layer[layer]
        got = read.pop(layer) if layer in read else layer_read(layer, q, q_pos, lc)
        for e, (stats, values) in got.items():
            obs[e].stats[layer] = stats
            for name in during:
                if name in names:
                    stats[name] = STATISTICS[name].per_layer(q[:, :, :e], q_pos[:, :e], model,
                                                             needs)
            for name, value in values.items():
                obs[e].extra[name][layer] = value
        if spy is not None:
            spy(layer, q, q_pos, lc, out)

    def final(h):                                 # the final norm's output (B, T, dim)
        # −log p(token_t | tokens_<t) reads nothing after t: a prefix's is the prompt's first e
        surprisal = M.surprisal(model, h, tokens) if needs.surprisal else None
        for e in ends:
            if surprisal is not None:
                obs[e].surprisal = surprisal[:, :e]
            if e < T:                             # the logits after token e−1, as Llama.step
                logits = model.lm_head(h[:, e - 1])
                last_logits[e] = logits if logits.dtype == torch.float64 else logits.float()

    wanted = any(per_layer) or needs.extra or spy
    hooks = (Hooks(post_kernel=post_kernel if wanted else None,
                   final=final if needs.surprisal or ends != [T] else None,
                   kernel=fused_kernel(per_layer, needs, layer_read, read)
                   if fused and wanted else None)
             if wanted or needs.surprisal or ends != [T] else None)
    full = M.prefill(model, tokens, hooks)
    caches = {e: full if e == T else
              Cache([prefix_layer(lc, e) for lc in full.layers], e, last_logits[e])
              for e in ends}
    for name, st in STATISTICS.items():          # extra passes after the prefill
        layers = [l for l in range(L) if name in per_layer[l]]
        if st.after is not None and layers:
            for e in ends:
                t0 = time.perf_counter()
                for l, value in st.after(model, caches[e], tokens[:, :e], needs, layers).items():
                    obs[e].stats[l][name] = value
                obs[e].seconds[name] = time.perf_counter() - t0
    return {e: (caches[e], obs[e]) for e in ends}


def observe_for(model, tokens, methods: list):
    """The shared prefill of several methods: observe(model, tokens, union of their needs)."""
    return observe(model, tokens, union([m.needs(model) for m in methods], model.config.n_layers))


# ============================================================================= 2. the rules
# A rule is one small scoring function under its formula and citation, registered with its needs
# (which prefill statistics it reads) and its decode form (what it does while decoding).
# Everything else reads the registry when it is used: `Policy`, `evaluate.py --methods`,
# calibration's pool (`pool()`), the report's baselines, the rule tests; README "Add your own rule".
# A scoring function takes a `ScoreInput` and returns (scores (B, G, T) or broadcastable to it,
# higher = keep; protected (T,) bool, always kept). `select` keeps the top-`budget` (protected
# first, ties toward the later position) sorted by position. GQA: a score per query head is
# reduced to its KV head by the mean over its g query heads (kvpress convention); TOVA averages
# over all H heads (one kept set per layer, as `tova_cache.py`). Departures from the original
# code (docs/design.md): H2O and TOVA score once after a full prefill (KVCache-Factory's form),
# not token by token; StreamingLLM's kept keys keep their rotation; PyramidKV is SnapKV with a
# layer schedule (`pyramid_budgets`), not a rule.

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
    """What a scoring function may read about one layer after the prefill.

    The protections a rule keeps (attention sinks, the observation window) sit at the edges of
    the *prompt*, not of the keys scored: `sinks(n)` are the keys among the prompt's first n
    positions and `recent(w)` those among its last w. They are the first n and last w keys
    when the whole prompt is scored; under the `context` protocol the keys are the context
    alone (positions first..first+T−1 of a prompt ending at `end`), the real sinks sit in the
    free prefix and the window in the free question, so neither protects a context token
    (only the window's part that the question does not cover, if it is shorter than w)."""
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

    def positions(self) -> torch.Tensor:                 # (T,) the keys' prompt positions
        return torch.arange(self.first, self.first + self.k.shape[2], device=self.k.device)

    def prompt_end(self) -> int:
        return self.first + self.k.shape[2] if self.end is None else self.end

    def sinks(self, n: int) -> torch.Tensor:             # (T,) keys among the first n positions
        return self.positions() < n

    def recent(self, w: int) -> torch.Tensor:            # (T,) keys among the last w positions
        return self.positions() >= self.prompt_end() - w

    def n_sinks(self, n: int) -> int:                    # how many keys `sinks(n)` holds
        return max(0, min(self.k.shape[2], n - self.first))

    def n_before(self, w: int) -> int:                   # how many keys precede the last w
        return max(0, min(self.k.shape[2], self.prompt_end() - w - self.first))


def score_input(obs: "Observation", full: Cache, layer: int, settings: RuleSettings) -> ScoreInput:
    """Layer `layer`'s ScoreInput from a FullKV cache (or the context protocol's cut of one) and
    its observation."""
    lc = full.layers[layer]
    return ScoreInput(obs.stats[layer], lc.k, layer, settings, lc.v, obs.first, full.next_pos)


@dataclass(frozen=True)
class Rule:
    name: str
    score: Callable       # ScoreInput -> (scores (B, G, T), protected (T,))
    needs: frozenset      # prefill statistics it reads (by name)
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


def none_protected(T: int, device=None) -> torch.Tensor:      # (T,) nothing protected
    return torch.zeros(T, dtype=torch.bool, device=device)


def recent(T: int, w: int, device=None) -> torch.Tensor:     # (T,) the last w positions
    return torch.arange(T, device=device) >= T - w


def sinks(T: int, n: int, device=None) -> torch.Tensor:      # (T,) the first n positions
    return torch.arange(T, device=device) < n


# ----------------------------------------------------------------------------- the rules

@rule("streaming", decode="streaming")
def streaming(x: ScoreInput):
    """StreamingLLM (Xiao et al. 2023, `streaming_llm/kv_cache.py`): the first n_sink tokens
    (attention sinks) + the most recent; score = position."""
    B, G, T = x.shape
    dev = x.k.device
    return (torch.arange(T, dtype=torch.float64, device=dev).expand(B, G, T),
            x.sinks(x.settings.n_sink))


@rule("h2o", needs={"colsum"}, decode="h2o")
def h2o(x: ScoreInput):
    """H2O (Zhang et al. 2023, `h2o_hf/utils_hh/modify_llama.py`; KVCache-Factory's one-shot
    form): s_j = Σ_{all i} A[h,i,j], group mean; the recent r = w tokens kept."""
    B, G, T = x.shape
    return group_mean(x.stats["colsum"], G), x.recent(x.settings.window)


@rule("tova", needs={"last"}, decode="tova")
def tova(x: ScoreInput):
    """TOVA (Oren et al. 2024, `src/tova_cache.py`): s_j = mean_h A[h,T−1,j] over all H heads
    of the layer, one kept set shared by its KV heads."""
    B, G, T = x.shape
    sc = x.stats["last"].mean(1, keepdim=True).expand(B, G, T)
    if x.settings.tova_keep_last:        # kvpress: scores of keys < T−1, the last token kept
        return sc, x.recent(1)
    return sc, none_protected(T, x.k.device)


@rule("snapkv", needs={"window"})
def snapkv(x: ScoreInput):
    """SnapKV (Li et al. 2024, `snapkv/monkeypatch/snapkv_utils.py`): s_j = Σ_{i in last w}
    A[h,i,j] for j < T−w, max-pooled over j (kernel k, stride 1, padding k//2), group mean;
    the window itself is kept. (T−w: the keys before the prompt's last w, `n_before`.)"""
    B, G, T = x.shape
    s = x.settings
    win = x.stats["window"][:, :, : x.n_before(s.window)]                     # (B, H, T−w)
    if win.shape[2]:
        pool = F.max_pool1d if s.pool == "max" else F.avg_pool1d              # avg: kvpress
        win = pool(win, s.kernel, stride=1, padding=s.kernel // 2)            # (B, H, T−w)
    sc = torch.cat((group_mean(win, G), win.new_zeros(B, G, T - win.shape[2])), 2)
    return sc, x.recent(s.window)


@rule("random", pool=False)
def random(x: ScoreInput):
    """A floor: uniform random scores from (seed, layer), drawn on the CPU's generator whatever
    the model's device (the same scores on every device), then moved to the keys' device."""
    B, G, T = x.shape
    g = torch.Generator("cpu").manual_seed(x.settings.seed * 100003 + x.layer)
    sc = torch.rand(1, G, T, generator=g, dtype=torch.float64, device="cpu").to(x.k.device)
    return sc.expand(B, G, T), none_protected(T, x.k.device)


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


# ============================================================================= 3. the policy

def prefill_rules() -> tuple:
    """"full" (keep every entry) and every registered rule, those registered at run time too."""
    return ("full",) + tuple(RULES)


def pool() -> tuple:
    """PolyKV's prefill patterns: every registered rule but the random floor, read when called
    (a rule registered at run time joins the calibration pool)."""
    return tuple(name for name, r in RULES.items() if r.pool)


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

    def __post_init__(self):
        if self.budget < 1:
            raise UsageError(f"budget must be >= 1, got {self.budget}")
        L = len(self.layers)
        for phase, names in (("prefill", prefill_rules()), ("decode", tuple(DECODE))):
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
                settings: RuleSettings = RuleSettings()) -> "Policy":
        """Every layer: (rule, budget) at prefill and the rule's own decode form."""
        if rule == "pyramidkv":
            raise UsageError(
                "pyramidkv is SnapKV scoring with a layer schedule: use Policy.pyramid"
            )
        if rule not in prefill_rules():
            raise UsageError(f"unknown rule {rule!r}; choose from {', '.join(prefill_rules())}")
        dec = decode or ("append" if rule == "full" else RULES[rule].decode)
        return cls([LayerPolicy((rule, budget), (dec, budget)) for _ in range(n_layers)],
                   budget, settings)

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
        return Policy(layers, self.budget, self.settings, dict(self.meta), self.allowance + n)

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
        return Policy(layers, budget, self.settings, dict(self.meta))

    # -- the method interface ----------------------------------------------------------------
    def needs(self, model) -> Needs:
        """Per layer, what its prefill rule scores with and what its decode rule starts from."""
        if len(self.layers) != model.config.n_layers:
            raise UsageError(
                f"policy has {len(self.layers)} layers, the model has {model.config.n_layers}"
            )
        per_layer = tuple(
            (RULES[lp.prefill.rule].needs if lp.prefill.rule in RULES else frozenset())
            | (
                {DECODE[lp.decode.rule].acc_from}
                if DECODE[lp.decode.rule].acc_from
                else frozenset()
            )
            for lp in self.layers
        )
        s = self.settings
        return Needs(
            per_layer, s.window, s.chunk, n_sink=s.n_sink, future=s.future, repeat=s.repeat,
            repeat_from=s.repeat_from
        )

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
                sc, prot = score(rule, score_input(obs, full, l, self.settings))
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
    def load(cls, path, n_layers: Optional[int] = None) -> "Policy":
        """Read a policy file; n_layers (the model's) is checked when given."""
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
        return cls(layers, budget, settings, meta)


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
