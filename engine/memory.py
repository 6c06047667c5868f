"""Peak memory of each stage, by one formula and by measurement (docs/memory.md).

Stages: the plain FullKV prefill; the shared observation for every default method but KVzip
(`engine/observe.observe`: column sums, window sums, last row, Expected Attention's query
statistics, GraceKV's probes and value flow, the surprisal); KVzip's reconstruction pass
(`baselines.reconstruct`); each default method's compression of the FullKV cache.

The formula (`stages`) adds the bytes of the tensors a stage holds at its worst moment, read off
the code: what it keeps (the KV cache with its append room, the per-layer statistics, GraceKV's
units) plus the largest short-lived working set inside it (one layer's activations, one query
chunk of attention probabilities, KVzip's copied cache, GraceKV's probe logits...). Each term
names the line it comes from. Numbers are bytes; b = the model's element size, a = 4 (fp32
statistics and softmax; 8 for an fp64 model). What it leaves out: Python objects, allocator
slack, library workspaces (BLAS, SDPA), the tokenizer: small next to the terms at 2K and more.

The measurement (`measure`, one process per length, run by `main`): the embedded model in fp32
on the CPU, one thread; the resident set after loading the model and one small warm-up
prefill is the baseline. Each stage's peak is Linux's high-water mark of the resident set
(VmHWM, reset through /proc/self/clear_refs before the stage) minus the resident set just
before it: what the stage adds on top of what earlier stages left. glibc is told to map every
allocation above 64 KiB on its own (MALLOC_MMAP_THRESHOLD_), so that a freed tensor leaves the
resident set at once and the next stage's peak is its own.

    python -m engine.memory --length 2048,4096 --threads 1     # measured vs formula (embedded)
    python -m engine.memory --table                             # 8B models in bf16 vs 80 GB
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, replace

from engine import fast_cache

GB = 1e9
HOST_NODE = 2300       # bytes of host memory per GraceKV plan node (Python records), measured
NAMES = ("streaming", "h2o", "tova", "snapkv", "knorm", "expected", "kvzip-uniform", "random",
         "pyramidkv", "adakv", "kvzip", "polykv", "gracekv")   # the default methods, FullKV aside


@dataclass(frozen=True)
class Shape:
    """What the formula reads of a model: its config's sizes and the element sizes."""
    L: int            # layers
    H: int            # query heads
    G: int            # KV heads
    D: int            # head dim
    dim: int          # hidden size
    F: int            # MLP width
    V: int            # vocabulary
    b: int = 4        # bytes per weight / activation / k, v element (bf16: 2)
    a: int = 4        # bytes per statistic and softmax element (fp32)

    @classmethod
    def of(cls, cfg, b: int) -> "Shape":
        return cls(cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dim,
                   cfg.hidden_dim, cfg.vocab_size, b, 8 if b == 8 else 4)

    def weights(self, tied: bool) -> int:
        """Parameters × b: embedding (and head unless tied), per layer q, k, v, o, MLP, norms."""
        per_layer = self.dim * (2 * self.H * self.D + 2 * self.G * self.D) + 3 * self.dim * self.F
        embeddings = self.V * self.dim * (1 if tied else 2)
        return self.b * (embeddings + self.L * (per_layer + 2 * self.dim))


@dataclass(frozen=True)
class Knobs:
    """The settings the formula depends on (the defaults of polykv.RuleSettings / Needs and
    gracekv.Settings) and the budget of the compression stages."""
    budget: int = 512
    chunk: int = 256           # polykv.Needs.chunk: query rows per observation chunk
    fused_rows: int = 128      # fast_observe.FUSED_ROWS: rows per chunk where A·V is made too
    window: int = 32           # SnapKV's w; GraceKV's r
    future: int = 512          # Expected Attention's future positions
    repeat: tuple = (8, 13, 5)  # KVzip's instruction, later instruction, suffix (tokens)
    recon_chunk: int = 2048    # baselines.reconstruct's chunk of the prompt
    recon_rows: int = 64       # baselines.scored_attention's query rows per block
    surprisal_chunk: int = 512  # model.surprisal's chunk of positions
    evidence: int = 32         # GraceKV: evidence probes per layer, every `stride`-th query
    stride: int = 4
    sampled: int = 3           # GraceKV: hop_depths (layers whose queries the flow keeps)
    seeds: int = 64            # GraceKV: seeds per hop


