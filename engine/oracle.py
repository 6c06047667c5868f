"""A reference oracle for faster implementations: dump what a method keeps, compare two dumps.

A faster implementation of a rule (a Triton kernel, a serving engine's eviction code) is checked
against this one through a *reference file*: for one model, prompt, method and budget,

  tokens     (T,)        int64   the prompt
  pos        (L, G, S)   int64   kept positions per (layer, KV head), ascending; −1 = padding
  bias       (L, G, S)   fp32    additive logit per entry: 0 token, log m GraceKV prototype, −inf
  pad
  scores     (L, G, T)   fp32    the rule's scores (higher = keep; +inf = protected), when the
                                 method is one rule
  out        (L, H, P+n, D) fp32 attention output of each layer over the compressed cache for
                                 P probe queries (the last P prompt positions) and n decode steps
  full_out   (L, H, P+n, D) fp32 the same queries over the FullKV cache

in one safetensors file whose metadata holds a JSON header under "oracle": format, model,
method, budget, settings, versions, P, n, decode_tokens. The decode steps feed FullKV's greedy
tokens (`decode_tokens`) to both caches, appending (no decode-time eviction), so `out` compares
attention kernels over the same kept set. Probe queries are each layer's own queries from the
FullKV pass; they see the compressed cache's entries with position <= theirs.

`compare(a, b)` (files of the same prompt, --probes and --decode; else "cannot compare", exit 2)
reports per unit exact-set agreement, Jaccard, where two selections first differ (the rank in a's
score order and the score margin to a's selection boundary there: a near-tie is not a bug), the
largest bias difference on shared entries and the attention-output error ‖out_a − out_b‖ /
‖full_out‖ per layer; `passed` needs every unit equal and that error below `tol`. Command line:
`python -m engine.oracle dump ...` and `python -m engine.oracle compare A B` (exit 0 on pass, 1 on
fail, 2 when it could not compare: support/cli.py). README "Test your implementation against this
one" shows the format from the other side.
"""
from __future__ import annotations

import json
import math
import platform
from pathlib import Path

import torch

import calibrate
import baselines as BL
import model as M
import polykv as P
from engine import harness as H
from engine import observe as OB
from engine.fast import SPEED
from support import cli
from support import tasks as TK
from support.errors import UsageError
from support.files import writable_file

FORMAT = "kvcache-oracle/1"
CONVENTIONS = {"paper": P.RuleSettings(), "kvpress": P.KVPRESS}


def conventions(name: str, tok) -> P.RuleSettings:
    """The rule settings of `--conventions name` with KVzip's reconstruction prompt in tok's
    vocabulary: the papers' (calibrate.with_prompt: a template only from
    tokenizer_config.json, as this project applies it), or kvpress 0.5.5's (P.KVPRESS, and
    KVzip's prompt and first reconstructed position as KVzipPress builds them from the chat
    template transformers reads: tasks.kvpress_reconstruction)."""
    if name != "kvpress":
        return calibrate.with_prompt(CONVENTIONS[name], tok)
    repeat, start = TK.kvpress_reconstruction(tok)
    return P.RuleSettings(**{**P.KVPRESS.__dict__, "repeat": repeat, "repeat_from": start})


def make_method(name: str, budget: int, n_layers: int, settings=None, policy=None) -> P.Method:
    """A method by its evaluate.py name (H.method), with no decode-time eviction; polykv
    reads its policy file."""
    if name != "polykv":
        return H.method(name, budget, n_layers, settings, decode="append")
    if policy is None:
        raise UsageError("polykv needs --policy FILE (python calibrate.py --out FILE)")
    pol = P.Policy.load(policy, n_layers=n_layers, rules=BL.RULES)
    pol = pol if pol.budget == budget else pol.rescaled(budget)
    return P.Policy([P.LayerPolicy(lp.prefill, ("append", lp.decode.budget)) for lp in pol.layers],
                    pol.budget, pol.settings, pol.meta, rules=BL.RULES)


