"""Peak memory of each stage, by one formula and by measurement (docs/memory.md).

Stages: the plain FullKV prefill; the shared observation for every default method but KVzip
(`polykv.observe`: column sums, window sums, last row, Expected Attention's query statistics,
GraceKV's probes and value flow, the surprisal); KVzip's reconstruction pass
(`polykv.reconstruct`); each default method's compression of the FullKV cache.

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

    python -m support.memory --length 2048,4096 --threads 1     # measured vs formula (embedded)
    python -m support.memory --table                             # 8B models in bf16 vs 80 GB
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

GB = 1e9
HOST_NODE = 2800       # bytes of host memory per GraceKV plan node (Python records), measured
NAMES = ("streaming", "h2o", "tova", "snapkv", "knorm", "expected", "kvzip-uniform", "random",
         "pyramidkv", "adakv", "kvzip", "polykv", "gracekv")      # the default methods, FullKV aside


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
        return self.b * (self.V * self.dim * (1 if tied else 2) + self.L * (per_layer + 2 * self.dim))


@dataclass(frozen=True)
class Knobs:
    """The settings the formula depends on (the defaults of polykv.RuleSettings / Needs and
    gracekv.Settings) and the budget of the compression stages."""
    budget: int = 512
    chunk: int = 256           # polykv.Needs.chunk: query rows per observation chunk
    window: int = 32           # SnapKV's w; GraceKV's r
    future: int = 512          # Expected Attention's future positions
    repeat: tuple = (8, 12, 5)  # KVzip's instruction, later instruction, suffix (tokens)
    recon_chunk: int = 2048    # polykv.reconstruct's chunk
    surprisal_chunk: int = 512  # model.surprisal's chunk of positions
    evidence: int = 32         # GraceKV: evidence probes per layer, every `stride`-th query
    stride: int = 4
    sampled: int = 3           # GraceKV: hop_depths (layers whose queries the flow keeps)
    bends: int = 3             # GraceKV: bend_depths
    seeds: int = 64            # GraceKV: seeds per hop
    slot: int = 64             # GraceKV: slot_target


def kv(s: Shape, slots: int) -> int:
    """A cache of `slots` entries per (layer, KV head): k, v (b each), pos (int64), bias (a)."""
    return s.L * s.G * slots * (2 * s.D * s.b + 8 + s.a)


def room(T: int) -> int:
    """Slots of a layer's buffer after its first append of T tokens (model.LayerCache.append:
    a quarter more, at least 64)."""
    return T + max(64, T // 4)


def layer_pass(s: Shape, T: int, S: int) -> dict:
    """The largest working set inside one block fed T tokens over S keys (model.Block): the
    residual stream, its norm, the block's output; the attention side (q and three RoPE
    temporaries of its size, k, v and their RoPE temporaries, the kernel's output and its
    reshaped copy); the MLP (silu(gate x), up x and their product live together: 3·T·F)."""
    stream = 3 * T * s.dim * s.b
    attention = (6 * s.H + 4 * s.G) * T * s.D * s.b
    mlp = 3 * T * s.F * s.b
    return {"stream": stream, "layer": max(attention, mlp)}


def stages(s: Shape, T: int, k: Knobs = Knobs(), host: bool = True) -> dict:
    """{stage: {term: bytes}}: what each stage holds at its peak, above the model's weights and
    what the stages before it left (the observation's cache and statistics stay for the
    compressions; KVzip's scores too). A stage's peak is the sum of its terms. host: count
    the Python records of GraceKV's plan (True on the CPU, where they share the memory; on a
    GPU they sit in the host's memory, not the device's)."""
    L, H, G, D, a, b = s.L, s.H, s.G, s.D, s.a, s.b
    c = min(k.chunk, T)
    out = {}
    # plain prefill: the cache (with its append room) and one layer's working set
    out["prefill"] = {"kv cache": kv(s, room(T)), **layer_pass(s, T, T)}

    # the shared observation: the same, plus what every layer keeps and the chunk loop's peak
    per_layer = {
        "colsum, window, last (L·3·H·T·a)": 3 * L * H * T * a,
        "query statistics μ, Σ": L * H * (D + D * D) * a,
        "flow x^0, probes, strided queries": L * (G * T * a + H * (k.window + -(-T // k.stride)) * D * b),
        "sampled layers' queries and lse": k.sampled * H * T * (D * b + a),
        "surprisal": T * a,
    }
    # polykv.observe_layer: the previous chunk's A alive while the next one's logits and
    # softmax are made (causal_probs), 3 × (H, c, T); query_stats: the un-rotated queries and
    # four RoPE temporaries of (H, T, D) in fp32, plus the (future, D, D) rotation average × 4
    chunk = 3 * H * c * T * a + G * c * T * a       # + ValueFlow.add's group mean (G, c, T)
    qstats = 5 * H * T * D * a + 4 * k.future * D * D * a
    # model.surprisal: a (512, V) logit block in b, its fp32 copy (none when b = a) and its
    # log-softmax
    surpr = min(k.surprisal_chunk, max(T - 1, 1)) * s.V * (b + a + (a if b != a else 0))
    held_in_layer = 2 * H * T * D * b            # the layer's q and attention output, alive in the hook
    out["observation"] = {"kv cache": kv(s, room(T)), **per_layer,
                          "stream": 3 * T * s.dim * b,
                          "working set": max(layer_pass(s, T, T)["layer"],
                                             held_in_layer + max(chunk, qstats), surpr)}

    # KVzip's pass: per chunk of the prompt, a fork of the FullKV cache fed n new tokens; where
    # the buffer's room is short of n, every layer's cache is copied into a bigger buffer
    # (LayerCache.append), all held until the step ends; the step's own layer pass with a mask
    # (n, T + n) in fp32 and bool; the spy's probabilities over (H, 256, 2n) × 3; the scores
    n = k.repeat[0] + k.repeat[2] + min(k.recon_chunk, T)
    copy = kv(s, room(T + n)) if n > room(T) - T else 0
    mask = n * (T + n) * (2 * a + 1)
    spy = 3 * H * 256 * (2 * n) * a + G * 2 * n * D * b
    out["kvzip pass"] = {"scores (L·H·T·a)": L * H * T * a, "copied cache": copy,
                         "stream": 3 * n * s.dim * b,
                         "working set": max(layer_pass(s, n, T + n)["layer"], mask + spy)}

    B = min(k.budget, T)
    small = kv(s, B)                                  # a compressed dense cache
    sel = 4 * G * T * 8                               # one layer's scores, masked copy, flip, sort (fp64, int64)
    for name in ("streaming", "h2o", "tova", "snapkv", "random", "kvzip-uniform", "pyramidkv", "polykv"):
        out[name] = {"compressed cache": small, "selection": sel}
    # K-norm: the layer's keys in fp64
    out["knorm"] = {"compressed cache": small, "selection": sel + G * T * D * 8}
    # Expected Attention: keys repeated to H heads in fp32, k·Σ, its product with k; ‖v‖ in fp32
    out["expected"] = {"compressed cache": small, "selection": sel + 3 * H * T * D * a + G * T * D * a}
    out["polykv"]["selection"] = out["expected"]["selection"]          # its layers' worst rule
    # head-wise: every layer's scores (L, G, T) fp64 kept, stacked (KVzip: over all layers),
    # masked, flipped and sorted: about five copies; the kept mask and its nonzero indices
    for name in ("adakv", "kvzip"):
        scope = L if name == "kvzip" else 1
        out[name] = {"compressed cache": small, "scores": L * G * T * 8,
                     "selection": 4 * scope * G * T * 8 + L * G * T + L * G * B * 3 * 8}

    # GraceKV (batch 1; U = L·G units, P = g·(r + m) probes, Tc = T − r, all in a = fp32).
    # gracekv.context: the units' k° (kr), values and post-RoPE keys (U, Tc+1, D) each, ‖k°‖,
    # R, ŝ (U, Tc); while they are built, the probes' logits (U, P, T), their row-normalised
    # slice and its padded transpose (the units' lg) are alive together. Before that,
    # hop_rows (the sampled layers' queries and keys in fp64, repeated to H heads, the
    # (H, seeds, Tc) logits ×3) and slot_bends (a (T, 2·G·D) trajectory and eight
    # temporaries) are smaller. gracekv.allocate: the units stay; each node of the plan holds
    # its key and value (2·D·a) and, on the host, its Python records (Node, two tensor
    # views, its split): about 2.8 kB measured at 2K (the one constant not read off shapes);
    # nodes ≈ 4·U·B (176,660 = 3.8·U·B measured at T = 2048, B = 512)
    U, g, r = L * G, H // G, min(k.window, T)
    P = g * (r + k.evidence)
    Tc = max(T - r, 0)
    units = U * (Tc + 1) * (3 * D + 3) * a + U * (Tc + 1) * P * a + U * Tc
    probes = 2 * U * P * T * a                  # the logits and their normalised slice
    hops = 2 * H * Tc * D * 8 + 3 * H * k.seeds * Tc * 8
    bend = 8 * T * 2 * G * D * a
    nodes = 4 * U * B if T > B else 0
    plan = nodes * (2 * D * a + (HOST_NODE if host else 0))
    out["gracekv"] = {"units (U·(Tc+1)·(3D + 3 + P)·a)": units, "compressed cache": small,
                      "working set: the context's or the plan's": max(probes, hops, bend, plan)}
    return out


def peaks(s: Shape, T: int, k: Knobs = Knobs(), host: bool = True) -> dict:
    """{stage: peak bytes}: each stage's terms summed."""
    return {name: sum(terms.values()) for name, terms in stages(s, T, k, host).items()}


