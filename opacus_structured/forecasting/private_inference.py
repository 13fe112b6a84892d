r"""Private forecasts of a protected series (inference-time privacy).

DP-SGD training protects the training series through the parameters; a forecast
:math:`f_\theta(x)` also reads its input series :math:`x`. Schuchardt et al. (ICML 2025,
arXiv:2502.02410), Appendix H, protect that input with the time-domain mechanism of Koga,
Meehan & Chaudhuri (AISTATS 2022, arXiv:2201.04762), Theorem 3.2, and forecast from what it
releases:

1. keep each time step of the input independently with probability ``subsampling_rate``
   (Poisson subsampling in the time domain);
2. add Gaussian noise of standard deviation ``noise_multiplier * sensitivity`` to every kept
   value;
3. impute the dropped steps with the average of the kept noisy values (or a public constant
   when none is kept, or with ``imputation="constant"``);
4. apply the model to the reconstructed series.

:func:`privatize_series` runs steps 1–3 (use it to feed any predictor, e.g. a gluonts
``Predictor``); :func:`private_forecast` runs all four. Both return an
:class:`InferencePrivacyReport` with the (ε, δ) of
:mod:`opacus_structured.accounting.inference_privacy` — an upper bound for the forecast (the
imputation and the model are post-processing) for the :math:`(w, v)`-event-level relation: the
protected series may differ in ``changed_steps`` time steps, each by at most ``sensitivity``.
That bound on the change is the assumption to check; ``value_range=(lo, hi)`` clips the input so
that it holds for *any* substitution when ``hi - lo <= sensitivity``.

This ε is **separate from the model's training ε**: it covers the input of the forecast only,
and a value that is both a training value and a forecast input is covered by the composition of
the two.

**Forecasters that read a longer history** (issue 47). DLinear's predictor reads up to
``local_history_length`` past steps of each series (its local ETS is fitted on them;
:mod:`.baseline_skip`), not only the network's ``context_length``. This changes nothing in the
training ε: the DP guarantee is on the released weights, each training window's gradient
still depends on that window's own context only, and a forecast reads its own series at
prediction as every forecaster does (the zero-shot model, seasonal naive, ETS). For private
*inputs*, release every step the predictor reads: :func:`privatize_panel` releases each
series' whole history (all but the held-out steps), every step through the mechanism, so a
predictor reading any number of the released steps is post-processing and the report's ε
holds as it is (the ε of the (w, v)-event-level relation does not depend on the series
length). Privatizing only the last ``context_length`` steps with :func:`privatize_series`
and appending raw earlier steps would leave those steps unprotected.

Randomness: by default the mask and the noise come from a generator seeded with fresh OS entropy
(:func:`~opacus_structured.samplers._generator.fresh_seed`, recorded nowhere). A ``seed`` or a
caller's ``generator`` makes the release reproducible and therefore **not private** (whoever
knows the seed or the generator's state regenerates and subtracts the noise): the report says so
(``private=False``, ``not_private_reason``), as :class:`~.training.TrainResult` does for seeded
training. Use them in tests only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from .._validation import check_finite, check_open_unit, check_positive, check_probability
from ..accounting.bounds import BoundKind
from ..accounting.inference_privacy import (
    FORECAST_BOUND,
    _uses,
    calibrate_time_domain_noise,
    time_domain_epsilon,
)
from ..samplers._generator import resolve_generator
from .data import Panel

__all__ = ["InferencePrivacyReport", "privatize_series", "private_forecast", "privatize_panel"]

IMPUTATIONS = ("mean", "constant")

SCOPE = ("inference-time privacy of the forecast's input series only; separate from (not "
         "included in) the model's training epsilon: compose the two for a value that is both "
         "trained on and forecast from")


@dataclasses.dataclass(frozen=True)
class InferencePrivacyReport:
    """What one private release guarantees.

    ``epsilon`` at ``delta`` covers ``releases`` releases whose inputs contain the protected
    steps (this one included), each drawn with fresh coins and the same ``noise_multiplier``;
    ``bound`` is ``"upper"`` for a forecast (the profile is tight for the released subsample
    itself). ``private`` is ``True`` only when the coins came from fresh OS entropy.
    """

    epsilon: float
    delta: float
    noise_multiplier: float
    noise_std: float
    subsampling_rate: float
    sensitivity: float
    changed_steps: int
    releases: int
    imputation: str
    kept_steps: int
    series_length: int
    bound: BoundKind = FORECAST_BOUND
    target_epsilon: Optional[float] = None
    value_range: Optional[tuple[float, float]] = None
    seed: Optional[int] = None
    caller_generator: bool = False
    scope: str = SCOPE

    @property
    def private(self) -> bool:
        """The (ε, δ) guarantee holds for this release: the coins were secret OS entropy."""
        return self.seed is None and not self.caller_generator

    @property
    def not_private_reason(self) -> Optional[str]:
        """Why this release is not private (``None`` when it is)."""
        if self.seed is not None:
            return ("reproducible noise: the time-domain subsample and the input noise were "
                    f"seeded with seed={self.seed}, which regenerates them")
        if self.caller_generator:
            return ("reproducible noise: the time-domain subsample and the input noise came "
                    "from the caller's generator, whose state regenerates them")
        return None

    @property
    def relation(self) -> str:
        """The neighbouring relation the guarantee is for, in words."""
        step = "step" if self.changed_steps == 1 else "steps"
        return (f"({self.changed_steps}, {self.sensitivity:g})-event level: the input series "
                f"differs in at most {self.changed_steps} time {step}, each by at most "
                f"{self.sensitivity:g}")

    @property
    def covers_any_substitution(self) -> bool:
        """The input was clipped to a range no wider than the sensitivity, so the guarantee
        holds for any replacement of the changed steps, not only for bounded changes."""
        return (self.value_range is not None
                and self.value_range[1] - self.value_range[0] <= self.sensitivity)

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["bound"] = str(self.bound)
        out.update(private=self.private, not_private_reason=self.not_private_reason,
                   relation=self.relation, covers_any_substitution=self.covers_any_substitution)
        if self.seed is None:
            out.pop("seed")
        return out


def _as_series(series) -> torch.Tensor:
    if isinstance(series, torch.Tensor):
        x = series.detach()
    else:
        try:
            x = torch.as_tensor(np.asarray(series))
        except (TypeError, ValueError, RuntimeError):
            raise ValueError("series must be a 1-D array of real numbers") from None
    if x.dtype == torch.bool or x.is_complex():
        raise ValueError(f"series must be real-valued, got dtype {x.dtype}")
    if x.ndim != 1 or x.numel() == 0:
        raise ValueError(f"series must be a non-empty 1-D array (one univariate series), got "
                         f"shape {tuple(x.shape)}")
    if not x.is_floating_point():
        x = x.to(torch.get_default_dtype())
    if not bool(torch.isfinite(x).all()):
        raise ValueError("series must be finite (no NaN or inf): missing values are not "
                         "covered by the guarantee")
    return x


def _check_value_range(value_range) -> Optional[tuple[float, float]]:
    if value_range is None:
        return None
    if not isinstance(value_range, Sequence) or isinstance(value_range, str) \
            or len(value_range) != 2:
        raise ValueError(f"value_range must be a pair (low, high), got {value_range!r}")
    lo = check_finite("value_range[0]", value_range[0])
    hi = check_finite("value_range[1]", value_range[1])
    if not lo < hi:
        raise ValueError(f"value_range must have low < high, got {value_range!r}")
    return lo, hi


def _noise_multiplier(noise_multiplier, epsilon, delta, rate, releases, changed_steps):
    if (noise_multiplier is None) == (epsilon is None):
        raise ValueError("pass exactly one of noise_multiplier and epsilon (a target to "
                         "calibrate the noise for)")
    if noise_multiplier is not None:
        return check_positive("noise_multiplier", noise_multiplier), None
    epsilon = check_positive("epsilon", epsilon)
    z = calibrate_time_domain_noise(epsilon, delta, subsampling_rate=rate, releases=releases,
                                    changed_steps=changed_steps)
    return z, epsilon


def privatize_series(series, *, subsampling_rate: float, sensitivity: float, delta: float,
                     noise_multiplier: Optional[float] = None, epsilon: Optional[float] = None,
                     releases: int = 1, changed_steps: int = 1, imputation: str = "mean",
                     fill_value: float = 0.0,
                     value_range: Optional[tuple[float, float]] = None,
                     generator: Optional[torch.Generator] = None, seed: Optional[int] = None,
                     ) -> tuple[torch.Tensor, InferencePrivacyReport]:
    """Subsample ``series`` in time, add Gaussian noise, impute; return it with its report.

    Args:
        series: the protected input series, 1-D (a tensor, array or list of real numbers,
            finite). Not modified.
        subsampling_rate: probability in (0, 1] that a time step is kept.
        sensitivity: :math:`v` > 0, the largest change of one protected time step.
        delta: δ in (0, 1) at which ε is reported (and calibrated).
        noise_multiplier: noise standard deviation in units of ``sensitivity``; or
        epsilon: a target ε > 0 to calibrate the smallest such noise for (exactly one of the
            two).
        releases: releases (forecasts) with fresh coins whose inputs contain the protected
            steps, this one included, that the reported ε must cover (≥ 1).
        changed_steps: :math:`w` ≥ 1, time steps two neighbouring series may differ in.
        imputation: ``"mean"`` (the average of the kept noisy values; ``fill_value`` when none
            is kept) or ``"constant"`` (``fill_value``).
        fill_value: a public constant (finite).
        value_range: optional ``(low, high)``: the input is clipped to it before the noise.
        generator, seed: randomness for tests (the release is then not private); default fresh
            OS entropy.

    Returns:
        ``(released_series, report)``: a tensor with the dtype and device of ``series`` (floating
        point) and an :class:`InferencePrivacyReport`.
    """
    x = _as_series(series)
    rate = check_probability("subsampling_rate", subsampling_rate)
    sensitivity = check_positive("sensitivity", sensitivity)
    delta = check_open_unit("delta", delta)
    _uses(releases, changed_steps)
    releases, changed_steps = int(releases), int(changed_steps)
    if imputation not in IMPUTATIONS:
        raise ValueError(f"imputation must be one of {IMPUTATIONS}, got {imputation!r}")
    fill_value = check_finite("fill_value", fill_value)
    value_range = _check_value_range(value_range)
    z, target = _noise_multiplier(noise_multiplier, epsilon, delta, rate, releases,
                                  changed_steps)
    gen = resolve_generator(generator, seed, "privatize_series")
    eps = time_domain_epsilon(delta, noise_multiplier=z, subsampling_rate=rate,
                              releases=releases, changed_steps=changed_steps)

    values = x.to(device="cpu", dtype=torch.float64)
    if value_range is not None:
        values = values.clamp(value_range[0], value_range[1])
    n = values.numel()
    keep = torch.rand(n, generator=gen, dtype=torch.float64) < rate
    noise = torch.randn(n, generator=gen, dtype=torch.float64) * (z * sensitivity)
    noisy = values + noise
    kept = int(keep.sum())
    if imputation == "mean" and kept > 0:
        fill = noisy[keep].mean()
    else:
        fill = torch.tensor(fill_value, dtype=torch.float64)
    released = torch.where(keep, noisy, fill)
    out = released.to(device=x.device, dtype=x.dtype)

    report = InferencePrivacyReport(
        epsilon=eps, delta=delta, noise_multiplier=z, noise_std=z * sensitivity,
        subsampling_rate=rate, sensitivity=sensitivity, changed_steps=changed_steps,
        releases=releases, imputation=imputation, kept_steps=kept, series_length=n,
        target_epsilon=target, value_range=value_range,
        seed=None if seed is None else int(seed), caller_generator=generator is not None)
    return out, report


def private_forecast(model_fn: Callable[[torch.Tensor], Any], series, *,
                     subsampling_rate: float, sensitivity: float, delta: float,
                     noise_multiplier: Optional[float] = None, epsilon: Optional[float] = None,
                     releases: int = 1, changed_steps: int = 1, imputation: str = "mean",
                     fill_value: float = 0.0,
                     value_range: Optional[tuple[float, float]] = None,
                     generator: Optional[torch.Generator] = None, seed: Optional[int] = None,
                     ) -> tuple[Any, InferencePrivacyReport]:
    """Forecast from a privatized input: ``model_fn(privatize_series(series, ...)[0])``.

    ``model_fn`` receives the released 1-D series (dtype and device of ``series``) and runs
    under ``torch.no_grad()``; whatever it returns is the forecast (post-processing: any model,
    deterministic or sampling, keeps the guarantee). Other arguments and the report as in
    :func:`privatize_series`.
    """
    if not callable(model_fn):
        raise ValueError(f"model_fn must be callable, got {type(model_fn).__name__}")
    released, report = privatize_series(
        series, subsampling_rate=subsampling_rate, sensitivity=sensitivity, delta=delta,
        noise_multiplier=noise_multiplier, epsilon=epsilon, releases=releases,
        changed_steps=changed_steps, imputation=imputation, fill_value=fill_value,
        value_range=value_range, generator=generator, seed=seed)
    with torch.no_grad():
        forecast = model_fn(released)
    return forecast, report


def privatize_panel(panel, holdout: int, *, subsampling_rate: float, sensitivity: float,
                    delta: float, epsilon: Optional[float] = None,
                    noise_multiplier: Optional[float] = None, changed_steps: int = 1,
                    imputation: str = "mean", fill_value: float = 0.0,
                    value_range: Optional[tuple[float, float]] = None,
                    seed: Optional[int] = None):
    """Privatize the forecast inputs of every series of ``panel`` (evaluation of private inputs).

    Each series' history — all but its last ``holdout`` values — is released once through
    :func:`privatize_series` (fresh coins per series; one protected input per series, so every
    series gets the same (ε, δ)); the last ``holdout`` values are kept as they are, as the
    ground truth a held-out evaluation scores against (``make_evaluation_predictions`` removes
    them before the model sees the input). Returns ``(panel_with_private_inputs, reports)``
    with one :class:`InferencePrivacyReport` per series. ``seed`` seeds series ``i`` with
    ``seed + i`` (reproducible, hence not private).
    """
    if holdout < 0:
        raise ValueError(f"holdout must be >= 0, got {holdout}")
    targets, reports = [], []
    for i, y in enumerate(panel.targets):
        y = np.asarray(y, dtype=np.float64)
        if len(y) <= holdout:
            raise ValueError(f"series {panel.item_ids[i]!r} has {len(y)} values, no history "
                             f"before the {holdout} held-out ones")
        history, future = y[:len(y) - holdout], y[len(y) - holdout:]
        released, report = privatize_series(
            history, subsampling_rate=subsampling_rate, sensitivity=sensitivity, delta=delta,
            epsilon=epsilon, noise_multiplier=noise_multiplier, changed_steps=changed_steps,
            imputation=imputation, fill_value=fill_value, value_range=value_range,
            seed=None if seed is None else seed + i)
        targets.append(np.concatenate([released.numpy(), future]).astype(np.float32))
        reports.append(report)
    return Panel(tuple(targets), panel.starts, panel.item_ids, panel.freq,
                 panel.titles, panel.static_cats), reports
