"""A rule registered at run time (the "add your own rule" exercise) reaches every place that
lists rules: the calibration pool, the harness's methods and baselines, the calibration tables
and plots. The registries are read when used, never copied at import."""
import pytest
import torch

import calibrate as C
import evaluate as E
import polykv as P
from test_calibrate import SET, B, texts, tiny  # noqa: F401  (fixture)


@pytest.fixture
def latest():
    """A sixth pool rule, `latest`: prefer the later positions (the scores are the positions)."""
    @P.rule("latest")
    def latest(x: P.ScoreInput):
        Bt, G, T = x.shape
        return torch.arange(T, dtype=torch.float64).expand(Bt, G, T).clone(), P.none_protected(T)
    yield "latest"
    del P.RULES["latest"]


def test_registered_rule_reaches_pool_methods_and_baselines(latest):
    assert latest in P.pool() and latest in P.prefill_rules()
    assert latest in E.uniform_methods() and latest in E.all_methods() and latest in E.baselines()
    assert latest in E.default_methods() and E.family(latest) == "uniform"
    m = tiny(0)
    cache = E.method(latest, 6, m.config.n_layers, SET).prefill(m, torch.randint(1, 50, (1, 20)))
    assert all(lc.pos[0].tolist() == [list(range(14, 20))] * 2 for lc in cache.layers)


def test_registered_rule_is_calibrated_shown_and_plotted(latest, tmp_path, capsys):
    m = tiny(2)
    pol = C.calibrate(m, None, B, texts=texts(2), settings=SET)
    sig = pol.meta["signals"]
    assert list(sig["prefill"]["cosine"]) == list(P.pool()) and latest in sig["uniform_dppl"]
    # the plot and --show see a pool of six: force the new rule into two layers' routes
    layers = [P.LayerPolicy((latest if l % 2 else lp.prefill.rule, lp.prefill.budget), lp.decode)
              for l, lp in enumerate(pol.layers)]
    shown = P.Policy(layers, pol.budget, pol.settings, pol.meta)
    f = tmp_path / "p.json"
    shown.save(f)
    C.main(["--show", str(f)])
    out = capsys.readouterr().out
    assert f"cos.{latest[:4]}" in out and f" {latest} " in out
    pytest.importorskip("matplotlib")
    C.main(["--show", str(f), "--plot", str(tmp_path / "p.png")])
    assert (tmp_path / "p.png").stat().st_size > 0


def test_method_styles_are_distinct_per_row():
    """The headline figure: every method its own (colour, marker); a paper's rows share a hue."""
    pytest.importorskip("matplotlib")
    from support import report
    names = list(E.all_methods())
    st = report.styles(names, E.family)
    assert len({v[:2] for v in st.values()}) == len(names)
    assert len({st[n][0] for n in names}) == len(names)