# ----------------------------------------------------------------------------- the GPU table

LLAMA_31_8B = dict(L=32, H=32, G=8, D=128, dim=4096, F=14336, V=128256)     # untied head
QWEN3_8B = dict(L=36, H=32, G=8, D=128, dim=4096, F=12288, V=151936)        # untied head


def gpu_table(gpu_gb: float = 80.0, lengths=(8192, 32768, 131072)) -> str:
    """Markdown: per model and length, the weights, the prefill and the shared observation
    (+ KVzip's pass) held at once with the largest compression, and which methods fit."""
    rows = ["| model | T | weights | prefill peak | observation peak | + KVzip pass | method "
            "(compression peak) over the observation's cache and statistics | fits 80 GB |",
            "|---|---|---|---|---|---|---|---|"]
    for label, dims in (("Llama-3.1-8B", LLAMA_31_8B), ("Qwen3-8B", QWEN3_8B)):
        s = Shape(**dims, b=2, a=4)
        w = s.weights(tied=False)
        for T in lengths:
            st = stages(s, T)
            p = peaks(s, T)
            held = sum(v for key, v in st["observation"].items() if key not in ("stream", "working set"))
            recon = held + p["kvzip pass"]
            worst = max(NAMES, key=lambda n: p[n])
            fits = [n for n in NAMES if w + held + (st["kvzip pass"]["scores (L·H·T·a)"] if "kvzip" in n else 0)
                    + p[n] <= gpu_gb * GB]
            over = [n for n in NAMES if n not in fits]
            rows.append(f"| {label} | {T // 1024}K | {w / GB:.1f} | {(w + p['prefill']) / GB:.1f} | "
                        f"{(w + p['observation']) / GB:.1f} | {(w + recon) / GB:.1f} | {worst} "
                        f"{(w + held + p[worst]) / GB:.1f} | "
                        + ("all" if not over else "all but " + ", ".join(over)) + " |")
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


