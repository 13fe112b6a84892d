"""Training again from private weights composes (issue 29, case 11).

A second DP run that starts from the weights of a first DP run on the same data releases a
model that went through both: its ε is the composition of the two runs. Independent oracles:
dp_accounting's own PLD of the Poisson-equivalent Gaussian of Thm 4.4 (σ/2, sensitivity 1,
rate ρ·r; Thm 4.4), composed over both runs' steps, and a fresh accountant fed both
histories. Weights without a privacy record are refused unless declared public; the shipped
public pretrained weights need no flag.
"""

import json
import math

import numpy as np
import pytest

pytest.importorskip("gluonts")
pytest.importorskip("lightning")

from opacus_structured.accountants.structured import StructuredSubsamplingAccountant  # noqa: E402,E501
from opacus_structured.forecasting import provenance as prov  # noqa: E402
from opacus_structured.forecasting.data import Panel, load_us_employment, train_test_split  # noqa: E402,E501
from opacus_structured.forecasting.training import train_forecaster  # noqa: E402

D = 1e-3  # coarse pessimistic grid (tests/conftest.py)
H = 6
DELTA = 1e-5
TINY = dict(hidden_dimension=2, kernel_size=5)
COMMON = dict(prediction_length=H, context_length=8, batch_size=4, delta=DELTA,
              discretization=D, estimator_kwargs=TINY)


@pytest.fixture(scope="module")
def panel():
    return load_us_employment()


@pytest.fixture(scope="module")
def tiny(panel):
    return train_test_split(panel.subset(range(0, 148, 18)), H)[0]  # 9 series


@pytest.fixture(scope="module")
def other(panel):
    return train_test_split(panel.subset(range(1, 148, 18)), H)[0]  # 9 other series


@pytest.fixture(scope="module")
def first(tiny):
    """The first DP run: 2 steps at σ = 1.5."""
    return train_forecaster("dlinear", tiny, noise_multiplier=1.5, max_steps=2, **COMMON)


def _poisson_equivalent(scheme, runs):
    """dp_accounting's ε(δ) of the runs ``[(σ, steps), ...]`` composed: Thm 4.4's step is a
    Poisson-subsampled Gaussian with std σ/2, sensitivity 1, rate ρ·r (Schuchardt et al.,
    ICML 2025, Thm 4.4)."""
    from dp_accounting.pld import privacy_loss_distribution as pldm

    rho = scheme.batch_size / scheme.num_series
    r = (scheme.context_length + scheme.forecast_length) / (
        scheme.series_length - scheme.forecast_length + 1)
    total = None
    for sigma, steps in runs:
        part = pldm.from_gaussian_mechanism(
            standard_deviation=sigma / 2, sensitivity=1.0, sampling_prob=rho * min(1.0, r),
            value_discretization_interval=D).self_compose(steps)
        total = part if total is None else total.compose(part)
    return total.get_epsilon_for_delta(DELTA)


def _both_histories(scheme, rate, runs):
    """Our accountant fed the steps of both runs (one history)."""
    acc = StructuredSubsamplingAccountant(scheme, discretization=D)
    for sigma, steps in runs:
        acc.step(noise_multiplier=sigma, sample_rate=rate, num_steps=steps)
    return acc.get_epsilon(DELTA)


# ---- (a) same data: composed ------------------------------------------------------------------
def test_second_run_from_private_weights_composes(first, tiny):
    rec = first.privacy_record
    assert rec["format"] == prov.RECORD_FORMAT and len(rec["runs"]) == 1
    assert rec["weights"] == prov.weights_fingerprint(first.state_dict())
    second = train_forecaster("dlinear", tiny, noise_multiplier=2.0, max_steps=3,
                              init_state=first.state_dict(), init_record=rec, **COMMON)
    s = second.scheme
    assert s == first.scheme
    # this run alone, as before
    assert second.run_epsilon == pytest.approx(s.epsilon(2.0, 3, DELTA, discretization=D),
                                               rel=1e-12)
    # the released model: both runs composed (independent: dp_accounting, both runs' events)
    ref = _poisson_equivalent(s, [(1.5, 2), (2.0, 3)])
    assert second.epsilon == pytest.approx(ref, rel=0.02)
    assert second.epsilon >= ref * (1 - 5e-3)
    assert second.epsilon > second.run_epsilon + 0.05
    # ... and our accountant fed both histories gives the same number
    rate = first.accountant.history[0][1]
    assert second.epsilon == pytest.approx(_both_histories(s, rate, [(1.5, 2), (2.0, 3)]),
                                           rel=1e-6)
    # labelled
    assert second.private and second.bound == "tight"
    (prior,) = second.prior_runs
    assert prior["composed"] and prior["data"] == "this data"
    assert prior["epsilon"] == pytest.approx(first.epsilon) and prior["steps"] == 2
    summary = second.summary()
    assert summary["epsilon_composes_prior_runs"] is True
    assert summary["run_epsilon"] == second.run_epsilon and summary["init"] == "privacy record"
    # a third run composes all three (the record carries the history)
    assert len(second.privacy_record["runs"]) == 2
    third = train_forecaster("dlinear", tiny, noise_multiplier=2.0, max_steps=1,
                             init_state=second.state_dict(),
                             init_record=second.privacy_record, **COMMON)
    # (to 1e-6: each ε is read at δ minus its composition's round-off floor, and composing a
    # composed prior with new steps bounds that floor differently from one history)
    assert third.epsilon == pytest.approx(
        _both_histories(s, rate, [(1.5, 2), (2.0, 3), (2.0, 1)]), rel=1e-6)
    json.dumps(third.summary())  # JSON-ready


