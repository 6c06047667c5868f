"""GraceKV's other rows, as data: this project's earlier reading of the paper (before its
equations were at hand) and its ablations, each a drop-in for one step of `gracekv.Formulas` or
a change of `gracekv.Settings`. The table `VARIANTS` names them and `variant` builds one (the
engine's fast GraceKV, engine/gracekv_fast.fast, with `FAST`: the fast form of each formula
here beside the paper's); none is the method called `gracekv`, whose formulas are in
gracekv.py. Each per-node formula below has its batched twin (`..._batched`), tested equal
(tests/test_gracekv_fast.py). docs/gracekv.md has each one's figures (the earlier rounds:
docs/history.md (at commit fc6d824))."""
from __future__ import annotations

import ast
import math
from dataclasses import dataclass, fields, replace

import torch

import gracekv as GK
from engine import gracekv_fast as GF
from support.errors import UsageError


def key_post(node: GK.NodeView) -> torch.Tensor:
    """Variant: k̃ = mean_t k_t of the post-RoPE keys, so q·k̃ = mean_t q·k_t for every q."""
    return node.k.mean(0)


def key_post_batched(span) -> torch.Tensor:
    """key_post of N nodes (engine/gracekv_fast.Span)."""
    return span.rows(span.units.k).sum(1) / span.nf[:, None]


def multiplicity_n(node: GK.NodeView, key) -> torch.Tensor:
    """Variant: m = n (with the post-RoPE key, m·e^{q·k̃} is Jensen's lower bound of Z)."""
    return torch.tensor(float(len(node.tokens)), dtype=node.kr.dtype,
                        device=node.kr.device).log()


def multiplicity_n_batched(span) -> torch.Tensor:
    """multiplicity_n of N nodes."""
    return span.nf.log()


FIT_SLACK = 2.0    # c in the fitted bias's clamp [0, log n + c] [choice]


def multiplicity_fit(node: GK.NodeView, key) -> torch.Tensor:
    """Variant: log m fitted on the probes that read the node, the mass-weighted mean of
    log Z_u − q_u·k̃/√D + c_u (log Z_u = log Σ_{t∈v} A[u, t]), clamped to
    [0, log n + FIT_SLACK]."""
    log_Z = node.lg[:, node.seen].logsumexp(0)                              # (P',)
    qk = node.q[node.seen] @ key / math.sqrt(key.shape[-1]) - node.c[node.seen]
    fit = (torch.softmax(log_Z, 0) * (log_Z - qk)).sum()
    return fit.clamp(min=0).minimum(fit.new_tensor(len(node.tokens)).log() + FIT_SLACK)


def multiplicity_fit_batched(span) -> torch.Tensor:
    """multiplicity_fit of N nodes: from the span's logZ and qk (N, P), unseen probes at
    logZ = −1e30 (weight 0)."""
    fit = (torch.softmax(span.logZ, -1) * (span.logZ - span.qk)).sum(-1)
    return torch.minimum(fit.clamp(min=0), span.nf.log() + FIT_SLACK)


def beta_global(node: GK.NodeView, beta: float) -> torch.Tensor:
    """Variant (the first reading): one β = beta·mean over the context of R_t = beta/Tc."""
    return node.R.new_tensor(beta / node.Tc)


def beta_global_batched(span, beta: float) -> torch.Tensor:
    """beta_global of N nodes."""
    return torch.full_like(span.nf, beta / span.units.Tc)


def greedy_slots(b: torch.Tensor, Tc: int, s) -> list:
    """Variant (this project's first reading): cut at the highest b in [a+slot_min, a+slot_max]."""
    slots, a = [], 0
    while Tc - a > s.slot_max:
        hi = min(a + s.slot_max, Tc - s.slot_min)
        cut = a + s.slot_min + int(b[a + s.slot_min:hi + 1].argmax())
        slots.append((a, cut))
        a = cut
    return slots + ([(a, Tc)] if Tc > a else [])


