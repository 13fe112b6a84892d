r"""gluonts' ``Evaluator`` aggregate (``mean_wQuantileLoss``, ``MASE``, ``MSE``, ``ND``),
computed with numpy over all series at once.

:func:`score_forecasts` returns the four numbers that
``gluonts.evaluation.Evaluator(quantiles=..., seasonality=m, num_workers=0)`` (default
``aggregation_strategy=aggregate_no_nan``, ``ignore_invalid_values=True``,
``allow_nan_forecast=False``) aggregates, with the same floating-point operations in the same
dtypes, so the results agree to rounding (the tests ask for a relative difference ≤ 1e-9; most
are bit-identical). The evaluator spends its time in per-series pandas and masked-array work;
here the series are grouped by shape and dtype and every group is scored in one pass.

**Per series** (gluonts 0.17, ``evaluation/_base.py`` and ``evaluation/metrics.py``). Let
:math:`y_{1..h}` be the series at the forecast's index (``series.loc[forecast.index]``) and
:math:`x_{1..L}` the series up to one step before the forecast start (``series.loc[:start -
1]``). Non-finite values of :math:`y` and :math:`x` are masked (left out of sums and counts);
:math:`V` is the set of finite target steps, :math:`n = |V|`. Quantile forecasts
:math:`\hat y^{(\tau)}` come from ``forecast.quantile(τ)`` (for a ``SampleForecast`` of
:math:`S` sample paths: the sorted samples' row :math:`\mathrm{round}((S-1)\tau)`, no
interpolation) and the mean forecast :math:`\bar y` from ``forecast.mean`` (for a
``SampleForecast``: the samples' mean). Then

.. math::

    m' &= m \text{ if } m < L \text{ else } 1 \quad (m = \text{seasonality}, \text{ or
          gluonts' } \texttt{get\_seasonality(freq)} \text{ when not given}),\\
    \mathrm{se} &= \operatorname{mean}_{t}\, |x_t - x_{t+m'}| \quad (t = 1..L-m',
          \text{ pairs with both values finite}),\\
    \mathrm{MASE} &= \tfrac{1}{n} \textstyle\sum_{V} |y_t - \hat y^{(0.5)}_t| \,/\, \mathrm{se},
    \qquad \mathrm{MSE} = \tfrac{1}{n} \textstyle\sum_{V} (y_t - \bar y_t)^2,\\
    \mathrm{AE} &= \textstyle\sum_{V} |y_t - \hat y^{(0.5)}_t|, \qquad
    \mathrm{ATS} = \textstyle\sum_{V} |y_t|, \qquad
    \mathrm{QL}_\tau = 2 \textstyle\sum_{V} |(\hat y^{(\tau)}_t - y_t)
                       (\mathbb 1[y_t \le \hat y^{(\tau)}_t] - \tau)|.

Sums run in the values' dtype (float32 for gluonts datasets); a mean is that sum, in float64,
divided by the count. A series with no finite target step has NaN for every metric; a
seasonal error with no finite pair is NaN. Division by zero is not guarded (gluonts runs it
under ``np.errstate(divide="ignore", invalid="ignore")``): a **constant past**
(:math:`\mathrm{se} = 0`) gives :math:`\mathrm{MASE} = +\infty` for that series, or NaN when
its forecast is also exact (0/0).

**Aggregate** over the :math:`N` series (pandas' reductions with ``skipna=True``: NaN is left
out, ``inf`` is kept):

.. math::

    \mathrm{MASE} = \operatorname{nanmean}_i \mathrm{MASE}_i, \quad
    \mathrm{MSE} = \operatorname{nanmean}_i \mathrm{MSE}_i, \quad
    \mathrm{ND} = \frac{\sum_i \mathrm{AE}_i}{\sum_i \mathrm{ATS}_i}, \quad
    \mathrm{mean\_wQuantileLoss} = \frac{1}{|Q|} \sum_{\tau \in Q}
        \frac{\sum_i \mathrm{QL}_{\tau, i}}{\sum_i \mathrm{ATS}_i}.

So a single constant series makes the aggregate MASE ``inf`` (``nan`` if every finite per-series
value is gone; an all-NaN column gives NaN), while ND and the weighted quantile loss, which are
ratios of sums, stay finite. ND is recomputed from the sums, not averaged over series.

Like the evaluator, a forecast whose mean or any requested quantile holds NaN raises
``ValueError("Forecast contains NaN values.")``, and a forecast index outside its series raises
(``ValueError`` here, ``AssertionError`` in gluonts). Inputs are univariate: forecasts with 2-d
sample paths (``SampleForecast``) or any gluonts ``Forecast`` with ``quantile`` and ``mean``
(``QuantileForecast``, ``DistributionForecast``: asked for its quantiles one level at a
time, except gluonts' Student t, possibly affinely scaled, whose quantiles of all series and
levels come from one elementwise scipy call); series are pandas ``DataFrame`` s of one
column (as ``make_evaluation_predictions`` yields) or ``Series``. float16 values are not
mirrored (gluonts sums them in float32).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from .warning_filters import known_harmless_warnings_filtered

__all__ = ["score_forecasts"]

_NAN_FORECAST = "Forecast contains NaN values."


def _groups(keys: list) -> list[tuple[object, np.ndarray]]:
    """``[(key, indices)]`` of equal keys, in order of first appearance."""
    out: dict = {}
    for i, key in enumerate(keys):
        out.setdefault(key, []).append(i)
    return [(key, np.asarray(idx, dtype=np.intp)) for key, idx in out.items()]


def _values(series):
    """The 1-d values of a univariate pandas ``Series`` / one-column ``DataFrame``."""
    if getattr(series, "ndim", None) == 2:
        if series.shape[1] != 1:
            raise ValueError(f"series must be univariate, got a frame with {series.shape[1]} "
                             "columns")
        return series.to_numpy()[:, 0]
    return series.to_numpy()


def _cut(series, forecast, h: int):
    """``(pred_target, past_data)``: the series at the forecast's index and up to one step
    before its start (gluonts' ``Evaluator.extract_pred_target`` / ``extract_past_data``)."""
    import pandas as pd

    index = series.index
    start = forecast.start_date
    if isinstance(index, pd.PeriodIndex) and index.freq == start.freq and len(index):
        # a regular PeriodIndex: positions from ordinals, no per-series pandas indexing
        step = start.freq.n
        ords = index.asi8
        first = int(ords[0])
        if step > 0 and int(ords[-1]) - first == step * (len(ords) - 1) and (
                len(ords) < 2 or bool(np.all(np.diff(ords) == step))):
            delta = int(start.ordinal) - first
            if delta % step == 0:
                pos = delta // step
                if pos < 0 or pos + h > len(ords):
                    raise ValueError(
                        f"the forecast's index (start {start}, {h} steps) lies outside its "
                        f"series' index ({index[0]} .. {index[-1]})")
                values = _values(series)
                return values[pos:pos + h], values[:max(pos, 0)]
    # anything else: gluonts' own extraction (label-based, asserts containment)
    from gluonts.evaluation import Evaluator

    try:
        return (np.array(Evaluator.extract_pred_target(series, forecast)),
                np.array(Evaluator.extract_past_data(series, forecast)))
    except AssertionError as err:
        raise ValueError(str(err)) from None


def _sample_forecast_class():
    from gluonts.model.forecast import SampleForecast

    return SampleForecast


def _is_plain_sample_forecast(forecast, sample_cls) -> bool:
    """A ``SampleForecast`` (2-d samples) whose ``quantile``/``mean`` are gluonts' own."""
    cls = type(forecast)
    return (isinstance(forecast, sample_cls) and cls.quantile is sample_cls.quantile
            and cls.mean is sample_cls.mean and np.ndim(forecast.samples) == 2)


def _forecast_arrays(forecasts, qvals, sample_cls):
    """Per forecast: ``(median, mean or None, [quantile arrays])`` as gluonts reads them.

    ``SampleForecast`` s of equal sample shape and dtype are stacked: one sort and one mean
    per group (the same values as ``forecast.quantile`` / ``forecast.mean``). Any other
    forecast is asked through its own ``quantile`` and ``mean``.
    """
    n = len(forecasts)
    median: list = [None] * n
    mean: list = [None] * n
    quants: list = [None] * n
    plain = [_is_plain_sample_forecast(f, sample_cls) for f in forecasts]
    keys = [(f.samples.shape, f.samples.dtype) if p else None
            for f, p in zip(forecasts, plain, strict=True)]
    for key, idx in _groups(keys):
        if key is None:
            continue
        (num_samples, _), _ = key
        stack = np.stack([forecasts[i].samples for i in idx])  # (g, S, h)
        means = np.mean(stack, axis=1)
        if np.isnan(means).any():  # a NaN sample makes the mean NaN (gluonts validates it)
            raise ValueError(_NAN_FORECAST)
        ordered = np.sort(stack, axis=1)
        rows = {q: int(np.round((num_samples - 1) * q)) for q in (*qvals, 0.5)}
        for j, i in enumerate(idx):
            mean[i] = means[j]
            median[i] = ordered[j, rows[0.5]]
            quants[i] = [ordered[j, rows[q]] for q in qvals]
    levels = [*qvals, 0.5] if 0.5 not in qvals else list(qvals)
    chains = [None if p else _student_t_chain(f) for f, p in zip(forecasts, plain, strict=True)]
    tables: dict = {}
    for key, idx in _groups([None if c is None else f.shape[0]
                             for f, c in zip(forecasts, chains, strict=True)]):
        if key is not None:
            tables.update(_student_t_quantiles(forecasts, idx, chains, levels))
    for i, forecast in enumerate(forecasts):
        if plain[i]:
            continue
        try:
            mean[i] = getattr(forecast, "mean", None)
        except NotImplementedError:
            mean[i] = None
        table = tables.get(i)
        if table is None:  # ask the forecast, one level at a time
            table = [np.asarray(forecast.quantile(q)) for q in levels]
        quants[i] = list(table[:len(qvals)])
        median[i] = table[levels.index(0.5)]
        if mean[i] is not None:
            mean[i] = np.asarray(mean[i])
        # gluonts' validate_forecast: the mean and the requested quantiles
        if (mean[i] is not None and np.isnan(mean[i]).any()) or any(
                np.isnan(a).any() for a in quants[i]):
            raise ValueError(_NAN_FORECAST)
    return median, mean, quants


def _student_t_chain(forecast):
    """``(layers, base)`` when ``forecast`` is a torch ``DistributionForecast`` of gluonts'
    ``StudentT``, bare or under affine ``TransformedDistribution`` layers (gluonts'
    ``AffineTransformed``: DLinear's default output), over a 1-d horizon; else ``None``."""
    import sys

    module = sys.modules.get("gluonts.torch.model.forecast")
    if module is None or type(forecast) is not module.DistributionForecast:
        return None
    from gluonts.torch.distributions.studentT import StudentT
    from torch.distributions import AffineTransform, TransformedDistribution

    layers, dist = [], forecast.distribution
    while isinstance(dist, TransformedDistribution):
        if (type(dist).icdf is not TransformedDistribution.icdf
                or not all(type(t) is AffineTransform for t in dist.transforms)):
            return None
        layers.append(dist)
        dist = dist.base_dist
    if type(dist) is not StudentT or len(forecast.shape) != 1:
        return None
    return layers, dist


def _student_t_quantiles(forecasts, idx, chains, levels) -> dict:
    """``{i: (len(levels), h) array}``: ``forecast.quantile`` at every level for the Student t
    forecasts ``idx`` (one horizon ``h``), with one scipy call for all of them.

    The same operations as ``DistributionForecast.quantile`` → ``TransformedDistribution.icdf``
    → gluonts' ``StudentT.icdf`` (``scipy.stats.t.ppf`` of the frozen distribution, which is
    ``t.ppf(q, df, loc, scale)``, elementwise) → the affine maps, on the same float32 level
    tensor, only broadcast over levels and stacked over series.
    """
    import torch
    from scipy.stats import t as student_t

    values, params, devices = [], [], []
    for i in idx:
        layers, base = chains[i]
        device = base.loc.device
        v = torch.tensor(levels, device=device).reshape(-1, 1)
        for layer in layers:  # outermost first, as the nested icdf calls run
            v = layer._monotonize_cdf(v)
        h = forecasts[i].shape[0]
        values.append(np.broadcast_to(v.detach().cpu().numpy(), (len(levels), h)))
        params.append([np.broadcast_to(p.detach().cpu().numpy(), (h,))
                       for p in (base.df, base.loc, base.scale)])
        devices.append((device, v.dtype))
    df, loc, scale = (np.stack([p[k] for p in params])[:, None, :] for k in range(3))
    table = student_t.ppf(np.stack(values), df, loc=loc, scale=scale)
    out = {}
    for j, i in enumerate(idx):
        layers, _ = chains[i]
        device, dtype = devices[j]
        x = torch.tensor(table[j], device=device, dtype=dtype)
        for layer in reversed(layers):  # innermost transforms first
            for transform in layer.transforms:
                x = transform(x)
        out[i] = x.cpu().numpy()
    return out


def _masked_sum(values: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Row sums over the valid entries (numpy's ``MaskedArray.sum``: ``filled(0).sum``)."""
    return np.where(valid, values, 0).sum(axis=-1)


def _masked_mean(total: np.ndarray, count: np.ndarray) -> np.ndarray:
    """``MaskedArray.mean`` from its row sum: ``sum * 1. / count``; NaN where nothing is
    valid (numpy gives ``masked``, which gluonts' frame turns into NaN)."""
    out = np.asarray(total * 1. / count, dtype=np.float64)
    out[count == 0] = np.nan
    return out


def _seasonal_errors(pasts: list, seasonalities: list) -> np.ndarray:
    """gluonts' ``calculate_seasonal_error`` of every series, grouped by length, dtype and
    lag."""
    out = np.empty(len(pasts), dtype=np.float64)
    keys = []
    for past, m in zip(pasts, seasonalities, strict=True):
        lag = m if m < len(past) else 1
        keys.append((len(past), past.dtype, lag))
    for (length, _, lag), idx in _groups(keys):
        if length == 0:
            out[idx] = np.nan
            continue
        stack = np.stack([pasts[i] for i in idx])  # (g, L)
        y_t, y_tm = stack[:, :-lag], stack[:, lag:]
        valid = np.isfinite(y_t) & np.isfinite(y_tm)
        total = _masked_sum(np.abs(y_t - y_tm), valid)
        out[idx] = _masked_mean(total, valid.sum(axis=-1))
    return out


def _nansum(values: np.ndarray) -> np.float64:
    """pandas' ``Series.sum(skipna=True)`` of a float64 column: NaN as 0, then numpy's sum."""
    return np.where(np.isnan(values), 0.0, values).sum()


def _nanmean(values: np.ndarray) -> float:
    """pandas' ``Series.mean(skipna=True)`` of a float64 column (``inf`` kept)."""
    missing = np.isnan(values)
    count = np.float64(missing.size - missing.sum())
    total = np.where(missing, 0.0, values).sum()
    return total / count if count > 0 else np.nan


def score_forecasts(forecasts: Sequence, series: Sequence,
                    quantiles: Sequence[float] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9),
                    season_length: Optional[int] = None, *, return_items: bool = False):
    """gluonts' ``Evaluator`` aggregate ``{"mean_wQuantileLoss", "MASE", "MSE", "ND"}`` (floats)
    of ``forecasts`` against ``series`` (module docstring for the formulas).

    ``series`` are the ground-truth pandas objects matching ``forecasts`` one to one (as
    ``make_evaluation_predictions`` yields them); ``quantiles`` are floats or gluonts quantile
    strings (``"0.1"``, ``"p10"``); ``season_length`` is the MASE lag ``m`` (gluonts'
    ``get_seasonality`` of each forecast's frequency when ``None`` or 0).

    With ``return_items=True`` returns ``(aggregate, items)``: ``items`` maps ``"MASE"``,
    ``"seasonal_error"``, ``"MSE"``, ``"abs_error"``, ``"abs_target_sum"`` and
    ``"QuantileLoss[q]"`` (gluonts' column names) to float64 arrays, one value per series in
    input order: the columns of the evaluator's per-series frame.
    """
    from gluonts.model.forecast import Quantile

    forecasts, series = list(forecasts), list(series)
    if len(forecasts) != len(series) or not forecasts:
        raise ValueError(f"need one forecast per series, got {len(forecasts)} forecasts and "
                         f"{len(series)} series")
    qvals = [Quantile.parse(q).value for q in quantiles]
    if not qvals:
        raise ValueError("quantiles must not be empty")
    if season_length and season_length < 1:
        raise ValueError(f"season_length must be >= 1, got {season_length}")
    n = len(forecasts)

    median, mean, quants = _forecast_arrays(forecasts, qvals, _sample_forecast_class())

    targets, pasts, seasonalities = [], [], []
    lag_of_freq: dict = {}
    for ts, forecast, med in zip(series, forecasts, median, strict=True):
        if np.ndim(med) != 1:
            raise ValueError(f"forecasts must be univariate, got quantiles of shape "
                             f"{np.shape(med)}")
        y, past = _cut(ts, forecast, len(med))
        targets.append(np.atleast_1d(y))
        pasts.append(np.atleast_1d(past))
        if season_length:
            seasonalities.append(int(season_length))
        else:
            freq = forecast.start_date.freqstr
            if freq not in lag_of_freq:
                lag_of_freq[freq] = _gluonts_seasonality(freq)
            seasonalities.append(lag_of_freq[freq])

    mse = np.full(n, np.nan)
    abs_error = np.empty(n)
    abs_target_sum = np.empty(n)
    mase = np.empty(n)
    qloss = np.empty((len(qvals), n))
    keys = [(len(y), y.dtype, med.dtype, None if mu is None else mu.dtype,
             tuple(a.dtype for a in qs))
            for y, med, mu, qs in zip(targets, median, mean, quants, strict=True)]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        seasonal_error = _seasonal_errors(pasts, seasonalities)
        for (h, _, _, mean_dtype, _), idx in _groups(keys):
            y = np.stack([targets[i] for i in idx])  # (g, h)
            if y.shape[1] != h or any(len(median[i]) != h for i in idx):
                raise ValueError("a forecast and its target differ in length")
            valid = np.isfinite(y)
            count = valid.sum(axis=-1)
            none = count == 0
            med = np.stack([median[i] for i in idx])
            err = _masked_sum(np.abs(y - med), valid)
            mase[idx] = _masked_mean(err, count) / seasonal_error[idx]
            abs_error[idx] = np.where(none, np.nan, err)
            abs_target_sum[idx] = np.where(none, np.nan, _masked_sum(np.abs(y), valid))
            if mean_dtype is not None:
                mu = np.stack([mean[i] for i in idx])
                mse[idx] = _masked_mean(_masked_sum(np.square(y - mu), valid), count)
            for k, q in enumerate(qvals):
                fq = np.stack([quants[i][k] for i in idx])
                loss = 2 * _masked_sum(np.abs((fq - y) * ((y <= fq) - q)), valid)
                qloss[k, idx] = np.where(none, np.nan, loss)

        total_abs_target = _nansum(abs_target_sum)
        weighted = [_nansum(qloss[k]) / total_abs_target for k in range(len(qvals))]
        aggregate = {"mean_wQuantileLoss": float(np.array(weighted).mean()),
                     "MASE": float(_nanmean(mase)),
                     "MSE": float(_nanmean(mse)),
                     "ND": float(_nansum(abs_error) / total_abs_target)}
    if not return_items:
        return aggregate
    items = {"MASE": mase, "seasonal_error": seasonal_error, "MSE": mse,
             "abs_error": abs_error, "abs_target_sum": abs_target_sum}
    for k, q in enumerate(quantiles):
        items[f"QuantileLoss[{Quantile.parse(q)}]"] = qloss[k]
    return aggregate, items


def _gluonts_seasonality(freq: str) -> int:
    """gluonts' ``get_seasonality`` (its pandas alias warnings filtered as elsewhere)."""
    from gluonts.time_feature import get_seasonality

    with known_harmless_warnings_filtered():
        lag = get_seasonality(freq)
    return int(lag)
