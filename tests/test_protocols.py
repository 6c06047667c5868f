"""The protocols (engine/protocols.py): what is compressed, charged and seen, on a tiny random
LLaMA in fp64, against naive recomputations and exact invariants."""
import functools
import json
import math

import pytest
import torch

import evaluate as E
import gracekv as GK
from engine import gracekv_fast as GF
import model as M
import polykv as P
from conftest import tiny as tiny_llama
from engine import protocols as PR
from engine import harness as H
from engine import observe as OB
import baselines as BL

tiny = functools.partial(tiny_llama, L=2)
A, B_, T = 5, 50, 60                 # the context is keys 5..49: prefix 5 tokens, question 10


def tokens(seed=0, n=T):
    return torch.randint(1, 50, (1, n), generator=torch.Generator().manual_seed(seed))


def by_head(lc, G):
    """[(sorted positions, {position: (k, v, bias)})] per KV head of a dense or ragged layer."""
    lc = lc.dense(G)
    out = []
    for g in range(G):
        real = lc.pos[0, g] >= 0
        pos = lc.pos[0, g, real]
        out.append(
            (
                sorted(pos.tolist()),
                {
                    int(p): (lc.k[0, g, real][i], lc.v[0, g, real][i], lc.bias[0, g, real][i])
                    for i, p in enumerate(pos)
                },
            )
        )
    return out


def test_cut_sees_the_question_and_slices_every_key_statistic():
    """The cut's `window` and `colsum` statistics equal the naive full-prompt attention (every
    query of the whole prompt, question included, softmax over all its keys) summed over the
    last w queries / all queries and read at the context's keys only; its cache holds exactly
    those keys at their positions."""
    m, x = tiny(), tokens()
    pol = P.Policy.uniform("snapkv", 8, 2, settings=P.RuleSettings(window=4), rules=BL.RULES)
    needs = OB.union([pol.needs(m), P.Policy.uniform("h2o", 8, 2, rules=BL.RULES).needs(m)], 2)
    full, obs = OB.observe(m, x, needs)
    part, pobs = PR.cut(full, obs, needs, A, B_)
    qs = {}
    M.prefill(m, x, M.Hooks(post_kernel=lambda l, q, qp, lc, o: qs.__setitem__(l, (q, lc.k))))
    for l in range(2):
        q, k = qs[l]
        k = k.repeat_interleave(2, 1)                                         # (1, H, T, D)
        lg = (q @ k.transpose(-1, -2)) / k.shape[-1] ** 0.5
        lg = lg.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        a = torch.softmax(lg, -1)                                            # (1, H, T, T) naive
        torch.testing.assert_close(
            pobs.stats[l]["window"], a[:, :, -4:, A:B_].sum(2), rtol=1e-10, atol=1e-12
        )
        torch.testing.assert_close(
            pobs.stats[l]["colsum"], a[:, :, :, A:B_].sum(2), rtol=1e-10, atol=1e-12
        )
        assert part.layers[l].pos[0, 0].tolist() == list(range(A, B_))
        assert torch.equal(part.layers[l].k, full.layers[l].k[:, :, A:B_])
    assert part.next_pos == T and torch.equal(part.last_logits, full.last_logits)


def naive_attention(m, x):
    """Per layer the whole prompt's attention (1, H, T, T), written out (causal softmax)."""
    qs = {}
    M.prefill(m, x, M.Hooks(post_kernel=lambda l, q, qp, lc, o: qs.__setitem__(l, (q, lc.k))))
    out = []
    for l in sorted(qs):
        q, k = qs[l]
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)                  # (1, H, T, D)
        lg = (q @ k.transpose(-1, -2)) / k.shape[-1] ** 0.5
        n = lg.shape[-1]
        lg = lg.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out.append(torch.softmax(lg, -1))
    return out


