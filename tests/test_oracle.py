"""The spec oracle: dump/compare round trip, a perturbed file flagged at exactly its unit, and
the kvpress-convention presets against kept sets produced by kvpress itself."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import baselines as BL
import model as M
from engine import oracle
from support import checkpoint, tasks
import polykv as P

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"


@pytest.fixture(scope="module")
def tiny():
    cfg = M.Config.from_hf(checkpoint.read_config(GOLDEN / "tiny-llama"))
    return M.from_state_dict(
        cfg, checkpoint.read_weights(GOLDEN / "tiny-llama"), "cpu", torch.float32
    )


@pytest.fixture(scope="module")
def golden():
    return json.loads((GOLDEN / "kvpress_kept.json").read_text())


def kept(tiny, golden, rule, settings):
    x = torch.tensor([golden["tokens"]])
    cache = P.Policy.uniform(
        rule, golden["n_kept"], tiny.config.n_layers, "append", settings
    , rules=BL.RULES).prefill(tiny, x)
    return [[lc.pos[0, g].tolist() for g in range(tiny.config.n_kv_heads)] for lc in cache.layers]


@pytest.mark.parametrize("rule", ["snapkv", "streaming", "tova"])
def test_kvpress_conventions_reproduce_kvpress_kept_sets(tiny, golden, rule):
    """P.KVPRESS on the tiny checkpoint keeps exactly what kvpress 0.5.5's press kept
    (tests/golden/make_kvpress_golden.py), every (layer, KV head); the project's own defaults
    (the papers' code) keep other sets for SnapKV and TOVA."""
    assert kept(tiny, golden, rule, P.KVPRESS) == golden["kept"][rule]
    if rule != "streaming":
        assert kept(tiny, golden, rule, P.RuleSettings()) != golden["kept"][rule]


def test_kvpress_knorm_differs_only_at_exact_ties(tiny, golden):
    """K-norm: the same kept sets but where two keys have the same fp32 norm (a token repeated
    in layer 0: RoPE preserves the norm), which kvpress's top-k breaks its own way."""
    full = M.prefill(tiny, torch.tensor([golden["tokens"]]))
    ours = kept(tiny, golden, "knorm", P.KVPRESS)
    for l, lc in enumerate(full.layers):
        norms = lc.k[0].norm(dim=-1)                                           # (G, T) fp32
        for g in range(tiny.config.n_kv_heads):
            a, b = set(ours[l][g]), set(golden["kept"]["knorm"][l][g])
            assert len(a - b) == len(b - a)
            for i, j in zip(sorted(a - b), sorted(b - a)):
                assert norms[g, i] == norms[g, j]


def test_dump_compare_round_trip_and_perturbed_unit(tiny, tmp_path):
    x = torch.randint(1, 128, (1, 90), generator=torch.Generator().manual_seed(3))
    method = oracle.make_method(
        "snapkv", 24, tiny.config.n_layers, P.RuleSettings(window=8, kernel=3)
    )
    t, h = oracle.dump(tiny, x, method, "snapkv", 24, n_probe=4, n_decode=3, model_name="tiny")
    assert (
        t["pos"].shape == (2, 2, 24)
        and t["scores"].shape == (2, 2, 90)
        and t["out"].shape == (2, 4, 7, 16)
    )
    a = tmp_path / "a.safetensors"
    oracle.write(a, t, h)
    res = oracle.compare(a, a)
    assert res["passed"] and not res["bad"] and max(res["out_err"]) == 0
    assert all(u["equal"] and u["jaccard"] == 1 for u in res["units"])
    # one swapped position in layer 1, head 0: flagged there and nowhere else
    pos = t["pos"].clone()
    dropped = int(pos[1, 0, 3])
    outside = next(j for j in range(90) if j not in set(pos[1, 0].tolist()))
    pos[1, 0, 3] = outside
    pos[1, 0] = pos[1, 0].sort().values
    b = tmp_path / "b.safetensors"
    oracle.write(b, {**t, "pos": pos}, h)
    res = oracle.compare(a, b)
    assert not res["passed"] and [(u["layer"], u["head"]) for u in res["bad"]] == [(1, 0)]
    u = res["bad"][0]
    assert u["jaccard"] == pytest.approx(23 / 25) and u["diverge"] is not None
    order = (
        89 - torch.sort(t["scores"][1, 0].double().flip(0), descending=True, stable=True).indices
    ).tolist()
    assert u["diverge"][0] == min(order.index(dropped), order.index(outside))
    # one changed bias in layer 0, head 1: flagged there only
    bias = t["bias"].clone()
    bias[0, 1, 5] += 0.5
    c = tmp_path / "c.safetensors"
    oracle.write(c, {**t, "bias": bias}, h)
    res = oracle.compare(a, c)
    assert [(u["layer"], u["head"]) for u in res["bad"]] == [(0, 1)] and res["bad"][0][
        "bias_err"
    ] == 0.5


def test_files_of_other_probes_or_decode_steps_cannot_be_compared(tiny, tmp_path, capsys):
    """Two files of one prompt and method dumped with other --probes or --decode: `compare`
    exits 2 with one line, "cannot compare" (not a FAIL: a script must not read it as one);
    the verdict line names each file's conventions."""
    from support import cli
    x = torch.randint(1, 128, (1, 90), generator=torch.Generator().manual_seed(3))
    method = oracle.make_method("tova", 24, tiny.config.n_layers)
    for name, probes, decode in (("a", 4, 3), ("p", 2, 3), ("d", 4, 1)):
        t, h = oracle.dump(tiny, x, method, "tova", 24, n_probe=probes, n_decode=decode)
        oracle.write(tmp_path / name, t, {**h, "conventions": "paper"})

    def compare(b):
        """(exit status, stdout, stderr) of `oracle.py compare a b`."""
        with pytest.raises(SystemExit) as e:
            cli.run(lambda: oracle.main(["compare", str(tmp_path / "a"), str(tmp_path / b)]))
        out, err = capsys.readouterr()
        return e.value.code, out, err
    for other, what in (("p", "has 4 probe queries (--probes)"),
                        ("d", "has 3 decode steps (--decode)")):
        status, _, err = compare(other)
        assert status == 2 and len(err.strip().splitlines()) == 1, err
        assert err.startswith("error: cannot compare: ") and what in err
    status, out, _ = compare("a")
    assert status == 0 and out.startswith("tova B=24 (paper conventions) vs tova B=24 (paper "
                                          "conventions): 4/4 (layer, KV head) units agree")


def test_cli_dump_compare_exit_codes(tmp_path, capsys):
    """python -m engine.oracle dump ... then compare: exit 0 on itself, 1 on another method. One
    call runs the module in a process of its own; the others call its main as the module does
    (support.cli.run: the exit status, the one-line error), without starting Python again."""
    from support import cli
    tok = json.loads((GOLDEN / "kvpress_kept.json").read_text())["tokens"][:120]
    (tmp_path / "t.json").write_text(json.dumps(tok))
    folder = tmp_path / "ckpt"                       # the tiny checkpoint with a tokenizer
    from tokenizers import Tokenizer, models
    folder.mkdir()
    for f in (GOLDEN / "tiny-llama").iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0")).save(
        str(folder / "tokenizer.json")
    )

    def run(*a):
        """`python -m engine.oracle *a`, in this process: (returncode, stdout, stderr)."""
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            cli.run(lambda: oracle.main(list(a)))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(a, e.value.code, out, err)
    for method, out in (("tova", "a"), ("h2o", "b"), ("adakv", "c"), ("kvzip", "d")):
        r = run("dump", "--model", str(folder), "--tokens", str(tmp_path / "t.json"), "--method",
                method, "--budget", "40", "--out", str(tmp_path / f"{out}.st"))
        assert r.returncode == 0, r.stderr
    same = subprocess.run([sys.executable, "-m", "engine.oracle", "compare", str(tmp_path / "a.st"),
                           str(tmp_path / "a.st")], cwd=ROOT, capture_output=True, text=True)
    other = run("compare", str(tmp_path / "a.st"), str(tmp_path / "b.st"))
    assert same.returncode == 0 and "4/4 (layer, KV head) units agree (100.0 %)" in same.stdout
    assert other.returncode == 1 and other.stdout.strip().endswith("FAIL")
    # head-wise (ragged) caches dump as padded kept sets and round-trip
    for f in ("c", "d"):
        r = run("compare", str(tmp_path / f"{f}.st"), str(tmp_path / f"{f}.st"))
        assert r.returncode == 0 and "4/4 (layer, KV head) units agree" in r.stdout, (
            r.stdout + r.stderr
        )
    bad = run("compare", str(tmp_path / "a.st"), str(tmp_path / "t.json"))
    assert bad.returncode == 2 and bad.stderr.startswith("error: cannot read")
    assert "Traceback" not in bad.stderr
    for text, why in (('[1, 2', "is not JSON"), ('{"a": 1}', "non-empty JSON list of integer"),
                      ('[1, 2.5]', "non-empty JSON list of integer"),
                      ('[1, 128]', "token id 128 is outside")):
        (tmp_path / "bad.json").write_text(text)
        r = run("dump", "--model", str(folder), "--tokens", str(tmp_path / "bad.json"), "--method",
                "tova", "--budget", "40", "--out", str(tmp_path / "bad.st"))
        assert r.returncode == 2 and why in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "bad.st").exists()


