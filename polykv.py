"""Eviction rules, per-layer / per-phase policies, and the hooks that run them.

Implements the uniform baselines the PolyKV paper (Fei & Kalnis, 2026; seeds 000/001) compares
against, and its framework: a *policy* assigns every layer l and phase φ ∈ {prefill, decode} a
rule r_{l,φ} and a budget b_{l,φ}. Rules plug into the model's hook points (model.Hooks): the
post-kernel hook observes attention statistics, the cache-update hook evicts.

Notation (SPEC.md): B batch, T prompt tokens, S cached entries, H query heads, G KV heads,
g = H/G, D head dim, L layers, w observation window, A[h,i,j] the causal attention (fp32).

Each rule is one small scoring function `(B, G, T)` (higher = keep) plus a set of protected
tokens; one shared `select` keeps the top-`budget` scores (protected first, ties toward the
later position), sorted by position. GQA: a score per query head is reduced to its KV head by
the mean over its g query heads (kvpress convention); TOVA averages over all H heads of the
layer (one kept set shared by the layer's KV heads, as in TOVA's `tova_cache.py`).

Departures from the original code, all following SPEC.md §3:
- H2O and TOVA evict token by token during prefill in their original code; here, as in
  KVCache-Factory and the PolyKV framework, they score once after a full-attention prefill.
- H2O's column sums Σ_i A[h,i,j] are reduced chunk by chunk of queries: no (H, T, T) tensor.
- StreamingLLM re-assigns cache positions to the kept tokens; here kept keys keep their
  original rotation and queries their true positions (the cache contract of model.py).
- PyramidKV's per-layer sizes use largest-remainder rounding instead of integer division, so
  that Σ_l b_l = L·B exactly (KVCache-Factory's `//` drifts above the average budget).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

import model as M
from model import Cache, Hooks, UsageError, attention_probs

RULES = ("full", "streaming", "h2o", "tova", "snapkv", "pyramidkv", "random")
DECODE_RULES = ("append", "streaming", "h2o", "tova")
DEFAULT_DECODE = {"full": "append", "streaming": "streaming", "h2o": "h2o", "tova": "tova",
                  "snapkv": "append", "pyramidkv": "append", "random": "append"}


@dataclass(frozen=True)
class RuleSettings:
    window: int = 32      # w: SnapKV paper's LongBench configs (KVCache-Factory uses 8); H2O's recent r = w
    kernel: int = 7       # SnapKV max-pool kernel (SnapKV paper, KVCache-Factory)
    n_sink: int = 4       # StreamingLLM attention sinks (Xiao et al. 2023, §3.2)
    beta: float = 20.0    # PyramidKV's ratio max/min of selected tokens (KVCache-Factory default)
    seed: int = 0         # the `random` floor's seed
    chunk: int = 256      # queries per chunk when reducing H2O's column sums

    def __post_init__(self):
        for name in ("window", "kernel", "chunk"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_sink < 0 or self.beta <= 1:
            raise UsageError(f"need n_sink >= 0 and beta > 1, got {self.n_sink}, {self.beta}")


# ----------------------------------------------------------------------------- observation

# which attention statistics each rule needs from the prefill (per query head, (B, H, T)):
#   colsum = Σ_{all i} A[h,i,j] (H2O), window = Σ_{i in last w} A[h,i,j] (SnapKV), last = A[h,T−1,j]
NEEDS = {"full": set(), "streaming": set(), "random": set(), "h2o": {"colsum"},
         "tova": {"last"}, "snapkv": {"window"}, "pyramidkv": {"window"}}


def attention_stats(q, q_pos, lc, needs: set, s: RuleSettings) -> dict:
    """Per-head attention statistics of the new queries q (B, H, T, D) over the layer cache lc.

    Each entry is (B, H, S) fp32. Queries are processed chunk by chunk (all of them for colsum,
    only the last w otherwise), so at most (B, H, chunk, S) probabilities exist at once."""
    T = q.shape[2]
    first = 0 if "colsum" in needs else max(0, T - s.window) if "window" in needs else T - 1
    out = {}
    for a in range(first, T if needs else first, s.chunk):
        b = min(a + s.chunk, T)
        p = attention_probs(q[:, :, a:b], lc.k, lc.bias, q_pos[:, a:b], lc.pos)  # (B, H, b−a, S)
        parts = {"colsum": p.sum(2),                                          # Σ_{all i} A[h,i,j]
                 "window": p[:, :, max(0, T - s.window - a):].sum(2),         # Σ_{i ≥ T−w} A[h,i,j]
                 "last": p[:, :, -1] if b == T else None}                     # A[h,T−1,j]
        for k in needs:
            if parts[k] is not None:
                out[k] = out[k] + parts[k] if k in out and k != "last" else parts[k]
    return out


def observe(model, tokens, needs, settings: RuleSettings = RuleSettings()):
    """One full-attention prefill of tokens (B, T), recording per layer the stats in needs[l].

    Returns (FullKV cache, [dict of (B, H, T) stats] * L). Shared by every method of a sample."""
    stats = [dict() for _ in range(model.config.n_layers)]

    def post_kernel(layer, q, q_pos, lc, out):
        stats[layer] = attention_stats(q, q_pos, lc, needs[layer], settings)

    cache = M.prefill(model, tokens, Hooks(post_kernel=post_kernel))
    return cache, stats


# ----------------------------------------------------------------------------- scoring

def group_mean(s: torch.Tensor, G: int) -> torch.Tensor:
    """(B, H, S) per query head -> (B, G, S): mean over each KV head's g query heads."""
    B, H, S = s.shape
    return s.view(B, G, H // G, S).mean(2)


def score(rule: str, st: dict, T: int, G: int, s: RuleSettings, layer: int = 0):
    """Scores (B, G, T), higher = keep, and protected mask (T,) for a prefill rule."""
    idx = torch.arange(T)
    recent = idx >= T - s.window
    if rule == "streaming":      # StreamingLLM: sinks + most recent; score = position
        return idx.double().expand(1, G, T), idx < s.n_sink
    if rule == "h2o":            # H2O: s_j = Σ_i A[h,i,j] over all prompt queries; recent r = w kept
        return group_mean(st["colsum"], G), recent
    if rule == "tova":           # TOVA: s_j = mean_h A[h,T−1,j], shared by the layer's KV heads
        return st["last"].mean(1, keepdim=True).expand(-1, G, -1), torch.zeros(T, dtype=torch.bool)
    if rule in ("snapkv", "pyramidkv"):
        # SnapKV: s_j = Σ_{i in last w} A[h,i,j] for j < T−w, max-pooled over j (kernel k,
        # stride 1, padding k//2), then mean over the group; the window itself is kept
        win = st["window"][:, :, : max(T - s.window, 0)]                      # (B, H, T−w)
        if win.shape[2]:
            win = F.max_pool1d(win, s.kernel, stride=1, padding=s.kernel // 2)  # (B, H, T−w)
        sc = torch.cat((group_mean(win, G), win.new_zeros(win.shape[0], G, T - win.shape[2])), 2)
        return sc, recent
    if rule == "random":         # a floor: uniform scores from (seed, layer)
        g = torch.Generator().manual_seed(s.seed * 100003 + layer)
        return torch.rand(1, G, T, generator=g, dtype=torch.float64), torch.zeros(T, dtype=torch.bool)
    raise UsageError(f"unknown rule {rule!r}; choose from {', '.join(RULES)}")


def select(scores: torch.Tensor, budget: int, protected: torch.Tensor) -> torch.Tensor:
    """Indices (B, G, budget) of the kept entries, ascending by position.

    Protected entries first, then the highest scores; ties go to the later position (a stable
    descending sort over the position-reversed scores)."""
    B, G, S = scores.shape
    sc = scores.double().masked_fill(protected.to(scores.device), float("inf"))
    order = torch.sort(sc.flip(-1), dim=-1, descending=True, stable=True).indices  # (B, G, S)
    keep = (S - 1) - order[..., :budget]                                   # (B, G, budget)
    return keep.sort(-1).values


# ----------------------------------------------------------------------------- policy

@dataclass
class LayerPolicy:
    prefill: tuple    # (rule, budget)
    decode: tuple     # (rule, budget); rule "append" grows without bound


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
class Policy:
    """Per layer a prefill (rule, budget) and a decode (rule, budget); `budget` = average B."""
    layers: list
    budget: int
    settings: RuleSettings = field(default_factory=RuleSettings)
    meta: dict = field(default_factory=dict)   # e.g. calibration signals, model name

    def __post_init__(self):
        if self.budget < 1:
            raise UsageError(f"budget must be >= 1, got {self.budget}")
        L = len(self.layers)
        for phase, rules in (("prefill", RULES), ("decode", DECODE_RULES)):
            for l, lp in enumerate(self.layers):
                rule, b = getattr(lp, phase)
                if rule not in rules:
                    raise UsageError(f"layer {l}: unknown {phase} rule {rule!r}; choose from {', '.join(rules)}")
                if not isinstance(b, int) or b < 0:
                    raise UsageError(f"layer {l}: {phase} budget must be a non-negative integer, got {b!r}")
            total = sum(getattr(lp, phase)[1] for lp in self.layers
                        if getattr(lp, phase)[0] not in ("full", "append"))
            if total > L * self.budget:
                raise UsageError(f"{phase} budgets sum to {total} > L·B = {L}·{self.budget}")

    @classmethod
    def uniform(cls, rule: str, budget: int, n_layers: int, decode: Optional[str] = None,
                settings: RuleSettings = RuleSettings()) -> "Policy":
        """Every layer: (rule, budget) at prefill and the rule's own decode form (SPEC §3)."""
        if rule not in RULES:
            raise UsageError(f"unknown rule {rule!r}; choose from {', '.join(RULES)}")
        dec = decode or DEFAULT_DECODE[rule]
        return cls([LayerPolicy((rule, budget), (dec, budget)) for _ in range(n_layers)],
                   budget, settings)

    @classmethod
    def pyramid(cls, budget: int, n_layers: int, prompt_len: int,
                settings: RuleSettings = RuleSettings()) -> "Policy":
        """PyramidKV: SnapKV scoring with the pyramid layer schedule for a prompt of T tokens."""
        bs = pyramid_budgets(budget, prompt_len, n_layers, settings.window, settings.beta)
        return cls([LayerPolicy(("pyramidkv", b), ("append", b)) for b in bs], budget, settings)

    def rescaled(self, budget: int) -> "Policy":
        """The same rules with every phase's budgets scaled to average `budget` (exact sum L·B)."""
        L = len(self.layers)
        scaled = {}
        for phase in ("prefill", "decode"):
            old = [getattr(lp, phase)[1] for lp in self.layers]
            tot = sum(old) or 1
            scaled[phase] = largest_remainder([b * L * budget / tot for b in old], L * budget)
        layers = [LayerPolicy((lp.prefill[0], scaled["prefill"][l]), (lp.decode[0], scaled["decode"][l]))
                  for l, lp in enumerate(self.layers)]
        return Policy(layers, budget, self.settings, dict(self.meta))

    def prefill(self, model, tokens) -> Cache:
        return prefill(model, tokens, self)

    # -- JSON -----------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": "polykv-policy/1", "budget": self.budget, **self.meta,
                "settings": self.settings.__dict__,
                "layers": [{"prefill": {"rule": lp.prefill[0], "budget": lp.prefill[1]},
                            "decode": {"rule": lp.decode[0], "budget": lp.decode[1]}}
                           for lp in self.layers]}

    def save(self, path):
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path, n_layers: Optional[int] = None) -> "Policy":
        """Read a policy file; n_layers (the model's) is checked when given."""
        try:
            d = json.loads(Path(path).read_text())
            layers = [LayerPolicy((x["prefill"]["rule"], x["prefill"]["budget"]),
                                  (x["decode"]["rule"], x["decode"]["budget"])) for x in d["layers"]]
            budget, settings = d["budget"], RuleSettings(**d.get("settings", {}))
        except OSError as e:
            raise UsageError(f"cannot read policy {str(path)!r}: {e.strerror}")
        except (ValueError, KeyError, TypeError) as e:
            raise UsageError(f"malformed policy {str(path)!r}: {type(e).__name__} {e}")
        if n_layers is not None and len(layers) != n_layers:
            raise UsageError(f"policy {str(path)!r} has {len(layers)} layers, the model has {n_layers}")
        meta = {k: v for k, v in d.items() if k not in ("format", "budget", "settings", "layers")}
        return cls(layers, budget, settings, meta)


