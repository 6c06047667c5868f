"""The benchmark: every method against FullKV at one or several budgets, offline.

`python evaluate.py --budget 512` runs the default suite on the embedded model and prints one
Markdown table (rows = methods, columns = tasks). Suites (SPEC.md §6, data from tasks.py):
- fidelity: natural-text prompts, compressed, then the real next tokens teacher-forced;
  KL(FullKV ‖ method) of the next-token distributions, ΔNLL vs FullKV, top-1 agreement.
- RULER-style retrieval: greedy answers scored with `string_match_all`, and *answer fidelity*:
  the gold answer teacher-forced after the answer prefix, its ΔNLL and KL vs FullKV.
- LongBench (`--data DIR`): greedy answers scored with the official metrics.

Protocol (SnapKV / PyramidKV / KVCache-Factory): the whole prompt is prefilled with full
attention, then compressed once; so the first generated token is always predicted from full
attention, identically for every method, and only later tokens see the compressed cache. All
methods of one sample share that one prefill (and its attention statistics); each method costs
only its compression and decoding. Teacher-forced distributions count from the first
continuation token (predicted from the prefill's last logits) on.

Ablations are methods too: `polykv-pattern` (the calibrated rules, uniform budgets),
`polykv-budget` (the best uniform rule, the calibrated budgets), `polykv-prefill` (the
calibrated prefill phase, no eviction while decoding) and the `gracekv-*` variants
(gracekv.VARIANTS, Settings overrides). Every method is a methods.Method: the harness builds
each once (`Methods`), runs one shared prefill observing the union of their needs, compresses
each method once and decodes forks of its cache with the method's decoder. Each row records its compression time (`compress_s`) and
the shared prefill's (`prefill_s`).

Every finished (method, budget, sample) is appended and flushed to OUT/samples.jsonl; a rerun
with the same arguments skips what is there. OUT/summary.json (flat rows for scripts) and
OUT/summary.md (the table) are written at the end.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import gracekv
import methods as MT
import metrics
import model as M
import polykv as P
import report
import rules
import tasks as TK
from errors import UsageError

# FullKV, every registered rule (rules.RULES) and PyramidKV's schedule
UNIFORM = ("full",) + tuple(name for name in rules.RULES if name != "random") + ("pyramidkv", "random")
POLYKV = ("polykv", "polykv-pattern", "polykv-budget", "polykv-prefill")
METHODS = UNIFORM + POLYKV + tuple(gracekv.VARIANTS)
DEFAULT_METHODS = UNIFORM + ("polykv", "gracekv")
# the default suite on the embedded CPU model: RULER tasks the 4-bit 135M model solves with the
# full cache at the default length (README: measured FullKV scores and why the others are out)
DEFAULT_RULER = ("niah_single_1",)


# ----------------------------------------------------------------------------- one sample

@dataclass
class Item:
    """One prompt of a suite: tokens (1, T) and what to do with them."""
    task: str
    index: int
    length: int                 # the target length (task column)
    tokens: torch.Tensor        # (1, T)
    sample: TK.Sample = None    # RULER / LongBench: answers, metric, max_new_tokens, gold
    target: torch.Tensor = None  # (1, n) tokens to teacher-force: the continuation or the gold answer


def teacher_force(model, cache, target, decoder=None) -> torch.Tensor:
    """log p(· | prompt, target[:i]) for i < n: (n, V) fp32; the first row is the prefill's.
    decoder: the method's decode-time eviction (None = append)."""
    first = cache.last_logits[:, None]                                        # (1, 1, V)
    rest = M.decode(model, target[:, :-1], cache, decoder) if target.shape[1] > 1 else first[:, :0]
    return torch.log_softmax(torch.cat((first, rest), 1)[0].float(), -1)     # (n, V)


def compare(ref_lp, lp, target) -> dict:
    """KL(FullKV ‖ method), ΔNLL and top-1 agreement over the n teacher-forced positions."""
    tgt = target[0].to(lp.device)
    kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1).clamp_min(0).mean()          # Σ p (log p − log q)
    nll = -lp.gather(1, tgt[:, None]).mean()
    ref_nll = -ref_lp.gather(1, tgt[:, None]).mean()
    top1 = (lp.argmax(-1) == ref_lp.argmax(-1)).float().mean()
    return {"kl": float(kl), "dnll": float(nll - ref_nll), "top1": 100 * float(top1)}