def kept_by(tiny, golden, name):
    """Per (layer, KV head) kept positions of a --methods name under kvpress's conventions and
    KVzip's reconstruction prompt in the golden folder's character tokenizer."""
    tok = checkpoint.Tokenizer(GOLDEN / "tiny-llama" / "tokenizer.json")
    s = P.RuleSettings(**{**P.KVPRESS.__dict__, "repeat": tasks.reconstruction_prompt(tok)})
    cache = oracle.make_method(name, golden["n_kept"], tiny.config.n_layers, s).prefill(
        tiny, torch.tensor([golden["tokens"]])
    )
    G = tiny.config.n_kv_heads
    return [
        [lc.dense(G).pos[0, g][lc.dense(G).pos[0, g] >= 0].tolist() for g in range(G)]
        for lc in cache.layers
    ]


@pytest.mark.parametrize("name", ["expected", "adakv", "kvzip"])
def test_new_baselines_reproduce_kvpress_kept_sets(tiny, golden, name):
    """Expected Attention (per head), AdaKV over SnapKV (head-wise within a layer, safeguard 0.2)
    and KVzip (global over layers and heads, its reconstruction pass) keep exactly what kvpress
    0.5.5 kept on the tiny checkpoint, every (layer, KV head); the two head-wise ones really hold
    their heads' different counts (ragged)."""
    ours = kept_by(tiny, golden, name)
    assert ours == golden["kept"][name]
    if name != "expected":
        counts = [len(h) for layer in ours for h in layer]
        assert (
            len(set(counts)) > 1
            and sum(counts) == tiny.config.n_layers * tiny.config.n_kv_heads * golden["n_kept"]
        )