def dense_flow(A_bar: torch.Tensor, r: int, s) -> torch.Tensor:
    """Variant (the first reading) of what the observation records: the value flow spread
    densely through every query row of its own layer, x^0 = the first hop,
    x^k_i = Σ_j x^{k−1}_j Ā[j, i] for k = 1..hops (hops+1, G, T)."""
    x = [A_bar[:, A_bar.shape[1] - r:].sum(1)]                              # x^0 (G, T)
    for _ in range(s.hops):
        x.append((x[-1][:, None, :] @ A_bar)[:, 0])                         # x^{k−1} Ā
    return torch.stack(x)


@dataclass(frozen=True)
class DenseFlow(GF.ValueFlow):
    """dense_flow in the shared observation (its fast form): query rows come in descending
    chunks, so row j's x^{k−1} is complete when its chunk arrives; x (hops+1, G, T)."""
    hops: int = 2

    @classmethod
    def of(cls, s, sampled: tuple, stride: int) -> "DenseFlow":
        return cls(s.window, sampled, stride, s.hops)

    def lowest(self, T: int, layer: int) -> int:      # every query row
        return 0

    def flow_rows(self) -> int:
        return self.hops + 1

    def spread(self, x, seed, c0: int, c1: int, A):
        prev = seed[c0:c1].expand(A.shape[0], -1)                    # (G, c)
        for k in range(self.hops + 1):
            x[k, :, :c1] += (prev[:, None, :] @ A)[:, 0]       # x^k += x^{k−1}[rows] Ā[rows]
            prev = x[k, :, c0:c1]

    def merge(self, other: GF.ValueFlow) -> "DenseFlow":
        merged = super().merge(other)
        return replace(merged, hops=max(self.hops, getattr(other, "hops", 0)))


def dense_hops(model, full, flow, s_hat, s):
    """Variant (the first reading): d̂ per unit = normalised Σ_k decay^(k−1)·x^k of
    `dense_flow`; seeds: the top of the mean ŝ, for the floor."""
    Tc = s_hat.shape[1]
    x = torch.stack(flow.flow)[..., :Tc]                             # (L, hops+1, G, Tc)
    hops = x.shape[1] - 1
    d = sum(s.decay ** (k - 1) * x[:, k] for k in range(1, hops + 1)) if hops else x[:, 0]
    d = d.reshape(-1, Tc)                                            # (U, Tc)
    s_bar = s_hat.mean(0)                                            # (Tc,)
    seeds = s_bar.argsort(descending=True)[:s.seeds * (s.hops + 1)].tolist()
    return d / d.sum(-1, keepdim=True).clamp(min=1e-300), seeds


def shared_relevance(model, full, flow, Tc: int, s, f):
    """Variant (the first reading): one relevance row shared by every unit, the mean of the
    per-unit rows of eq. 10."""
    R, s_hat, seeds = GK.relevance(model, full, flow, Tc, s, f)      # (U, Tc)
    return R.mean(0).expand_as(R), s_hat, seeds


def extract_hole(ctx, u, a, b, free, within):
    """Variant (the first reading): the token of highest ŝ leaves, the node minus it stands for
    the rest: cost 1 (its token a hole of the unit: `splits_with_holes`)."""
    t = a + ctx.sal[u[:, None], within].masked_fill(~free, float("-inf")).argmax(1)
    return t, [(a, b, t), (t, t + 1, torch.full_like(a, -1))]


def splits_with_holes(ctx, plan, ids: list):
    """gracekv.best_splits for extract_hole: a token extracted from a node becomes a hole of its
    unit (ctx.units.floor, this call's), so that no later node of the unit holds it."""
    u, t = GK.best_splits(ctx, plan, ids)
    ctx.units.floor[u, t] = True
    return u, t


def split_gain_mass(omega, R_v, D_v, children) -> torch.Tensor:
    """Variant (this project's earlier reading of eq. 12): each child weighed by its own
    relevance, Δ_split(v) = ω·(R(v)·D(v) − Σ_u R(u)·D(u)); the paper weighs the drop in
    distortion by the parent's R(v) alone (gracekv.split_gain)."""
    return omega * (R_v * D_v - (children.R * children.D).sum(0))


