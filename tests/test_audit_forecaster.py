"""Issue 19: the forecasting trainer (``train_forecaster``) audited end to end.

The ``forecaster`` / ``forecaster-ghost`` paths of the ``structured`` audit call the trainer
itself (gluonts transformation and splitter, structured sampler with the deterministic top
level, DPCallback, Opacus' DPOptimizer or our book-keeping, Adam, the trainer's accountant) on
a panel of canary series, with a canary head on the network (opacus_structured.audit.forecaster).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("gluonts")

from opacus_structured.audit.estimators import epsilon_lower_bound  # noqa: E402
from opacus_structured.audit.forecaster import (  # noqa: E402
    AUDIT_CLIP,
    CanaryHeadNetwork,
    ReleasedHeadGradient,
    canary_head_estimator,
    canary_panel,
)
from opacus_structured.audit.pipelines import audit_registry, run_audit  # noqa: E402
from opacus_structured.forecasting.training import train_forecaster  # noqa: E402

#: The registry's flags for the trainer's paths (deterministic top level, r = 2/4, 3 epochs).
FLAGS = audit_registry()["structured"]["path_flags"]["forecaster"]


def test_registry_offers_the_trainer_paths_on_structured_only():
    reg = audit_registry()
    assert {"forecaster", "forecaster-ghost"} <= set(reg["structured"]["paths"])
    assert set(reg["structured"]["path_flags"]) == {"forecaster", "forecaster-ghost"}
    for name, entry in reg.items():
        if name != "structured":
            assert not {"forecaster", "forecaster-ghost"} & set(entry["paths"]), name
            assert entry["path_flags"] == {}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def test_canary_head_reads_the_code_and_the_event_off_the_raw_window():
    head = CanaryHeadNetwork(torch.nn.Identity(), codes=3, magnitude=10.0)
    past = torch.tensor([[0.0, 2.0], [0.0, 0.0], [1.0, 1.0], [5.0, 5.0]])  # padding zeros
    future = torch.tensor([[2.0], [-3.0], [1.0], [5.0]])
    h = head.features(past, future)
    expected = torch.zeros(4, 3)
    expected[0, 1] = -10.0  # run 1 (code 2), no event
    expected[1, 2] = 10.0   # run 2 (code 3), its event (-3) in the forecast
    expected[2, 0] = -10.0  # run 0
    # code 5 is no run's: no head gradient
    assert torch.equal(h, expected)


def test_panel_interleaves_runs_and_plants_the_event_in_series_zero():
    present = np.array([True, False, True])
    panel = canary_panel(present, num_series=2, series_length=4, event_time=1)
    assert len(panel) == 6 and panel.min_length == 4
    targets = np.stack(panel.targets)
    np.testing.assert_array_equal(targets[0], [1, -1, 1, 1])   # run 0, series 0, with
    np.testing.assert_array_equal(targets[1], [2, 2, 2, 2])    # run 1, series 0, without
    np.testing.assert_array_equal(targets[2], [3, -3, 3, 3])   # run 2, series 0, with
    np.testing.assert_array_equal(targets[3:], [[1] * 4, [2] * 4, [3] * 4])  # series 1


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_trainer_releases_one_dirac_per_window_at_the_canary_series_step(mode):
    """Nearly noise-free (σ = 0.1): every run's head coordinate releases -1 per window of its
    series, +1 where the drawn window covers the event: only in the "with" runs, only at the
    canary series' step (the first of every 2-step epoch), with frequency r = 2/4 (the window
    law the accountant prices), and the residual is the noise (std σ)."""
    runs = 300
    present = np.random.default_rng(0).random(runs) < 0.5
    panel = canary_panel(present, 2, 4, event_time=0)
    released = ReleasedHeadGradient(runs / AUDIT_CLIP)
    result = train_forecaster(
        None, panel, estimator=canary_head_estimator(runs, prediction_length=1,
                                                     context_length=1, batch_size=runs),
        batch_size=runs, noise_multiplier=0.1, delta=0.05, max_grad_norm=AUDIT_CLIP,
        max_steps=6, top_level="deterministic", seed=3, discretization=0.05,
        grad_sample_mode=mode, callbacks=[released])
    assert result.scheme.top_level == "deterministic" and result.steps == 6
    y = np.stack(released.rows, axis=1)
    assert y.shape == (runs, 6)
    covered = y > 0
    assert not covered[~present].any() and not covered[:, 1::2].any()
    draws = covered[present][:, ::2]
    assert abs(draws.mean() - 0.5) < 4 * math.sqrt(0.25 / draws.size)
    residual = np.abs(y) - 1.0
    assert abs(residual.std() - 0.1) < 0.01 and abs(residual.mean()) < 0.01


def test_forecaster_path_prices_what_the_hooks_path_prices():
    """The trainer's accountant prices the panel of 2·R series (Λ = R per step); under the
    deterministic top level its ε depends on r and the epochs only, so it reports the hooks
    audit's ε at the same flags. Ghost (book-keeping) releases what hooks release."""
    hooks = run_audit("structured", runs=8, seed=1, path="hooks", **FLAGS)
    trainer = run_audit("structured", runs=8, seed=1, path="forecaster", **FLAGS)
    ghost = run_audit("structured", runs=8, seed=1, path="forecaster-ghost", **FLAGS)
    assert trainer.reported_epsilon == pytest.approx(hooks.reported_epsilon, rel=1e-12)
    assert np.all(np.isfinite(trainer.scores_with)) and trainer.scores_with.size == 8
    np.testing.assert_allclose(ghost.scores_with, trainer.scores_with, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ghost.scores_without, trainer.scores_without, rtol=1e-5,
                               atol=1e-5)
    assert trainer.meta["path"] == "forecaster"


@pytest.mark.parametrize("flags, match", [
    (dict(top_level="wor"), "top_level: the forecaster path needs 'deterministic'"),
    (dict(FLAGS, context_length=0), "context_length"),
    (dict(FLAGS, mutation="no-clipping"), "mutation: the forecaster path"),
    (dict(FLAGS, canary="input"), "canary"),
])
def test_forecaster_path_names_what_it_cannot_audit(flags, match):
    flags = dict(flags)
    kw = {k: flags.pop(k) for k in ("mutation", "canary") if k in flags}
    with pytest.raises(ValueError, match=match):
        run_audit("structured", runs=4, seed=0, path="forecaster", **kw, **flags)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["forecaster", "forecaster-ghost"])
def test_forecaster_audit_is_sound_and_nearly_tight(path):
    scores = run_audit("structured", runs=4000, seed=11, path=path, **FLAGS)
    lb = epsilon_lower_bound(scores.scores_with, scores.scores_without,
                             delta=scores.delta).epsilon
    assert 0.5 * scores.reported_epsilon <= lb <= scores.reported_epsilon


@pytest.mark.slow
def test_forecaster_noise_halved_is_caught():
    scores = run_audit("structured", runs=3000, seed=12, path="forecaster",
                       mutation="noise-halved", **FLAGS)
    lb = epsilon_lower_bound(scores.scores_with, scores.scores_without,
                             delta=scores.delta).epsilon
    assert lb > scores.reported_epsilon
