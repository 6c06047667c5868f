"""A rule added to the table (the "add your own rule" exercise: one function and one line in
baselines.RULES) reaches every place that lists rules: the calibration pool, the harness's
methods and baselines, the calibration tables and plots. The table is read when used, never
copied at import."""
import pytest
import torch

import baselines as BL
import polykv as P
from engine import harness as H
from engine import policy_tables
from engine.calibration import calibrate_paper
from test_calibrate import SET, B, texts, tiny  # noqa: F401  (fixture)


def latest_rule(x: P.ScoreInput):
    """Prefer the later positions (the scores are the positions)."""
    Bt, G, T = x.shape
    return torch.arange(T, dtype=torch.float64).expand(Bt, G, T).clone(), P.none_protected(T)


@pytest.fixture
def latest():
    """A new pool rule, `latest`, as the line a user adds to baselines.RULES."""
    BL.RULES["latest"] = P.Rule(latest_rule)
    yield "latest"
    del BL.RULES["latest"]


def test_registered_rule_reaches_pool_methods_and_baselines(latest):
    assert latest in P.pool(BL.RULES) and latest in P.prefill_rules(BL.RULES)
    assert latest in H.uniform_methods() and latest in H.all_methods() and latest in H.baselines()
    assert latest in H.default_methods() and H.family(latest) == "uniform"
    m = tiny(0)
    cache = H.method(latest, 6, m.config.n_layers, SET).prefill(m, torch.randint(1, 50, (1, 20)))
    assert all(lc.pos[0].tolist() == [list(range(14, 20))] * 2 for lc in cache.layers)


def test_registered_rule_is_calibrated_shown_and_plotted(latest, tmp_path, capsys):
    m = tiny(2)
    pol = calibrate_paper(m, None, B, texts=texts(2), settings=SET)
    sig = pol.meta["signals"]
    assert list(sig["prefill"]["cosine"]) == list(P.pool(BL.RULES))
    assert latest in sig["uniform_dppl"]
    # the plot and --show see a pool of six: force the new rule into two layers' routes
    layers = [P.LayerPolicy((latest if l % 2 else lp.prefill.rule, lp.prefill.budget), lp.decode)
              for l, lp in enumerate(pol.layers)]
    shown = P.Policy(layers, pol.budget, pol.settings, pol.meta, rules=BL.RULES)
    f = tmp_path / "p.json"
    shown.save(f)
    policy_tables.main([str(f)])
    out = capsys.readouterr().out
    assert f"cos.{latest[:4]}" in out and f" {latest} " in out
    pytest.importorskip("matplotlib")
    policy_tables.main([str(f), "--plot", str(tmp_path / "p.png")])
    assert (tmp_path / "p.png").stat().st_size > 0


def test_method_styles_are_distinct_per_row():
    """The headline figure: every method its own (colour, marker); a paper's rows share a hue."""
    pytest.importorskip("matplotlib")
    from engine import report
    names = list(H.all_methods())
    st = report.styles(names, H.family)
    assert len({v[:2] for v in st.values()}) == len(names)
    assert len({st[n][0] for n in names}) == len(names)
