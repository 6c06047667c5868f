"""Where the time goes, as ratios measured in one run: figures, not tests.

`python bench.py` on the embedded model, natural-text prompts from the test split:
1. observation, at each `--length`: the plain FullKV prefill vs the shared prefill that
   observes for every default method (or `--methods`) at once (polykv.observe_for: column sums,
   window sums, last row, query statistics, GraceKV's probes and flow; KVzip's reconstruction
   pass timed apart and charged to the methods that read it), and each method's compression at
   `--budget` with the peak resident memory while it runs;
2. decoding: FullKV ms per generated token at 128, 2K and 8K tokens of context, and SnapKV at
   B = 512 after the 8K prompt next to FullKV at the same 512 + window context;
3. Hugging Face transformers' decoding at 2K on the same checkpoint, when it is installed
   (optional: never a dependency of the project);
4. peak resident memory of the process.
Each figure is the median of `--repeat` runs; the two prefills of 1. are timed in interleaved
pairs and their ratio is the median of the pairs' ratios.
"""
from __future__ import annotations

import resource
import statistics
import time

import torch

import calibrate
import evaluate as E
import gracekv_variants as GV
import model as M
import polykv as P
from support import cli
from support import tasks as TK


def timed(fn, repeat: int):
    """(median seconds, last result) over `repeat` calls."""
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def timed_pair(fa, fb, repeat: int):
    """(median seconds of fa, of fb, median of the per-pair ratio fb / fa, last result of fb),
    the calls interleaved a, b, a, b, ... so that both see the same state of the machine."""
    ta, tb, out = [], [], None
    for _ in range(repeat):
        ta.append(timed(fa, 1)[0])
        t, out = timed(fb, 1)
        tb.append(t)
    return (statistics.median(ta), statistics.median(tb),
            statistics.median(b / a for a, b in zip(ta, tb)), out)


def decode_ms(m, cache, steps: int, repeat: int, decoder=None) -> float:
    """ms per greedy token from a prefilled cache (each repeat decodes a fresh fork)."""
    t, _ = timed(lambda: M.greedy(m, cache.fork(), steps, (), decoder), repeat)
    return 1000 * t / steps


