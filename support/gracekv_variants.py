"""GraceKV's other readings: this project's earlier reading of the paper (before its equations
were at hand) and its ablations, each a drop-in for one formula of `gracekv.Settings`. The
table `gracekv.VARIANTS` names them; none is the method called `gracekv`, whose formulas are in
gracekv.py. docs/gracekv.md has each one's figures."""
from __future__ import annotations

import ast

import torch

from support.errors import UsageError


def key_post(span) -> torch.Tensor:
    """Variant: k̃ = mean_t k_t of the post-RoPE keys, so q·k̃ = mean_t q·k_t for every q."""
    return span.rows(span.cx.k).sum(1) / span.nf[:, None]


def multiplicity_n(span, qk, logZ) -> torch.Tensor:
    """Variant: m = n (with the post-RoPE key, m·e^{q·k̃} is Jensen's lower bound of Z)."""
    return span.nf.log()


FIT_SLACK = 2.0    # c in the fitted bias's clamp [0, log n + c] [choice]


def multiplicity_fit(span, qk, logZ) -> torch.Tensor:
    """Variant: log m fitted on the probes, the mass-weighted mean of log Z − q·k̃/√D (qk),
    clamped to [0, log n + FIT_SLACK]."""
    fit = (torch.softmax(logZ, -1) * (logZ - qk)).sum(-1)
    return torch.minimum(fit.clamp(min=0), span.nf.log() + FIT_SLACK)


def beta_global(Rt, mask, nf, beta: float, Tc: int) -> torch.Tensor:
    """Variant (the first reading): one β = beta·mean over the context of R_t = beta/Tc."""
    return torch.full_like(nf, beta / Tc)


def greedy_slots(b: torch.Tensor, Tc: int, s) -> list:
    """Variant (this project's first reading): cut at the highest b in [a+slot_min, a+slot_max]."""
    slots, a = [], 0
    while Tc - a > s.slot_max:
        hi = min(a + s.slot_max, Tc - s.slot_min)
        c = a + s.slot_min + int(b[a + s.slot_min:hi + 1].argmax())
        slots.append((a, c))
        a = c
    return slots + ([(a, Tc)] if Tc > a else [])


def dense_hops(model, full, flow, s_hat, x, s):
    """Variant (the first reading): d̂ per unit = normalised Σ_k decay^(k−1)·x^k, the flow spread
    densely through every query row of its own layer (`ValueFlow` with dense_hops); seeds: the
    top of the mean ŝ, for the floor."""
    Tc = s_hat.shape[1]
    d = sum(s.decay ** (k - 1) * x[:, k] for k in range(1, s.dense_hops + 1)) if s.dense_hops else x[:, 0]
    s_bar = s_hat.mean(0)
    d = d.reshape(-1, Tc)
    return d / d.sum(-1, keepdim=True).clamp(min=1e-300), s_bar.argsort(descending=True)[:s.seeds * (s.hops + 1)].tolist()


def shared_row(R: torch.Tensor) -> torch.Tensor:
    """Variant (the first reading): one row shared by every unit, the mean of the per-unit rows."""
    return R.mean(0).expand_as(R)


def extract_hole(cx, u, a, b, ok, idc):
    """Variant (the first reading): the token of highest ŝ leaves, the node minus it stands for
    the rest (a hole of the unit, so every later node of that unit leaves it out): cost 1."""
    t = a + cx.sal[u[:, None], idc].masked_fill(~ok, float("-inf")).argmax(1)
    return t, [(a, b, t), (t, t + 1, torch.full_like(a, -1))], True


def split_gain_mass(omega, R_v, D_v, R_children, D_children):
    """Variant (this project's earlier reading of eq. 12): each child weighed by its own
    relevance, Δ_split(v) = ω·(R(v)·D(v) − Σ_u R(u)·D(u)); the paper weighs the drop in
    distortion by the parent's R(v) alone (gracekv.split_gain)."""
    return omega * (R_v * D_v - (R_children * D_children).sum(0))


def rank_with_lookahead(cx, plan, best_splits) -> dict:
    """Variant (ours, not the paper's): an add ranked by max(Δ_add, (Δ_add + Δ_split(root))/(1 +
    cost_split)), so a slot whose mass sits on one token competes with the extraction behind its
    poor root; the paper corrects this myopia with the floor instead."""
    best_splits(cx, plan, [i for i in plan.add_gain if plan.nodes[i].n > 1])
    rank = dict(plan.add_gain)
    for i, g in plan.add_gain.items():
        if i in plan.split:
            sg, sc = plan.split[i].gain, plan.split[i].cost
            rank[i] = max(g, (g + sg) / (1 + sc))                       # gain per entry of both
    return rank


def hop_order_floor(cx, per_unit: int) -> int:
    """Variant (this project's earlier floor): the first min(per_unit, |seeds|) seeds in hop
    order (hop 0 by the mean first hop s̄, then each hop's, best first), the same tokens in
    every unit."""
    f = cx.seeds[:max(per_unit, 0)]
    if f:
        cx.units.hole[:, torch.tensor(f, device=cx.units.hole.device)] = True
    return cx.units.hole.shape[0] * len(f)