def test_target_epsilon_bounds_the_composition(first, tiny):
    spent = first.epsilon
    target = spent + 0.6
    second = train_forecaster("dlinear", tiny, epsilon=target, max_steps=3,
                              init_state=first.state_dict(), init_record=first.privacy_record,
                              **COMMON)
    s, sigma = second.scheme, second.noise_multiplier
    # calibrated so that the composition meets the target, nearly tight
    assert second.epsilon <= target
    assert second.epsilon == pytest.approx(_poisson_equivalent(s, [(1.5, 2), (sigma, 3)]),
                                           rel=0.02)
    rate = first.accountant.history[0][1]
    assert _both_histories(s, rate, [(1.5, 2), (sigma * 0.97, 3)]) > target
    assert second.run_epsilon < second.epsilon
    # a budget the first run already spent is refused, naming the earlier spend
    with pytest.raises(ValueError, match="already spent"):
        train_forecaster("dlinear", tiny, epsilon=spent * 0.9, max_steps=3,
                         init_state=first.state_dict(), init_record=first.privacy_record,
                         **COMMON)
    # fixed σ with a budget: stops before the step at which the composition exceeds it
    capped = train_forecaster("dlinear", tiny, noise_multiplier=1.5, epsilon=target,
                              max_steps=50, init_state=first.state_dict(),
                              init_record=first.privacy_record, **COMMON)
    n = capped.steps
    assert 0 < n < 50 and capped.epsilon <= target
    assert _both_histories(s, rate, [(1.5, 2), (1.5, n + 1)]) > target


# ---- (b) other data: reported, not composed -------------------------------------------------
def test_record_from_other_data_is_reported_not_composed(first, tiny, other):
    second = train_forecaster("dlinear", other, noise_multiplier=2.0, max_steps=2,
                              init_state=first.state_dict(), init_record=first.privacy_record,
                              **COMMON)
    assert second.epsilon == second.run_epsilon
    (prior,) = second.prior_runs
    assert prior["composed"] is False and prior["data"] == "other data"
    # one series in common is the same data: composed
    mixed = Panel(other.targets[:-1] + (tiny.targets[0],), other.starts[:-1] + (tiny.starts[0],),
                  other.item_ids[:-1] + (tiny.item_ids[0],), other.freq)
    third = train_forecaster("dlinear", mixed, noise_multiplier=2.0, max_steps=2,
                             init_state=first.state_dict(), init_record=first.privacy_record,
                             **COMMON)
    assert third.prior_runs[0]["composed"] and third.epsilon > third.run_epsilon


def test_fingerprint_is_keyed_unordered_and_reads_no_value(tiny, tmp_path, monkeypatch):
    fp = prov.panel_fingerprint(tiny)
    assert fp == prov.panel_fingerprint(tiny.subset(range(len(tiny) - 1, -1, -1)))
    assert len(fp["ids"]) == len(tiny) and all(len(t) == 16 for t in fp["ids"])
    # the record is published: it must not depend on the private values
    changed = Panel(tuple(t + 1.0 for t in tiny.targets), tiny.starts, tiny.item_ids,
                    tiny.freq)
    assert prov.panel_fingerprint(changed) == fp
    # a subset of the series is the same data
    assert prov._overlap(fp, prov.panel_fingerprint(tiny.subset([2]))) is True
    # another key (another machine): not comparable, so the earlier run is composed
    monkeypatch.setenv("OPACUS_STRUCTURED_CACHE", str(tmp_path))
    other_key = prov.panel_fingerprint(tiny)
    assert other_key["key_id"] != fp["key_id"] and not set(other_key["ids"]) & set(fp["ids"])
    assert prov._overlap(fp, other_key) is None


