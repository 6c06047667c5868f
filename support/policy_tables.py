"""The tables and the picture of a PolyKV policy file (calibrate.py --show, --plot): plain
functions of a policy's layers and its recorded signals."""


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
    """One line of calibrate.placement_control's result: the route's KL, its rank, the shuffled
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