# ----------------------------------------------------------------------------- prefill

def needs_of(policy: Policy) -> list:
    """Per layer, the statistics its prefill rule (and an H2O decode's initial sums) need."""
    return [NEEDS[lp.prefill[0]] | ({"colsum"} if lp.decode[0] == "h2o" else set())
            for lp in policy.layers]


@torch.no_grad()
def prefill(model, tokens, policy: Policy) -> Cache:
    """Full prefill of tokens (1, T), then each layer compressed to its prefill budget."""
    if len(policy.layers) != model.config.n_layers:
        raise UsageError(f"policy has {len(policy.layers)} layers, the model has {model.config.n_layers}")
    cache, stats = observe(model, tokens, needs_of(policy), policy.settings)
    return compress(cache, stats, policy)


def compress(full: Cache, stats: list, policy: Policy) -> Cache:
    """A new cache: layer l keeps min(b_l, T) entries per KV head chosen by its rule.

    `full` is left untouched, so several policies can share one FullKV prefill."""
    layers, kept_idx = [], []
    for l, (lc, lp) in enumerate(zip(full.layers, policy.layers)):
        rule, b = lp.prefill
        B, G, T, _ = lc.k.shape
        if rule == "full" or b >= T:
            idx = torch.arange(T, device=lc.k.device).expand(B, G, T)
            layers.append(lc)       # nothing evicted: share the tensors (never written in place)
        else:
            sc, prot = score(rule, stats[l], T, G, policy.settings, l)
            idx = select(sc.to(lc.k.device), b, prot).to(lc.k.device)         # (B, G, b)
            layers.append(lc.gather(idx))
        kept_idx.append(idx)
    cache = Cache(layers, full.next_pos, full.last_logits)
    cache.hooks = decode_hooks(policy, stats, kept_idx)
    return cache


