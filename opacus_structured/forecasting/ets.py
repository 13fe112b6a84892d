r"""A **non-private** classical reference: statsmodels ETS fitted per series.

A data owner who can look at their own panel without any privacy constraint could fit an
exponential-smoothing model to every series. This row shows where DP fine-tuning stands against
that free alternative. It is **not private**: each series' model is fitted on its own training
part with no noise, so releasing these forecasts (or models) carries no DP guarantee at all.

Model, per series ``y_1..y_n`` (the training part; the test steps are never read), with season
length ``m``. Fitted by maximum likelihood (statsmodels' ``ETSModel``) on ``y / s`` with the
scale ``s = mean |y|`` (1 for an all-zero series), then scaled back. The initial states come from
the heuristic of Hyndman et al. (2008, sec. 2.6.1) when it applies (at least 10 steps and two
full seasons), which is about 15 times faster than estimating them too (148 series of the
bundled panel: 7 s against 39 s). Otherwise they are estimated with the smoothing parameters. The specs are tried in
this order, and the first whose fit succeeds with finite forecasts is used:

1. ``ETS(A,Ad,A)``, additive errors, damped additive trend and additive seasonality of period
   ``m``. Only when ``2 <= m <= 24`` (R's ``forecast::ets`` rule: longer seasons have too many
   free states) and ``n >= max(2m, m + 10)``.
2. ``ETS(A,Ad,N)``, damped trend, no seasonality, when ``n >= 10``.
3. ``ETS(A,N,N)``, simple exponential smoothing, when ``n >= 4``.
4. Otherwise, or when every fit fails, the **naive** fallback ``ŷ_{n+h} = y_n`` with the
   random-walk predictive ``N(y_n, h σ²)``, where ``σ`` is the standard deviation of the first
   differences (0 for a series of length 1). It is labelled ``"naive (fallback: reason)"``.
   A constant series gets the constant forecast with zero spread (``"constant"``).

**Predictive distribution.** An ETS model with additive errors is linear-Gaussian (class 1 in
Hyndman et al., *Forecasting with Exponential Smoothing*, 2008, ch. 6). Its ``h``-step forecast
is therefore ``N(μ_h, v_h)``, with statsmodels' exact forecast variance ``v_h``
(``get_prediction(...).forecast_variance``, ``method == "exact"``). The quantile at level ``τ``
is ``μ_h + Φ^{-1}(τ) √v_h``. The forecasts are gluonts ``QuantileForecast`` objects at the
levels of :data:`~opacus_structured.forecasting.metrics.QUANTILES` plus the mean. They are
scored by the same ``Evaluator`` and on the same test windows as every other row, so the CRPS
is the same mean weighted quantile loss, computed here from the exact Gaussian quantiles with
no sampling noise.

**Speed.** The fits run with one BLAS / OpenMP thread (``threadpoolctl``): their linear
algebra is tiny, and in the ``forecast`` command, after torch has trained, the default thread
pools made them 3.4 times slower (41 s against 12 s for the bundled panel at load 6–9; that
is the likely cause of the issue's 52.6 s). The series are fitted independently, so with more
than one CPU
(:func:`ets_workers`: the CPUs this process may use, at most :data:`MAX_WORKERS`) and at least
:data:`MIN_SERIES_PER_WORKER` series per process they are fitted in forked worker processes
(``multiprocessing``'s ``fork`` start method; the parent imports statsmodels first, so the
workers start without importing anything). Each series runs the same code as in one process,
so the forecasts are identical (tested); only the wall time changes (docs/benchmarks.md). Where
``fork`` is not available (Windows, and macOS's default), or with ``workers=1``, the series are
fitted one after another in this process; ``summary["workers"]`` records the count used.
statsforecast's ``AutoETS`` was compared on the bundled panel and not adopted: slower here
(its import alone took 8 s) and not the same forecasts (another optimiser and initial states:
CRPS 0.0057 against 0.0041, per-series MASE differing by more than 10 % on 121 of 148
series; docs/benchmarks.md).

``statsmodels`` is optional: it is in the ``forecast`` extra. Without it,
:func:`ets_unavailable_reason` says so and the ``forecast`` command omits the row with one
notice.
"""