# ---- (c) no record: declared public, or refused -----------------------------------------------
def test_undeclared_foreign_weights_are_refused(first, tiny):
    bare = first.state_dict()  # private weights that lost their record
    with pytest.raises(ValueError, match="init_public"):
        train_forecaster("dlinear", tiny, noise_multiplier=2.0, max_steps=1, init_state=bare,
                         **COMMON)
    # a record of other weights is refused
    changed = {k: v + 1e-3 for k, v in bare.items()}
    with pytest.raises(ValueError, match="other weights"):
        train_forecaster("dlinear", tiny, noise_multiplier=2.0, max_steps=1,
                         init_state=changed, init_record=first.privacy_record, **COMMON)
    # declared public: used, priced as this run alone, labelled
    declared = train_forecaster("dlinear", tiny, noise_multiplier=2.0, max_steps=1,
                                init_state=changed, init_public=True, **COMMON)
    assert declared.epsilon == declared.run_epsilon
    assert declared.init_provenance.source == "declared public"
    # a declaration contradicted by the record is refused
    with pytest.raises(ValueError, match="not\\s+public"):
        train_forecaster("dlinear", tiny, noise_multiplier=2.0, max_steps=1, init_state=bare,
                         init_record=first.privacy_record, init_public=True, **COMMON)
    with pytest.raises(ValueError, match="pass init_state"):
        train_forecaster("dlinear", tiny, noise_multiplier=2.0, max_steps=1, init_public=True,
                         **COMMON)


def test_nonprivate_or_seeded_earlier_run_on_this_data(tiny):
    plain = train_forecaster("dlinear", tiny, max_steps=1, **{**COMMON, "delta": None})
    with pytest.raises(ValueError, match="WITHOUT DP"):
        train_forecaster("dlinear", tiny, noise_multiplier=2.0, max_steps=1,
                         init_state=plain.state_dict(), init_record=plain.privacy_record,
                         **COMMON)
    seeded = train_forecaster("dlinear", tiny, noise_multiplier=2.0, max_steps=1, seed=3,
                              **COMMON)
    after = train_forecaster("dlinear", tiny, noise_multiplier=2.0, max_steps=1,
                             init_state=seeded.state_dict(), init_record=seeded.privacy_record,
                             **COMMON)
    assert not after.private and "seeded" in after.not_private_reason


def test_public_pretrained_weights_need_no_flag(panel):
    from opacus_structured.forecasting.pretraining import (
        load_weights,
        pretrained_weights,
        shipped_weights_path,
        weights_key,
    )

    train = train_test_split(panel.subset(range(0, 148, 18)), 12)[0]
    key = weights_key("dlinear", freq="M", prediction_length=12)
    shipped, _ = load_weights(shipped_weights_path(key))  # recognised by content
    assert prov.is_known_public({k: v.clone() for k, v in shipped.items()})
    state, meta = pretrained_weights("dlinear", freq="M", prediction_length=12)
    assert meta["source"] == "shipped"
    res = train_forecaster("dlinear", train, prediction_length=12, batch_size=4,
                           noise_multiplier=2.0, delta=DELTA, max_steps=1, discretization=D,
                           init_state=state)
    assert res.init_provenance.source == "public" and res.prior_runs == []
    assert res.epsilon == res.run_epsilon and res.private
    # its record has this run only (the public weights contribute none)
    assert len(res.privacy_record["runs"]) == 1


def test_public_record_has_no_runs(tiny):
    import torch

    state = {"w": torch.ones(2)}
    rec = prov.public_record(state, "test corpus")
    assert rec["runs"] == [] and rec["weights"] == prov.weights_fingerprint(state)
    assert prov.is_known_public({"w": torch.ones(2)})  # registered by content
    got = prov.resolve_init({"w": torch.ones(2)}, init_record=rec, init_public=False,
                            panel=tiny, dp_sgd=True)
    assert got.source == "public" and got.composed == [] and got.prior_pld(D) is None


# ---- files and the command line ----------------------------------------------------------------
def test_record_is_refused_for_weights_changed_after_release(tiny):
    import torch

    res = train_forecaster("dlinear", tiny, noise_multiplier=2.0, max_steps=1, **COMMON)
    with torch.no_grad():
        next(res.prepared.module.model.parameters()).add_(1.0)  # e.g. more training outside
    with pytest.raises(ValueError, match="changed after"):
        _ = res.privacy_record


def test_saved_weights_round_trip_the_record(first, tiny, tmp_path):
    from opacus_structured.forecasting.pretraining import load_weights

    path = tmp_path / "w.pt"
    first.save_weights(str(path))
    state, meta = load_weights(str(path))
    assert meta["privacy_record"] == first.privacy_record
    second = train_forecaster("dlinear", tiny, noise_multiplier=2.0, max_steps=1,
                              init_state=state, init_record=meta["privacy_record"], **COMMON)
    assert second.epsilon > second.run_epsilon