def test_kvzip_with_a_chat_template_reproduces_kvpress(tiny, golden, tmp_path):
    """On a copy of the tiny checkpoint with a chat template (chat_template.jinja, read first as
    transformers does), `--conventions kvpress` follows kvpress 0.5.5's KVzipPress: the
    template's prefix is not reconstructed and its suffix follows the repeat instruction, so
    KVzip keeps exactly kvpress's sets there; the reconstruction prompt without the template
    (the papers' conventions, which read a template from tokenizer_config.json only) keeps
    others."""
    folder = tmp_path / "tiny-llama-chat"
    folder.mkdir()
    for f in (GOLDEN / "tiny-llama").iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    (folder / "chat_template.jinja").write_text(golden["chat_template"])
    tok = checkpoint.Tokenizer(folder / "tokenizer.json")
    settings = oracle.conventions("kvpress", tok)
    prefix = "<|im_start|>system\nYou are a tiny test model.<|im_end|>\n<|im_start|>user\n"
    assert settings.repeat_from == len(prefix)          # one token per character
    assert settings.repeat[2] == tuple(tok.encode("<|im_end|>\n<|im_start|>assistant\n"))
    G = tiny.config.n_kv_heads

    def kept_with(s):
        cache = oracle.make_method("kvzip", golden["n_kept"], tiny.config.n_layers, s).prefill(
            tiny, torch.tensor([golden["tokens"]]))
        return [[lc.dense(G).pos[0, g][lc.dense(G).pos[0, g] >= 0].tolist() for g in range(G)]
                for lc in cache.layers]
    assert kept_with(settings) == golden["kept"]["kvzip_template"]
    without = P.RuleSettings(**{**P.KVPRESS.__dict__, "repeat": tasks.reconstruction_prompt(tok)})
    assert kept_with(without) != golden["kept"]["kvzip_template"]
