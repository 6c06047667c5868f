"""The baselines newer than PolyKV's pattern pool that a 2026 reader compares with, each
written the way a new rule is added (README, "Add your own rule"): a scoring function and its
record in the table `RULES` (polykv's rules and these: the table the harness and PolyKV's
calibration pool read) and, where it reads more than the prompt's own attention, the statistic
it computes (a polykv.Statistic in its record).

 1. K-norm (Devoto et al. 2024): keep the keys of lowest L2 norm.
 2. Expected Attention (Devoto et al. 2025): the attention future queries are expected to pay,
    from a Gaussian fitted to the prompt's queries, times the value norm.
 3. KVzip (Kim et al. 2025): the most attention an entry receives while the model reconstructs
    the prompt (an extra pass), per head; its own allocation is global (section 4).
 4. Head-wise allocations over one rule's scores: AdaKV (Feng et al. 2024) within a layer,
    KVzip's over the whole model.

Notation as in polykv.py: B batch, T prompt tokens, H query heads, G KV heads, D head dim,
L layers. The conventions are NVIDIA kvpress 0.5.5's (its presses are cited per function).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

import model as M
import polykv as P
from model import Cache
from support.errors import UsageError


# ============================================================================= 1. K-norm

def knorm(x: P.ScoreInput):
    """K-norm (Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
    Compression"; kvpress `KnormPress`): keys with a *low* L2 norm draw more attention, so
    s_j = −‖k_j‖ per KV head; no protected tokens (as kvpress). RoPE is a rotation, so the
    norm of the post-RoPE key is the norm of the key."""
    B, G, T = x.shape
    return -x.k.double().norm(dim=-1), P.none_protected(T, x.k.device)


# ============================================================================ 2. Expected Attention

def query_stats(q, q_pos, inv_freq, n_sink: int, future: int):
    """Expected Attention's query statistics (kvpress
    `ExpectedAttentionPress.get_query_statistics` and `apply_avg_rope`): the queries
    q (B, H, T, D) un-rotated to pre-RoPE (RoPE⁻¹ at their positions), those at positions
    >= n_sink kept; μ = mean, Σ = Σ_i (q_i − μ)(q_i − μ)ᵀ / n; then
    R̄ = mean_{p = T..T+future−1} R_p, the RoPE matrix averaged over the next positions,
    gives μ' = R̄μ, Σ' = R̄ΣR̄ᵀ. Returns (μ' (B, H, D), Σ' (B, H, D, D)) in fp32
    (fp64)."""
    B, H, T, D = q.shape
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    # (B, H, n, D) pre-RoPE
    q_unrotated = M.apply_rope(q.to(dtype), -q_pos[:, None, :], inv_freq)[:, :, n_sink:]
    mu = q_unrotated.mean(2)                                                   # (B, H, D)
    centred = q_unrotated - mu[:, :, None]
    cov = centred.transpose(-1, -2) @ centred / q_unrotated.shape[2]          # (B, H, D, D)
    eye = torch.eye(D, dtype=dtype, device=q.device)
    ahead = torch.arange(T, T + future, device=q.device)[:, None]             # (future, 1)
    # (D, D) = R̄ᵀ (rows e_i -> R̄ e_i)
    R_bar_T = M.apply_rope(eye.expand(future, D, D), ahead, inv_freq).mean(0)
    return mu @ R_bar_T, R_bar_T.T @ cov @ R_bar_T


def expected_queries(q, q_pos, model, needs: P.Needs):
    """The `queries` statistic of one layer during the prefill: query_stats of its queries."""
    return query_stats(q, q_pos, model.inv_freq, needs.n_sink, needs.future)


def expected(x: P.ScoreInput):
    """Expected Attention (Devoto et al. 2025, "Expected Attention: KV Cache Compression by
    Estimating Attention from Future Queries Distribution"; kvpress `ExpectedAttentionPress`):
    future q ~ N(μ', Σ') (`queries`), E[exp(q·k/√D)] = exp(μ'·k/√D + ½kᵀΣ'k/D); per
    query head a softmax of that logit over the keys past the sinks, group mean, × ‖v_j‖;
    sinks kept."""
    B, G, T = x.shape
    n = x.before(x.settings.n_sink)      # the prompt's first n_sink tokens among these keys
    # (B, H, D), (B, H, D, D)
    mu, cov = x.stats["queries"]
    H, D = mu.shape[1:]
    k = x.k[:, :, n:].to(mu.dtype).repeat_interleave(H // G, 1)               # (B, H, T−n, D)
    logit = (k @ mu[..., None])[..., 0] / math.sqrt(D) + ((k @ cov) * k).sum(-1) / (2 * D)
    score = P.group_mean(torch.softmax(logit, -1), G) * x.v[:, :, n:].to(mu.dtype).norm(dim=-1)
    return F.pad(score, (n, 0)), x.sinks(x.settings.n_sink)


# ============================================================================= 3. KVzip

@torch.no_grad()
def reconstruct(model, full: Cache, tokens, repeat: tuple, layers: list, n_sink: int = 4,
                chunk: int = 2048, overlap: int = 8, start: int = 0) -> dict:
    """KVzip's scores (Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression with Context
    Reconstruction"; kvpress `KVzipPress`): each `chunk` of the prompt from position `start` on
    fed again after a fork of the FullKV cache (left as it was) behind a repeat instruction
    (later chunks: + the `overlap` tokens before) and the suffix. Per query u of that pass,
    A_rec[h,u,·] = softmax over the sinks (the first min(n_sink, a) positions, a the chunk's
    start), the chunk and the pass's own causal keys; score_j = max_u A_rec; the positions
    before `start` are not reconstructed and score 0. start > 0 is kvpress's convention for a
    tokenizer with a chat template: `KVzipPress.prepare` skips the template's prefix
    (`prefix_length` tokens) and chunks the rest (support.tasks.kvpress_reconstruction).

    The pass computes each layer's attention itself (`scored_attention`, the model.Hooks kernel):
    one product of its queries with every key gives both the attention the pass runs on
    (softmax over all keys) and A_rec (softmax over the subset), so the scores cost no second
    product. tests/test_baselines.py writes A_rec out from a plain forward. The pass runs the
    blocks up to the deepest layer in `layers` only (all of them when `layers` is empty)."""
    if not repeat:
        raise UsageError(
            "kvzip needs the reconstruction prompt: "
            "polykv.RuleSettings(repeat=tasks.reconstruction_prompt(tok))"
        )
    B, T = tokens.shape
    first, later, suffix = (
        torch.tensor([r], dtype=torch.long, device=tokens.device).expand(B, -1) for r in repeat
    )
    dtype = torch.float64 if model.dtype == torch.float64 else torch.float32
    out = {
        l: torch.zeros(B, model.config.n_heads, T, dtype=dtype, device=tokens.device)
        for l in layers
    }
    # the blocks after the deepest scored layer are not run: nothing they compute reaches a score
    # (no layer named: the whole pass, its cost without scores)
    depth = max(layers) + 1 if layers else model.config.n_layers
    for a in range(start, T, chunk):
        b, sink = min(T, a + chunk), min(n_sink, a)
        lead = first if a == start else torch.cat((later, tokens[:, a - overlap:a]), 1)
        ids = torch.cat((lead, suffix, tokens[:, a:b]), 1)                       # (B, n)

        def kernel(layer, q, q_pos, lc):
            if layer not in out:
                return None                                  # the model's own kernel
            o, rec = scored_attention(q, lc, (sink, a, b))
            out[layer][..., a:b] = torch.maximum(out[layer][..., a:b], rec)
            return o

        pos = torch.arange(full.next_pos, full.next_pos + ids.shape[1], device=ids.device)
        M.run_layers(model, model.embed_tokens(ids), pos.expand(B, -1), full.fork().layers,
                     hooks=M.Hooks(kernel=kernel), end=depth)
    return out


def scored_attention(q, lc, span: tuple, rows: int = 64) -> tuple:
    """(attention output (B, H, n, D), A_rec max (B, H, b − a)) of the pass's n queries q over
    lc: the T = S − n cached keys of the prompt (every one visible, bias as cached) and the
    pass's own n keys (causal). Per block of `rows` queries and KV group: the logits once (one
    2-D product, the keys never copied g times); softmax over all keys -> the output; the
    log-sum-exp over the sinks [0, sink), the chunk [a, b) and the own keys up to the query ->
    A_rec at the chunk's keys, max over the block's queries. span = (sink, a, b).
    rows = 64 [choice: measured on the 2-core CPU, one thread, the whole pass: 64 and 128 rows
    equal at 2,048 tokens and 256 rows 14 % slower; at 8,192 tokens 64 rows 7 % faster than
    128 or 256; a block's (g, rows, T + n) fp32 exponentials at 8,192 tokens are 8 MB at 64 rows,
    31 MB at 256, against that CPU's 32 MB L3 cache]."""
    sink, a, b = span
    B, H, n, D = q.shape
    G, S = lc.k.shape[1], lc.k.shape[2]
    T, g = S - n, H // G
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    k, v, bias = lc.k.to(dtype), lc.v.to(dtype), lc.bias.to(dtype)
    out = q.new_empty(B, G, g, n, D, dtype=dtype)                             # (B, G, g, n, D)
    best = q.new_zeros(B, G, g, b - a, dtype=dtype)                           # (B, G, g, b − a)
    for c0 in range(0, n, rows):
        c1 = min(n, c0 + rows)
        c, S_seen = c1 - c0, T + c1                   # the block's queries see keys < T + c1
        future = torch.ones(c, c, dtype=torch.bool, device=q.device).triu_(1)  # own keys j > i
        for batch in range(B):
            for group in range(G):
                q_block = q[batch, group * g:(group + 1) * g, c0:c1].to(dtype)
                q_block = q_block.reshape(g * c, D) / math.sqrt(D)            # (g·c, D)
                # (g·c, S_seen)
                logits = torch.mm(q_block, k[batch, group, :S_seen].T)
                logits = logits.add_(bias[batch, group, :S_seen]).view(g, c, S_seen)
                logits[:, :, T + c0:].masked_fill_(future, float("-inf"))
                # one exp serves both softmaxes: e = exp(logit − shift), shift the subset's max
                # (finite: the subset holds the query's own key), or the max over all keys − 80
                # if that is higher, so that no e overflows (e^80 < the fp32 maximum e^88)
                shift = torch.maximum(logits[..., a:b].amax(-1), logits[..., T:].amax(-1))
                if sink:
                    shift = torch.maximum(shift, logits[..., :sink].amax(-1))
                shift = torch.maximum(shift, logits.amax(-1) - 80)[..., None]     # (g, c, 1)
                e = logits.sub_(shift).exp_()                          # (g, c, S_seen), in place
                if dtype == torch.float32:   # subnormal terms: 0 (fast_observe.causal_probs)
                    torch.threshold_(e, torch.finfo(dtype).tiny, 0.0)
                z_sub = e[..., :sink].sum(-1) + e[..., a:b].sum(-1) + e[..., T:].sum(-1)
                z_sub = z_sub.clamp_min(torch.finfo(dtype).tiny)  # the subset 80 below: rec 0
                att = e.view(g * c, S_seen).mm(v[batch, group, :S_seen]).view(g, c, D)
                out[batch, group, :, c0:c1] = att / e.sum(-1, keepdim=True)
                rec = (e[..., a:b] / z_sub[..., None]).amax(1)                     # (g, b − a)
                best[batch, group] = torch.maximum(best[batch, group], rec)
    return out.reshape(B, H, n, D).to(q.dtype), best.reshape(B, H, b - a)


def kvzip_scores(model, full: Cache, tokens, needs: P.Needs, layers: list) -> dict:
    """The `recon` statistic: `reconstruct` after the prefill, for the layers that read it."""
    return reconstruct(model, full, tokens, needs.repeat, layers, needs.n_sink,
                       start=needs.repeat_from)


def kvzip(x: P.ScoreInput):
    """KVzip (Kim et al. 2025; kvpress `KVzipPress`): s_j = max over the group of `recon`, the
    most attention j receives while the model repeats the prompt; sinks kept; query-agnostic.
    This per-head form is PolyKV's pool rule; KVzip's own allocation is global (`ALLOCATIONS`)."""
    B, G, T = x.shape
    recon = x.stats["recon"]
    return recon.view(B, G, recon.shape[1] // G, T).amax(2), x.sinks(x.settings.n_sink)


# ============================================================================= the rule table

# Every rule this project has: the paper's design space (polykv.RULES) and the three above, each
# with the statistics it reads. Adding a rule is one function and one line here.
RULES = {
    **P.RULES,
    "knorm": P.Rule(knorm),
    "expected": P.Rule(expected, frozenset({"queries"}),
                       computed=(("queries", P.Statistic(per_layer=expected_queries)),)),
    "kvzip": P.Rule(kvzip, frozenset({"recon"}),
                    computed=(("recon", P.Statistic(after=kvzip_scores)),)),
}


# ========================================================================= 4. head-wise allocations

# Allocations over one rule's scores that give KV heads different budgets: name -> (rule,
# scope, safeguard α). `adakv-RULE` is AdaKV over any registered rule.
ALLOCATIONS = {"adakv": ("snapkv", "layer", 0.2),     # Feng et al. 2024; kvpress AdaKVPress
               # Kim et al. 2025; kvpress KVzipPress(layerwise=False)
               "kvzip": ("kvzip", "model", 0.0)}


def allocation(name: str) -> Optional[tuple]:
    """(rule, scope, α) of an allocation name, None if `name` is not one."""
    if name.startswith("adakv-") and name[6:] in RULES:
        return (name[6:],) + ALLOCATIONS["adakv"][1:]
    return ALLOCATIONS.get(name)


@dataclass
class Headwise(P.Method):
    """Head-wise budgets over a rule's scores, stored ragged (model.LayerCache.ragged: each KV
    head holds exactly its entries, so allocated slots = entries). scope "layer" (AdaKV: Feng et
    al. 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation"; kvpress
    `AdaKVPress`): a layer keeps its G·B best (head, entry) pairs, each head first guaranteed its
    top n_safe = max(1, ⌊α·B⌋) (kvpress `alpha_safeguard` = 0.2). scope "model" (KVzip,
    kvpress `layerwise=False`): the L·G·B best pairs of all layers and heads, no safeguard.
    Protected entries first; ties to the later (layer, head, position). Decoding appends (as
    kvpress)."""
    rule: str
    budget: int
    scope: str = "layer"
    alpha: float = 0.2
    settings: P.RuleSettings = field(default_factory=P.RuleSettings)
    # the table `rule` is in: RULES if None
    rules: Optional[dict] = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        self.rules = RULES if self.rules is None else self.rules

    def needs(self, model) -> P.Needs:
        return P.Policy.uniform(
            self.rule, self.budget, model.config.n_layers, "append", self.settings, self.rules
        ).needs(model)

    def compress(self, model, full: Cache, obs: P.Observation) -> Cache:
        B, G, T, _ = full.layers[0].k.shape
        if self.budget >= T:
            return Cache(list(full.layers), full.next_pos, full.last_logits)
        dev = full.layers[0].k.device        # the selection runs where the scores are
        scores = []
        for l, lc in enumerate(full.layers):
            x = P.score_input(obs, full, l, self.settings)
            score, protected = P.score(self.rule, x, self.rules)
            score = score[0].double().to(dev).masked_fill(protected.to(dev), float("inf"))  # (G, T)
            if self.alpha > 0:        # the safeguard: each head's top n_safe cannot lose
                n_safe = max(1, int(self.budget * self.alpha))
                # (G, n_safe)
                top = P.select(score[None], n_safe, P.none_protected(T, dev))[0]
                score = score.scatter(1, top, float("inf"))
            scores.append(score)
        # the best pairs of each group: (L', G, T) bool
        kept = []
        groups = [torch.stack(scores)] if self.scope == "model" else [s[None] for s in scores]
        for group in groups:
            none = P.none_protected(group.numel(), dev)
            idx = P.select(group.reshape(1, 1, -1), group.shape[0] * G * self.budget, none)
            kept.append(none.index_fill(0, idx[0, 0], True).view(group.shape))
        kept = torch.cat(kept)                                                         # (L, G, T)
        # every head's kept positions from one nonzero and one read of the counts (two host
        # synchronisations in all, not one per (layer, head))
        at = kept.nonzero()[:, 2].split(kept.sum(-1).flatten().tolist())   # [(S_lg,)] * L·G
        return Cache([lc.ragged(list(at[l * G:(l + 1) * G])) for l, lc in enumerate(full.layers)],
                     full.next_pos, full.last_logits)