from __future__ import annotations

import collections
import math
import multiprocessing
import os
import warnings
from typing import Optional, Sequence

import numpy as np

from .._validation import check_int
from .metrics import QUANTILES, evaluate_forecasts

__all__ = ["ETS_LABEL", "ETS_NOT_PRIVATE_NOTE", "MAX_WORKERS", "MIN_SERIES_PER_WORKER",
           "ets_unavailable_reason", "ets_series_forecast", "ets_forecasts", "ets_specs_for",
           "ets_reference", "ets_workers"]

#: Row label used by the ``forecast`` command and the benchmark (the privacy status is in it).
ETS_LABEL = "statsmodels ETS (NOT PRIVATE)"
#: One-line statement of what the row is.
ETS_NOT_PRIVATE_NOTE = ("statsmodels ETS is a reference fitted WITHOUT any privacy protection on "
                        "the training part of every series (not private, no ε): it shows what "
                        "the data owner gets for free when privacy is not required")

#: Largest season fitted with a seasonal component (R forecast::ets' limit).
MAX_SEASONAL_PERIOD = 24
#: Most worker processes :func:`ets_forecasts` forks (the fits are CPU-bound).
MAX_WORKERS = 4
#: Fewest series per worker process (below it a process costs more than it saves).
MIN_SERIES_PER_WORKER = 8