class Methods:
    """Turns a method name + budget into a methods.Method (built once, then reused)."""

    def __init__(self, model, tok, args):
        self.model, self.tok, self.args = model, tok, args
        self.L = model.config.n_layers
        self.policies, self.made = {}, {}

    def calibrated(self, budget):
        """--policy FILE (rescaled to each budget), else one calibration per budget, cached."""
        key = "file" if self.args.policy else budget
        if key not in self.policies:
            if self.args.policy:
                self.policies[key] = P.Policy.load(self.args.policy, n_layers=self.L)
            else:
                import calibrate
                print(f"polykv: policy for budget {budget} from {self.args.cache_dir} "
                      "(calibrated once on first use, about 5 min on 2 CPU cores)", flush=True)
                self.policies[key] = calibrate.policy_for(self.model, self.tok, self.args.model_name, budget,
                                                          self.args.seed, Path(self.args.cache_dir))
        pol = self.policies[key]
        return pol if pol.budget == budget else pol.rescaled(budget)

    def get(self, name, budget) -> MT.Method:
        if (name, budget) not in self.made:
            self.made[name, budget] = self.make(name, budget)
        return self.made[name, budget]

    def make(self, name, budget) -> MT.Method:
        if name == "pyramidkv":
            return P.Pyramid(budget)
        if name in UNIFORM:
            return P.Policy.uniform(name, budget, self.L)
        if name in gracekv.VARIANTS:
            return gracekv.GraceKV(budget, gracekv.Settings(**gracekv.VARIANTS[name]))
        import calibrate
        pol = self.calibrated(budget)
        if name == "polykv":
            return pol
        if name == "polykv-pattern":
            return calibrate.pattern_only(pol)
        if name == "polykv-prefill":
            return calibrate.prefill_only(pol)
        return calibrate.budget_only(pol, pol.meta.get("best_uniform", "snapkv"))


def run_item(model, tok, methods: Methods, names, budgets, item: Item, done: set):
    """All (method, budget) results of one item not in done, as dicts."""
    T = item.tokens.shape[1]
    todo = [(n, b) for b in budgets for n in names if result_key(n, b, item) not in done]
    made = {nb: methods.get(*nb) for nb in todo}      # policies resolved outside the timers
    t0 = time.perf_counter()
    full, obs = MT.observe_for(model, item.tokens, list(made.values()))
    t_p = time.perf_counter() - t0
    ref_lp = teacher_force(model, full.fork(), item.target) if item.target is not None else None
    L, G = model.config.n_layers, model.config.n_kv_heads
    out = []
    for (name, budget), method in made.items():
        t0 = time.perf_counter()
        cache = method.compress(model, full, obs)
        t_c = time.perf_counter() - t0
        r = {"key": result_key(name, budget, item), "method": name, "budget": budget,
             "task": item.task, "length": item.length, "index": item.index, "n_tokens": T,
             "kv_fraction": cache.entries() / (L * G * T), "compress_s": round(t_c, 4),
             "prefill_s": round(t_p, 4)}   # the shared prefill + every method's statistics
        if item.target is not None:
            r.update(compare(ref_lp, teacher_force(model, cache.fork(), item.target, method.decoder),
                             item.target))
        if item.sample is not None:
            ids = M.greedy(model, cache.fork(), min(item.sample.max_new_tokens, methods.args.max_new_tokens),
                           tok.eos_ids, method.decoder)
            r["pred"] = tok.decode(ids)
            r["score"] = metrics.score(item.sample, r["pred"])
        out.append(r)
    return out


def result_key(name, budget, item) -> str:
    return f"{name}|{budget}|{item.task}|{item.length}|{item.index}"


# ----------------------------------------------------------------------------- suites

def build_items(tok, args, model):
    """The suite, deterministic from args.seed: fidelity prompts, RULER tasks, LongBench."""
    dev = model.device
    as_t = lambda ids: torch.tensor([ids], device=dev)
    items = []
    for length in args.fidelity_length:
        for i in range(args.fidelity_samples):
            p, c = TK.fidelity_text(tok, length, args.cont_len, args.seed, i)
            items.append(Item("fidelity", i, length, as_t(p), target=as_t(c)))
    for length in args.length:
        for task in args.tasks:
            for i in range(args.samples):
                s = TK.RULER_TASKS[task](tok, length, args.seed, i)
                ids = tok.encode(s.prompt)
                gold = tok.encode(s.prompt + s.gold)[len(ids):] if s.gold else None
                items.append(Item(task, i, length, as_t(ids), s, as_t(gold) if gold else None))
    if args.data:
        for i, s in enumerate(TK.load_longbench(args.data, tok, model.config.max_seq_len - 256)):
            items.append(Item(s.task, s.index, 0, as_t(tok.encode(s.prompt)), s))
    for it in items:
        if it.tokens.shape[1] > model.config.max_seq_len:
            raise UsageError(f"{it.task} prompt of {it.tokens.shape[1]} tokens is longer than the "
                             f"model's maximum ({model.config.max_seq_len}); lower --length")
    return items


# ----------------------------------------------------------------------------- main