def stage(fn):
    """(fn(), bytes the resident set peaked above where it stood before, seconds)."""
    gc.collect()
    before = rss()
    reset_peak()
    t0 = time.perf_counter()
    out = fn()
    return out, peak() - before, time.perf_counter() - t0


def mixed_policy(L: int, budget: int, settings):
    """PolyKV's shape without a calibration: layer l runs the pool rule l mod 6, its own decode
    form (what a calibrated policy holds at most: one rule per layer)."""
    import polykv as P
    pool = P.pool()
    layers = [P.LayerPolicy((pool[l % len(pool)], budget), (P.RULES[pool[l % len(pool)]].decode, budget))
              for l in range(L)]
    return P.Policy(layers, budget, settings)


def measure(T: int, budget: int, threads: int) -> dict:
    """One length in this process (see the module docstring): {stage: measured bytes}, plus the
    seconds of each stage and GraceKV's node count."""
    import torch
    import evaluate as E
    import calibrate
    import gracekv as GK
    import model as M
    import polykv as P
    from support import tasks as TK
    torch.set_num_threads(threads)
    m, tok = M.load(device="cpu", dtype=torch.float32)
    L = m.config.n_layers
    settings = calibrate.with_prompt(P.RuleSettings(), tok)
    x = torch.tensor([TK.fidelity_text(tok, T, 0)[0]])
    with torch.no_grad():
        M.prefill(m, x[:, :64])                                              # warm-up, not counted
        made = {n: mixed_policy(L, budget, settings) if n == "polykv" else E.method(n, budget, L, settings)
                for n in NAMES}
        needs = P.union([meth.needs(m) for meth in made.values()], L)
        no_recon = P.Needs(tuple(st - {"recon"} for st in needs.stats), needs.window, needs.chunk,
                           needs.extra, needs.n_sink, needs.future, needs.repeat, needs.surprisal)
        got, secs = {}, {}
        _, got["prefill"], secs["prefill"] = stage(lambda: M.prefill(m, x))
        (full, obs), got["observation"], secs["observation"] = stage(lambda: P.observe(m, x, no_recon))
        layers = [l for l in range(L) if "recon" in needs.stats[l]]
        rec, got["kvzip pass"], secs["kvzip pass"] = stage(
            lambda: P.reconstruct(m, full, x, needs.repeat, layers, needs.n_sink))
        for l, sc in rec.items():
            obs.stats[l]["recon"] = sc
        del rec
        nodes = None
        for name, meth in made.items():
            GK.CONTEXTS.clear()
            out, got[name], secs[name] = stage(lambda: meth.compress(m, full, obs))
            if name == "gracekv" and T > budget:
                plan = GK.compress(m, full, GK.flow_of(obs, meth.settings.window), budget,
                                   meth.settings, return_plan=True)[1]
                nodes = len(plan.nodes)
            del out
        GK.CONTEXTS.clear()
    return {"T": T, "budget": budget, "bytes": got, "seconds": secs, "gracekv_nodes": nodes,
            "repeat": [len(r) for r in settings.repeat]}