@torch.no_grad()
def dump(model, tokens: torch.Tensor, method: P.Method, name: str, budget: int, n_probe: int = 8,
         n_decode: int = 4, model_name: str = "") -> tuple:
    """(tensors, header) of the reference file for tokens (1, T)."""
    T, L = tokens.shape[1], model.config.n_layers
    P_ = min(n_probe, T)
    qs = {}                   # probe queries: each layer's queries at the last P prompt positions

    def spy(l, q, q_pos, lc, out):
        """Keep layer l's queries (1, H, P, D) at the last P prompt positions, and those
        positions."""
        qs[l] = (q[:, :, -P_:].clone(), q_pos[:, -P_:])
    full, obs = OB.observe(model, tokens, method.needs(model), spy)
    cache = method.compress(model, full, obs)
    G = model.config.n_kv_heads
    # ragged: padded view
    cache = M.Cache([lc.dense(G) for lc in cache.layers], cache.next_pos, cache.last_logits)
    S = max(lc.size for lc in cache.layers)

    def pad(x, v):
        """x (G, S_l) padded with v to (G, S), S the largest layer's entries."""
        return torch.nn.functional.pad(x, (0, S - x.shape[-1]), value=v)
    t = {"tokens": tokens[0].cpu(),
         # (L, G, S)
         "pos": torch.stack([pad(lc.pos[0], -1) for lc in cache.layers]).cpu(),
         "bias": torch.stack([pad(lc.bias[0].float(), -math.inf) for lc in cache.layers]).cpu()}
    if isinstance(method, P.Policy) and len({lp.prefill.rule for lp in method.layers}) == 1 \
            and method.layers[0].prefill.rule in BL.RULES:
        rule = method.layers[0].prefill.rule
        scores = []
        for l in range(L):
            score, protected = P.score(rule, P.score_input(obs, full, l, method.settings))
            # protected: always kept
            scores.append(score[0].masked_fill(protected.to(score.device), math.inf))
        # (L, G, T)
        t["scores"] = torch.stack(scores).float().cpu()
    outs = {"out": [], "full_out": []}          # the probe queries over both caches
    for key, kv_cache in (("out", cache), ("full_out", full)):
        for l in range(L):
            q, q_pos = qs[l]
            lc = kv_cache.layers[l]
            # (H, P, D)
            outs[key].append([M.attention(q, lc.k, lc.v, lc.bias, q_pos, lc.pos)[0].float()])
    # decode steps: FullKV's greedy tokens fed to both caches (append)
    dec = M.greedy(model, full.fork(), n_decode)
    for key, kv_cache in (("out", cache.fork()), ("full_out", full.fork())):
        seen = {}

        def record(l, q, q_pos, lc, out):
            """Keep layer l's attention output (H, 1, D) of this decode step."""
            seen.setdefault(l, []).append(out[0].float())
        hook = M.Hooks(post_kernel=record)
        for tok_id in dec:
            model.step(torch.tensor([[tok_id]], device=tokens.device), kv_cache, hook)
        for l in range(L):
            outs[key][l] += seen.get(l, [])
    for key in outs:
        # (L, H, P+n, D)
        t[key] = torch.stack([torch.cat(o, 1) for o in outs[key]]).cpu()
    header = {"format": FORMAT, "model": model_name, "method": name, "budget": budget,
              "settings": settings_json(getattr(method, "settings", None)),
              "P": P_, "n": len(dec), "decode_tokens": dec,
              "versions": {"torch": torch.__version__, "python": platform.python_version()}}
    return t, header


def settings_json(s) -> dict:
    """A method's settings for the header: RuleSettings' fields, or GraceKV's (formulas by name)."""
    if s is None:
        return {}
    return s.to_json() if hasattr(s, "to_json") else dict(s.__dict__)


def read_tokens(path, vocab_size: int) -> list:
    """The prompt's token ids from a JSON file (a list of integers), checked against the
    vocabulary."""
    try:
        ids = json.loads(Path(path).read_text())
    except OSError as e:
        raise UsageError(f"cannot read --tokens {str(path)!r}: {e.strerror}")
    except ValueError as e:
        raise UsageError(f"--tokens {str(path)!r} is not JSON: {e}")
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    ):
        raise UsageError(
            f"--tokens {str(path)!r} must hold a non-empty JSON list of integer token ids"
        )
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise UsageError(
            f"--tokens {str(path)!r}: token id {bad[0]} is outside the vocabulary "
            f"(0..{vocab_size - 1})"
        )
    return ids