def ets_workers(num_series: int, workers: Optional[int] = None) -> int:
    """How many processes fit ``num_series`` series: ``workers`` when given (``>= 1``), else
    the CPUs this process may use, at most :data:`MAX_WORKERS` and
    ``num_series // MIN_SERIES_PER_WORKER``; 1 where the ``fork`` start method is missing."""
    if workers is not None:
        workers = check_int("workers", workers, minimum=1)
    else:
        cpus = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                else (os.cpu_count() or 1))
        workers = min(cpus, MAX_WORKERS, num_series // MIN_SERIES_PER_WORKER)
    if "fork" not in multiprocessing.get_all_start_methods():
        return 1
    return max(1, min(workers, num_series))


def ets_unavailable_reason() -> Optional[str]:
    """``None`` when statsmodels (with ``ETSModel``) and threadpoolctl can be imported, else a
    one-line reason with the install command."""
    try:
        from statsmodels.tsa.exponential_smoothing.ets import ETSModel  # noqa: F401
    except ImportError as exc:
        return (f"statsmodels is not installed ({exc.__class__.__name__}: {exc}): the "
                "non-private ETS reference row is omitted; pip install "
                "\"opacus-structured[forecast]\" (or pip install \"statsmodels>=0.14\") to "
                "add it")
    try:
        import threadpoolctl  # noqa: F401  (one BLAS thread for the fits)
    except ImportError as exc:
        return (f"threadpoolctl is not installed ({exc.__class__.__name__}: {exc}): the "
                "non-private ETS reference row is omitted; pip install "
                "\"opacus-structured[forecast]\" (or pip install \"threadpoolctl>=3\") to add it")
    return None


def ets_specs_for(n: int, season_length: int) -> list[tuple[str, Optional[str], bool,
                                                              Optional[str]]]:
    """The specs tried for a training series of length ``n``, in order, as
    ``(name, trend, damped, seasonal)`` (see the module docstring)."""
    n = check_int("n", n, minimum=1)
    m = check_int("season_length", season_length, minimum=1)
    specs = []
    if 2 <= m <= MAX_SEASONAL_PERIOD and n >= max(2 * m, m + 10):
        specs.append((f"ETS(A,Ad,A) m={m}", "add", True, "add"))
    if n >= 10:
        specs.append(("ETS(A,Ad,N)", "add", True, None))
    if n >= 4:
        specs.append(("ETS(A,N,N)", None, False, None))
    return specs


def _fit_one(y: np.ndarray, h: int, m: int, trend, damped, seasonal):
    import pandas as pd
    from statsmodels.tsa.exponential_smoothing.ets import ETSModel

    # Hyndman et al.'s heuristic initial states (2008, sec. 2.6.1) where they apply (>= 10 steps
    # and two full seasons): 15x faster than estimating the m + 2 initial states by ML
    heuristic = y.size >= 10 and (seasonal is None or y.size >= 2 * m)
    model = ETSModel(pd.Series(y), error="add", trend=trend, damped_trend=damped,
                     seasonal=seasonal, seasonal_periods=m if seasonal else None,
                     initialization_method="heuristic" if heuristic else "estimated")
    with warnings.catch_warnings():
        # statsmodels' optimiser chatter (ConvergenceWarning, overflow in the likelihood of a
        # rejected trial point): the result is checked for finiteness below instead
        warnings.simplefilter("ignore")
        res = model.fit(disp=False)
        pred = res.get_prediction(start=len(y), end=len(y) + h - 1)
        mean = np.asarray(pred.predicted_mean, dtype=np.float64)
        var = np.asarray(pred.forecast_variance, dtype=np.float64)
    if pred.method != "exact":
        raise RuntimeError(f"prediction method {pred.method!r} is not the exact Gaussian one")
    if mean.shape != (h,) or var.shape != (h,):
        raise RuntimeError(f"forecast of shape {mean.shape} / {var.shape}, expected ({h},)")
    if not (np.all(np.isfinite(mean)) and np.all(np.isfinite(var)) and np.all(var >= 0)):
        raise RuntimeError("non-finite forecast or negative variance")
    return mean, np.sqrt(var)


def ets_series_forecast(y: Sequence[float], prediction_length: int,
                        season_length: int) -> tuple[np.ndarray, np.ndarray, str]:
    """``(mean, std, spec)``: the Gaussian ``h``-step predictive of one series (module
    docstring), ``h = 1..prediction_length``; ``spec`` names the model used (or the
    fallback and its reason)."""
    y = np.asarray(y, dtype=np.float64)
    if y.ndim != 1 or y.size == 0 or not np.all(np.isfinite(y)):
        raise ValueError("y must be a non-empty 1-d array of finite values")
    h = check_int("prediction_length", prediction_length, minimum=1)
    m = check_int("season_length", season_length, minimum=1)
    if np.ptp(y) == 0:
        return np.full(h, y[-1]), np.zeros(h), "constant"
    scale = float(np.mean(np.abs(y))) or 1.0
    failures = []
    for name, trend, damped, seasonal in ets_specs_for(y.size, m):
        try:
            mean, std = _fit_one(y / scale, h, m, trend, damped, seasonal)
        except Exception as exc:  # noqa: BLE001 - any fit failure moves to the next spec
            failures.append(f"{name}: {exc.__class__.__name__}")
            continue
        return mean * scale, std * scale, name
    sigma = float(np.std(np.diff(y), ddof=1)) if y.size > 2 else (
        float(abs(y[1] - y[0])) if y.size == 2 else 0.0)
    reason = "; ".join(failures) if failures else f"only {y.size} training steps"
    return (np.full(h, y[-1]), sigma * np.sqrt(np.arange(1, h + 1)),
            f"naive (fallback: {reason})")


def _fit_task(task):
    return ets_series_forecast(*task)


def _one_blas_thread():
    """Pool initializer: one BLAS / OpenMP thread per worker (the workers are the parallelism;
    a forked worker otherwise starts the parent's BLAS thread count, and workers × threads
    spinning on the same cores made the fits twice as slow as one process)."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(1)


def _fit_all(targets, h: int, m: int, workers: int) -> list:
    from threadpoolctl import threadpool_limits

    tasks = [(y, h, m) for y in targets]
    if workers == 1:
        with threadpool_limits(1):  # the fits' linear algebra is tiny: threads only cost
            return [_fit_task(t) for t in tasks]
    with multiprocessing.get_context("fork").Pool(workers, initializer=_one_blas_thread) as pool:
        return pool.map(_fit_task, tasks, chunksize=max(1, len(tasks) // (4 * workers)))


def ets_forecasts(train, prediction_length: int, season_length: int,
                  quantiles: Sequence[float] | None = None,
                  workers: Optional[int] = None) -> tuple[list, dict]:
    """One gluonts ``QuantileForecast`` per series of the training panel ``train`` (a
    :class:`~opacus_structured.forecasting.data.Panel`), for the ``prediction_length`` steps
    after each series' training part, i.e. the test steps of
    :func:`~opacus_structured.forecasting.data.train_test_split`.

    Returns ``(forecasts, summary)``. ``summary`` has ``"models"`` (how many series used each
    spec, fallbacks grouped as ``"naive (fallback)"``), ``"fallbacks"`` (``[(item_id, spec)]``
    for every fallback), ``"predictive"`` (how the quantiles are formed) and ``"workers"``
    (processes used, :func:`ets_workers`; the forecasts do not depend on it).
    """
    from gluonts.model.forecast import QuantileForecast
    from scipy.stats import norm

    reason = ets_unavailable_reason()
    if reason is not None:
        raise ImportError(reason)
    qs = tuple(QUANTILES if quantiles is None else quantiles)
    for q in qs:
        if not 0.0 < float(q) < 1.0:
            raise ValueError(f"quantiles must lie in (0, 1), got {q}")
    h = check_int("prediction_length", prediction_length, minimum=1)
    z = norm.ppf(np.asarray(qs, dtype=np.float64))[:, None]
    keys = [str(q) for q in qs] + ["mean"]
    check_int("season_length", season_length, minimum=1)
    forecasts, counts, fallbacks = [], collections.Counter(), []
    workers = ets_workers(len(train.targets), workers)
    fits = _fit_all(train.targets, h, season_length, workers)
    for (mean, std, spec), y, start, item in zip(fits, train.targets, train.starts,
                                                 train.item_ids, strict=True):
        if spec.startswith("naive"):
            counts["naive (fallback)"] += 1
            fallbacks.append((str(item), spec))
        else:
            counts[spec] += 1
        arrays = np.vstack([mean[None, :] + z * std[None, :], mean[None, :]])
        forecasts.append(QuantileForecast(arrays.astype(np.float32), start_date=start + len(y),
                                          forecast_keys=keys, item_id=item))
    summary = {"models": dict(sorted(counts.items())), "fallbacks": fallbacks,
               "predictive": "Gaussian N(mu_h, v_h) with statsmodels' exact ETS forecast "
                             "variance (additive errors); quantiles mu_h + z_tau sqrt(v_h)",
               "workers": workers}
    if not math.isfinite(sum(float(np.sum(f.forecast_array)) for f in forecasts)):
        raise RuntimeError("ETS produced a non-finite forecast")
    return forecasts, summary


def ets_reference(train, series: Sequence, prediction_length: int, season_length: int,
                  quantiles: Sequence[float] | None = None,
                  workers: Optional[int] = None) -> dict:
    """Fit :func:`ets_forecasts` on ``train`` and score it against ``series`` (the ground
    truth from ``make_evaluation_predictions`` on the test panel, in the same order) with
    :func:`~opacus_structured.forecasting.metrics.evaluate_forecasts` and the same season
    length as every other row. Returns the metrics, the summary of
    :func:`ets_forecasts`, ``"private": False``, the note and the fit time."""
    import time

    t0 = time.perf_counter()
    forecasts, summary = ets_forecasts(train, prediction_length, season_length, quantiles,
                                       workers)
    metrics = evaluate_forecasts(forecasts, list(series),
                                 QUANTILES if quantiles is None else quantiles,
                                 season_length=season_length)
    return {**metrics, **summary, "private": False, "note": ETS_NOT_PRIVATE_NOTE,
            "seconds": time.perf_counter() - t0, "forecasts": forecasts}
