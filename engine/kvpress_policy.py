"""A PolyKV policy as one NVIDIA kvpress press, and a command that runs kvpress's pipeline with it.

A policy file (polykv.Policy: per layer a prefill (rule, budget) and a decode (rule, budget))
becomes one `PolicyPress`, a kvpress 0.5.5 press (`press(model)` hooks every attention layer of
a Hugging Face model; `pipeline("kv-press-text-generation")` takes it as `press=`). Sources read:
NVIDIA/kvpress 0.5.5 `kvpress/presses/{base,scorer,prefill_decoding,decoding,kvzip,snapkv,
tova,streaming_llm,knorm,expected_attention}_press.py`, `kvpress/utils.py`,
`kvpress/pipeline.py`. Read top to bottom:

 1. The budget as the exact count. kvpress keeps n = max(1, int(T·(1 − r))) entries per KV head
    at compression ratio r (`utils.compute_n_kept`); the layer's budget b is kept exactly at
    r = 1 − (b + ½)/T: T·(1 − r) = b + ½ up to a rounding far below ½, so int() gives b
    (`exact_ratio`). Which b entries: this project's `polykv.select` over the layer's scores
    (top-b, ties toward the later position, kept in position order), not kvpress's
    `scores.topk`, which leaves ties to torch and gathers in score order.
 2. Each layer's prefill rule as a kvpress scorer: kvpress's own press where kvpress has the
    rule with the policy's settings (StreamingLLM, K-norm, Expected Attention; SnapKV with
    average pooling; TOVA keeping the last token: polykv.KVPRESS), else this project's scoring
    function wrapped as one (`RuleScorer`: H2O, random, SnapKV with max pooling, TOVA without the
    last token kept), its attention statistics read off the layer's own queries in query chunks
    (support/fast_observe.observe_layer). KVzip cannot score one layer alone (its reconstruction
    pass runs the whole model): kvpress's `KVzipPress` runs that pass once after the prefill
    for every KVzip layer (`KVzipScores`), its chat-template conventions included, and each
    such layer keeps its own budget per KV head (the project's per-head rule; kvpress's press
    allocates over all layers and heads). Every layer keeps its full cache until that pass,
    which reads them all (kvpress's KVzipPress never frees anything either: it masks).
 3. The decode phase: per layer whose decode rule evicts, kvpress's `DecodingPress` with
    compression_interval = 1 and target_size = the decode budget (it finds the ratio that
    keeps exactly that many), over `DecodeRule`: StreamingLLM's scores from kvpress's press (the
    cache is kept in position order, so its oldest-first scores are the rolling window), TOVA's
    and H2O's from this project's decode forms (polykv.DECODE: kvpress's TOVAPress would keep
    the newest token; H2O keeps running sums kvpress has no press for). An appending layer has
    no decoding press.
 4. One mask per layer. transformers builds the causal mask of a multi-token step (a question
    fed after the compressed context) for layer 0's cache length; with per-layer budgets the
    other layers' caches differ and sdpa fails (kvpress 0.5.5's PyramidKVPress and
    PerLayerCompressionPress fail the same way in its pipeline on the CPU). A forward pre-hook
    gives each layer the causal mask of its own length: every cached entry visible, the new
    tokens causal among themselves.

Every phase of every rule runs exactly as `Policy.compress` and `Policy.decoder` do (the table
in docs/kvpress.md; tests/test_kvpress_policy.py checks the kept entries per layer and KV head
and the greedy answer against the project's model). Notation: B batch, T prompt tokens, S cached
entries, H query heads, G KV heads, D head dim, L layers, b a layer's budget.
"""
from __future__ import annotations

import math
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

import baselines as BL
import polykv as P
from model import LayerCache, attention_probs, rotate_half
from support import checkpoint, cli
from support import tasks as TK
from support.errors import UsageError
from engine.observe import ATTENTION_STATS, observe_layer

try:
    from kvpress import (DecodingPress, ExpectedAttentionPress, KnormPress, KVzipPress,
                         PrefillDecodingPress, ScorerPress, SnapKVPress, StreamingLLMPress,
                         TOVAPress)
    from kvpress.presses.base_press import BasePress, is_prefilling
    from kvpress.utils import compute_n_kept, get_prerope_query_states