def write(path, tensors: dict, header: dict):
    """One safetensors file; the header as JSON in its metadata under "oracle"."""
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path),
              metadata={"oracle": json.dumps(header)})


def read(path) -> tuple:
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            header = json.loads((f.metadata() or {}).get("oracle", "{}"))
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, ValueError, SafetensorError) as e:       # JSONDecodeError is a ValueError
        raise UsageError(f"cannot read {str(path)!r} as a reference file: {e}")
    missing = {"tokens", "pos", "bias", "out", "full_out"} - tensors.keys()
    if header.get("format") != FORMAT or missing:
        raise UsageError(
            f"{str(path)!r} is not a {FORMAT} file (missing {sorted(missing) or 'header'})"
        )
    return tensors, header


def first_divergence(scores: torch.Tensor, a: set, b: set, k: int):
    """(rank, margin): the first rank in the score order (descending, ties to the later
    position) whose token is kept by one selection only, and its score minus the score at rank
    k (just outside a selection of k); None if the two agree."""
    T = scores.shape[0]
    order = (T - 1) - torch.sort(scores.double().flip(0), descending=True, stable=True).indices
    for rank, j in enumerate(order.tolist()):
        if (j in a) != (j in b):
            edge = float(scores[order[min(k, T - 1)]])
            return rank, float(scores[j]) - edge
    return None


def compare(a_path, b_path, tol: float = 1e-3) -> dict:
    """Agreement of two reference files (a = the reference): per unit and in summary."""
    (a, ha), (b, hb) = read(a_path), read(b_path)
    if not torch.equal(a["tokens"], b["tokens"]):
        raise UsageError("cannot compare: the two files are for different prompts")
    if a["pos"].shape[:2] != b["pos"].shape[:2]:
        raise UsageError(
            f"different (layers, KV heads): {tuple(a['pos'].shape[:2])} vs "
            f"{tuple(b['pos'].shape[:2])}"
        )
    for k, what in (("P", "probe queries (--probes)"), ("n", "decode steps (--decode)")):
        if ha.get(k) != hb.get(k):
            raise UsageError(f"cannot compare: {str(a_path)!r} has {ha.get(k)} {what}, "
                             f"{str(b_path)!r} {hb.get(k)}; dump both with the same --probes "
                             "and --decode")
    for k in ("out", "full_out"):
        if a[k].shape != b[k].shape:
            raise UsageError(f"cannot compare: {k} is {tuple(a[k].shape)} in {str(a_path)!r}, "
                             f"{tuple(b[k].shape)} in {str(b_path)!r} (other models?)")
    L, G = a["pos"].shape[:2]
    units = []
    for l in range(L):
        for g in range(G):
            pa, pb = a["pos"][l, g], b["pos"][l, g]
            A, B = set(pa[pa >= 0].tolist()), set(pb[pb >= 0].tolist())
            u = {"layer": l, "head": g, "equal": A == B, "jaccard": len(A & B) / max(1, len(A | B)),
                 "kept": (len(A), len(B))}
            ba = {p: float(x) for p, x in zip(pa.tolist(), a["bias"][l, g].tolist()) if p >= 0}
            bb = {p: float(x) for p, x in zip(pb.tolist(), b["bias"][l, g].tolist()) if p >= 0}
            u["bias_err"] = max([abs(ba[p] - bb[p]) for p in A & B] or [0.0])
            if A != B and "scores" in a:
                u["diverge"] = first_divergence(a["scores"][l, g], A, B, len(A))
            units.append(u)
    err = [
        float((a["out"][l] - b["out"][l]).norm() / a["full_out"][l].norm().clamp(min=1e-30))
        for l in range(L)
    ]
    bad = [u for u in units if not u["equal"] or u["bias_err"] > 1e-5]
    return {"a": ha, "b": hb, "units": units, "out_err": err, "bad": bad,
            "passed": not bad and max(err) <= tol, "tol": tol}


