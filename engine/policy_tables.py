"""The tables, the picture and the placement control of PolyKV policy files:

    python -m engine.policy_tables POLICY.json [...] [--plot PNG] [--shuffle N [--out JSON]]

prints each file's per-layer table (its rules, budgets and the signals behind them), draws the
files side by side, and with --shuffle runs the placement control of the paper's later version
(the calibrated route against N shuffled ones)."""
from __future__ import annotations

import json
import random

import torch

import baselines
import calibrate
import model as M
import polykv
from engine.fast import SPEED
from engine.observe import observe_for
from polykv import LayerPolicy, Policy
from support import cli, tasks
from support.errors import UsageError
from support.files import writable_file, write_atomic


def table(policy) -> str:
    """One line per layer: the chosen rules and budgets, and the signals behind them."""
    sig = policy.meta["signals"]
    pool, dpool = list(sig["prefill"]["cosine"]), list(sig["decode"]["cosine"])   # as measured
    ab = {r: r[:4] for r in pool}
    head = (f"{'layer':>5} {'prefill':>9} {'b_pre':>5} {'decode':>9} {'b_dec':>5} {'entropy':>7} | "
            + " ".join(f"{'cos.' + ab[r]:>9}" for r in pool) + f" {'ΔPPLmax':>8} | "
            + " ".join(f"{'dcos.' + ab[r]:>9}" for r in dpool) + f" {'ΔPPLmax':>8}")
    rows = [head]
    for l, lp in enumerate(policy.layers):
        def worst(ph):
            """Layer l's largest ΔPPL over the pool in phase ph."""
            return max(d[l] for d in sig[ph]["dppl"].values())
        rows.append(
            f"{l:>5} {lp.prefill.rule:>9} {lp.prefill.budget:>5} {lp.decode.rule:>9} "
            f"{lp.decode.budget:>5} "
            f"{sig['entropy'][l]:>7.3f} | "
            + " ".join(f"{sig['prefill']['cosine'][r][l]:>9.5f}" for r in pool)
            + f" {worst('prefill'):>8.4f} | "
            + " ".join(f"{sig['decode']['cosine'][r][l]:>9.5f}" for r in dpool)
            + f" {worst('decode'):>8.4f}"
        )
    return "\n".join(rows)


def describe(policy) -> str:
    """The per-layer table of a calibrated policy, whichever procedure made it ("" if none)."""
    if policy.meta.get("procedure") == "joint":
        return table_joint(policy)
    return table(policy) if "signals" in policy.meta else ""


def procedure(policy) -> str:
    """The procedure that made a policy, with the joint procedure's objective."""
    name = policy.meta.get("procedure", "paper")
    if name == "joint":
        r = policy.meta.get("calibration", {}).get("retrieval")
        name += ", text only" if r is None else f", retrieval {r}"
    return name


def placement(r: dict) -> str:
    """One line of `placement_control`'s result: the route's KL, its rank, the shuffled
    spread."""
    kls = r["shuffled_kl"]
    return (
        f"fidelity KL {r['route_kl']:.4f}, rank {r['rank']} of {len(kls) + 1} (shuffled: min "
        f"{min(kls):.4f}, "
        f"median {sorted(kls)[len(kls) // 2]:.4f}, max {max(kls):.4f})"
    )