@pytest.mark.parametrize("w", [4, 12])
def test_context_protects_the_prompts_edges_not_the_contexts(w):
    """Under `context` the rules' protections stay at the prompt's own edges: StreamingLLM's
    sinks are the prompt's first tokens (in the free prefix), so it keeps the context's last B;
    H2O and SnapKV score every context key (SnapKV: the window sums of the prompt's last w
    queries, max-pooled over the context's keys) and protect only context keys among the
    prompt's last w positions: none when the question (10 tokens) covers the window (w = 4),
    the 2 last context keys when it does not (w = 12). Naive: the whole prompt's attention."""
    m, x = tiny(), tokens()
    L, G, budget, g = 2, 2, 12, 2
    settings = P.RuleSettings(window=w, kernel=3, n_sink=2)
    protected = [p for p in range(A, B_) if p >= T - w]
    attn = naive_attention(m, x)
    for rule in ("streaming", "h2o", "snapkv"):
        pol = P.Policy.uniform(rule, budget, L, settings=settings, rules=BL.RULES)
        needs = pol.needs(m)
        full, obs = OB.observe(m, x, needs)
        comp = pol.compress(m, *PR.cut(full, obs, needs, A, B_))
        for l in range(L):
            a = attn[l][0]                                                    # (H, T, T)
            for h in range(G):
                if rule == "streaming":
                    score = {p: float(p) for p in range(A, B_)}
                elif rule == "h2o":
                    score = {p: float(a[h * g:(h + 1) * g, :, p].sum(1).mean())
                             for p in range(A, B_)}
                else:
                    win = {p: a[:, T - w:, p].sum(1) for p in range(A, B_) if p < T - w}
                    pooled = {p: torch.stack([win[j] for j in (p - 1, p, p + 1) if j in win])
                              .amax(0) for p in win}                          # (H,) each
                    score = {p: float(pooled[p][h * g:(h + 1) * g].mean()) for p in pooled}
                rest = sorted(score, key=lambda p: (-score[p], -p))
                want = sorted(protected + [p for p in rest if p not in protected]
                              [:budget - len(protected)])
                assert comp.layers[l].pos[0, h].tolist() == want, (rule, l, h)


@pytest.mark.parametrize("name", ["full", "snapkv", "tova", "h2o", "pyramidkv", "adakv", "gracekv"])
def test_context_keeps_prefix_and_question_exact_and_free(name):
    """Under `context` every head holds the prefix and the question exactly (the FullKV entries)
    around at most B compressed context entries per head on average (exactly B for a uniform
    rule; L·G·B in all for every method), and FullKV's join is the FullKV cache itself."""
    m, x = tiny(), tokens()
    L, G, budget = 2, 2, 12
    meth = (
        H.method(name, budget, L, P.RuleSettings(window=4))
        if name != "gracekv"
        else GF.fast(
            budget,
            GK.Settings(window=4, slot_min=3, slot_max=8, slot_target=5, bend_widths=(2, 3),
                        seeds=3, evidence=4),
        )
    )
    needs = OB.union([meth.needs(m)], L)
    full, obs = OB.observe(m, x, needs)
    part, pobs = PR.cut(full, obs, needs, A, B_)
    comp = meth.compress(m, part, pobs)
    cache = PR.join(full, comp, A, B_)
    free = A + T - B_
    want = L * G * (B_ - A) if name == "full" else L * G * budget
    assert (
        comp.entries() == want
        if name in ("full", "snapkv", "tova", "h2o", "adakv")
        else comp.entries() <= want
    )
    assert cache.entries() == comp.entries() + L * G * free
    for l in range(L):
        exact = by_head(full.layers[l], G)
        for g, (pos, ent) in enumerate(by_head(cache.layers[l], G)):
            kept = [p for p in pos if A <= p < B_]
            # sorted, prefix and question whole
            assert pos == list(range(A)) + kept + list(range(B_, T))
            for p in list(range(A)) + list(range(B_, T)):
                assert all(torch.equal(a, b) for a, b in zip(ent[p], exact[g][1][p]))
    if name == "full":
        for a, b in zip(cache.layers, full.layers):
            assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("k", "v", "pos", "bias"))


