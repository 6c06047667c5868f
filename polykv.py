"""PolyKV's policies: per layer and phase, an eviction rule and a budget; and how they run.

Implements the framework of Fei & Kalnis, "PolyKV: Heterogeneous Retention and Allocation for
KV Cache Compression" (2026; seeds 000/001, SPEC.md §4): a *policy* Π assigns every layer l and
phase φ ∈ {prefill, decode} a rule r_{l,φ} and a budget b_{l,φ} with Σ_l b_{l,φ} <= L·B. The
rules are the registry of rules.py; a uniform baseline is the policy with one rule everywhere.
A Policy is a methods.Method: it observes what its rules need during the shared prefill,
compresses each layer once by its prefill rule, and its `decoder` evicts each layer back to its
decode budget after every generated token (decode rules streaming, h2o, tova; `append` grows).

Notation (SPEC.md): B batch, T prompt tokens, S cached entries, H query heads, G KV heads,
L layers, w observation window.

PyramidKV (Cai et al. 2024) is SnapKV scoring with a layer schedule (`pyramid_budgets`); its
per-layer sizes use largest-remainder rounding instead of integer division, so that
Σ_l b_l = L·B exactly (KVCache-Factory's `//` drifts above the average budget).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import torch

import methods
import rules
from cache import Cache
from errors import UsageError
from model import Hooks, attention_probs
from rules import DECODE, RULES, RuleSettings, ScoreInput, group_mean, select



def prefill_rules() -> tuple:
    """"full" (keep every entry) and every registered rule, those registered at run time too."""
    return ("full",) + tuple(RULES)


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
class Policy(methods.Method):
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
                    raise UsageError(f"layer {l}: unknown {phase} rule {rule!r}; choose from {', '.join(names)}")
                if not isinstance(b, int) or b < 0:
                    raise UsageError(f"layer {l}: {phase} budget must be a non-negative integer, got {b!r}")
            total = sum(getattr(lp, phase)[1] for lp in self.layers
                        if getattr(lp, phase)[0] not in ("full", "append"))
            cap = L * (self.budget + (self.allowance if phase == "decode" else 0))
            if total > cap:
                raise UsageError(f"{phase} budgets sum to {total} > L·B = {L}·{self.budget}"
                                 + (f" + L·{self.allowance} generated" if phase == "decode" and self.allowance else ""))

    @classmethod
    def uniform(cls, rule: str, budget: int, n_layers: int, decode: Optional[str] = None,
                settings: RuleSettings = RuleSettings()) -> "Policy":
        """Every layer: (rule, budget) at prefill and the rule's own decode form (SPEC §3)."""
        if rule == "pyramidkv":
            raise UsageError("pyramidkv is SnapKV scoring with a layer schedule: use Policy.pyramid")
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
        """Equal memory (SPEC.md §6): every decode budget raised by n generated tokens, so a
        layer may grow by the generated tokens as an appending method does, and its decode rule
        evicts only beyond that. The paper's protocol is n = 0."""
        layers = [LayerPolicy(lp.prefill, (lp.decode[0], lp.decode[1] + n)) for lp in self.layers]
        return Policy(layers, self.budget, self.settings, dict(self.meta), self.allowance + n)

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

    # -- the method interface ----------------------------------------------------------------
    def needs(self, model) -> methods.Needs:
        """Per layer, what its prefill rule scores with and what its decode rule starts from."""
        if len(self.layers) != model.config.n_layers:
            raise UsageError(f"policy has {len(self.layers)} layers, the model has {model.config.n_layers}")
        per_layer = tuple(
            (RULES[lp.prefill[0]].needs if lp.prefill[0] in RULES else frozenset())
            | ({DECODE[lp.decode[0]].acc_from} if DECODE[lp.decode[0]].acc_from else frozenset())
            for lp in self.layers)
        return methods.Needs(per_layer, self.settings.window, self.settings.chunk)

    def compress(self, model, full: Cache, obs: methods.Observation) -> Cache:
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
                sc, prot = rules.score(rule, ScoreInput(obs.stats[l], lc.k, l, self.settings))
                idx = select(sc.to(lc.k.device), b, prot).to(lc.k.device)    # (B, G, b)
                kept = lc.gather(idx)
            start = DECODE[lp.decode[0]].acc_from      # a decode rule's running sums, kept entries
            if start:
                st = obs.stats[l][start]
                kept = replace(kept, acc=group_mean(st, G).gather(2, idx.to(st.device)))
            layers.append(kept)
        return Cache(layers, full.next_pos, full.last_logits)

    @property
    def decoder(self) -> Optional[Hooks]:
        """None when every layer appends; else hooks evicting back to the decode budgets."""
        if all(lp.decode[0] == "append" for lp in self.layers):
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
            last = attention_probs(q[:, :, -1:], lc.k, lc.bias, q_pos[:, -1:], lc.pos)[:, :, 0]  # (B, H, S)
        if d.acc_from:
            lc = replace(lc, acc=lc.acc + group_mean(last, lc.k.shape[1]))
        if lc.size <= b:
            return lc
        sc, prot = d.score(lc, last, self.settings)
        return lc.gather(select(sc, b, prot))                                  # (B, G, b)

    # -- JSON -----------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": "polykv-policy/1", "budget": self.budget, **self.meta,
                "settings": self.settings.__dict__,
                "layers": [{"prefill": {"rule": lp.prefill[0], "budget": lp.prefill[1]},
                            "decode": {"rule": lp.decode[0], "budget": lp.decode[1]}}
                           for lp in self.layers]}

    def save(self, path):
        """Atomically: a later run never reads a half-written policy (temporary file + rename)."""
        write_atomic(path, json.dumps(self.to_json(), indent=1))

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


@dataclass
class Pyramid(methods.Method):
    """PyramidKV: SnapKV scoring, per-layer budgets decreasing with depth (`pyramid_budgets`,
    which depend on the prompt length T, so the policy is made at compression time); append."""
    budget: int
    settings: RuleSettings = field(default_factory=RuleSettings)

    def needs(self, model) -> methods.Needs:
        return Policy.uniform("snapkv", self.budget, model.config.n_layers, "append", self.settings).needs(model)

    def compress(self, model, full: Cache, obs: methods.Observation) -> Cache:
        T = full.layers[0].k.shape[2]
        return Policy.pyramid(self.budget, model.config.n_layers, T, self.settings).compress(model, full, obs)


def write_atomic(path, text: str):
    """Write text to path through a temporary file in the same folder and a rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@torch.no_grad()
def prefill(model, tokens, policy: Policy) -> Cache:
    """Full prefill of tokens (1, T), then each layer compressed to its prefill budget."""
    return policy.prefill(model, tokens)