def hf_decode_ms(folder, ids, steps: int, repeat: int):
    """transformers' LlamaForCausalLM on the same folder: ms per greedy token after ids, or None."""
    try:
        from transformers import DynamicCache, LlamaForCausalLM
    except ImportError:
        return None
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    x = torch.tensor([ids])

    def run():
        cache = DynamicCache()
        out = hf(x, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = hf(nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
        return time.perf_counter() - t0
    with torch.no_grad():
        return 1000 * statistics.median(run() for _ in range(repeat)) / steps


def cold(method, m, full, obs):
    """method.compress, with nothing kept from an earlier call (the methods here hold no
    gracekv.context_memo: GraceKV's compression is timed with its budget-independent steps)."""
    return method.compress(m, full, obs)


def peak_rss_gb(fn):
    """(result, peak resident memory in GB while fn ran): Linux's high-water mark VmHWM, reset
    first through /proc/self/clear_refs; (result, None) where that is not available."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return fn(), None
    out = fn()
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
    return out, hwm / 2**20


def observation(m, tok, length: int, made: dict, budgets: list, repeat: int):
    """1.: the plain prefill against the shared observation for every method in `made`, then each
    method's compression at each budget (its own extra pass included) and the process's peak
    resident memory during one compression."""
    x = torch.tensor([TK.fidelity_text(tok, length, 1)[0]], device=m.device)    # (1, T)
    M.prefill(m, x)                                                           # warm-up, untimed
    everyone = [ms[budgets[0]] for ms in made.values()]
    t_plain, t_obs, ratio, (full, obs) = timed_pair(
        lambda: M.prefill(m, x), lambda: P.observe_for(m, x, everyone), repeat
    )
    rec = obs.seconds.get("recon", 0.0)
    print(
        f"\nprefill of {x.shape[1]} tokens: plain {t_plain:.2f} s; observing for every method "
        f"below "
        f"{t_obs:.2f} s = {ratio:.2f}x plain (median ratio of {repeat} interleaved pairs), of "
        f"which "
        f"KVzip's reconstruction pass {rec:.2f} s ({rec / t_plain:.2f}x plain, in the kvzip rows)"
    )
    print(
        "| method | "
        + " | ".join(f"compress s @ {b} (÷ plain prefill) · peak GB" for b in budgets)
        + " |"
    )
    print("|---|" + "---|" * len(budgets))
    for name, ms in made.items():
        cells = []
        for b in budgets:
            t, (_, peak) = timed(lambda: peak_rss_gb(lambda: cold(ms[b], m, full, obs)), repeat)
            t += E.own_pass(m, ms[b], obs)
            cells.append(
                f"{t:.3f} ({t / t_plain:.2f}x) · " + (f"{peak:.2f}" if peak is not None else "n/a")
            )
        print(f"| {name} | " + " | ".join(cells) + " |")


@torch.no_grad()
def main(argv=None):
    ap = cli.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--length", type=cli.int_list, default=[2048],
                    help="prompt lengths of the observation benchmark (comma list)")
    ap.add_argument("--methods", default=None,
                    help="methods of the compression table (default: the default methods)")
    ap.add_argument("--budget", type=cli.int_list, default=[128, 512])
    ap.add_argument("--contexts", type=cli.int_list, default=[128, 2048, 8000],
                    help="FullKV decoding contexts")
    ap.add_argument("--steps", type=int, default=16, help="decoded tokens per measurement")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    cli.at_least(1, steps=args.steps, repeat=args.repeat, threads=args.threads,
                 budget=min(args.budget), length=min(args.length), contexts=min(args.contexts))
    names = cli.split_names(args.methods, "--methods") if args.methods else \
        [n for n in E.default_methods() if n not in ("full", "random", "polykv")]
    uncalibrated = [n for n in E.all_methods() if E.family(n) != "polykv"]   # PolyKV's calibrate
    bad = [n for n in names if n not in uncalibrated and not GV.is_row(n)]
    if bad:
        raise M.UsageError(f"unknown method {bad[0]!r}; choose from {', '.join(uncalibrated)}")
    for n in names:
        if GV.is_row(n):
            GV.variant(n, 1)                           # its [settings] checked before any work
    if args.threads:
        torch.set_num_threads(args.threads)
    budgets = args.budget
    m, tok = M.load(args.model)
    L = m.config.n_layers
    model_name = M.default_model_dir().name if args.model is None else args.model
    print(
        f"model {model_name} · {L} layers · "
        f"{torch.get_num_threads()} threads · device {m.device} · median of {args.repeat}"
    )
    settings = calibrate.with_prompt(P.RuleSettings(), tok)
    made = {n: {b: E.method(n, b, L, settings) for b in budgets} for n in names}
    for length in args.length:                            # 1. observation and compression
        observation(m, tok, length, made, budgets, args.repeat)

    # 2. decoding
    contexts = args.contexts
    ms_full = {}
    longest = None
    for c in contexts:
        ids = TK.fidelity_text(tok, c, 0)[0]
        cache = M.prefill(m, torch.tensor([ids], device=m.device))
        ms_full[c] = decode_ms(m, cache, args.steps, args.repeat)
        longest = (ids, cache)
    print(
        "\nFullKV decoding: "
        + ", ".join(f"{c} tokens {ms_full[c]:.1f} ms/token" for c in contexts)
        + f"; {contexts[-1]} / {contexts[0]} = {ms_full[contexts[-1]] / ms_full[contexts[0]]:.2f}x"
    )
    ids, _ = longest
    snap = P.Policy.uniform("snapkv", 512, L)
    small = snap.prefill(m, torch.tensor([ids], device=m.device))
    ms_snap = decode_ms(m, small, args.steps, args.repeat, snap.decoder)
    same = M.prefill(m, torch.tensor([TK.fidelity_text(tok, 512, 0)[0]], device=m.device))
    ms_same = decode_ms(m, same, args.steps, args.repeat)
    print(f"SnapKV B=512 after {len(ids)} tokens: {ms_snap:.1f} ms/token; FullKV at 512 tokens "
          f"{ms_same:.1f} ms/token ({ms_snap / ms_same:.2f}x)")

    # 3. transformers, if installed
    if 2048 in ms_full:
        folder = M.default_model_dir() if args.model is None else args.model
        hf = hf_decode_ms(folder, TK.fidelity_text(tok, 2048, 0)[0], args.steps, args.repeat)
        print(
            "transformers: not installed (optional)"
            if hf is None
            else f"transformers LlamaForCausalLM at 2048 tokens: {hf:.1f} ms/token; ours / "
                 f"theirs = {ms_full[2048] / hf:.2f}"
        )
    print(f"\npeak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GB")


if __name__ == "__main__":
    cli.run(main)
