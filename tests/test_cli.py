"""Every command line's bad input (support/cli.py): one `error: ...` line naming the option and
what it accepts, exit status 2 ("could not run", apart from oracle.py compare's FAIL, 1), no
traceback, nothing written; Ctrl-C one line and 130. Each command's main runs in this process
as its `__main__` runs it (`cli.run`); test_evaluate.py, test_oracle.py and test_model.py run
a few as real processes."""
import functools
import json
from pathlib import Path

import pytest

import bench
import calibrate as C
import calibrate_joint as J
import evaluate as E
import oracle
import polykv as P
from support import cli, report


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


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_dir):
    """What the bad inputs point at: a plain file, a policy that names another model, a run
    folder with a garbled middle line, a LongBench folder whose question is longer than half
    the tiny model's prompt limit (1024 − 256 tokens), a policy for --show."""
    d = tmp_path_factory.mktemp("bad")
    (d / "file").write_text("not a folder")
    layers = [P.LayerPolicy(("tova", 16), ("tova", 16))] * 2                   # tiny_dir: 2 layers
    P.Policy(layers, 16, meta={"model": "Qwen3-8B"}).save(d / "qwen.json")
    P.Policy.uniform("tova", 16, 2).save(d / "policy.json")
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
    return {"tiny": str(tiny_dir), "dir": str(d), **named}


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
    args = E.parse(["--methods", "full,snapkv,snapkv,full", "--budget", "64,64,32",
                    "--tasks", "niah_single_1,niah_single_1", "--length", "256,256",
                    "--protocol", "prompt,prompt"])
    assert (args.methods, args.budget, args.tasks, args.length, args.protocol) == \
        (["full", "snapkv"], [64, 32], ["niah_single_1"], [256], ["prompt"])


OTHERS = [   # (command, argv, the error line's start)
    (C.main, ["--show", "{policy}", "--shuffle", "0", "--out", "{dir}/x.json"],
     "error: --out with --show is where --shuffle N writes its JSON"),
    (C.main, ["--shuffle", "5"], "error: --shuffle N is the placement control of --show POLICY"),
    (C.main, ["--show", "{policy}", "--shuffle", "-3"], "error: --shuffle must be >= 0, got -3"),
    (C.main, ["--show", "{policy}", "--shuffle", "1", "--n-prompts", "0"],
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
]


@pytest.mark.parametrize("main, argv, message", OTHERS,
                         ids=[f"{m.__module__} {' '.join(a)}" for m, a, _ in OTHERS])
def test_other_commands_bad_input_is_one_line(files, capsys, main, argv, message):
    """calibrate.py, python -m support.report, bench.py, oracle.py: before any model is loaded."""
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