def _forecast(tmp_path, name, *extra):
    from opacus_structured.cli import main

    out = tmp_path / name
    argv = ["forecast", "--model", "dlinear", "--epsilon", "2", "--delta", "1e-5",
            "--num-series", "10", "--max-steps", "2", "--batch-size", "4",
            "--prediction-length", str(H), "--context-length", "8", "--num-samples", "5",
            "--no-baselines", "--no-plot", "--output", str(out), "--json", "--no-progress",
            "--discretization", str(D), *extra]
    rc = main(argv)
    return rc, out


def test_forecast_init_from_private_weights_composes(tmp_path, capsys):
    import torch

    weights = tmp_path / "first.pt"
    rc, _ = _forecast(tmp_path, "a", "--init-from", "none", "--save-weights", str(weights))
    assert rc == 0
    first = json.loads(capsys.readouterr().out)
    assert first["privacy_record"]["runs"][0]["steps"] == 2
    rc, _ = _forecast(tmp_path, "b", "--init-from", str(weights))
    assert rc == 0
    second = json.loads(capsys.readouterr().out)
    assert second["epsilon_composes_prior_runs"] is True
    assert second["prior_runs"][0]["epsilon"] == pytest.approx(first["epsilon"])
    # the composition meets the target; independent: our accountant fed both histories
    assert second["epsilon"] <= 2.0 and second["run_epsilon"] < second["epsilon"]
    from opacus_structured.schemes.base import Scheme

    scheme = Scheme.from_dict(first["privacy_record"]["runs"][0]["accountant"]["scheme"])
    rate = first["privacy_record"]["runs"][0]["accountant"]["history"][0][1]
    assert second["epsilon"] == pytest.approx(_both_histories(
        scheme, rate, [(first["noise_multiplier"], 2), (second["noise_multiplier"], 2)]),
        rel=1e-9)
    # weights without a record: refused (naming the flag) unless declared public
    bare = tmp_path / "bare.pt"
    torch.save(torch.load(weights, weights_only=True)["state_dict"], bare)
    rc, _ = _forecast(tmp_path, "c", "--init-from", str(bare))
    assert rc == 2 and "--init-public" in capsys.readouterr().err
    rc, _ = _forecast(tmp_path, "d", "--init-from", str(bare), "--init-public")
    assert rc == 0
    declared = json.loads(capsys.readouterr().out)
    assert declared["init"] == "declared public" and declared["epsilon"] == declared["run_epsilon"]
    assert not math.isnan(declared["epsilon"])
    rc, _ = _forecast(tmp_path, "e", "--init-from", "none", "--init-public")
    assert rc == 2 and "--init-public" in capsys.readouterr().err


def test_dp_estimator_train_from_composes(tiny, tmp_path):
    from gluonts.model.predictor import Predictor
    from gluonts.torch.model.d_linear import DLinearEstimator

    from opacus_structured.forecasting.dp_estimator import DPEstimator

    def est():
        return DLinearEstimator(prediction_length=H, context_length=8, hidden_dimension=2,
                                kernel_size=5, batch_size=4)

    dp = DPEstimator(est(), noise_multiplier=1.5, delta=DELTA, max_steps=2, discretization=D,
                     init_from="none")
    predictor = dp.train(tiny)
    first_eps = predictor.privacy_report["epsilon"]
    predictor.serialize(tmp_path / "model")  # the record comes back with the model
    predictor = Predictor.deserialize(tmp_path / "model")
    again = DPEstimator(est(), noise_multiplier=2.0, delta=DELTA, max_steps=3,
                        discretization=D)
    p2 = again.train_from(predictor, tiny)
    report = p2.privacy_report
    assert report["epsilon_composes_prior_runs"] is True
    assert report["prior_runs"][0]["epsilon"] == pytest.approx(first_eps)
    scheme = again.last_result.scheme
    ref = _poisson_equivalent(scheme, [(1.5, 2), (2.0, 3)])
    assert report["epsilon"] == pytest.approx(ref, rel=0.02) and report["epsilon"] >= ref * 0.995
    # a plain gluonts predictor (no record): refused unless declared public
    plain = DPEstimator(est(), noise_multiplier=2.0, delta=DELTA, max_steps=1,
                        discretization=D)
    from gluonts.torch.model.predictor import PyTorchPredictor

    bare = PyTorchPredictor(**{k: v for k, v in predictor.__init_args__.items()
                               if k in ("input_names", "prediction_net", "batch_size",
                                        "prediction_length", "input_transform")})
    with pytest.raises(ValueError, match="init_public"):
        plain.train_from(bare, tiny)
    assert plain.train_from(bare, tiny, init_public=True).privacy_report["init"] == \
        "declared public"
    assert np.isfinite(report["run_epsilon"])
