"""Where the time goes, as ratios measured in one run: figures, not tests.

`python -m engine.bench` on the embedded model, natural-text prompts from the test split:
1. observation, at each `--length`: the plain FullKV prefill vs the shared prefill that
   observes for every default method (or `--methods`) at once (engine/observe.observe_for: column
   sums, window sums, last row, query statistics, GraceKV's probes and flow), KVzip's reconstruction
   pass timed apart (charged to the methods that read it) beside the same pass without its scores,
   and each method's compression at `--budget` with the peak resident memory while it runs;
2. decoding: FullKV ms per generated token at 128, 2K and 8K tokens of context, and SnapKV at
   B = 512 after the 8K prompt next to FullKV at the same 512 + window context;
3. Hugging Face transformers' decoding at 2K on the same checkpoint, when it is installed
   (optional: never a dependency of the project);
4. peak resident memory of the process;
5. with `--per-prompt LENGTH` (alone with `--only-per-prompt`): the cost of a reference run's
   prompt. One fidelity prompt and one prompt of two tasks (the one whose answers are decoded,
   niah_single_1, and vt) of the 8K reference run `results/reference-8k/` (its README.md has
   the command), each run by evaluate.run_item with every method, budget and protocol of that
   run, at LENGTH tokens instead of 8,000; the time split into the shared prefill, KVzip's
   reconstruction pass, the compressions and decoding, and the whole run's wall time projected
   from it;
6. with `--stages` (and `--per-prompt LENGTH`): the same three prompts' CPU seconds by
   protocol and stage (`Stages`: observation, KVzip's passes, GraceKV's compressions, the
   other compressions, questions fed, teacher forcing and greedy answers on FullKV-sized and
   compressed caches).
Each figure is the median of `--repeat` runs; the two prefills of 1. are timed in interleaved
pairs and their ratio is the median of the pairs' ratios.
"""
from __future__ import annotations

import resource
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