def plot(policies: list, path, pool=()) -> str:
    """Bars: prefill budget per layer, coloured by the prefill rule; one panel per policy (e.g.
    the paper's and the joint procedure's). pool: the rules to give colours first (the
    registry's pool, so a rule keeps its colour from plot to plot). Needs matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot written"
    # one colour per rule, from the registry now and the rules the policies use (any count)
    names = list(dict.fromkeys(list(pool) + [lp.prefill.rule for p in policies for lp in p.layers]))
    cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    colour = {r: cmap(i % cmap.N) for i, r in enumerate(names)}
    fig, axes = plt.subplots(1, len(policies), figsize=(7 * len(policies), 3.5), squeeze=False)
    for ax, policy in zip(axes[0], policies):
        for l, lp in enumerate(policy.layers):
            ax.bar(l, lp.prefill.budget, color=colour.get(lp.prefill.rule, "grey"))
        ax.axhline(policy.budget, color="grey", ls="--", lw=1, label=f"B = {policy.budget}")
        for r in dict.fromkeys(lp.prefill.rule for lp in policy.layers):
            ax.bar(0, 0, color=colour[r], label=r)
        ax.set(
            xlabel="layer",
            ylabel="prefill budget (entries per KV head)",
            title=f"PolyKV ({procedure(policy)}): {policy.meta.get('model', '')}, B = "
                  f"{policy.budget}",
        )
        ax.legend(ncol=3, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"wrote {path}"


def table_joint(policy) -> str:
    """One line per layer: the chosen rule and budget, and each rule's score in the last sweep
    (KL, or −cosine with signal = cosine) with the other layers as chosen before it."""
    sig = policy.meta["signals"]
    last = sig["sweeps"][-1]["scores"]
    pool = list(last[0])                     # the pool the sweeps scored
    head = f"{'layer':>5} {'rule':>9} {'budget':>6} | " + " ".join(f"{r:>9}" for r in pool)
    rows = [head] + [
        f"{l:>5} {lp.prefill.rule:>9} {lp.prefill.budget:>6} | "
        + " ".join(f"{last[l][r]:>9.5f}" for r in pool)
        for l, lp in enumerate(policy.layers)
    ]
    changed = [len(s["changed"]) for s in sig["sweeps"]]
    rows.append(
        f"start: uniform {sig['start']}; layers changed per sweep {changed}; {sig['seconds']} s"
    )
    return "\n".join(rows)


# ---------------------------------------------------------------------------- the placement control
# The later version of the paper tests whether its profiles carry information: with the counts
# of each rule held fixed, the profile-guided placement ranks second among 100 evaluated
# assignments. Here: the calibrated route against N seeded permutations of its layers' rules,
# each layer keeping its budgets, all scored by the harness's fidelity KL at equal memory.

def kl(ref_lp, lp) -> float:
    """KL(FullKV ‖ q) summed over the vocabulary, mean over positions (evaluate.compare's kl)."""
    return float((ref_lp.exp() * (ref_lp - lp)).sum(-1).clamp_min(0).mean())



def shuffled(policy: Policy, n: int, seed: int = 0) -> list:
    """n routes with the policy's rules placed at random: seeded permutations of the layers'
    (prefill rule, decode rule) pairs, every layer keeping its own budgets."""
    rng = random.Random(f"shuffle/{seed}")
    pairs = [(lp.prefill.rule, lp.decode.rule) for lp in policy.layers]
    return [Policy([LayerPolicy((pre, lp.prefill.budget), (dec, lp.decode.budget))
                    for (pre, dec), lp in zip(rng.sample(pairs, len(pairs)), policy.layers)],
                   policy.budget, policy.settings, {"shuffled": k, "seed": seed},
                   rules=policy.rules) for k in range(n)]


@torch.no_grad()
def placement_control(model, tok, policy: Policy, n: int = 100, split: str = "dev",
                      n_prompts: int = 4, prompt_len: int = calibrate.PROMPT_LEN,
                      cont_len: int = calibrate.CONT_LEN,
                      seed: int = 0, texts=None, log=None) -> dict:
    """Fidelity KL (evaluate.py's, at equal memory: decode budgets grow by the continuation) of
    the calibrated route and of n `shuffled` ones on n_prompts natural-text passages of `split`
    (tasks.fidelity_text with `seed`; texts: given [(prompt_ids, cont_ids)] instead); rank 1 =
    the lowest mean KL, ties counted against the route."""
    if texts is None:
        texts = [
            tasks.fidelity_text(tok, prompt_len, cont_len, seed, i, split) for i in range(n_prompts)
        ]
    routes = [
        r.with_allowance(max(len(c) for _, c in texts))
        for r in [policy] + shuffled(policy, n, seed)
    ]
    kls = [[] for _ in routes]
    for i, (p, c) in enumerate(texts):
        x, cont = torch.tensor([p], device=model.device), torch.tensor([c], device=model.device)
        full, obs = observe_for(model, x, routes)                     # one prefill for all
        ref = M.teacher_force(model, full.fork(), cont)[0]
        for j, r in enumerate(routes):
            dec = r.decoder if r.evicts_within(len(p), len(c)) else None
            lp = M.teacher_force(model, r.compress(model, full, obs), cont, dec, dec is not None)[0]
            kls[j].append(kl(ref, lp))
        if log:
            log(f"placement control, {split} prompt {i + 1}/{len(texts)}")
    mean = [sum(k) / len(k) for k in kls]
    return {"split": split, "seed": seed, "n": n, "prompts": len(texts), "budget": policy.budget,
            "procedure": policy.meta.get("procedure", "paper"), "route_kl": mean[0],
            "shuffled_kl": mean[1:], "rank": 1 + sum(m <= mean[0] for m in mean[1:]),
            "per_prompt": kls}


def main(argv=None):
    ap = cli.ArgumentParser(description="The tables, picture and placement control of PolyKV "
                                        "policy files.")
    ap.add_argument("policies", nargs="+", metavar="POLICY", help="policy files")
    ap.add_argument("--plot", default=None, help="write the files side by side (needs matplotlib)")
    ap.add_argument("--shuffle", type=int, default=0, metavar="N",
                    help="the placement control: each policy against N shuffled routes "
                         "(fidelity KL on --n-prompts passages of --split; JSON to --out if given)")
    ap.add_argument("--out", default=None, help="--shuffle's JSON")
    ap.add_argument("--split", choices=tasks.SPLITS, default="dev", help="--shuffle's passages")
    ap.add_argument("--model", default=None, help="HF folder (default: embedded SmolLM2-135M)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=calibrate.PROMPT_LEN)
    ap.add_argument("--cont-len", type=int, default=calibrate.CONT_LEN)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op CPU threads")
    a = ap.parse_args(argv)
    cli.at_least(0, shuffle=a.shuffle)
    if a.out and not a.shuffle:
        raise UsageError("--out is where --shuffle N writes its JSON: give --shuffle N >= 1, or "
                         "leave --out out")
    cli.at_least(1, threads=a.threads, n_prompts=a.n_prompts, prompt_len=a.prompt_len)
    for f, option in ((a.out, "--out"), (a.plot, "--plot")):
        if f:
            writable_file(f, option)
    pols = [Policy.load(f, rules=baselines.RULES) for f in a.policies]
    for f, pol in zip(a.policies, pols):
        print(f"{f}:\n{describe(pol)}")
    if a.plot:
        try:
            print(plot(pols, a.plot, polykv.pool(baselines.RULES)))
        except OSError as e:
            raise UsageError(f"cannot write {a.plot!r}: {e.strerror}") from None
    if a.shuffle:
        torch.set_num_threads(a.threads)
        m, tok = M.load(a.model, speed=SPEED)
        res = []
        for f, pol in zip(a.policies, pols):
            r = placement_control(m, tok, pol, a.shuffle, a.split, a.n_prompts, a.prompt_len,
                                  a.cont_len, a.seed, log=print)
            print(f"{f}: {placement(r)}")
            res.append({"policy": str(f), **r})
        if a.out:
            write_atomic(a.out, json.dumps(res, indent=1))


if __name__ == "__main__":
    cli.run(main)
