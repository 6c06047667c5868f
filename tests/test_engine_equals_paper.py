"""The engine against the papers' path it replaces, for every method the harness runs without a
calibration (FullKV, each rule, PyramidKV, AdaKV, KVzip's global allocation, Expected
Attention) and a mixed PolyKV policy whose layers use every rule and every decode form.

The papers' path: the model with no speed handed in (the explicit attention, appends that
concatenate), the method alone observing the naive way (polykv.observe: each layer's whole
attention matrix), compressing, then decoding. The engine's path, as evaluate.py runs it: the
model with engine/fast.py's SPEED, one shared observation of every method and of the
`agnostic` protocol's prefix (engine/observe.observe_prefixes, query chunks, the fused kernel),
each method compressing from it. Under each protocol (engine/protocols.py): `prompt` the whole
prompt; `context` the context alone cut from the whole prompt's observation and joined back
between the exact prefix and question; `agnostic` prefix + context alone, the question fed
after. Both must keep the same entries (positions and biases per layer and KV head) and decode
the same logits (to rounding). On the tiny fp64 model at T = 256 and on the embedded model at
T = 1,024 (eight chunks of the engine's query rows; the paper's path computes each method's
whole attention matrices alone, 13 methods × 3 protocols)."""
import pytest
import torch

import baselines as BL
import calibrate
import model as M
import polykv as P
from conftest import REPEAT, tiny
from engine import harness as H
from engine import observe as OB
from engine import protocols as PR
from engine.fast import SPEED
from support import tasks as TK

NAMES = ("full", "streaming", "h2o", "tova", "snapkv", "knorm", "expected", "kvzip-uniform",
         "random", "pyramidkv", "adakv", "kvzip")


def mixed_policy(L: int, budget: int, settings) -> P.Policy:
    """Layer l: prefill rule l mod |rules| (full included), and the decode forms in turn."""
    rules = P.prefill_rules(BL.RULES)
    decodes = tuple(P.DECODE)
    layers = [P.LayerPolicy((rules[l % len(rules)], budget),
                            (decodes[l % len(decodes)], budget + 64)) for l in range(L)]
    return P.Policy(layers, budget, settings, allowance=64, rules=BL.RULES)


def methods_of(L: int, budget: int, settings) -> dict:
    made = {name: H.method(name, budget, L, settings) for name in NAMES}
    made["polykv (mixed)"] = mixed_policy(L, budget, settings)
    return made


def kept(cache: M.Cache, G: int) -> list:
    """Per layer, (positions, biases) of each KV head, ragged layers padded per head."""
    out = []
    for lc in cache.layers:
        dense = lc.dense(G)
        out.append((dense.pos, dense.bias))
    return out


def decoded(model, cache: M.Cache, tokens, method) -> torch.Tensor:
    """Logits (1, n, V) of tokens fed after the cache, one at a time when the method's decoder
    evicts (as model.decode does)."""
    return M.decode(model, tokens, cache, method.decoder)


def paper_path(model, x, split, method, protocol: str, cont):
    """(kept entries, logits of cont): the method alone on the naive model and observation."""
    a, b = split
    if protocol == "prompt":
        cache = method.prefill(model, x)
    elif protocol == "agnostic":
        cache = method.prefill(model, x[:, :b])
        cont = torch.cat((x[:, b:], cont), 1)              # the question is fed after
    else:                                                   # context: the cut of the whole
        full, obs = P.observe(model, x, method.needs(model))
        cut_full, cut_obs = PR.cut(full, obs, method.needs(model), a, b)
        cache = PR.join(full, method.compress(model, cut_full, cut_obs), a, b)
    G = model.config.n_kv_heads
    return kept(cache, G), decoded(model, cache.fork(), cont, method)


def compressed(model, x, split, methods: dict, cont, whole, prefix, needs) -> dict:
    """{(name, protocol): (kept entries, logits of cont)} of every method from observations
    `whole` (FullKV cache, Observation) of the prompt and `prefix` of prefix + context."""
    a, b = split
    G = model.config.n_kv_heads
    (full, obs), (start, start_obs) = whole, prefix
    cut_full, cut_obs = PR.cut(full, obs, needs, a, b)
    out = {}
    for name, meth in methods.items():
        caches = {"prompt": (meth.compress(model, full, obs), cont),
                  "context": (PR.join(full, meth.compress(model, cut_full, cut_obs), a, b), cont),
                  "agnostic": (meth.compress(model, start, start_obs),
                               torch.cat((x[:, b:], cont), 1))}
        for protocol, (cache, fed) in caches.items():
            out[name, protocol] = (kept(cache, G), decoded(model, cache.fork(), fed, meth))
    return out


def engine_paths(model, x, split, methods: dict, cont) -> dict:
    """`compressed` from one shared observation of every method, of the whole prompt and of its
    prefix + context (engine/observe.observe_prefixes)."""
    needs = OB.union([meth.needs(model) for meth in methods.values()], model.config.n_layers)
    observed = OB.observe_prefixes(model, x, needs, (x.shape[1], split[1]))
    return compressed(model, x, split, methods, cont, observed[x.shape[1]], observed[split[1]],
                      needs)