def test_gracekv_cut_keeps_each_strided_query_at_its_token():
    """The cut of GraceKV's flow: strided queries (stride 4, every 4th token from 0) cut at a
    context start that is not a multiple of 4 sit at token i·4 + phase of the cut, as the same
    queries observed with stride 1 say; x is the first hop read at the context's keys; the row
    log-normalisers are the whole prompt's (a naive logsumexp over every causal key)."""
    m, x = tiny(), tokens()
    flows = {}
    for stride in (4, 1):
        needs = P.Needs(extra=(("flow", GF.ValueFlow(4, (0, 1), stride)),))
        full, obs = OB.observe(m, x, needs)
        flows[stride] = [needs.extra[0][1].cut(v, A, B_) for v in obs.extra["flow"]]
    for l in range(2):
        (_, x4, q4, s4, ph4, n4), (_, x1, q1, s1, ph1, n1) = flows[4][l], flows[1][l]
        assert ph1 == 0 and ph4 == 3 and (A + ph4) % 4 == 0
        assert torch.equal(s4, s1[:, ph4::4]) and torch.equal(x4, x1) and torch.equal(q4, q1)
        assert torch.equal(q1, obs.extra["flow"][l][2][:, A:B_]) and q1.shape[1] == B_ - A
        # (H, T, D) each
        q, k = obs.extra["flow"][l][2], full.layers[l].k[0].repeat_interleave(2, 0)
        lg = (q @ k.transpose(1, 2) / q.shape[-1] ** 0.5).masked_fill(
            torch.ones(T, T).triu(1).bool(), -math.inf
        )
        torch.testing.assert_close(n1, lg.logsumexp(-1)[:, A:B_], rtol=1e-12, atol=1e-12)
        assert torch.equal(n4, n1)


def test_agnostic_fullkv_equals_the_whole_prompt():
    """Agnostic: prefill of prefix + context, then the question fed to that cache, gives the
    whole prompt's FullKV logits and cache (fp64, up to summation order)."""
    m, x = tiny(), tokens()
    whole = M.prefill(m, x)
    part = M.prefill(m, x[:, :B_])
    M.decode(m, x[:, B_:], part)
    torch.testing.assert_close(part.last_logits, whole.last_logits, rtol=1e-10, atol=1e-10)
    for a, b in zip(part.layers, whole.layers):
        torch.testing.assert_close(a.k, b.k, rtol=1e-10, atol=1e-10)
        assert torch.equal(a.pos, b.pos)


def test_three_protocols_in_one_run(tiny_dir, tmp_path):
    """evaluate.py --protocol prompt,context,agnostic: every row says its protocol; FullKV is
    exact in each; the charged fraction is B over what each protocol compresses (the whole
    prompt, prefix + context, the context); fidelity rows are the same under all three; a
    rerun does nothing twice."""
    args = ["--model", str(tiny_dir), "--device", "cpu", "--dtype", "float64", "--out",
            str(tmp_path), "--budget", "24", "--methods", "full,snapkv,tova,gracekv", "--tasks",
            "niah_single_1", "--length", "400", "--samples", "2", "--fidelity-length", "80",
            "--fidelity-samples", "1", "--cont-len", "6", "--max-new-tokens", "3", "--protocol",
            "prompt,context,agnostic"]
    E.main(args)
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == len({r["key"] for r in rows}) == 3 * 4 * 3
    assert all("score" in r for r in rows if r["task"] == "niah_single_1")
    items = {
        it.index: it
        for it in H.build_items(M.load(tiny_dir)[1], H.parse(args), M.load(tiny_dir)[0])
        if it.task == "niah_single_1"
    }
    for r in rows:
        if r["method"] == "full":
            assert r["kl"] == 0 and r["dnll"] == 0 and r["kv_fraction"] == 1
        if r["task"] != "fidelity" and r["method"] == "snapkv":
            n_pre, n_q = items[r["index"]].split
            charged = {"prompt": r["n_tokens"], "agnostic": r["n_tokens"] - n_q,
                       "context": r["n_tokens"] - n_q - n_pre}[r["protocol"]]
            assert r["kv_fraction"] == pytest.approx(24 / charged, rel=1e-12)
    fid = {}
    for r in rows:
        if r["task"] == "fidelity":
            fid.setdefault(r["method"], set()).add(
                json.dumps(
                    {
                        k: v
                        for k, v in r.items()
                        if k not in ("key", "protocol", "compress_s", "prefill_s")
                    }
                )
            )
    assert all(len(v) == 1 for v in fid.values()) and len(fid) == 4
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {d["protocol"] for d in summary["rows"]} == {"prompt", "context", "agnostic"}
    # the header's prefill: one observation per prompt serves all three protocols
    # (OB.observe_prefixes), so every row of a prompt records the same pass
    obs = {}
    for r in rows:
        obs.setdefault((r["task"], r["index"]), set()).add(r["prefill_s"])
    assert all(len(v) == 1 for v in obs.values()) and len(obs) == 3     # 2 needles, 1 text
    mean = round(sum(v.pop() for v in obs.values()) / len(obs), 2)
    assert summary["config"]["prefill_s"] == mean and "prefill_agnostic_s" not in summary["config"]
    E.main(args)                                                              # resumes: nothing new
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == len(rows)
    # ΔNLL only
    E.main(args + ["--greedy", "", "--out", str(tmp_path / "nll"), "--methods", "full,snapkv"])
    quiet = [
        json.loads(line) for line in (tmp_path / "nll" / "samples.jsonl").read_text().splitlines()
    ]
    assert {r["task"] for r in quiet} == {"fidelity", "niah_single_1"} and not any(
        "score" in r for r in quiet
    )
    same = {r["key"]: r["dnll"] for r in rows}
    assert all(r["dnll"] == same[r["key"]] for r in quiet)