def embedded_shape():
    import model as M
    from support import checkpoint
    cfg = M.Config.from_hf(checkpoint.read_config(M.default_model_dir()))
    return Shape.of(cfg, 4), cfg.tie_embeddings


def compare(result: dict) -> str:
    """Markdown rows: measured vs formula for one length."""
    s, _ = embedded_shape()
    k = Knobs(budget=result["budget"], repeat=tuple(result["repeat"]))
    want = peaks(s, result["T"], k)
    rows = []
    for name, got in result["bytes"].items():
        f = want[name]
        rows.append(f"| {result['T']} | {name} | {got / 1e6:.0f} | {f / 1e6:.0f} | "
                    f"{(f - got) / max(got, 1) * 100:+.0f} % | {result['seconds'][name]:.1f} |")
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", default="2048,4096", help="prompt lengths to measure (comma list)")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--table", action="store_true", help="only the 8B models' table (no measurement)")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)   # a child: one length
    args = ap.parse_args(argv)
    if args.one is not None:
        print(json.dumps(measure(args.one, args.budget, args.threads)))
        return
    print(f"budget {args.budget}, threads {args.threads}, lengths {args.length}", flush=True)
    if args.table:
        print(gpu_table())
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": str(args.threads)}
    print("| T | stage | measured MB | formula MB | formula − measured | s |\n|---|---|---|---|---|---|")
    for T in [int(t) for t in args.length.split(",")]:
        cmd = [sys.executable, "-m", "support.memory", "--one", str(T), "--budget", str(args.budget),
               "--threads", str(args.threads)]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode:
            sys.exit(f"error: the measurement at {T} tokens failed: {r.stderr[-2000:]}")
        result = json.loads(r.stdout.strip().splitlines()[-1])
        print(compare(result), flush=True)
        print(json.dumps(result), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