def summary(res: dict) -> str:
    """One screen: the verdict, the disagreeing units (first ten), the output error."""
    units, bad = res["units"], res["bad"]
    def named(h):                          # 'snapkv B=128 (paper conventions)'
        conventions = f" ({h['conventions']} conventions)" if "conventions" in h else ""
        return f"{h['method']} B={h['budget']}{conventions}"
    lines = [
        f"{named(res['a'])} vs {named(res['b'])}: "
        f"{len(units) - len(bad)}/{len(units)} (layer, KV head) units agree "
        f"({100 * (len(units) - len(bad)) / len(units):.1f} %), mean Jaccard "
        f"{sum(u['jaccard'] for u in units) / len(units):.4f}, attention-output error max "
        f"{max(res['out_err']):.2e} (tol {res['tol']:.0e})"
    ]
    for u in bad[:10]:
        d = u.get("diverge")
        where = f", first differs at rank {d[0]} (score margin {d[1]:+.3e})" if d else ""
        lines.append(
            f"  layer {u['layer']} head {u['head']}: kept {u['kept'][0]} vs {u['kept'][1]}, "
            f"Jaccard {u['jaccard']:.4f}, bias err {u['bias_err']:.2e}{where}"
        )
    if len(bad) > 10:
        lines.append(f"  ... and {len(bad) - 10} more units")
    lines.append("PASS" if res["passed"] else "FAIL")
    return "\n".join(lines)


def main(argv=None):
    ap = cli.ArgumentParser(
        description="Reference files for testing a KV-cache compression implementation.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump", help="write the reference file of one method on one prompt")
    d.add_argument("--model", default=None, help="HF folder (default: embedded SmolLM2-135M)")
    d.add_argument("--method", required=True)
    d.add_argument("--budget", type=int, required=True)
    d.add_argument("--conventions", choices=sorted(CONVENTIONS), default="paper",
                   help="rule settings: the papers' reference code, or kvpress 0.5.5's")
    d.add_argument("--policy", default=None, help="PolyKV policy file (method polykv)")
    d.add_argument("--text", default=None, help="the prompt as text")
    d.add_argument("--tokens", default=None, help="a JSON file with the prompt's token ids")
    d.add_argument("--length", type=int, default=2048,
                   help="without --text/--tokens: a test passage of this many tokens")
    d.add_argument("--probes", type=int, default=8)
    d.add_argument("--decode", type=int, default=4)
    d.add_argument("--out", required=True)
    c = sub.add_parser("compare", help="compare two reference files (the first is the reference)")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument(
        "--tol", type=float, default=1e-3, help="max attention-output error, relative to FullKV's"
    )
    args = ap.parse_args(argv)
    if args.cmd == "compare":
        if not args.tol >= 0:
            raise UsageError(f"--tol must be a number >= 0, got {args.tol}")
        res = compare(args.a, args.b, args.tol)
        print(summary(res))
        return 0 if res["passed"] else cli.FAILED
    print(
        f"dump: model={args.model or M.default_model_dir()} method={args.method} "
        f"budget={args.budget} "
        f"conventions={args.conventions} out={args.out}",
        flush=True,
    )
    if args.budget < 1:
        raise UsageError(f"budget must be >= 1, got {args.budget}")
    writable_file(args.out, "--out")
    cli.at_least(1, probes=args.probes, length=args.length)
    cli.at_least(0, decode=args.decode)
    m, tok = M.load(args.model, device="cpu", speed=SPEED)
    if args.tokens:
        ids = read_tokens(args.tokens, m.config.vocab_size)
    elif args.text is not None:
        ids = tok.encode(args.text)
    else:
        ids = TK.fidelity_text(tok, args.length, 0)[0]
    M.check_length(m, len(ids))
    conv = conventions(args.conventions, tok)       # + KVzip's prompt in this vocabulary
    method = make_method(args.method, args.budget, m.config.n_layers, conv, args.policy)
    name = Path(args.model).name if args.model else M.default_model_dir().name
    t, h = dump(
        m, torch.tensor([ids]), method, args.method, args.budget, args.probes, args.decode, name
    )
    h["conventions"] = args.conventions
    write(args.out, t, h)
    print(f"wrote {args.out}: {len(ids)} tokens, {int((t['pos'] >= 0).sum())} kept entries")
    return 0


if __name__ == "__main__":
    cli.run(main)