import baselines as BL
import calibrate
import model as M
import polykv as P
from engine import gracekv_variants as GV
from support import cli
from engine import harness as H
from engine import observe as OB
from engine.fast import SPEED
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
    engine.gracekv_fast.context_memo: GraceKV's compression is timed with its budget-independent
    steps)."""
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
    """1.: the plain prefill against the shared observation for every method in `made` that does
    not read KVzip's reconstruction pass; that pass against itself without scores; then each
    method's compression at each budget (its own extra pass included) and the process's peak
    resident memory during one compression."""
    x = torch.tensor([TK.fidelity_text(tok, length, 1)[0]], device=m.device)    # (1, T)
    M.prefill(m, x)                                                           # warm-up, untimed
    everyone = [ms[budgets[0]] for ms in made.values()]
    # the shared observation of the methods that do not read KVzip's reconstruction pass, then
    # that pass alone: it runs after the prefill, once per prompt, for the methods that read it
    others = [method for method in everyone if "recon" not in method.needs(m).used]
    t_plain, t_obs, ratio, _ = timed_pair(
        lambda: M.prefill(m, x), lambda: OB.observe_for(m, x, others), repeat
    )
    print(
        f"\nprefill of {x.shape[1]} tokens: plain {t_plain:.2f} s; observing for every method "
        f"below but those reading KVzip's pass {t_obs:.2f} s = {ratio:.2f}x plain (median ratio "
        f"of {repeat} interleaved pairs)"
    )
    # the observation of every method for the compressions below (untimed), KVzip's pass left
    # out: the last of the timed passes below gives its scores, so it runs no extra time
    L = m.config.n_layers
    needs = OB.union([method.needs(m) for method in everyone], L)
    scored = [l for l in range(L) if "recon" in needs.stats[l]]     # the layers reading the pass
    full, obs = OB.observe(m, x, replace(needs, stats=tuple(st - {"recon"} for st in needs.stats)))
    if scored:
        # the pass scoring the layers that read it against the same pass scoring none: every
        # layer then runs the model's own attention kernel, so that one is the least the pass
        # can cost (each chunk of the prompt fed again behind the whole prompt), whatever
        # computes the scores
        ids = needs.repeat                                          # the methods' repeat prompt
        t_floor, t_pass, _, recon = timed_pair(
            lambda: BL.reconstruct(m, full, x, ids, [], needs.n_sink),
            lambda: BL.reconstruct(m, full, x, ids, scored, needs.n_sink), repeat)
        for l, value in recon.items():
            obs.stats[l]["recon"] = value
        obs.seconds["recon"] = t_pass
        print(f"KVzip's reconstruction pass: {t_pass:.2f} s = {t_pass / t_plain:.2f}x plain (in "
              f"the rows of the methods reading it); the same pass without its scores (the "
              f"model's own kernel in every layer: the pass's floor) {t_floor:.2f} s = "
              f"{t_floor / t_plain:.2f}x plain (medians of {repeat} interleaved pairs)")
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
            t += H.own_pass(m, ms[b], obs)
            cells.append(
                f"{t:.3f} ({t / t_plain:.2f}x) · " + (f"{peak:.2f}" if peak is not None else "n/a")
            )
        print(f"| {name} | " + " | ".join(cells) + " |")


# ----------------------------------------------------------------------------- 5. per prompt

# the 8K reference run of results/reference-8k/ (its README.md) as evaluate.py's arguments,
# less --out; --length, --fidelity-length, --methods, --threads and --model are set on top of it
REFERENCE_RUN = [
    "--split", "test", "--threads", "1", "--budget", "64,128,512",
    "--protocol", "prompt,context,agnostic",
    "--methods", "full,streaming,h2o,tova,snapkv,knorm,expected,kvzip-uniform,pyramidkv,adakv,"
                 "kvzip,random,polykv,polykv-joint,gracekv",
    "--tasks", "niah_single_1,niah_multikey_3,niah_multivalue,niah_multiquery,vt,cwe,fwe",
    "--length", "8000", "--samples", "16",
    "--fidelity-length", "7936", "--fidelity-samples", "16", "--greedy", "niah_single_1",
    "--calibration-length", "8000",
    "--cache-dir", str(Path(__file__).resolve().parent.parent / "results" / "reference-8k"
                       / "policies"),
]
REFERENCE_RANKS = 2         # torchrun --nproc_per_node 2, each rank --threads 1
FIDELITY_SHORTER = 64       # 7,936 = 8,000 - 64: the fidelity prompt + its 64 forced tokens
STAND_IN = "vt"             # measured for every task whose answers are not decoded


def reference_args(length: int, methods=None, threads=None, model=None):
    """The reference run's arguments through evaluate.py's own parser, at `length` tokens
    (fidelity prompts FIDELITY_SHORTER fewer) and, if given, other methods, threads, model."""
    argv = REFERENCE_RUN + ["--length", str(length),
                            "--fidelity-length", str(length - FIDELITY_SHORTER)]
    if methods is not None:
        argv += ["--methods", methods]
    if threads is not None:
        argv += ["--threads", str(threads)]
    if model is not None:
        argv += ["--model", model]
    return H.parse(argv)


class Observed:
    """Within `with`: every engine/observe.observe_prefixes call (evaluate.run_protocol's one
    observation of a prompt for all its protocols) recorded as its {prefix length: Observation},
    the call itself unchanged but for `fuse`."""

    def __init__(self, fuse: bool = True):
        self.fuse = fuse                     # False: each layer's attention computed twice

    def __enter__(self):
        self.calls, self.observe = [], OB.observe_prefixes

        def recorded(*args, **kw):
            out = self.observe(*args, **kw, fuse=self.fuse)  # {e: (FullKV cache, Observation)}
            self.calls.append({e: obs for e, (_, obs) in out.items()})
            return out
        OB.observe_prefixes = recorded
        return self

    def __exit__(self, *exc):
        OB.observe_prefixes = self.observe


class Stages:
    """Within `with`: the CPU seconds (time.process_time: this process's own, so that other jobs on
    the machine count little) of what the harness runs, by (protocol, stage), each stage its own
    time without the stages it calls: the shared observation ("observation"), KVzip's
    reconstruction passes ("KVzip passes"), GraceKV's compressions, the other compressions, a
    question fed to a cache after it ("question fed": agnostic), teacher forcing and greedy
    answers, each on a cache of more than `full_from` entries per (layer, KV head) ("FullKV")
    or fewer ("compressed"). The observation, shared by the protocols of a prompt, is charged
    to the first one run."""

    def __init__(self, full_from: int):
        self.full_from, self.seconds, self.protocol = full_from, {}, None
        self.inner = [0.0]                         # per open stage: its callees' seconds
        self.open = []                             # the open stages' names, innermost last

    def stage(self, name_of, fn, within=None):
        """fn timed as stage name_of(*args); a call from within a stage named in `within` is
        that stage's own work (model.teacher_force and model.greedy feed tokens through
        model.decode: that is teacher forcing and answering, not a question fed)."""
        def timed_call(*args, **kw):
            if within and self.open and self.open[-1].startswith(within):
                return fn(*args, **kw)
            self.open.append(name_of(*args, **kw))
            self.inner.append(0.0)
            t0 = time.process_time()
            try:
                return fn(*args, **kw)
            finally:
                spent = time.process_time() - t0
                key = (self.protocol, self.open.pop())
                self.seconds[key] = self.seconds.get(key, 0.0) + spent - self.inner.pop()
                self.inner[-1] += spent
        return timed_call

    def size(self, cache) -> str:
        return "FullKV" if cache.layers[0].k.shape[2] > self.full_from else "compressed"

    def __enter__(self):
        import gracekv as GK
        self.saved = [(OB, "observe_prefixes"), (BL, "reconstruct"), (M, "teacher_force"),
                      (M, "greedy"), (M, "decode"), (H, "run_protocol"),
                      (GK.GraceKV, "compress"), (P.Policy, "compress"), (P.Pyramid, "compress"),
                      (BL.Headwise, "compress")]
        self.saved = [(owner, name, getattr(owner, name)) for owner, name in self.saved]
        stage = self.stage
        OB.observe_prefixes = stage(lambda *a, **k: "observation", OB.observe_prefixes)
        BL.reconstruct = stage(lambda *a, **k: "KVzip passes", BL.reconstruct)
        M.teacher_force = stage(lambda m, cache, *a, **k: "teacher forcing " + self.size(cache),
                                M.teacher_force)
        M.greedy = stage(lambda m, cache, *a, **k: "greedy " + self.size(cache), M.greedy)
        M.decode = stage(lambda *a, **k: "question fed", M.decode,
                         within=("teacher forcing", "greedy"))
        GK.GraceKV.compress = stage(lambda *a, **k: "GraceKV compression", GK.GraceKV.compress)
        for cls in (P.Policy, P.Pyramid, BL.Headwise):
            cls.compress = stage(lambda *a, **k: "other compressions", cls.compress)
        run_protocol = H.run_protocol

        def protocol_of(model, tok, methods, item, protocol, *args, **kw):
            self.protocol = protocol
            return run_protocol(model, tok, methods, item, protocol, *args, **kw)
        H.run_protocol = protocol_of
        return self

    def __exit__(self, *exc):
        for owner, name, value in self.saved:
            setattr(owner, name, value)


STAGES = ("observation", "KVzip passes", "GraceKV compression", "other compressions",
          "question fed", "teacher forcing FullKV", "teacher forcing compressed",
          "greedy FullKV", "greedy compressed")


def staged_item(m, tok, methods, a, item):
    """run_item on one item under Stages: ({protocol: {stage: CPU s}}, CPU s, wall s)."""
    with Stages(full_from=item.tokens.shape[1] // 2) as st:
        t0, w0 = time.process_time(), time.perf_counter()
        H.run_item(m, tok, methods, a.methods, a.budget, item, set(), a.protocol)
        cpu, wall = time.process_time() - t0, time.perf_counter() - w0
    by = {}
    for (protocol, stage), sec in st.seconds.items():
        by.setdefault(protocol, dict.fromkeys(STAGES, 0.0))[stage] += sec
    return by, cpu, wall


def prepared(m, tok, a) -> tuple:
    """(items, methods) of the run `a` as evaluate.main makes them: its items and allowance, every
    method at every budget made (PolyKV's policies loaded) before any timer starts."""
    torch.manual_seed(a.seed)
    items = H.build_items(tok, a, m)
    a.allowance = H.run_allowance(a, items)
    methods = H.Methods(m, tok, a)
    for b in a.budget:
        for n in a.methods:
            methods.get(n, b)
    return items, methods


def greedy_task(a) -> str:
    """The task measured with its answers decoded: the first --greedy task (else the first)."""
    return a.greedy[0] if a.greedy else a.tasks[0]


def picks(a) -> list:
    """The prompts measured, (task, label): one fidelity prompt, one of `greedy_task` (its
    answers decoded) and one of STAND_IN."""
    greedy = greedy_task(a)
    return [("fidelity", "fidelity #0"), (greedy, f"{greedy} #0 (answers decoded)"),
            (STAND_IN, f"{STAND_IN} #0")]


def print_stages(m, tok, a):
    """6.: the per-stage table of each of the `picks` prompts."""
    items, methods = prepared(m, tok, a)
    print(f"\nCPU seconds by stage (time.process_time, {torch.get_num_threads()} threads): "
          f"{len(a.methods)} methods × budgets {','.join(map(str, a.budget))} × protocols "
          f"{','.join(a.protocol)}; the shared observation under the first protocol run")
    print("| prompt | protocol | " + " | ".join(STAGES) + " | total |")
    print("|---|---|" + "---|" * (len(STAGES) + 1))
    for task, label in picks(a):
        item = next(it for it in items if it.task == task and it.index == 0)
        by, cpu, wall = staged_item(m, tok, methods, a, item)
        for protocol, sec in by.items():
            print(f"| {label} | {protocol} | " + " | ".join(f"{sec[s]:.1f}" for s in STAGES)
                  + f" | {sum(sec.values()):.1f} |")
        print(f"| {label} | all | " + " | ".join(
            f"{sum(sec[s] for sec in by.values()):.1f}" for s in STAGES)
            + f" | {cpu:.1f} CPU s, {wall:.1f} wall s |", flush=True)


def prompt_split(m, methods, item, rows, calls) -> dict:
    """Seconds of one prompt's run_item by what its rows and its observation say: prefill (the
    one shared prefill, every row's prefill_s), recon (the extra passes, once per prefix
    observed, obs.seconds: KVzip's reconstruction), compress (each compression's compress_s less
    the extra passes charged to it, evaluate.own_pass); the rest of the wall time is decoding
    (FullKV's reference and every method's teacher forcing and greedy answer)."""
    if len(calls) != 1 or len({r["prefill_s"] for r in rows}) != 1:
        raise RuntimeError(f"{item.task} #{item.index}: {len(calls)} observations, prefill_s "
                           f"{sorted({r['prefill_s'] for r in rows})}; one of each expected")
    observed, T = calls[0], item.tokens.shape[1]

    # the prefix a row's observation read: the whole prompt, or under agnostic the prompt
    # without its question (run_protocol's `seen`)
    def seen(protocol):
        return T - item.split[1] if item.split is not None and protocol == "agnostic" else T
    # one compression per (method, budget, protocol); a prompt without a question is compressed
    # once and its rows repeat under every protocol
    once = {(r["method"], r["budget"], r["protocol"] if item.split is not None else None): r
            for r in rows}
    compress = 0.0
    for (name, budget, protocol), r in once.items():
        charged = H.own_pass(m, methods.get(name, budget), observed[seen(protocol)])
        compress += r["compress_s"] - charged
    return {"rows": len(rows), "prefixes": len(observed), "prefill": rows[0]["prefill_s"],
            "recon": sum(sum(obs.seconds.values()) for obs in observed.values()),
            "compress": compress}


def mean_task_s(n_greedy: int, greedy_s: float, n_other: int, other_s: float) -> float:
    """Mean seconds of a task prompt of the run: its n_greedy prompts (answers decoded) cost
    greedy_s each, its n_other prompts other_s each."""
    # mean = (n_greedy · greedy_s + n_other · other_s) / (n_greedy + n_other)
    return (n_greedy * greedy_s + n_other * other_s) / (n_greedy + n_other)


def project_run(n_task: int, task_s: float, n_fidelity: int, fidelity_s: float,
                ranks: int) -> float:
    """Hours of wall time of a run of n_task task prompts of task_s seconds each (the mean) and
    n_fidelity fidelity prompts of fidelity_s seconds each, dealt evenly to `ranks` ranks that
    run side by side at the speed each was measured at alone."""
    # hours = (n_task · task_s + n_fidelity · fidelity_s) / ranks / 3600
    return (n_task * task_s + n_fidelity * fidelity_s) / ranks / 3600


# how the harness observed before one pass served every protocol: `prompt` and `context` in one
# observation, `agnostic` in another, each layer's attention computed by the model's kernel and
# again by the statistics' pass (fuse=False)
HARNESSES = {"now": ((), True), "before": ((("prompt", "context"), ("agnostic",)), False)}


def timed_item(m, tok, methods, a, item, harness: str) -> dict:
    """run_item on one item under `harness` (HARNESSES): {rows, prefixes, prefill, recon,
    compress, total} summed over its observations (one now; under `before`, a prompt with a
    question is run as two calls, each observing its own prefix)."""
    groups, fuse = HARNESSES[harness]
    groups = [[p for p in g if p in a.protocol] for g in groups] if item.split else []
    out = {"rows": 0, "prefixes": 0, "prefill": 0.0, "recon": 0.0, "compress": 0.0, "total": 0.0}
    for protocols in [g for g in groups if g] or [a.protocol]:
        with Observed(fuse) as seen:
            t0 = time.perf_counter()
            rows = H.run_item(m, tok, methods, a.methods, a.budget, item, set(), protocols)
            out["total"] += time.perf_counter() - t0
        for k, v in prompt_split(m, methods, item, rows, seen.calls).items():
            out[k] += v
    return out


def per_prompt(m, tok, a, harnesses=("now",)):
    """5.: one fidelity prompt, one prompt of the first --greedy task and one of STAND_IN, each
    run by evaluate.run_item as evaluate.main runs it (the run's items, allowance and methods,
    PolyKV's policies loaded before the timers), under each harness (HARNESSES; interleaved
    per prompt), then the run projected from them."""
    items, methods = prepared(m, tok, a)
    greedy = greedy_task(a)
    print(f"\nthe cost of a reference run's prompt (results/reference-8k/, evaluate.run_item): "
          f"{len(a.methods)} methods × budgets {','.join(map(str, a.budget))} × protocols "
          f"{','.join(a.protocol)}, {torch.get_num_threads()} threads")
    print("| harness | prompt | tokens | rows | prefixes observed | prefill s | KVzip recon s "
          "| compress s | decoding s | total s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    total = {h: {} for h in harnesses}
    for task, label in picks(a):
        item = next(it for it in items if it.task == task and it.index == 0)
        for h in harnesses:
            s = timed_item(m, tok, methods, a, item, h)
            total[h][task] = s["total"]
            decoding = s["total"] - s["prefill"] - s["recon"] - s["compress"]
            print(f"| {h} | {label} | {item.tokens.shape[1]} | {s['rows']} | {s['prefixes']} | "
                  f"{s['prefill']:.1f} | {s['recon']:.1f} | {s['compress']:.1f} | "
                  f"{decoding:.1f} | {s['total']:.1f} |", flush=True)

    # the run's prompts: every task × sample × length, and the fidelity ones
    n_task = len(a.tasks) * a.samples * len(a.length)
    n_greedy = len([t for t in a.tasks if a.greedy is None or t in a.greedy]) * a.samples * \
        len(a.length)
    n_fidelity = a.fidelity_samples * len(a.fidelity_length)
    for h in harnesses:
        t = total[h]
        task_s = mean_task_s(n_greedy, t[greedy], n_task - n_greedy, t[STAND_IN])
        hours = project_run(n_task, task_s, n_fidelity, t["fidelity"], REFERENCE_RANKS)
        print(f"\n{h}: mean task prompt ({n_greedy} × {t[greedy]:.1f} s + {n_task - n_greedy} × "
              f"{t[STAND_IN]:.1f} s) / {n_task} = {task_s:.1f} s; projected run ({n_task} task "
              f"prompts × {task_s:.1f} s + {n_fidelity} fidelity prompts × {t['fidelity']:.1f} "
              f"s) / {REFERENCE_RANKS} ranks = {hours:.2f} h at {a.length[0]} tokens")
    print(f"(the tasks whose answers are not decoded taken to cost what {STAND_IN} does; "
          f"{REFERENCE_RANKS} ranks × {torch.get_num_threads()} threads per rank (--threads), "
          "each rank as fast as this process alone, the prompts dealt evenly, the first "
          "prompt's one-time costs included)")


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
    ap.add_argument("--per-prompt", type=int, default=None, metavar="LENGTH",
                    help="5.: the cost of a prompt of the reference run results/reference-8k/ "
                         "at LENGTH tokens (8000: the run's own) and the run's projected wall "
                         "time")
    ap.add_argument("--only-per-prompt", action="store_true",
                    help="run 5. alone (with --per-prompt)")
    ap.add_argument("--per-prompt-methods", default=None,
                    help="methods of 5. (default: the reference run's 15)")
    ap.add_argument("--before", action="store_true",
                    help="5. also under the harness as it was: one observation for prompt and "
                         "context, another for agnostic, the attention computed twice")
    ap.add_argument("--stages", action="store_true",
                    help="6.: with --only-per-prompt, the per-stage CPU table of its three prompts "
                         "instead of 5.")
    args = ap.parse_args(argv)
    if args.only_per_prompt and args.per_prompt is None:
        raise M.UsageError("--only-per-prompt needs --per-prompt LENGTH")
    if args.stages and not args.only_per_prompt:
        raise M.UsageError("--stages needs --only-per-prompt --per-prompt LENGTH")
    if args.per_prompt is not None:
        cli.at_least(FIDELITY_SHORTER + 1, per_prompt=args.per_prompt)
    # the reference run's arguments, checked by evaluate.py's parser before any work
    run = None if args.per_prompt is None else reference_args(
        args.per_prompt, args.per_prompt_methods, args.threads, args.model)
    cli.at_least(1, steps=args.steps, repeat=args.repeat, threads=args.threads,
                 budget=min(args.budget), length=min(args.length), contexts=min(args.contexts))
    names = cli.split_names(args.methods, "--methods") if args.methods else \
        [n for n in H.default_methods() if n not in ("full", "random", "polykv")]
    uncalibrated = [n for n in H.all_methods() if H.family(n) != "polykv"]   # PolyKV's calibrate
    bad = [n for n in names if n not in uncalibrated and not GV.is_row(n)]
    if bad:
        raise M.UsageError(f"unknown method {bad[0]!r}; choose from {', '.join(uncalibrated)}")
    for n in names:
        if GV.is_row(n):
            GV.variant(n, 1)                           # its [settings] checked before any work
    if args.threads:
        torch.set_num_threads(args.threads)
    budgets = args.budget
    m, tok = M.load(args.model, speed=SPEED)
    L = m.config.n_layers
    model_name = M.default_model_dir().name if args.model is None else args.model
    print(
        f"model {model_name} · {L} layers · "
        f"{torch.get_num_threads()} threads · device {m.device} · median of {args.repeat}"
    )
    if args.stages:
        return print_stages(m, tok, run)
    if args.only_per_prompt:
        return per_prompt(m, tok, run, ("before", "now") if args.before else ("now",))
    settings = calibrate.with_prompt(P.RuleSettings(), tok)
    made = {n: {b: H.method(n, b, L, settings) for b in budgets} for n in names}
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
    if run is not None:                                   # 5. the cost of a reference prompt
        per_prompt(m, tok, run, ("before", "now") if args.before else ("now",))


if __name__ == "__main__":
    cli.run(main)