def test_later_questions_reuse_one_compressed_context(tiny_dir, tmp_path):
    """niah_multineedle_turns: 4 questions on one context, each a row (turn 0..3) under every
    protocol; FullKV exact on each; a later question's reference is FullKV given the same tokens
    (prefix + context + that question under context / agnostic): its answer ΔNLL against a
    fresh full prefill of that prompt is 0 up to summation order; summaries carry later / spread."""
    from support import tasks as TK
    args = ["--model", str(tiny_dir), "--device", "cpu", "--dtype", "float64", "--out",
            str(tmp_path), "--budget", "32", "--methods", "full,snapkv", "--tasks",
            "niah_multineedle_turns", "--length", "900", "--samples", "1", "--fidelity-samples",
            "0", "--max-new-tokens", "2", "--protocol", "prompt,context,agnostic"]
    E.main(args)
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert sorted((r["method"], r["protocol"], r["turn"]) for r in rows) == sorted(
        (m, p, t)
        for m in ("full", "snapkv")
        for p in ("prompt", "context", "agnostic")
        for t in range(4)
    )
    assert all(r["kl"] == 0 and r["dnll"] == 0 for r in rows if r["method"] == "full")
    m, tok = M.load(tiny_dir, dtype=torch.float64)
    it = [i for i in H.build_items(tok, H.parse(args), m) if i.task == "niah_multineedle_turns"][0]
    assert len(it.turns) == 3 and TK.NIAH["niah_multineedle_turns"]["turns"]
    q, smp, gold = it.turns[1]
    whole = torch.cat((it.tokens[:, :it.tokens.shape[1] - it.split[1]], q), 1)
    # the question's own prompt
    assert whole[0].tolist() == tok.encode(smp.prompt)
    fresh, _ = M.teacher_force(m, M.prefill(m, whole), gold)
    # evaluate's FullKV base for a later question
    (n_pre, n_q), T = it.split, it.tokens.shape[1]
    full, obs = OB.observe(m, it.tokens, P.Needs())
    base = PR.join(
        full, PR.cut(full, obs, P.Needs(), n_pre, T - n_q)[0], n_pre, T - n_q, question=False
    )
    M.decode(m, q, base)
    fed, _ = M.teacher_force(m, base, gold)
    torch.testing.assert_close(fed, fresh, rtol=1e-9, atol=1e-9)
    summary = json.loads((tmp_path / "summary.json").read_text())["rows"]
    tasks = {d["task"] for d in summary}
    assert {"niah_multineedle_turns later", "niah_multineedle_turns spread", "answer later",
            "answer spread"} <= tasks
    E.main(args)                                                              # resumes: nothing new
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == len(rows)


def turns_prompt(tiny_dir):
    """(model, tokenizer, methods, item): the tiny model in fp64 and one 900-token prompt of
    four questions in turn (niah_multineedle_turns), B = 32, no decoder evicting
    (evaluate.main sizes the allowance to the items)."""
    m, tok = M.load(tiny_dir, dtype=torch.float64)
    args = H.parse(
        ["--model", str(tiny_dir), "--dtype", "float64", "--budget", "32", "--tasks",
         "niah_multineedle_turns", "--length", "900", "--samples", "1", "--fidelity-samples", "0",
         "--max-new-tokens", "2"]
    )
    args.allowance = 4096
    it = [i for i in H.build_items(tok, args, m) if i.task == "niah_multineedle_turns"][0]
    return m, tok, H.Methods(m, tok, args), it