def assert_same(paper, engine, name, atol):
    """The same entries in every (layer, KV head) unit, the same biases, logits within atol."""
    (kept_p, logits_p), (kept_e, logits_e) = paper, engine
    for l, ((pos_p, bias_p), (pos_e, bias_e)) in enumerate(zip(kept_p, kept_e)):
        assert torch.equal(pos_p, pos_e), f"{name}: layer {l} keeps other entries"
        assert torch.equal(bias_p, bias_e), f"{name}: layer {l} has other biases"
    torch.testing.assert_close(logits_e, logits_p, rtol=0, atol=atol, msg=name)


def units_apart(paper, engine) -> list:
    """[(layer, head, entries kept by one path only)] of the units whose kept sets differ."""
    apart = []
    for l, ((pos_p, _), (pos_e, _)) in enumerate(zip(paper[0], engine[0])):
        for g in range(pos_p.shape[1]):
            a, b = set(pos_p[0, g].tolist()) - {-1}, set(pos_e[0, g].tolist()) - {-1}
            if a != b:
                apart.append((l, g, len(a ^ b) // 2))
    return apart


@pytest.mark.parametrize("protocol", ["prompt", "context", "agnostic"])
def test_engine_equals_paper_on_the_tiny_model(protocol):
    settings = P.RuleSettings(window=8, kernel=3, n_sink=2, chunk=40, repeat=REPEAT, future=16)
    T, budget, split = 256, 24, (6, 256 - 12)
    naive, fast = tiny(5, fast=False), tiny(5)
    x = torch.randint(1, 50, (1, T + 6), generator=torch.Generator().manual_seed(5))
    x, cont = x[:, :T], x[:, T:]
    methods = methods_of(naive.config.n_layers, budget, settings)
    engine = engine_paths(fast, x, split, methods, cont)
    for name, meth in methods.items():
        paper = paper_path(naive, x, split, meth, protocol, cont)
        assert_same(paper, engine[name, protocol], f"{name} ({protocol})", atol=1e-9)


def naive_paths(model, x, split, methods: dict, cont) -> dict:
    """paper_path of every method, its naive observations shared (calibrate.observe_naive: the
    naive observation of the union of their needs, which reads each method's statistics as its
    own would): one of the whole prompt, one of prefix + context."""
    needs = OB.union([meth.needs(model) for meth in methods.values()], model.config.n_layers)
    whole = calibrate.observe_naive(model, x, list(methods.values()))
    prefix = calibrate.observe_naive(model, x[:, :split[1]], list(methods.values()))
    return compressed(model, x, split, methods, cont, whole, prefix, needs)


@pytest.mark.embedded
def test_engine_equals_paper_on_the_embedded_model(embedded):
    """T = 1,024 tokens of natural text, the first 32 a stand-in prefix and the last 48 a
    stand-in question (the protocols cut by token positions), B = 128; fp32, logits to 2e-3
    (the fused kernel and the chunked pass round in another order than the explicit forms).
    Every method and protocol keeps the same entries, but for at most one entry of one unit in
    at most two (method, protocol) pairs: a near-tie flipped by rounding (fp64 on the tiny
    model above: exact everywhere). T = 1,024, not the 2K reference's 2,048: the same code
    paths as at 2,048 (the engine's 128-row query chunks, KVzip's reconstruction in one chunk
    of at most 2,048 tokens) at a quarter of the paper path's attention cost."""
    m, tok = embedded
    settings = P.RuleSettings(repeat=TK.reconstruction_prompt(tok))
    prompt, cont = TK.fidelity_text(tok, 1024, 4, seed=3, index=0, split="dev")
    x, cont = torch.tensor([prompt]), torch.tensor([cont])
    split = (32, 1024 - 48)
    methods = methods_of(m.config.n_layers, 128, settings)
    assert m.speed is SPEED                                  # conftest's embedded model
    engine = engine_paths(m, x, split, methods, cont)
    m.speed = None
    try:
        paper = naive_paths(m, x, split, methods, cont)
    finally:
        m.speed = SPEED
    apart = {}
    for key, got in engine.items():
        name = f"{key[0]} ({key[1]})"
        units = units_apart(paper[key], got)
        if units:
            apart[name] = units
        else:
            assert_same(paper[key], got, name, atol=2e-3)
    print(f"units apart (method (protocol): [(layer, head, entries)]): {apart}")
    # fp32: the two paths sum in other orders, so an entry whose score ties the budget's
    # threshold to rounding may flip: at most one entry of one unit per (method, protocol)
    # (measured at T = 1,024: none; at 2,048, one entry of one unit, layer 13 head 2 of
    # kvzip-uniform under agnostic)
    assert all(len(u) == 1 and u[0][2] == 1 for u in apart.values()), apart
    assert len(apart) <= 2, apart