# ----------------------------------------------------------------------------- decode

def decode_hooks(policy: Policy, stats: list, kept_idx: list) -> Optional[Hooks]:
    """Hooks that keep each layer within its decode budget after every generated token.

    streaming: drop the oldest non-sink; h2o: add each new query's attention (group mean) to
    the running column sums, evict the lowest outside the recent r = w; tova: evict the lowest
    under the current query (mean over all H heads). `append` layers just grow."""
    s = policy.settings
    if all(lp.decode[0] == "append" for lp in policy.layers):
        return None
    acc = {}      # layer -> running H2O sums (B, G, S), aligned with the cache entries
    for l, lp in enumerate(policy.layers):
        if lp.decode[0] == "h2o":
            G = kept_idx[l].shape[1]
            acc[l] = group_mean(stats[l]["colsum"], G).gather(2, kept_idx[l].to(stats[l]["colsum"].device))
    last = {}

    def post_kernel(layer, q, q_pos, lc, out):
        if policy.layers[layer].decode[0] in ("h2o", "tova"):
            last[layer] = attention_probs(q[:, :, -1:], lc.k, lc.bias, q_pos[:, -1:], lc.pos)[:, :, 0]

    def cache_update(layer, lc):
        rule, b = policy.layers[layer].decode
        G, S = lc.k.shape[1], lc.size
        if rule == "h2o":
            new = group_mean(last[layer], G)                                  # (B, G, S)
            prev = acc[layer].to(new.device)
            acc[layer] = torch.cat((prev, new.new_zeros(*prev.shape[:2], S - prev.shape[2])), 2) + new
        if rule == "append" or S <= b:
            return lc
        order = torch.arange(S, device=lc.k.device)
        if rule == "streaming":
            sc, prot = lc.pos.double(), order < s.n_sink          # oldest non-sink has lowest pos
        elif rule == "h2o":
            sc, prot = acc[layer], order >= S - s.window
        else:  # tova
            sc, prot = last[layer].mean(1, keepdim=True).expand(-1, G, -1), torch.zeros_like(order, dtype=torch.bool)
        idx = select(sc, b, prot)                                             # (B, G, b)
        if rule == "h2o":
            acc[layer] = acc[layer].gather(2, idx)
        return lc.gather(idx)

    return Hooks(post_kernel=post_kernel, cache_update=cache_update)
