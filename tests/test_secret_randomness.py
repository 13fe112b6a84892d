"""Issue 22, secret coins: privacy coins and Monte Carlo checks draw OS entropy unless seeded;
seeded DP runs say they are not private; seeds are recorded only where harmless; fractional
epochs never price fewer steps than run."""

import json
import math
import re

import numpy as np
import pytest
import torch

from opacus_structured.accounting.bminsep_mc import BandedStrategy, BandMFMonteCarlo
from opacus_structured.cli import epochs_to_steps, main
from opacus_structured.runners.monte_carlo import (
    certify_noise_multiplier,
    collect_privacy_losses,
)


def _mech(n=4):
    return BandMFMonteCarlo(BandedStrategy.toeplitz([1.0], n), 1.0, "bminsep", 0.25, 1)


# ---- epochs -> steps ----------------------------------------------------------------------------
def test_epochs_round_up_never_down():
    assert epochs_to_steps(1.04, 10) == 11  # the nearest integer (10) would under-price
    assert epochs_to_steps(2.5, 3) == 8
    assert epochs_to_steps(0.01, 10) == 1
    assert epochs_to_steps(2, 7) == 14
    assert epochs_to_steps(0, 7) == 0
    # float round-off around an integer is not a partial step
    assert 0.14 * 50 > 7 and epochs_to_steps(0.14, 50) == 7
    assert epochs_to_steps(2.9999999999 / 10, 10) == 3
    for e in np.linspace(0.01, 5, 97):
        for per in (1, 3, 7, 10, 64):
            assert epochs_to_steps(float(e), per) >= float(e) * per - 1e-9 * max(1, e * per)
    with pytest.raises(ValueError, match="epochs"):
        epochs_to_steps(float("nan"), 3)


def test_trainer_converts_epochs_like_the_cli():
    pytest.importorskip("gluonts")
    from opacus_structured.forecasting.training import _epochs_to_steps

    for e in [*np.linspace(0, 7, 211), 0.14, 1.04, 2.9999999999 / 10]:
        for per in (1, 2, 3, 7, 10, 50, 64):
            assert _epochs_to_steps(float(e), per) == epochs_to_steps(float(e), per)