def strip(rows, *more):
    """key -> row without its timings (and the fields `more`)."""
    return {
        r["key"]: {k: v for k, v in r.items() if k not in ("compress_s", "prefill_s") + more}
        for r in rows
    }


def test_each_row_is_what_a_run_of_its_own_gives(tiny_dir):
    """Rows do not depend on what else a run does: prompt + context in one call (one shared
    observation and FullKV reference) equal each protocol alone; a later question's rows equal
    a run that asks that question alone after the same compressed context (forks of one cache
    do not leak into each other); and under `agnostic` the compressed cache is the same when the
    question changes (compression never sees it), while under `context` it changes."""
    from dataclasses import replace
    m, tok, methods, it = turns_prompt(tiny_dir)
    names, protocols = ["full", "snapkv", "gracekv"], PR.PROTOCOLS
    together = strip(H.run_item(m, tok, methods, names, [32], it, set(), protocols))
    alone = strip(
        [r for p in protocols for r in H.run_item(m, tok, methods, names, [32], it, set(), (p,))]
    )
    assert together == alone and len(together) == 3 * 3 * 4
    # question 3 alone after the context
    one = replace(it, turns=[it.turns[2]])
    single = strip(H.run_item(m, tok, methods, names, [32], one, set(), protocols), "key", "turn")
    for key, r in single.items():
        if key.endswith("|q1"):
            assert r == {
                k: v for k, v in together[key[:-1] + "3"].items() if k not in ("key", "turn")
            }
    # B = 64: more than the window, so scores decide
    kept = {}
    for name in ("snapkv", "gracekv"):
        meth = methods.get(name, 64)
        plain = meth.compress

        def compress(model, full, obs, plain=plain):
            """The method's own compression, each cache kept in the order of the calls."""
            return kept.setdefault(len(kept), plain(model, full, obs))
        meth.compress = compress
        n_q = it.split[1]
        other = it.tokens.clone()
        other[:, -n_q:] = torch.randint(
            5, 250, (1, n_q), generator=torch.Generator().manual_seed(1)
        )
        for p in ("agnostic", "context"):
            caches = []
            for toks in (it.tokens, other):
                kept.clear()
                H.run_item(
                    m, tok, methods, [name], [64], replace(it, tokens=toks, turns=[]), set(), (p,)
                )
                caches.append(kept[0])
            same = all(
                torch.equal(a.pos, b.pos) and torch.equal(a.k, b.k)
                for a, b in zip(*(c.layers for c in caches))
            )
            assert same == (p == "agnostic"), (name, p)
        meth.compress = plain


def test_fullkv_decodes_once_for_every_budget_and_its_rows_equal_runs_of_their_own(
        tiny_dir, monkeypatch):
    """FullKV's cache and decoding do not depend on the budget: in one call over two budgets it
    teacher-forces and answers once per protocol and question (plus the FullKV reference), and
    every row equals the row of a call with that budget alone."""
    m, tok, methods, it = turns_prompt(tiny_dir)
    protocols = PR.PROTOCOLS
    greedy, calls = M.greedy, []

    def counted(*a, **k):
        calls.append(1)
        return greedy(*a, **k)
    monkeypatch.setattr(M, "greedy", counted)
    together = strip(H.run_item(m, tok, methods, ["full", "snapkv"], [32, 64], it, set(),
                                protocols))
    once = len(calls)
    alone = {}
    for b in (32, 64):
        alone.update(strip(H.run_item(m, tok, methods, ["full", "snapkv"], [b], it, set(),
                                      protocols)))
    assert together == alone and len(together) == 2 * 2 * 3 * 4
    answers = 3 * 4                       # per protocol, the prompt's question and three more
    # alone: FullKV and SnapKV answer at each budget; together: FullKV once
    assert len(calls) - once == 2 * 2 * answers and once == 3 * answers