def rank_with_lookahead(ctx, plan) -> dict:
    """Variant (ours, not the paper's): an add ranked by max(Δ_add, (Δ_add + Δ_split(root))/(1 +
    cost_split)), so a slot whose mass sits on one token competes with the extraction behind its
    poor root; the paper corrects this myopia with the floor instead."""
    ctx.f.split(ctx, plan, [i for i in plan.add_gain if plan.nodes[i].n > 1])
    rank = dict(plan.add_gain)
    for i, gain in plan.add_gain.items():
        if i in plan.split:
            split = plan.split[i]
            rank[i] = max(gain, (gain + split.gain) / (1 + split.cost))   # gain per entry of both
    return rank


def hop_order_floor(ctx, per_unit: int) -> int:
    """Variant (this project's earlier floor): the first min(per_unit, |seeds|) seeds in hop
    order (hop 0 by the mean first hop s̄, then each hop's, best first), the same tokens in
    every unit."""
    floor = ctx.seeds[:max(per_unit, 0)]
    if floor:
        ctx.units.floor[:, torch.tensor(floor, device=ctx.units.floor.device)] = True
    return ctx.units.floor.shape[0] * len(floor)


def row_floor(ctx, per_unit: int) -> int:
    """Variant (the first reading): at most U·per_unit entries; layer l's G heads each keep their
    f_l highest-R_t tokens exact (ties to the later token); the f_l from one ranking of "one more
    floor token in every head of layer l", worth Σ_heads ω_j·R_j,(f_l+1) for G entries."""
    Tc, G = ctx.Tc, ctx.G
    # (U, Tc) per unit
    R, order = ctx.units.R[:, :Tc].flip(-1).sort(dim=-1, descending=True, stable=True)
    row = (ctx.omega[:, None] * R).view(-1, G, Tc).sum(1)                # (L, Tc) non-increasing
    # prefixes
    top = row.reshape(-1).sort(descending=True, stable=True).indices[:per_unit * row.shape[0]]
    # (U,) f_l per head
    f = torch.bincount(top // Tc, minlength=row.shape[0]).repeat_interleave(G)
    keep = torch.arange(Tc, device=f.device) < f[:, None]                # (U, Tc) the first f_l
    u = torch.arange(len(f), device=f.device)[:, None].expand(-1, Tc)
    ctx.units.floor[u[keep], Tc - 1 - order[keep]] = True
    return int(f.sum())


# each variant formula -> its fast form (with the paper's: engine/gracekv_fast.FAST)
FAST = {**GF.FAST, key_post: key_post_batched, multiplicity_n: multiplicity_n_batched,
        multiplicity_fit: multiplicity_fit_batched, beta_global: beta_global_batched,
        dense_flow: DenseFlow}


# GraceKV's rows (evaluate.py --methods): name -> overrides of gracekv.Formulas (a step's
# function) and of gracekv.Settings (a number); `gracekv` is the method as read here. Their
# figures: docs/gracekv.md.
FIRST_READING = {"rank_adds": rank_with_lookahead, "relevance": shared_relevance,
                 "extract": extract_hole, "split": splits_with_holes,
                 "split_gain": split_gain_mass,
                 "value_beta": beta_global, "multi_hop": dense_hops, "first_hop": dense_flow,
                 "slotting": greedy_slots, "bend_depths": (0.5,), "bend_widths": (8,),
                 "floor": row_floor, "floor_frac": 0.1, "seeds": 16, "evidence": 0,
                 "lambda_s": 0.0}
VARIANTS = {
    "gracekv": {},
    # this project's departures, one each (docs/gracekv.md has their dev figures):
    "gracekv-lookahead": {"rank_adds": rank_with_lookahead},   # adds ranked with the split behind
    "gracekv-postkey": {"key": key_post},                # the exact mean-logit key
    "gracekv-shared": {"relevance": shared_relevance},   # one relevance row for every unit
    # extraction: a node with a hole, cost 1
    "gracekv-hole": {"extract": extract_hole, "split": splits_with_holes},
    "gracekv-globalbeta": {"value_beta": beta_global},   # one β for every node
    "gracekv-dense": {"multi_hop": dense_hops, "first_hop": dense_flow},  # dense hops, no seeds
    "gracekv-greedycut": {"slotting": greedy_slots, "bend_depths": (0.5,), "bend_widths": (8,)},
    "gracekv-floor": {"floor": row_floor, "floor_frac": 0.95},   # 95 % exact tokens by ω·R
    "gracekv-massgain": {"split_gain": split_gain_mass},  # eq. 12 with each child's own R
    "gracekv-hopfloor": {"floor": hop_order_floor},      # the first seeds, in every unit
    "gracekv-v1": FIRST_READING,                         # the first reading, all together
    # ablations
    "gracekv-mn": {"multiplicity": multiplicity_n},      # m = n
    "gracekv-fit": {"multiplicity": multiplicity_fit},   # log m fitted on the probes
    "gracekv-trees": {"floor_frac": 0.0},                # the trees alone: no floor
    "gracekv-1hop": {"hops": 0, "lambda_graph": 0.0},    # relevance from the first hop only
    "gracekv-backhops": {"hop_forward": 0.0},            # hops walk only what a token reads
    "gracekv-noevidence": {"evidence": 0},               # distortion probes U alone
    "gracekv-nosurprisal": {"lambda_s": 0.0},            # slot boundaries from the bends alone
    "gracekv-exact": {"floor": row_floor, "floor_frac": 1.0},   # no trees: every entry exact
}


def is_row(name: str) -> bool:
    """Whether `name` is a GraceKV row (a VARIANTS key, with or without [settings])."""
    return name.partition("[")[0] in VARIANTS


def variant(name: str, budget: int, memo=None) -> GK.GraceKV:
    """The GraceKV row `name` at `budget` as the harness runs it (engine/gracekv_fast.fast;
    memo: a gracekv_fast.context_memo shared by the rows of one prompt); a setting out of its
    range is a UsageError that names the row."""
    over = overrides(name)
    try:
        settings, formulas = build(over)
    except UsageError as e:
        raise UsageError(f"{name}: {e}") from None
    return GF.fast(budget, settings, formulas, memo, FAST)


def build(over: dict) -> tuple:
    """(gracekv.Settings, gracekv.Formulas) with the overrides `over` (a row of VARIANTS, or
    any mix of their fields)."""
    steps = {f.name for f in fields(GK.Formulas)}
    formulas = GK.Formulas(**{k: v for k, v in over.items() if k in steps})
    settings = GK.Settings(**{k: v for k, v in over.items() if k not in steps})
    return settings, formulas


def overrides(name: str) -> dict:
    """The overrides of the GraceKV row `name`: a key of VARIANTS, or such a key with settings
    in brackets, `gracekv[seeds=64;floor_frac=0.25]` (numbers or tuples of them, checked
    against gracekv.Settings' fields; how the dev choices in docs/gracekv.md were compared)."""
    base, _, tail = name.partition("[")
    if base not in VARIANTS or (tail and not tail.endswith("]")):
        raise UsageError(f"unknown GraceKV row {name!r}; choose from {', '.join(VARIANTS)} "
                         "(+ [field=value;...])")
    over = dict(VARIANTS[base])
    defaults = GK.Settings()
    for item in filter(None, tail[:-1].split(";")):
        k, _, v = item.partition("=")
        if k not in GK.Settings.__dataclass_fields__:
            raise UsageError(f"{name}: {k!r} is not a numeric GraceKV setting")
        try:
            value = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            raise UsageError(f"{name}: {k}={v!r} is not a number or a tuple of numbers") from None
        over[k] = of_kind(name, k, value, getattr(defaults, k))
    return over


def of_kind(name: str, key: str, value, default):
    """value for the setting `key` if it is of its default's kind (an int field: an integer; a
    float field: a number; a tuple field: a non-empty tuple of such), else a UsageError, so that
    a bad value is one line before any model is loaded."""
    if isinstance(default, tuple):
        whole = all(isinstance(x, int) for x in default)
        fits = isinstance(value, tuple) and len(value) > 0 \
            and all(is_number(x, whole) for x in value)
        kind = f"a non-empty tuple of {'integers' if whole else 'numbers'}, e.g. {default}"
    else:
        whole = isinstance(default, int)
        fits = is_number(value, whole)
        kind = "an integer" if whole else "a number"
    if not fits:
        raise UsageError(f"{name}: {key}={value!r} must be {kind}")
    return value


def is_number(x, whole: bool) -> bool:
    """x is an integer (not a bool), or with whole=False also a float."""
    if isinstance(x, bool):
        return False
    return isinstance(x, int) or (not whole and isinstance(x, float))