def row_floor(cx, per_unit: int) -> int:
    """Variant (the first reading): at most U·per_unit entries; layer l's G heads each keep their
    f_l highest-R_t tokens exact (ties to the later token); the f_l from one ranking of "one more
    floor token in every head of layer l", worth Σ_heads ω_j·R_j,(f_l+1) for G entries."""
    Tc, G = cx.Tc, cx.G
    R, order = cx.units.R[:, :Tc].flip(-1).sort(dim=-1, descending=True, stable=True)   # (U, Tc) per unit
    row = (cx.omega[:, None] * R).view(-1, G, Tc).sum(1)                 # (L, Tc) non-increasing
    top = row.reshape(-1).sort(descending=True, stable=True).indices[:per_unit * row.shape[0]]   # prefixes
    f = torch.bincount(top // Tc, minlength=row.shape[0]).repeat_interleave(G)      # (U,) f_l per head
    keep = torch.arange(Tc, device=f.device) < f[:, None]                # (U, Tc) the first f_l
    u = torch.arange(len(f), device=f.device)[:, None].expand(-1, Tc)
    cx.units.hole[u[keep], Tc - 1 - order[keep]] = True
    return int(f.sum())


# GraceKV's rows (evaluate.py --methods): name -> Settings overrides, each swapping one formula
# or setting; `gracekv` is the method as read here. Their figures: docs/gracekv.md.
VARIANTS = {"gracekv": {},
            # this project's departures, one each (docs/gracekv.md has their dev figures):
            "gracekv-lookahead": {"rank_adds": rank_with_lookahead},   # adds ranked with the split behind
            "gracekv-postkey": {"key": key_post},                 # the exact mean-logit key
            "gracekv-shared": {"unit_rows": shared_row},          # one relevance row for every unit
            "gracekv-hole": {"extract": extract_hole},            # extraction as a node with a hole, cost 1
            "gracekv-globalbeta": {"value_beta": beta_global},    # one β for every node
            "gracekv-dense": {"multi_hop": dense_hops, "dense_hops": 2},   # dense hops, no seeds
            "gracekv-greedycut": {"slotting": greedy_slots, "bend_depths": (0.5,), "bend_widths": (8,)},
            "gracekv-floor": {"floor": row_floor, "floor_frac": 0.95},     # 95 % exact tokens by ω·R
            "gracekv-massgain": {"split_gain": split_gain_mass},  # eq. 12 with each child's own R
            "gracekv-hopfloor": {"floor": hop_order_floor},       # the first seeds, in every unit
            # the first reading, all of them together
            "gracekv-v1": {"rank_adds": rank_with_lookahead, "unit_rows": shared_row, "extract": extract_hole,
                           "split_gain": split_gain_mass,
                           "value_beta": beta_global, "multi_hop": dense_hops, "dense_hops": 2,
                           "slotting": greedy_slots, "bend_depths": (0.5,), "bend_widths": (8,), "floor": row_floor,
                           "floor_frac": 0.1, "seeds": 16, "evidence": 0, "lambda_s": 0.0},
            # ablations
            "gracekv-mn": {"multiplicity": multiplicity_n},       # m = n
            "gracekv-fit": {"multiplicity": multiplicity_fit},    # log m fitted on the probes
            "gracekv-trees": {"floor_frac": 0.0},                 # the trees alone: no floor
            "gracekv-1hop": {"hops": 0, "lambda_graph": 0.0},     # relevance from the first hop only
            "gracekv-backhops": {"hop_forward": 0.0},             # hops walk only what a token reads
            "gracekv-noevidence": {"evidence": 0},                # distortion probes U alone
            "gracekv-nosurprisal": {"lambda_s": 0.0},             # slot boundaries from the bends alone
            "gracekv-exact": {"floor": row_floor, "floor_frac": 1.0}}   # no trees: every entry an exact token


def overrides(name: str, settings) -> dict:
    """The Settings overrides of the GraceKV row `name`: a key of VARIANTS, or such a key with
    settings in brackets, `gracekv[seeds=64;floor_frac=0.25]` (numbers or tuples of them; how
    the dev choices in docs/gracekv.md were compared). settings: the Settings class (checked
    against its numeric fields)."""
    base, _, tail = name.partition("[")
    if base not in VARIANTS or (tail and not tail.endswith("]")):
        raise UsageError(f"unknown GraceKV row {name!r}; choose from {', '.join(VARIANTS)} (+ [field=value;...])")
    over = dict(VARIANTS[base])
    for item in filter(None, tail[:-1].split(";")):
        k, _, v = item.partition("=")
        if k not in settings.__dataclass_fields__ or callable(getattr(settings(), k)):
            raise UsageError(f"{name}: {k!r} is not a numeric GraceKV setting")
        try:
            value = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            raise UsageError(f"{name}: {k}={v!r} is not a number or a tuple of numbers") from None
        over[k] = of_kind(name, k, value, getattr(settings(), k))
    return over


def of_kind(name: str, key: str, value, default):
    """value for the setting `key` if it is of its default's kind (an int field: an integer; a
    float field: a number; a tuple field: a non-empty tuple of such), else a UsageError, so that
    a bad value is one line before any model is loaded."""
    if isinstance(default, tuple):
        whole = all(isinstance(x, int) for x in default)
        ok = isinstance(value, tuple) and len(value) > 0 \
            and all(is_number(x, whole) for x in value)
        kind = f"a non-empty tuple of {'integers' if whole else 'numbers'}, e.g. {default}"
    else:
        whole = isinstance(default, int)
        ok = is_number(value, whole)
        kind = "an integer" if whole else "a number"
    if not ok:
        raise UsageError(f"{name}: {key}={value!r} must be {kind}")
    return value


def is_number(x, whole: bool) -> bool:
    """x is an integer (not a bool), or with whole=False also a float."""
    if isinstance(x, bool):
        return False
    return isinstance(x, int) or (not whole and isinstance(x, float))


def is_row(name: str) -> bool:
    """Whether `name` is a GraceKV row (a VARIANTS key, with or without [settings])."""
    return name.partition("[")[0] in VARIANTS