except ImportError as e:                            # the command: one line; an import: the error
    if __name__ == "__main__":
        cli.fail(f"{e.name} is not installed: pip install -r requirements-kvpress.txt")
    raise


# ============================================================================= 1. the exact count

def exact_ratio(T: int, b: int) -> float:
    """The compression ratio at which kvpress keeps exactly b of T entries: r = 1 − (b + ½)/T,
    so int(T·(1 − r)) = int(b + ½ ± rounding) = b; 0 (keep all) for b >= T."""
    if b >= T:
        return 0.0
    r = 1 - (b + 0.5) / T
    assert compute_n_kept(T, r) == b, (T, b, r)
    return r


def keep(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """(B, G, n) indices of the kept entries, ascending: kvpress's count n at `ratio`, chosen by
    polykv.select (the highest scores, ties toward the later position)."""
    S = scores.shape[-1]
    n = compute_n_kept(S, ratio) if ratio else S
    return P.select(scores, n, P.none_protected(S, scores.device))


def gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x (B, G, S, D) at idx (B, G, n) along S."""
    return x.gather(2, idx[..., None].expand(*idx.shape, x.shape[-1])).contiguous()


# ============================================================================= 2. the prefill

def queries(module, hidden_states, position_embeddings) -> torch.Tensor:
    """The layer's post-RoPE queries (B, H, T, D) of hidden_states (B, T, dim), as kvpress's
    presses compute them (`utils.get_prerope_query_states`, then transformers' RoPE)."""
    q = get_prerope_query_states(module, hidden_states)                     # (B, H, T, D)
    cos, sin = position_embeddings                              # (B, T', D), the step's T' >= T
    T = q.shape[2]
    cos, sin = cos[:, -T:].unsqueeze(1), sin[:, -T:].unsqueeze(1)           # (B, 1, T, D)
    return q * cos + rotate_half(q) * sin          # RoPE, rotate_half layout (transformers')


def fresh_layer(keys, values) -> LayerCache:
    """A prefill's keys and values (B, G, T, D) as this project's layer cache: entry j at
    position j, bias 0."""
    B, G, T, _ = keys.shape
    pos = torch.arange(T, device=keys.device).expand(B, G, T)
    return LayerCache(keys, values, pos, torch.zeros(B, G, T, device=keys.device))


def attention_stats(module, hidden_states, keys, values, kwargs, names, settings) -> dict:
    """The prompt's attention statistics `names` (colsum, window, last: each (B, H, T)) of one
    layer from its own queries and keys, in query chunks (support/fast_observe.observe_layer,
    the shared observation's pass)."""
    q = queries(module, hidden_states, kwargs["position_embeddings"])       # (B, H, T, D)
    T = q.shape[2]
    q_pos = torch.arange(T, device=q.device)[None]                           # (1, T)
    stats, _ = observe_layer(q, q_pos, fresh_layer(keys, values), names, settings.window,
                             settings.chunk)[T]
    return stats


@dataclass
class RuleScorer(ScorerPress):
    """This project's scoring function of a rule (baselines.RULES) as a kvpress scorer:
    scores (B, G, T), protected entries at +inf. Its statistics are the prompt's own attention
    (`attention_stats`), so any rule reading only those runs (H2O, TOVA, SnapKV, random...)."""
    rule: str = "h2o"
    settings: P.RuleSettings = field(default_factory=P.RuleSettings)

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        names = BL.RULES[self.rule].needs
        stats = attention_stats(module, hidden_states, keys, values, kwargs, names,
                                self.settings) if names else {}
        x = P.ScoreInput(stats, keys, module.layer_idx, self.settings, values)
        scores, protected = P.score(self.rule, x, BL.RULES)
        return scores.masked_fill(protected.to(scores.device), math.inf)


def kvpress_press(rule: str, s: P.RuleSettings) -> Optional[ScorerPress]:
    """kvpress 0.5.5's own press for `rule` under settings s, if it computes this project's
    scores (docs/design.md, the kvpress conventions); else None."""
    if rule == "streaming":
        return StreamingLLMPress(n_sink=s.n_sink)
    if rule == "knorm":
        return KnormPress()
    if rule == "expected":
        return ExpectedAttentionPress(n_future_positions=s.future, n_sink=s.n_sink)
    if rule == "snapkv" and s.pool == "avg":
        return SnapKVPress(window_size=s.window, kernel_size=s.kernel)
    if rule == "tova" and s.tova_keep_last:
        return TOVAPress()
    return None


@dataclass
class LayerPlan:
    """One layer of the policy as the press runs it."""
    rule: str                         # prefill rule
    budget: int                       # prefill budget b (entries per KV head)
    scorer: Optional[ScorerPress]     # None: full, or kvzip (scored after the prefill)
    decode: str                       # decode rule
    decode_budget: int

    @property
    def source(self) -> str:
        """Where the layer's prefill scores come from, in words."""
        if self.rule == "full":
            return "-"
        if self.rule == "kvzip":
            return "kvpress KVzipPress (one pass, all KVzip layers)"
        if isinstance(self.scorer, RuleScorer):
            return f"this project's {self.rule} as a kvpress scorer"
        return f"kvpress {type(self.scorer).__name__}"


@dataclass
class PolicyPrefill(BasePress):
    """Per layer its prefill rule at its budget, during the prefill: the layer's scorer, then
    `keep` at the exact ratio. defer: keep every layer's full cache (and record what it keeps)
    until KVzip's pass after the prefill (PolicyPress.finish)."""
    plans: list = field(default_factory=list)     # [LayerPlan] * L
    settings: P.RuleSettings = field(default_factory=P.RuleSettings)
    defer: bool = False
    kept: dict = field(default_factory=dict)      # layer -> (B, G, n) kept indices, ascending
    acc: dict = field(default_factory=dict)       # layer -> (B, G, T) H2O decode's Σ_i A
    fresh: bool = False                           # a prefill's record not yet finished

    def post_init_from_model(self, model):
        for plan in self.plans:
            if plan.scorer is not None:
                plan.scorer.post_init_from_model(model)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        l, plan = module.layer_idx, self.plans[module.layer_idx]
        B, G, T, _ = keys.shape
        if l == 0:                                 # a new prompt
            self.kept, self.acc, self.fresh = {}, {}, True
        if P.DECODE[plan.decode].acc_from:         # H2O's decode form starts from Σ_i A
            colsum = attention_stats(module, hidden_states, keys, values, kwargs, ["colsum"],
                                     self.settings)["colsum"]
            self.acc[l] = P.group_mean(colsum, G)                                # (B, G, T)
        if plan.rule == "kvzip":
            return keys, values                    # scored after the prefill (finish)
        if plan.scorer is None or plan.budget >= T:
            self.kept[l] = torch.arange(T, device=keys.device).expand(B, G, T)
        else:
            plan.scorer.compression_ratio = exact_ratio(T, plan.budget)   # StreamingLLM reads it
            scores = plan.scorer.score(module, hidden_states, keys, values, attentions, kwargs)
            self.kept[l] = keep(scores, plan.scorer.compression_ratio)         # (B, G, b)
        if self.defer:
            return keys, values
        return gather(keys, self.kept[l]), gather(values, self.kept[l])


@dataclass
class KVzipScores(KVzipPress):
    """kvpress's KVzipPress with its scores kept instead of its selection: its context manager
    records the prefill's ids and cache, then runs its reconstruction pass (`prepare`,
    `score_kvzip`: the chat template's prefix skipped, its suffix after the repeat instruction,
    2,048-token chunks); `compress_post` (its global top-k and key masking) keeps score_val
    (L, B, G, T) and the cache instead. The pass runs only after a prefill (the cache as long as
    the ids it recorded): the pipeline enters the press again while it decodes."""

    def __post_init__(self):
        self.scores, self.cache = None, None
        super().__post_init__()

    def _perform_kvzip_compression(self, model, tokenizer):
        if self._cache is None:
            raise UsageError("a policy with KVzip layers needs the cache passed in "
                             "(past_key_values=DynamicCache()), as kvpress's pipeline does")
        if self._cache.get_seq_length() != self._context_ids.shape[1]:
            return                                 # a question or a generated token
        super()._perform_kvzip_compression(model, tokenizer)

    def compress_post(self, model):
        self.scores, self.cache = self.score_val, self._cache


# ============================================================================= 3. the decode phase

def newest_attention(module, hidden_states, keys, kwargs) -> torch.Tensor:
    """A (B, H, S): the attention of the step's last query over the layer's S cached entries
    (every one precedes it), softmax in fp32 (model.attention_probs)."""
    B, G, S, _ = keys.shape
    q = queries(module, hidden_states[:, -1:], kwargs["position_embeddings"])  # (B, H, 1, D)
    k_pos = torch.arange(S, device=keys.device).expand(B, G, S)
    q_pos = torch.full((B, 1), S - 1, device=keys.device)
    bias = torch.zeros(B, G, S, device=keys.device)
    return attention_probs(q, keys, bias, q_pos, k_pos)[:, :, 0]


@dataclass
class DecodeRule(ScorerPress):
    """A layer's decode rule as the scorer of kvpress's DecodingPress (compression_interval 1,
    target_size the decode budget): after each step, scores over the layer's S entries, then
    `keep` at the ratio DecodingPress found (exactly the target). streaming: kvpress's
    StreamingLLMPress scores (the first n_sink and the newest, by index: the cache is kept in
    position order); tova, h2o: polykv.DECODE's forms, h2o over its running sums `acc`
    (B, G, S), the prefill's Σ_i A (group mean) of the kept entries plus each step's newest
    attention, a new entry starting at 0 (polykv.Policy.decode_update)."""
    rule: str = "tova"
    settings: P.RuleSettings = field(default_factory=P.RuleSettings)
    acc: Optional[torch.Tensor] = None

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.rule == "streaming":
            return StreamingLLMPress(self.compression_ratio, self.settings.n_sink).score(
                module, hidden_states, keys, values, attentions, kwargs)
        last = newest_attention(module, hidden_states, keys, kwargs)             # (B, H, S)
        layer = fresh_layer(keys, values)          # index = position order (entries kept sorted)
        if P.DECODE[self.rule].acc_from:
            G, S = keys.shape[1], keys.shape[2]
            self.acc = torch.nn.functional.pad(self.acc, (0, S - self.acc.shape[2]))
            self.acc = self.acc + P.group_mean(last, G)
            layer.acc = self.acc
        scores, protected = P.DECODE[self.rule].score(layer, last, self.settings)
        return scores.masked_fill(protected.to(scores.device), math.inf)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        S = keys.shape[2]
        n = compute_n_kept(S, self.compression_ratio) if self.compression_ratio else S
        if n >= S and not P.DECODE[self.rule].acc_from:
            return keys, values                    # nothing to evict, no state to carry
        scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
        if n >= S:
            return keys, values
        idx = keep(scores, self.compression_ratio)                              # (B, G, n)
        if self.acc is not None:
            self.acc = self.acc.gather(2, idx)
        return gather(keys, idx), gather(values, idx)


# ============================================================================= 4. the press

def own_mask(module, args, kwargs):
    """Forward pre-hook of an attention layer: its causal mask for its own cache length S_l + q
    (q new tokens after S_l cached entries: every entry visible, the new ones causal), where
    transformers built one for layer 0's length. A step without a mask (one token) is left."""
    mask, cache = kwargs.get("attention_mask"), kwargs.get("past_key_values")
    if mask is None or cache is None or mask.dim() != 4 or module.layer_idx >= len(cache.layers):
        return None
    q = kwargs["hidden_states"].shape[1]
    old = cache.layers[module.layer_idx].get_seq_length()
    if mask.shape[-1] == old + q:
        return None
    seen = torch.ones(q, old + q, dtype=torch.bool, device=mask.device)      # (q, S_l + q)
    seen[:, old:] = torch.ones(q, q, dtype=torch.bool, device=mask.device).tril()
    if mask.dtype != torch.bool:                   # an additive mask (eager attention)
        seen = torch.zeros_like(seen, dtype=mask.dtype).masked_fill(~seen,
                                                                   torch.finfo(mask.dtype).min)
    kwargs["attention_mask"] = seen.expand(mask.shape[0], 1, q, old + q)
    return args, kwargs


@dataclass
class PolicyPress(PrefillDecodingPress):
    """A polykv.Policy as one kvpress press (`policy_press` builds it). A PrefillDecodingPress, so
    that kvpress's pipeline keeps its hooks on while it decodes: the prefill goes to
    `prefilling_press` (a PolicyPrefill), each later step to the layer's DecodingPress in
    `decoders`; `kvzip` runs KVzip's pass around the prefill; each layer gets its own mask.
    After a prefill, `prefilling_press.kept[l]` holds layer l's kept positions (B, G, n)."""
    decoders: dict = field(default_factory=dict)   # layer -> DecodingPress
    kvzip: Optional[KVzipScores] = None
    kvzip_layers: tuple = ()

    def forward_hook(self, module, input, kwargs, output):
        if is_prefilling(kwargs["cache_position"], kwargs["hidden_states"].shape[1]):
            if module.layer_idx == 0 and self.kvzip is not None:
                self.kvzip.scores = None           # a new prompt: its own pass to come
            return self.prefilling_press.forward_hook(module, input, kwargs, output)
        decoder = self.decoders.get(module.layer_idx)
        return output if decoder is None else decoder.forward_hook(module, input, kwargs, output)

    @contextmanager
    def __call__(self, model):
        language_model = model.model
        with ExitStack() as stack:     # entered in this order, left in the reverse one
            if self.kvzip is not None:
                stack.enter_context(self.kvzip(model))   # its pass runs when it is left
            for layer in language_model.layers:
                hook = layer.self_attn.register_forward_pre_hook(own_mask, with_kwargs=True)
                stack.callback(hook.remove)
            for decoder in self.decoders.values():
                stack.callback(decoder.reset)
            stack.enter_context(super().__call__(model))
            yield
        self.finish()

    def finish(self):
        """After a prefill: the KVzip layers' selections from the pass's scores (sinks kept, as
        the kvzip rule), the deferred layers cut to what they keep, H2O decoders given their
        running sums of the kept entries."""
        prefill = self.prefilling_press
        if not prefill.fresh:
            return
        prefill.fresh = False
        if self.kvzip_layers and self.kvzip.scores is None:
            raise UsageError("KVzip's pass did not run after the prefill (call the model "
                             "inside `with press(model)` with its cache, as the pipeline does)")
        for l in self.kvzip_layers:
            scores = self.kvzip.scores[l].float()                            # (B, G, T)
            T = scores.shape[-1]
            scores[..., :prefill.settings.n_sink] = math.inf
            prefill.kept[l] = keep(scores, exact_ratio(T, prefill.plans[l].budget))
        if prefill.defer:
            for l, layer in enumerate(self.kvzip.cache.layers):
                layer.keys = gather(layer.keys, prefill.kept[l])
                layer.values = gather(layer.values, prefill.kept[l])
        for l, acc in prefill.acc.items():
            if l in self.decoders:
                self.decoders[l].base_press.acc = acc.gather(2, prefill.kept[l])


def policy_press(policy: P.Policy, n_layers: int) -> tuple:
    """(PolicyPress, notices): the press running `policy` on a model of n_layers layers, and
    one line per thing a user should know (how the KVzip layers and the decode rules run).
    A policy it cannot run is a UsageError naming the layer and rule."""
    if len(policy.layers) != n_layers:
        raise UsageError(f"the policy has {len(policy.layers)} layers, the model has {n_layers}")
    s, plans = policy.settings, []
    for l, lp in enumerate(policy.layers):
        (rule, b), (dec, bd) = lp.prefill, lp.decode
        if (rule != "full" and b < 1) or (P.DECODE[dec].score is not None and bd < 1):
            raise UsageError(f"layer {l}: {rule} budget {b}, decode {dec} budget {bd}: kvpress "
                             "keeps at least one entry per KV head")
        unread = BL.RULES[rule].needs - set(ATTENTION_STATS) if rule in BL.RULES else set()
        scorer = None if rule in ("full", "kvzip") else kvpress_press(rule, s)
        if scorer is None and rule not in ("full", "kvzip"):
            if unread:
                raise UsageError(f"layer {l}: rule {rule} reads {', '.join(sorted(unread))}, "
                                 "which kvpress has no press for and this adapter cannot read")
            scorer = RuleScorer(rule=rule, settings=s)
        plans.append(LayerPlan(rule, b, scorer, dec, bd))
    kvzip = tuple(l for l, p in enumerate(plans) if p.rule == "kvzip")
    decoders = {l: DecodingPress(base_press=DecodeRule(rule=p.decode, settings=s),
                                 compression_interval=1, target_size=p.decode_budget,
                                 hidden_states_buffer_size=0)
                for l, p in enumerate(plans) if P.DECODE[p.decode].score is not None}
    # the KVzip pass's ratio only lets its context manager run the pass
    scores = KVzipScores(compression_ratio=0.5, n_sink=s.n_sink) if kvzip else None
    press = PolicyPress(prefilling_press=PolicyPrefill(plans, s, defer=bool(kvzip)),
                        decoders=decoders, kvzip=scores, kvzip_layers=kvzip)
    notices = []
    if kvzip:
        notices.append(
            f"layers {', '.join(map(str, kvzip))}: kvzip scored by kvpress's KVzipPress "
            "reconstruction pass over the whole model after the prefill (one pass for these "
            "layers; every layer keeps its full cache until then), each layer then keeps its "
            "budget per KV head (kvpress's own KVzipPress allocates over all layers and heads)")
    for rule in dict.fromkeys(p.decode for p in plans):
        layers = [l for l, p in enumerate(plans) if p.decode == rule]
        if rule == "append":
            continue
        how = {"streaming": "kvpress's StreamingLLMPress scores",
               "tova": "this project's TOVA form (kvpress's TOVAPress keeps the newest token)",
               "h2o": "this project's H2O running sums (kvpress has no H2O press)"}.get(
                   rule, f"this project's {rule} decode form")
        notices.append(f"decode, layers {', '.join(map(str, layers))}: {rule} evicts back to "
                       f"the decode budget after every step through kvpress's DecodingPress "
                       f"(compression_interval 1), scored by {how}")
    return press, notices


def as_in_kvpress(policy: P.Policy, tok) -> P.Policy:
    """The policy as the press runs it: KVzip's reconstruction prompt and first reconstructed
    position are kvpress's for this tokenizer (support.tasks.kvpress_reconstruction, from the
    chat template transformers reads), whatever the policy file recorded."""
    repeat, start = TK.kvpress_reconstruction(tok)
    settings = P.RuleSettings(**{**policy.settings.__dict__, "repeat": repeat,
                                 "repeat_from": start})
    return P.Policy(policy.layers, policy.budget, settings, dict(policy.meta), policy.allowance,
                    BL.RULES)


# ============================================================================= the command

PROTOCOLS = {"agnostic": "the context compressed, then the question fed (kvpress's default)",
             "prompt": "context + question compressed, the chat template's closing fed after"}


def load_pipeline(folder: Path, device: str, dtype: torch.dtype):
    """kvpress's pipeline on the Hugging Face folder (sdpa attention)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype,
                                                 attn_implementation="sdpa").to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)


def inputs(pipe, context: str, question: str, protocol: str) -> tuple:
    """(context ids (1, T), question ids (1, n), the pipeline's context and question): what
    kvpress's pipeline compresses and what it feeds after, under `protocol` (PROTOCOLS)."""
    text, asked = (context, question or None) if protocol == "agnostic" else \
        (context + question, None)
    got = pipe.preprocess(text, questions=[asked or ""], answer_prefix="",
                          max_context_length=int(1e10))
    return got["context_ids"], got["questions_ids"][0], text, asked


def run(pipe, context: str, question, press, max_new_tokens: int) -> tuple:
    """(answer text, answer token ids, seconds): kvpress's pipeline on (context, question) with
    press (None: no compression); the ids are read off the language-model head's outputs (each
    call's argmax, as the pipeline picks the next token)."""
    ids = []

    def picked(module, args, logits):
        """The token the pipeline picks from these logits (1, n, V): the argmax of the last."""
        ids.append(int(logits[0, -1].argmax()))
    spy = pipe.model.lm_head.register_forward_hook(picked)
    try:
        t0 = time.perf_counter()
        with torch.no_grad():
            answer = pipe(context, question=question, press=press,
                          max_new_tokens=max_new_tokens)["answer"]
        seconds = time.perf_counter() - t0
    finally:
        spy.remove()
    return answer, ids, seconds


def main(argv=None):
    ap = cli.ArgumentParser(description="Run NVIDIA kvpress's pipeline with a PolyKV policy.")
    ap.add_argument("--policy", required=True, help="a PolyKV policy file (calibrate.py --out)")
    ap.add_argument("--model", default=None, help="HF folder (default: embedded SmolLM2-135M)")
    text = ap.add_mutually_exclusive_group(required=True)
    text.add_argument("--context", help="the context as text")
    text.add_argument("--context-file", help="a file holding the context")
    ap.add_argument("--question", default="", help="the question (appended to the context as is)")
    ap.add_argument("--protocol", choices=sorted(PROTOCOLS), default="agnostic")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--also-full", action="store_true",
                    help="also run the pipeline without a press (its answer and wall time)")
    args = ap.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(f"kvpress_policy: policy={args.policy} model={args.model or 'embedded'} "
          f"protocol={args.protocol} ({PROTOCOLS[args.protocol]}) "
          f"max_new_tokens={args.max_new_tokens} device={device}", flush=True)
    cli.at_least(1, max_new_tokens=args.max_new_tokens)
    if device not in ("cpu", "cuda"):
        raise UsageError(f"--device must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device on this machine")
    folder = checkpoint.folder(args.model)           # missing, no config, weights or tokenizer
    n_layers = checkpoint.read_config(folder).get("num_hidden_layers")
    policy = P.Policy.load(args.policy, n_layers=n_layers, rules=BL.RULES)
    policy = as_in_kvpress(policy, checkpoint.Tokenizer(folder / "tokenizer.json"))
    press, notices = policy_press(policy, n_layers)
    if args.context_file is not None:
        try:
            context = Path(args.context_file).read_text()
        except OSError as e:
            raise UsageError(f"cannot read --context-file {args.context_file!r}: {e.strerror}")
    else:
        context = args.context
    pipe = load_pipeline(folder, device, torch.bfloat16 if device == "cuda" else torch.float32)
    ctx, question, text, asked = inputs(pipe, context, args.question, args.protocol)
    T = ctx.shape[1]
    for l, lp in enumerate(policy.layers):
        if lp.prefill.rule != "full" and lp.prefill.budget > T:
            raise UsageError(f"layer {l}: {lp.prefill.rule} budget {lp.prefill.budget} is above "
                             f"the prompt's {T} tokens (a longer context, or the policy rescaled "
                             "to a smaller budget)")
    for line in notices:
        print(line)
    answer, ids, seconds = run(pipe, text, asked, press, args.max_new_tokens)
    kept = press.prefilling_press.kept
    print(f"compressed {T} prompt tokens, then fed {question.shape[1]} ({args.protocol})")
    print("| layer | rule | budget | kept per KV head | scores from |")
    print("|---|---|---|---|---|")
    for l, plan in enumerate(press.prefilling_press.plans):
        heads = ", ".join(str(kept[l].shape[-1]) for _ in range(kept[l].shape[1]))
        print(f"| {l} | {plan.rule} | {plan.budget} | {heads} | {plan.source} |")
    total = sum(k.shape[1] * k.shape[2] for k in kept.values())
    print(f"kept {total} entries of {T * sum(k.shape[1] for k in kept.values())} "
          f"(L·G·B = {n_layers * kept[0].shape[1] * policy.budget})")
    print(f"answer: {answer!r}\nanswer ids: {ids}\npipeline with the press: {seconds:.2f} s")
    if args.also_full:
        full, full_ids, full_s = run(pipe, text, asked, None, args.max_new_tokens)
        print(f"without a press: {full!r} (ids {full_ids}), {full_s:.2f} s")
    return 0


if __name__ == "__main__":
    cli.run(main)
