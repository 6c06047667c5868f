"""Every tensor on its input's device: each method, the protocols, KVzip's pass and PolyKV's
calibration run while torch's default device is `meta` and the model and its inputs live on the
CPU. A factory call without `device=` (torch.arange(T), torch.tensor(ids), ...) then makes a
meta tensor, which fails on first use next to a real one (a meta tensor has no data: it cannot
be copied, compared or read), exactly as a CPU tensor would fail next to CUDA ones on a GPU.
Each run is compared with the same run under the ordinary default: kept positions, biases,
logits and greedy tokens equal to the bit (the meta default must change nothing else).
Tiny random LLaMA in fp64."""
from types import SimpleNamespace

import pytest
import torch

import baselines as BL
import calibrate as C
from engine import calibrate_joint as J
import gracekv as GK
import model as M
from engine import policy_cache as PC
import polykv as P
from conftest import REPEAT, tiny
from engine import harness as H
from engine import observe as OB
from engine import gracekv_fast as GF
from engine import gracekv_variants as V

SET = P.RuleSettings(window=4, kernel=3, n_sink=2, chunk=5, repeat=REPEAT, future=7)
GSET = GK.Settings(window=4, slot_min=3, slot_max=8, slot_target=5, bend_widths=(2, 3),
                   prefetch=3, seeds=3)
T, BUDGET, N = 48, 12, 5          # prompt, budget per (layer, KV head), teacher-forced tokens


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.one_thread


def on_meta_default(fn, *args):
    """fn(*args) with torch's default device set to `meta`; the previous default restored."""
    before = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        return fn(*args)
    finally:
        torch.set_default_device(before)


def hand_policy(L: int) -> P.Policy:
    """A hand-made PolyKV policy for 3 layers: a different rule per layer and phase, budgets
    uneven but summing to L·B, decode rules that evict within N tokens (h2o from 8 + its running
    sums, tova, streaming)."""
    assert L == 3
    layers = [P.LayerPolicy(("snapkv", 8), ("h2o", 10)),
              P.LayerPolicy(("tova", 12), ("tova", 12)),
              P.LayerPolicy(("kvzip", 16), ("streaming", 14))]
    return P.Policy(layers, BUDGET, SET, rules=BL.RULES)


def make(name: str, L: int) -> P.Method:
    """The method `name` of H.all_methods() on the tiny model: PolyKV's rows are their
    transform (policy_cache.VARIANTS) of the hand-made policy, GraceKV's rows use small settings."""
    if name in PC.VARIANTS:
        return PC.VARIANTS[name][1](hand_policy(L))
    if V.is_row(name):
        settings, formulas = V.build({**GSET.__dict__, **V.overrides(name)})
        return GF.fast(BUDGET, settings, formulas, forms=V.FAST)
    return H.method(name, BUDGET, L, SET)


def run(m, method, x):
    """observe, compress, teacher-force N tokens (token by token through the method's decoder)
    and 3 greedy tokens: (kept (pos, bias, head) per layer, log p (N, V), greedy ids)."""
    full, obs = OB.observe(m, x[:, :T], method.needs(m))
    cache = method.compress(m, full, obs)
    kept = [(lc.pos, lc.bias, lc.head) for lc in cache.layers]
    lp, _ = M.teacher_force(m, cache.fork(), x[:, T:], method.decoder, stepwise=True)
    return kept, lp, M.greedy(m, cache.fork(), 3, (), method.decoder)


def assert_same(a, b):
    """Nested tuples / lists of tensors, numbers and None equal to the bit."""
    if isinstance(a, torch.Tensor):
        assert b.device == a.device and torch.equal(a, b)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert a == b


@pytest.mark.parametrize("name", H.all_methods())
def test_method_makes_every_tensor_on_its_inputs_device(name):
    """observe -> compress -> decode (the method's decoder where it evicts) -> greedy."""
    m = tiny()
    x = torch.randint(1, 50, (1, T + N), generator=torch.Generator().manual_seed(1))
    method = make(name, m.config.n_layers)
    want = run(m, method, x)
    got = on_meta_default(run, m, method, x)
    assert_same(got, want)


class Made:
    """What H.run_protocol asks of its methods (H.Methods.get), for given methods."""

    def __init__(self, methods: dict):
        self.methods = methods
        self.args = SimpleNamespace(greedy=None, max_new_tokens=0)
        self.memo = GF.context_memo()

    def get(self, name, budget):
        return self.methods[name, budget]


@pytest.mark.parametrize("protocol", ["prompt", "context", "agnostic"])
def test_protocols_make_every_tensor_on_the_inputs_device(protocol):
    """H.run_protocol under each protocol (cut and join for `context`, the question fed
    afterwards for `agnostic`): the same rows (KL, ΔNLL, top-1, memory fractions)."""
    m = tiny()
    L = m.config.n_layers
    x = torch.randint(1, 50, (1, T + N), generator=torch.Generator().manual_seed(2))
    names = ("snapkv", "h2o", "adakv", "kvzip", "expected", "gracekv", "polykv")
    methods = Made({(n, BUDGET): make(n, L) for n in names})
    item = H.Item("fidelity", 0, T, x[:, :T], target=x[:, T:], split=(5, 6))
    todo = [(n, BUDGET) for n in names]

    def rows():
        out = H.run_protocol(m, None, methods, item, protocol, todo)
        return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in out]   # no timings
    want = rows()
    assert_same(on_meta_default(rows), want)


def test_kvzip_pass_in_several_chunks_makes_every_tensor_on_the_inputs_device():
    """KVzip's reconstruction pass with 16-token chunks (later chunks lead with the overlap)."""
    m = tiny()
    x = torch.randint(1, 50, (1, T), generator=torch.Generator().manual_seed(3))
    full = M.prefill(m, x)

    def scores():
        return BL.reconstruct(m, full, x, REPEAT, list(range(m.config.n_layers)), 2, 16, 4)
    assert_same(on_meta_default(scores), scores())


@pytest.mark.parametrize("procedure", ["paper", "joint"])
def test_calibration_makes_every_tensor_on_the_inputs_device(procedure):
    """PolyKV's calibration signals (the paper's probes; the joint sweep) are the same."""
    m = tiny()
    g = torch.Generator().manual_seed(4)
    pairs = [(torch.randint(1, 50, (40,), generator=g).tolist(),
              torch.randint(1, 50, (8,), generator=g).tolist()) for _ in range(2)]

    def signals():                       # the joint sweep's wall time left out
        if procedure == "paper":
            return C.measure(m, C.references(m, pairs, SET), 10, "cosine", SET)
        sig = J.measure_joint(m, pairs, 10, signal="cosine", settings=SET)
        return {k: v for k, v in sig.items() if k != "seconds"}
    assert_same(on_meta_default(signals), signals())