def parse(argv):
    ap = argparse.ArgumentParser(description="KV-cache compression methods against FullKV.")
    ints = lambda s: [int(x) for x in s.split(",") if x]
    ap.add_argument("--budget", type=ints, default=[512], help="average entries per (layer, KV head); comma list sweeps")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    ap.add_argument("--model", default=None, help="HF checkpoint folder (default: embedded SmolLM2-135M)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None, choices=[None, "float32", "bfloat16", "float16", "float64"])
    ap.add_argument("--tasks", default=",".join(DEFAULT_RULER), help="RULER-style tasks (empty: none)")
    ap.add_argument("--length", type=ints, default=None, help="RULER prompt lengths in tokens")
    ap.add_argument("--samples", type=int, default=None, help="samples per RULER task and length")
    ap.add_argument("--fidelity-length", type=ints, default=None)
    ap.add_argument("--fidelity-samples", type=int, default=None)
    ap.add_argument("--cont-len", type=int, default=64, help="teacher-forced continuation tokens")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="cap on generated tokens (default: the task's own on GPU, 24 on CPU)")
    ap.add_argument("--data", default=None, help="folder of LongBench *.jsonl files")
    ap.add_argument("--policy", default=None, help="PolyKV policy JSON (default: calibrate once, cached)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cache-dir", default=str(M.default_model_dir().parent / "policies"))
    ap.add_argument("--plot", action="store_true", help="budget-vs-score PNG (needs matplotlib)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's; 1 is faster on a CPU shared with other jobs)")
    args = ap.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        raise UsageError(f"unknown method {bad[0]!r}; choose from {', '.join(METHODS)}")
    args.tasks = [t for t in args.tasks.split(",") if t]
    bad = [t for t in args.tasks if t not in TK.RULER_TASKS]
    if bad:
        raise UsageError(f"unknown task {bad[0]!r}; choose from {', '.join(TK.RULER_TASKS)}")
    if min(args.budget) < 1:
        raise UsageError(f"budget must be >= 1, got {min(args.budget)}")
    gpu = args.model is not None and torch.cuda.is_available()
    # defaults: CPU + embedded model -> sized to run in ~10 min on 2 cores; GPU -> long prompts
    args.length = args.length or ([4096, 8192, 16384] if gpu else [2048])
    args.fidelity_length = args.fidelity_length or ([4096, 8192, 16384] if gpu else [2048])
    args.samples = args.samples if args.samples is not None else (50 if gpu else 6)
    args.fidelity_samples = args.fidelity_samples if args.fidelity_samples is not None else (20 if gpu else 4)
    # RULER lets niah generate 128 tokens; the 7-digit answers need ~10, and on a CPU every
    # token costs one decoding step per method
    args.max_new_tokens = args.max_new_tokens or (10**6 if gpu else 24)
    args.model_name = Path(args.model).name if args.model else M.default_model_dir().name
    return args


def main(argv=None):
    args = parse(argv)
    t_start = time.time()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    m, tok = M.load(args.model, device=args.device, dtype=dtype)
    torch.manual_seed(args.seed)
    keyed = {k: getattr(args, k) for k in ("model_name", "tasks", "length", "samples", "fidelity_length",
                                           "fidelity_samples", "cont_len", "max_new_tokens", "data",
                                           "policy", "seed")}
    keyed["dtype"] = str(m.dtype)
    out = Path(args.out or f"runs/{args.model_name}-{hashlib.sha1(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:8]}")
    out.mkdir(parents=True, exist_ok=True)
    config = {**keyed, "budgets": args.budget, "methods": args.methods, "device": str(m.device), "out": str(out)}
    print("config: " + json.dumps(config), flush=True)
    items = build_items(tok, args, m)
    jsonl = out / "samples.jsonl"
    rows = [json.loads(l) for l in jsonl.read_text().splitlines() if l.strip()] if jsonl.exists() else []
    done = {r["key"] for r in rows}
    methods = Methods(m, tok, args)
    t0, n_run = time.time(), 0
    with open(jsonl, "a") as f:
        for i, item in enumerate(items):
            keys = {result_key(n, b, item) for n in args.methods for b in args.budget}
            if keys <= done:
                continue
            new = run_item(m, tok, methods, args.methods, args.budget, item, done)
            for r in new:
                if item.sample is not None:
                    r["metric"] = item.sample.metric
                f.write(json.dumps(r) + "\n")
            f.flush()
            rows += new
            done |= {r["key"] for r in new}
            n_run += 1
            eta = (time.time() - t0) / n_run * (len(items) - i - 1)
            print(report.progress(rows, item, args.methods, args.budget[0], i, len(items), eta), flush=True)
    summary = report.summarize(rows, args.methods, args.budget)
    config["wall_s"] = round(time.time() - t_start, 1)
    per_prompt = {(r["task"], r["length"], r["index"]): r["prefill_s"] for r in rows if "prefill_s" in r}
    config["prefill_s"] = round(sum(per_prompt.values()) / max(1, len(per_prompt)), 2)
    (out / "summary.json").write_text(json.dumps({"config": config, "rows": summary}, indent=1))
    header = (f"model {args.model_name} · device {m.device} · dtype {m.dtype} · seed {args.seed} · "
              f"RULER {','.join(args.tasks) or '–'} at {args.length} × {args.samples} · fidelity "
              f"{args.fidelity_length} × {args.fidelity_samples} (+{args.cont_len}) · wall {config['wall_s']} s · shared prefill "
              f"{config['prefill_s']} s per prompt")
    md = header + "\n\n" + report.table(summary, args.methods, args.budget, args.tasks)
    (out / "summary.md").write_text(md + "\n")
    print("\n" + md)
    if args.plot:
        report.plot(summary, args.methods, out)


if __name__ == "__main__":
    try:
        main()
    except UsageError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit("interrupted: finished samples are in samples.jsonl; rerun the same command to resume")