# what each default method observes: its statistics, GraceKV's value flow and the surprisal
# (PolyKV: a policy may hold any pool rule, so every pool statistic)
OBSERVES = {"streaming": (), "knorm": (), "random": (), "h2o": ("colsum",), "tova": ("last",),
            "snapkv": ("window",), "pyramidkv": ("window",), "adakv": ("window",),
            "expected": ("queries",), "kvzip-uniform": ("recon",), "kvzip": ("recon",),
            "polykv": ("colsum", "window", "last", "queries", "recon"),
            "gracekv": ("flow", "surprisal")}
EVERY = ("colsum", "window", "last", "queries", "recon", "flow", "surprisal")


def kv(s: Shape, slots: int) -> int:
    """A cache of `slots` entries per (layer, KV head): k, v (b each), pos (int64), bias (a)."""
    return s.L * s.G * slots * (2 * s.D * s.b + 8 + s.a)


def room(T: int) -> int:
    """Slots of a layer's buffer after its first append of T tokens (the in-place append,
    support/fast_cache.room: a quarter more, at least 64)."""
    return fast_cache.room(T)


def layer_pass(s: Shape, T: int) -> int:
    """The largest working set inside one block fed T tokens (model.Block), the residual
    stream aside: the attention side (q and three RoPE temporaries of its size, the kernel's
    output and its reshaped copy; k, v and their RoPE temporaries) or the MLP (silu(gate x),
    up x and their product live together: 3·T·F), whichever is larger."""
    attention = (6 * s.H + 4 * s.G) * T * s.D * s.b
    return max(attention, 3 * T * s.F * s.b)


def stream(s: Shape, T: int) -> int:
    """The residual stream, its norm and the block's output: 3·T·dim·b."""
    return 3 * T * s.dim * s.b