def test_cli_prices_the_started_step(capsys):
    flags = ["--num-series", "320", "--series-length", "20", "--context-length", "1",
             "--forecast-length", "1", "--batch-size", "32", "--noise-multiplier", "1",
             "--delta", "1e-5", "--discretization", "1e-3", "--json"]  # 10 steps per epoch
    assert main(["epsilon", "structured", *flags, "--epochs", "1.04"]) == 0
    eps_partial = json.loads(capsys.readouterr().out)
    assert eps_partial["steps"] == 11
    assert main(["epsilon", "structured", *flags, "--steps", "11"]) == 0
    assert json.loads(capsys.readouterr().out)["epsilon"] == eps_partial["epsilon"]
    assert main(["epsilon", "structured", *flags, "--epochs", "0.3"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 3
    assert main(["epsilon", "structured", *flags, "--epochs", "nan"]) == 2
    assert "--epochs" in capsys.readouterr().err


# ---- Monte Carlo: fresh seeds by default, recorded for audit ------------------------------------
def test_collect_defaults_to_fresh_recorded_seed():
    a = collect_privacy_losses(_mech(), 200, workers=1)
    b = collect_privacy_losses(_mech(), 200, workers=1)
    assert a.seed is not None and b.seed is not None and a.seed != b.seed
    assert not np.array_equal(a.remove, b.remove)
    again = collect_privacy_losses(_mech(), 200, seed=a.seed, workers=1)  # the audit
    np.testing.assert_array_equal(again.remove, a.remove)
    np.testing.assert_array_equal(again.add, a.add)
    assert (a + b).seed is None


def test_collect_resumes_with_the_recorded_seed(tmp_path):
    d = str(tmp_path / "run")
    first = collect_privacy_losses(_mech(), 300, shard_size=100, workers=1, directory=d)
    assert json.load(open(f"{d}/meta.json"))["seed"] == first.seed
    resumed = collect_privacy_losses(_mech(), 300, shard_size=100, workers=1, directory=d)
    assert resumed.seed == first.seed
    np.testing.assert_array_equal(resumed.remove, first.remove)
    with pytest.raises(ValueError, match="another run"):  # a new seed in the same directory
        collect_privacy_losses(_mech(), 300, seed=first.seed + 1, shard_size=100, workers=1,
                               directory=d)


def test_certify_defaults_to_fresh_seed_and_refuses_reseeding(tmp_path):
    kw = dict(sigma_min=2.0, sigma_max=2.1, ratio=1.05, workers=1)
    a = certify_noise_multiplier(_mech(), 2.0, 0.05, **kw)
    b = certify_noise_multiplier(_mech(), 2.0, 0.05, **kw)
    assert a.seed != b.seed and f"seed {a.seed}" in a.statement
    pinned = certify_noise_multiplier(_mech(), 2.0, 0.05, seed=a.seed, **kw)
    assert pinned.verified == a.verified and pinned.seed == a.seed
    d = str(tmp_path / "cert")
    c = certify_noise_multiplier(_mech(), 2.0, 0.05, directory=d, **kw)
    assert certify_noise_multiplier(_mech(), 2.0, 0.05, directory=d, **kw).seed == c.seed
    with pytest.raises(ValueError, match="multiple testing"):
        certify_noise_multiplier(_mech(), 2.0, 0.05, directory=d, seed=c.seed + 1, **kw)


def test_accountant_seed_is_fresh_recorded_and_round_trips():
    from opacus_structured.accountants.bminsep_mc import BMinSepMonteCarloAccountant
    from opacus_structured.runners.monte_carlo import MonteCarloSettings
    from opacus_structured.schemes import Scheme
    from opacus_structured.schemes.bminsep_mc import BMinSepMonteCarloScheme

    scheme = BMinSepMonteCarloScheme(bands=1, dataset_size=160, batch_size=10)
    run = MonteCarloSettings(samples=300, workers=1)
    a1, a2 = (BMinSepMonteCarloAccountant(scheme, settings=run) for _ in range(2))
    assert isinstance(a1.settings.seed, int) and a1.settings.seed != a2.settings.seed
    assert run.seed is None and MonteCarloSettings(seed=0).resolved().seed == 0
    with pytest.raises(ValueError, match="seed"):
        MonteCarloSettings(seed=-1)
    a1.step(noise_multiplier=1.0, sample_rate=10 / 160, num_steps=4)
    eps = float(a1.get_epsilon(0.05))
    state = json.loads(json.dumps(a1.state_dict()))
    assert state["monte_carlo"]["seed"] == a1.settings.seed
    other = MonteCarloSettings(samples=300, workers=1, seed=a1.settings.seed + 1)
    with pytest.raises(ValueError, match="Monte Carlo seed"):
        BMinSepMonteCarloAccountant(scheme, settings=other).load_state_dict(state)
    back = BMinSepMonteCarloAccountant(Scheme.from_dict(state["scheme"]))
    back.load_state_dict(state)
    assert back.settings.seed == a1.settings.seed and float(back.get_epsilon(0.05)) == eps


def test_bminsep_cli_reports_the_seed_it_used(capsys):
    flags = ["--bands", "1", "--dataset-size", "160", "--batch-size", "10", "--samples", "300",
             "--workers", "1", "--noise-multiplier", "1.0", "--steps", "4", "--delta", "0.05"]
    assert main(["bminsep-mc", "estimate", *flags, "--json"]) == 0
    a = json.loads(capsys.readouterr().out)
    assert main(["bminsep-mc", "estimate", *flags, "--json"]) == 0
    b = json.loads(capsys.readouterr().out)
    assert a["seed"] != b["seed"] and a["parameters"]["seed"] == a["seed"]
    assert main(["bminsep-mc", "estimate", *flags, "--json", "--seed", str(a["seed"])]) == 0
    assert json.loads(capsys.readouterr().out)["epsilon"] == a["epsilon"]
    assert main(["bminsep-mc", "estimate", *flags]) == 0
    assert "Monte Carlo seed" in capsys.readouterr().out


# ---- noise generators ---------------------------------------------------------------------------
def test_correlated_noise_without_generator_ignores_the_global_seed():
    from opacus_structured.optim.correlated_noise import CorrelatedNoiseDPOptimizer

    def noise():
        torch.manual_seed(0)  # a public constant, as in countless scripts
        p = torch.nn.Parameter(torch.zeros(50))
        opt = CorrelatedNoiseDPOptimizer(torch.optim.SGD([p], lr=1.0), noise_multiplier=1.0,
                                         max_grad_norm=1.0, expected_batch_size=1,
                                         noise_correlation=[1.0, 0.5])
        assert opt.generator is None
        p.grad_sample = torch.zeros(1, 50)
        opt.step()
        return p.detach().clone()

    a, b = noise(), noise()
    assert a.abs().sum() > 0 and not torch.equal(a, b)


def test_window_augmentation_noise_is_fresh_unless_seeded():
    from opacus_structured.forecasting.windowing import WindowDataset

    kw = dict(context_length=5, forecast_length=5, context_noise=1.0, value_bound=1.0)
    x = [np.zeros(30)]
    a, b = WindowDataset(x, **kw)[(0, 10)]["past"], WindowDataset(x, **kw)[(0, 10)]["past"]
    assert not torch.equal(a, b)
    s1, s2 = WindowDataset(x, **kw, seed=4), WindowDataset(x, **kw, seed=4)
    assert torch.equal(s1[(0, 10)]["past"], s2[(0, 10)]["past"])
    with pytest.raises(ValueError, match="not both"):
        WindowDataset(x, **kw, seed=4, generator=torch.Generator())


# ---- DP forecasting ----------------------------------------------------------------------------
H = 6
TINY = dict(hidden_dimension=2, kernel_size=5)


@pytest.fixture(scope="module")
def tiny():
    pytest.importorskip("gluonts")
    pytest.importorskip("lightning")
    from opacus_structured.forecasting.data import load_us_employment, train_test_split

    return train_test_split(load_us_employment().subset(range(0, 148, 18)), H)[0]


def _train(train, **kw):
    import lightning.pytorch as pl

    from opacus_structured.forecasting.training import train_forecaster

    coins = {}

    class Coins(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            coins["noise"] = trainer.optimizers[0].generator.initial_seed()
            coins["sampler"] = trainer.train_dataloader.batch_sampler.inner.generator.initial_seed()

    args = dict(prediction_length=H, context_length=8, batch_size=4, noise_multiplier=1.0,
                delta=1e-5, max_steps=2, discretization=1e-3, estimator_kwargs=TINY,
                callbacks=[Coins()])
    res = train_forecaster("dlinear", train, **{**args, **kw})
    params = torch.cat([p.detach().flatten() for p in res.prepared.module.model.parameters()])
    return res, params, coins


def test_default_training_draws_secret_coins(tiny):
    r1, p1, c1 = _train(tiny, init_seed=5)
    r2, p2, c2 = _train(tiny, init_seed=5)
    assert r1.private and r2.private and not r1.reproducible_noise
    assert r1.seed is None and r1.not_private_reason is None
    assert r1.epsilon == r2.epsilon  # the same ε ...
    assert c1["noise"] != c2["noise"] and c1["sampler"] != c2["sampler"]
    assert not torch.equal(p1, p2)  # ... and different noise (same initial weights)
    summary = json.dumps(r1.summary())
    assert '"seed"' not in summary and str(c1["noise"]) not in summary
    assert str(c1["sampler"]) not in summary


def test_seeded_training_is_reproducible_and_not_private(tiny):
    r1, p1, c1 = _train(tiny, seed=11)
    r2, p2, c2 = _train(tiny, seed=11)
    assert torch.equal(p1, p2) and c1 == c2 == {"noise": 12, "sampler": 11}
    assert r1.dp_sgd and not r1.private and r1.reproducible_noise
    assert "reproducible noise" in r1.not_private_reason and "11" in r1.not_private_reason
    s = r1.summary()
    assert s["private"] is False and s["seed"] == 11 and s["reproducible_noise"] is True
    assert r1.epsilon == _train(tiny, init_seed=3)[0].epsilon  # the mechanism's ε is unchanged
    nonprivate, _, _ = _train(tiny, noise_multiplier=None, delta=None, callbacks=[])
    assert not nonprivate.private and "non-private" in nonprivate.not_private_reason


def test_fractional_epochs_run_and_price_every_started_step(tiny):
    # 9 series, 4 per step: 2 steps per epoch; 1.25 epochs = 2.5 steps -> 3 (nearest: 2)
    res, _, _ = _train(tiny, max_steps=None, epochs=1.25, seed=0)
    assert res.steps == 3 == len(res.accountant)
    assert res.epsilon == res.scheme.epsilon(1.0, 3, 1e-5, discretization=1e-3)
    with pytest.raises(ValueError, match="epochs"):
        _train(tiny, max_steps=None, epochs=float("inf"))


def _forecast_args(out, *extra):
    return ["forecast", "--model", "dlinear", "--epsilon", "2", "--delta", "1e-5",
            "--num-series", "10", "--max-steps", "2", "--batch-size", "4",
            "--prediction-length", str(H), "--context-length", "8", "--num-samples", "5",
            "--init-from", "none",
            "--no-baselines", "--no-progress", "--output", str(out), *extra]


@pytest.mark.slow
def test_default_forecast_report_holds_no_seed_of_its_noise(tiny, tmp_path, capsys,
                                                            monkeypatch):
    from lightning_callbacks import dp_callback
    from opacus_structured.commands import _forecast_job, _forecast_reruns
    from opacus_structured.forecasting import training
    from opacus_structured.samplers import _generator

    drawn, original = [], _generator.fresh_seed

    def recording_fresh_seed():
        drawn.append(original())
        return drawn[-1]

    monkeypatch.setattr(training, "fresh_seed", recording_fresh_seed)
    monkeypatch.setattr(_generator, "fresh_seed", recording_fresh_seed)
    monkeypatch.setattr(_forecast_job, "fresh_seed", recording_fresh_seed)
    monkeypatch.setattr(dp_callback, "fresh_seed", recording_fresh_seed)
    monkeypatch.setattr(_forecast_reruns, "fresh_seed", recording_fresh_seed)
    reports = []
    for k in range(2):
        assert main(_forecast_args(tmp_path / str(k), "--json")) == 0
        captured = capsys.readouterr()
        assert "NOT PRIVATE" not in captured.err
        reports.append((tmp_path / str(k) / "diagnostics" / "report.json").read_text())
    # run_forecast draws the public init seed, train_forecaster the sampler coins and
    # DPCallback the noise coins (--no-baselines: no verdict, so no reruns; issue 47)
    assert len(drawn) == 6 and len(set(drawn)) == 6
    for text in reports:
        rep = json.loads(text)
        assert rep["private"] is True and rep["reproducible_noise"] is False
        assert rep["not_private_reason"] is None and "notice" not in rep
        assert not any("seed" in key for key in _keys(rep))
        numbers = {int(n) for n in re.findall(r"\d+", text)}
        assert not numbers & set(drawn)  # no coin (nor the init seed) is written anywhere
    a, b = (json.loads(t) for t in reports)
    assert a["epsilon"] == b["epsilon"] and a["noise_multiplier"] == b["noise_multiplier"]


def _keys(obj):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield k
            yield from _keys(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _keys(v)


@pytest.mark.slow
def test_seeded_forecast_says_not_private_everywhere(tiny, tmp_path, capsys):
    from opacus_structured.commands.forecast import NOT_PRIVATE_SEEDED

    assert main(_forecast_args(tmp_path / "a", "--seed", "7")) == 0
    out = capsys.readouterr()
    assert NOT_PRIVATE_SEEDED in out.out and NOT_PRIVATE_SEEDED in out.err
    assert "NOT PRIVATE" in out.out.splitlines()[2]  # the model's table row
    rep = json.loads((tmp_path / "a" / "diagnostics" / "report.json").read_text())
    assert rep["private"] is False and rep["dp_sgd"] is True and rep["reproducible_noise"]
    assert "reproducible noise" in rep["not_private_reason"]
    assert rep["notice"] == NOT_PRIVATE_SEEDED and rep["seed"] == 7 and rep["init_seed"] == 7
    assert main(_forecast_args(tmp_path / "b", "--seed", "7", "--json")) == 0
    out = capsys.readouterr()
    rep_b = json.loads(out.out)
    assert NOT_PRIVATE_SEEDED in out.err and rep_b["private"] is False
    assert rep_b["crps"] == rep["crps"] and rep_b["epsilon"] == rep["epsilon"]  # reproducible
    # --init-seed alone seeds only public randomness: still private, no coin seed written
    assert main(_forecast_args(tmp_path / "c", "--init-seed", "7", "--json")) == 0
    rep_c = json.loads(capsys.readouterr().out)
    assert rep_c["private"] is True and rep_c["init_seed"] == 7 and "seed" not in rep_c
    assert main(_forecast_args(tmp_path / "d", "--seed", "-1")) == 2
    assert "--seed" in capsys.readouterr().err
    assert not math.isnan(rep["epsilon"])