def held(s: Shape, T: int, needs, k: Knobs = Knobs()) -> dict:
    """{term: bytes} an observation leaves for the compressions: the FullKV cache with its append
    room, and per statistic in `needs` what every layer keeps (engine.observe.observe_layer,
    query_stats, engine.gracekv_fast.ValueFlow, model.surprisal; KVzip's scores, from its pass)."""
    L, H, G, D, a, b = s.L, s.H, s.G, s.D, s.a, s.b
    r = min(k.window, T)
    each = {"colsum": L * H * T * a, "window": L * H * T * a, "last": L * H * T * a,
            "queries": L * H * (D + D * D) * a,           # μ' (H, D), Σ' (H, D, D) per layer
            "recon": L * H * T * a,                       # KVzip's scores (H, T) per layer
            # x^0 (G, T), the probes (H, r, D) and every stride-th query (H, T/stride, D) of
            # every layer; the sampled layers' queries (H, T, D) and row normalisers (H, T)
            "flow": (L * (G * T * a + H * (r + -(-T // k.stride)) * D * b)
                     + k.sampled * H * T * (D * b + a)),
            "surprisal": T * a}
    return {"kv cache": kv(s, room(T)), **{f"{n} (kept)": each[n] for n in needs if n in each}}


def observation(s: Shape, T: int, needs, k: Knobs = Knobs()) -> dict:
    """{term: bytes} at the peak of a prefill observing `needs` (() = the plain prefill; KVzip's
    pass apart): what it keeps, the stream, and the largest of one block's working set, the
    observation hook's and the surprisal's (after the last block)."""
    H, G, D, a, b = s.H, s.G, s.D, s.a, s.b
    c = min(k.chunk, k.fused_rows, T)
    # fast_observe.observe_layer: query rows in descending chunks of c (only the last w rows for the
    # window alone, the last row for TOVA's); the previous chunk's A (H, c, T) alive while the
    # next chunk's logits and softmax are made: 3 × (H, c, T) in a; GraceKV's group mean. Where
    # every row is read (column sums, GraceKV's sampled layers) the pass makes the layer's
    # attention output too, in chunks of at most fused_rows rows (engine/observe.observe_prefixes)
    rows = c if {"colsum", "flow"} & set(needs) else min(k.window, T) if "window" in needs else 1
    chunk = 3 * H * rows * T * a + (G * c * T * a if "flow" in needs else 0)
    if not {"colsum", "window", "last", "flow"} & set(needs):
        chunk = 0
    # query_stats: the un-rotated queries and four RoPE temporaries (H, T, D) in a, and the
    # (future, D, D) average rotation's four
    qstats = 5 * H * T * D * a + 4 * k.future * D * D * a if "queries" in needs else 0
    hook = 2 * H * T * D * b + max(chunk, qstats) if chunk or qstats else 0   # + the q and out
    # model.surprisal: per chunk of n positions a (n, V) block of logits (in b, then in a) and
    # its log-softmax in a; from the second chunk on, the previous chunk's log-softmax is alive
    # while the next one is made
    n = min(k.surprisal_chunk, max(T - 1, 1))
    final = n * s.V * (max(b + a, 2 * a) + (a if T - 1 > n else 0)) if "surprisal" in needs else 0
    return {**held(s, T, needs, k), "stream": stream(s, T),
            "working set": max(layer_pass(s, T), hook, final)}


def kvzip_pass(s: Shape, T: int, k: Knobs = Knobs(), unscored: bool = False) -> dict:
    """{term: bytes} KVzip's reconstruction pass adds to the observation (baselines.reconstruct):
    per chunk of the prompt a fork of the FullKV cache is fed n new tokens; where the buffer's
    room is short of n (or, from the second chunk on, taken by the first chunk's in-place
    append), a layer's cache is copied into a bigger one (fast_cache.append) while its block
    runs, one layer at a time (model.run_layers keeps none); then the largest of the step's
    block working set and its attention kernel (baselines.scored_attention): per block of rows
    queries and KV group the logits and their exponentials (g, rows, T + n) in a, the output
    (H, n, D) in a, and the keys, values and bias in a where the model's dtype is another; the
    scores it keeps (L, H, T). unscored: some layer the pass runs is not scored (a PolyKV
    policy's) and runs the model's kernel, whose mask (n, T + n) is counted too."""
    L, H, G, D, a, b = s.L, s.H, s.G, s.D, s.a, s.b
    n = k.repeat[0] + k.repeat[2] + min(k.recon_chunk, T)
    copy = kv(s, room(T + n)) // L if n > room(T) - T or T > k.recon_chunk else 0   # 1 layer
    mask = n * (T + n) * (a + 2 + (b if b != a else 0)) if unscored else 0
    widened = (2 * D + 1) * G * (T + n) * a if b != a else 0
    kernel = 2 * (H // G) * min(k.recon_rows, n) * (T + n) * a + H * n * D * a + widened
    return {"scores": L * H * T * a, "copied cache": copy, "stream": stream(s, n),
            "working set": max(layer_pass(s, n), mask, kernel)}


def compression(s: Shape, T: int, name: str, k: Knobs = Knobs(), host: bool = True) -> dict:
    """{term: bytes} a method's compression adds to what the observation left. host: count the
    Python records of GraceKV's plan (on the CPU they share the memory; a GPU run keeps them
    in the host's memory, not the device's)."""
    L, H, G, D, a = s.L, s.H, s.G, s.D, s.a
    B = min(k.budget, T)
    small = kv(s, B)                                   # the compressed cache
    sel = 4 * G * T * 8       # one layer's scores, their masked copy, flip and sort (fp64, int64)
    extra = {"knorm": G * T * D * 8,                   # the layer's keys in fp64
             # Expected Attention: keys repeated to H heads, k·Σ', its product with k; ‖v‖
             "expected": 3 * H * T * D * a + G * T * D * a}
    extra["polykv"] = extra["expected"]                # its worst pool rule
    if name in ("adakv", "kvzip"):
        # every layer's scores (G, T) fp64 kept; per selection group (a layer; KVzip: all of
        # them) the stacked, masked, flipped and sorted copies; the kept mask, its indices
        scope = L if name == "kvzip" else 1
        return {"compressed cache": small, "scores": L * G * T * 8,
                "selection": 4 * scope * G * T * 8 + L * G * T + L * G * B * 3 * 8}
    if name != "gracekv":
        return {"compressed cache": small, "selection": sel + extra.get(name, 0)}
    # GraceKV (batch 1; U = L·G units, P = g·(r + m) probes, Tc = T − r, all in a).
    # gracekv.context: the units' k° (kr), values and post-RoPE keys (U, Tc, D) each, ‖k°‖,
    # R, ŝ; while they are built, the probes' logits (U, P, T) and their row-normalised slice
    # are alive beside the units' own copy (lg). hop_rows (the sampled layers' queries
    # and keys in fp64 repeated to H heads, the (H, seeds, Tc) logits × 3) and slot_bends
    # (a (T, 2·G·D) trajectory and eight temporaries) come earlier and are smaller.
    # gracekv.allocate: the units stay; each node of the plan holds its key and value (2·D·a)
    # and, on the host, its Python records (Node, two tensor views, its split): HOST_NODE
    # bytes, measured; nodes ≈ 4·U·B (176,660 = 3.8·U·B at T = 2,048, B = 512, measured).
    U, g, r = L * G, H // G, min(k.window, T)
    P = g * (r + k.evidence)
    Tc = max(T - r, 0)
    if T <= B:
        return {"compressed cache": 0}                 # FullKV: no observation, nothing made
    units = units_bytes(s, T, k)
    probes = 2 * U * P * T * a
    hops = 2 * H * Tc * D * 8 + 3 * H * k.seeds * Tc * 8
    bend = 8 * T * 2 * G * D * a
    plan = 4 * U * B * (2 * D * a + (HOST_NODE if host else 0))
    return {"units": units, "compressed cache": small,
            "working set (the context's or the plan's)": max(probes, hops, bend, plan)}


def units_bytes(s: Shape, T: int, k: Knobs = Knobs()) -> int:
    """GraceKV's per-prompt tensors that grow with T (gracekv.Context, gracekv.Units): k°,
    values, post-RoPE keys (U, Tc, D), ‖k°‖ and R (U, Tc), the probes' log-masses
    (U, Tc, P) in a; ŝ (U, Tc) in a; the floor (U, Tc) bool. (The probes' queries (U, P, D)
    do not grow with T.)"""
    U, g, r = s.L * s.G, s.H // s.G, min(k.window, T)
    P, Tc = g * (r + k.evidence), max(T - r, 0)
    return U * Tc * (3 * s.D + 2 + P) * s.a + U * Tc * s.a + U * Tc


def pipeline(s: Shape, T: int, name: str, k: Knobs = Knobs(), host: bool = True) -> int:
    """A method's peak from the prompt to its compressed cache, weights aside: the largest of
    its own observation, KVzip's pass on top of it (methods reading `recon`), and its
    compression on top of what both leave."""
    needs = OBSERVES[name]
    first = [n for n in needs if n != "recon"]         # KVzip's scores come with its pass
    peak = sum(observation(s, T, first, k).values())
    if "recon" in needs:
        # KVzip scores every layer; a PolyKV policy only its KVzip layers
        recon = kvzip_pass(s, T, k, unscored=name == "polykv")
        peak = max(peak, sum(held(s, T, first, k).values()) + sum(recon.values()))
    after = sum(held(s, T, needs, k).values()) + sum(compression(s, T, name, k, host).values())
    return max(peak, after)


# ----------------------------------------------------------------------------- the GPU table

LLAMA_31_8B = dict(L=32, H=32, G=8, D=128, dim=4096, F=14336, V=128256)     # untied head
QWEN3_8B = dict(L=36, H=32, G=8, D=128, dim=4096, F=12288, V=151936)        # untied head
MODELS = (("Llama-3.1-8B", LLAMA_31_8B), ("Qwen3-8B", QWEN3_8B))


def shared(s: Shape, T: int, k: Knobs = Knobs()) -> int:
    """The harness's one observation for every default method at once, then KVzip's pass over
    what it keeps: the larger peak, weights aside."""
    first = [n for n in EVERY if n != "recon"]
    return max(sum(observation(s, T, first, k).values()),
               sum(held(s, T, first, k).values()) + sum(kvzip_pass(s, T, k).values()))


def paths(s: Shape, T: int, k: Knobs = Knobs()) -> dict:
    """{path: peak bytes, weights aside} of the GPU table's rows: the FullKV cache alone, the
    plain prefill, the shared observation, each method alone (`pipeline`; GraceKV's plan records
    in the host's memory)."""
    out = {"weights + FullKV cache": kv(s, T),
           "plain prefill": sum(observation(s, T, (), k).values()),
           "shared observation, every default method": shared(s, T, k)}
    return {**out, **{name: pipeline(s, T, name, k, host=False) for name in NAMES}}


def gpu_table(gpu_gb: float = 80.0, lengths=(8192, 32768, 131072), k: Knobs = Knobs()) -> str:
    """Markdown: GB at the peak of each path (`paths`), weights included, for each model in
    bf16 and length; ✗ where it exceeds the GPU."""
    cols = [(label, Shape(**dims, b=2, a=4), T) for label, dims in MODELS for T in lengths]
    head = "| path | " + " | ".join(f"{label} {T // 1024}K" for label, _, T in cols) + " |"
    gb = [{p: (s.weights(tied=False) + v) / GB for p, v in paths(s, T, k).items()}
          for _, s, T in cols]
    rows = [head, "|---|" + "---|" * len(cols)]
    for p in gb[0]:
        cells = [f"{c[p]:.1f}" + (" ✗" if c[p] > gpu_gb else "") for c in gb]
        rows.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


# ----------------------------------------------------------------------------- measurement

def rss() -> int:
    """The resident set now, bytes (Linux /proc/self/status VmRSS)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) * 1024


def reset_peak():
    """Set the high-water mark VmHWM to the resident set now (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak() -> int:
    """The high-water mark of the resident set since the last reset_peak, bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) * 1024


def stage(fn, *args, **kwargs):
    """(fn(*args, **kwargs), bytes the resident set peaked above where it stood before,
    seconds)."""
    gc.collect()
    before = rss()
    reset_peak()
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, peak() - before, time.perf_counter() - t0


def mixed_policy(L: int, budget: int, settings):
    """PolyKV's shape without a calibration: layer l runs pool rule l mod |pool| with its own
    decode form (a calibrated policy holds one rule per layer, any of them)."""
    import baselines as BL
    import polykv as P
    pool = P.pool(BL.RULES)
    rules = [pool[l % len(pool)] for l in range(L)]
    return P.Policy([P.LayerPolicy((r, budget), (BL.RULES[r].decode, budget)) for r in rules],
                    budget, settings, rules=BL.RULES)


def measure(T: int, budget: int, threads: int) -> dict:
    """One length in this process (see the module docstring): {stage: measured bytes}, the
    seconds of each stage and GraceKV's node count."""
    import torch
    import baselines as BL
    import calibrate
    from engine import harness as H
    from engine import observe as OB
    from engine.fast import SPEED
    import model as M
    import polykv as P
    from support import tasks as TK
    torch.set_num_threads(threads)
    m, tok = M.load(device="cpu", dtype=torch.float32, speed=SPEED)
    with torch.no_grad():
        for p in m.parameters():       # safetensors maps the file: its pages would come and go
            p.data = p.data.clone()    # with the page cache; copies stay resident
    L = m.config.n_layers
    settings = calibrate.with_prompt(P.RuleSettings(), tok)
    x = torch.tensor([TK.fidelity_text(tok, T, 0)[0]])
    made = {n: mixed_policy(L, budget, settings) if n == "polykv"
            else H.method(n, budget, L, settings) for n in NAMES}
    needs = OB.union([meth.needs(m) for meth in made.values()], L)
    no_recon = replace(needs, stats=tuple(st - {"recon"} for st in needs.stats))
    recon_layers = [l for l in range(L) if "recon" in needs.stats[l]]
    got, secs, nodes = {}, {}, None
    with torch.no_grad():
        M.prefill(m, x[:, :64])                                              # warm-up, not counted
        _, got["prefill"], secs["prefill"] = stage(M.prefill, m, x)
        (full, obs), got["observation"], secs["observation"] = stage(OB.observe, m, x, no_recon)
        rec, got["kvzip pass"], secs["kvzip pass"] = stage(
            BL.reconstruct, m, full, x, needs.repeat, recon_layers, needs.n_sink)
        for l, sc in rec.items():
            obs.stats[l]["recon"] = sc
        del rec
        for name, meth in made.items():
            if name == "gracekv":      # its plan too, for the node count
                flow = meth.shared.flow(obs, meth.settings)
                (out, plan), got[name], secs[name] = stage(
                    meth.compress_flow, m, full, flow, return_plan=True)
                nodes = None if plan is None else len(plan.nodes)
                del plan
            else:
                out, got[name], secs[name] = stage(meth.compress, m, full, obs)
            del out
    return {"T": T, "budget": budget, "bytes": got, "seconds": secs, "gracekv_nodes": nodes,
            "repeat": [len(r) for r in settings.repeat]}


def embedded_shape() -> Shape:
    import model as M
    from support import checkpoint
    return Shape.of(M.Config.from_hf(checkpoint.read_config(M.default_model_dir())), 4)


def formula(s: Shape, T: int, k: Knobs) -> dict:
    """{stage: bytes} as `measure` reports them: the prefill; the observation of every default
    method but KVzip's pass; that pass over it; each compression over both."""
    out = {"prefill": sum(observation(s, T, (), k).values()),
           "observation": sum(observation(s, T, [n for n in EVERY if n != "recon"], k).values()),
           "kvzip pass": sum(kvzip_pass(s, T, k).values())}
    return {**out, **{n: sum(compression(s, T, n, k).values()) for n in NAMES}}


def compare(result: dict) -> str:
    """Markdown rows: measured vs formula for one length."""
    k = Knobs(budget=result["budget"], repeat=tuple(result["repeat"]))
    want = formula(embedded_shape(), result["T"], k)
    rows = []
    for name, got in result["bytes"].items():
        f = want[name]
        rows.append(f"| {result['T']} | {name} | {got / 1e6:.0f} | {f / 1e6:.0f} | "
                    f"{(f - got) / 1e6:+.0f} ({(f - got) / max(got, 1) * 100:+.0f} %) | "
                    f"{result['seconds'][name]:.0f} |")
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", default="2048,4096", help="prompt lengths to measure (comma list)")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--table", action="store_true", help="the 8B models' table, no measurement")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)   # a child's length
    args = ap.parse_args(argv)
    if args.one is not None:
        print(json.dumps(measure(args.one, args.budget, args.threads)))
        return
    print(f"budget {args.budget}, threads {args.threads}, lengths {args.length}", flush=True)
    if args.table:
        print(gpu_table(k=Knobs(budget=args.budget)))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": str(args.threads)}
    print("| T | stage | measured MB | formula MB | formula − measured MB | s |\n"
          "|---|---|---|---|---|---|")
    for T in [int(t) for t in args.length.split(",")]:
        cmd = [sys.executable, "-m", "engine.memory", "--one", str(T),
               "--budget", str(args.budget), "--threads", str(args.threads)]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode:
            sys.exit(f"error: the measurement at {T} tokens failed: {r.stderr[-2000:]}")
        result = json.loads(r.stdout.strip().splitlines()[-1])
        print(compare(result), flush=True)
        print(json.dumps(result), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
