"""Time gluonts' ``Evaluator`` against ``fast_metrics.score_forecasts`` (issue 41).

The main job (``opacus-structured forecast``) scores six sets of forecasts of the bundled US
employment panel (148 monthly series, 100 sample paths, horizon 12) with
``metrics.evaluate_forecasts``, i.e. gluonts' ``Evaluator(quantiles=0.1..0.9, num_workers=0,
seasonality=12)``. This script builds forecasts of that shape without training a model (the
seasonal-naive path plus Gaussian noise scaled to each series' seasonal step, float32, as a
gluonts predictor returns them), then times, in one process and interleaved:

* ``gluonts``: ``metrics.evaluate_forecasts`` (the evaluator, as the job calls it);
* ``fast``: ``fast_metrics.score_forecasts`` on the same forecasts (fresh objects each call,
  so no sorted-sample or mean cache is shared with the evaluator).

``--kind`` picks the forecast objects: ``sample`` (``SampleForecast``: the DP model with the
zero-shot mixture, seasonal naive), ``quantile`` (``QuantileForecast``: the ETS row) or
``distribution`` (torch ``DistributionForecast`` of a scaled Student t: DLinear without the
mixture). ``sample`` is vectorised end to end and the Student t quantiles of all series come
from one scipy call; a ``QuantileForecast`` is asked for its levels one series at a time, as
gluonts does (fewer times).

It prints the median and minimum seconds per call, the ratio of medians, the estimated
saving per job (six calls) and the largest relative difference of the four numbers.

    python benchmarks/forecast_metrics.py [--series 148] [--samples 100] [--horizon 12] \\
        [--repeats 3] [--kind sample|quantile|distribution] [--synthetic] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import numpy as np
from _machine import cpu_name  # benchmarks/_machine.py (scripts run from benchmarks/)

KEYS = {"crps": "mean_wQuantileLoss", "mase": "MASE", "mse": "MSE", "nd": "ND"}



def _panel(num_series: int, synthetic: bool, seed: int):
    """``(targets, starts)``: the bundled panel's first ``num_series`` series (cycled when more
    are asked for), or random monthly series when ``synthetic``."""
    import pandas as pd

    rng = np.random.default_rng(seed)
    if synthetic:
        targets, starts = [], []
        for _ in range(num_series):
            length = int(rng.integers(225, 1000))
            t = np.arange(length)
            level = 10 ** rng.uniform(1, 4)
            targets.append((level * (5 + np.sin(2 * np.pi * t / 12)
                                     + 0.2 * rng.standard_normal(length))).astype(np.float32))
            starts.append(pd.Period("1939-01", "M"))
        return targets, starts
    from opacus_structured.forecasting.data import load_us_employment

    panel = load_us_employment()
    pick = [i % len(panel) for i in range(num_series)]
    return [panel.targets[i] for i in pick], [panel.starts[i] for i in pick]


def _forecasts(targets, starts, num_samples: int, horizon: int, seed: int):
    """Series as one-column frames (``make_evaluation_predictions``' form) and sample
    forecasts of their last ``horizon`` steps (as raw sample arrays)."""
    import pandas as pd

    rng = np.random.default_rng(seed)
    series, samples, begins = [], [], []
    for y, start in zip(targets, starts, strict=True):
        index = pd.period_range(start, periods=len(y), freq=start.freq)
        series.append(pd.DataFrame(np.asarray(y, dtype=np.float32), index=index))
        past = np.asarray(y[:-horizon], dtype=np.float64)
        lag = 12 if len(past) > 12 else 1
        naive = np.resize(past[-lag:], horizon)
        scale = np.mean(np.abs(past[lag:] - past[:-lag])) + 1e-6
        samples.append((naive + scale * rng.standard_normal((num_samples, horizon))
                        ).astype(np.float32))
        begins.append(index[-horizon])
    return series, samples, begins


def _fresh(samples, begins, kind: str, quantiles):
    """New forecast objects (no cache shared between calls) of ``kind``: ``sample`` (a
    ``SampleForecast``), ``quantile`` (a ``QuantileForecast`` of the samples' quantiles and
    mean, like the ETS row) or ``distribution`` (a torch ``DistributionForecast``: gluonts'
    ``StudentTOutput`` with a scale, like DLinear's)."""
    from gluonts.model.forecast import QuantileForecast, SampleForecast

    if kind == "sample":
        return [SampleForecast(s, start_date=b) for s, b in zip(samples, begins, strict=True)]
    if kind == "quantile":
        keys = [str(q) for q in quantiles] + ["mean"]
        return [QuantileForecast(np.vstack([np.quantile(s, quantiles, axis=0), s.mean(0)])
                                 .astype(np.float32), start_date=b, forecast_keys=keys)
                for s, b in zip(samples, begins, strict=True)]
    import torch
    from gluonts.torch.distributions import StudentTOutput
    from gluonts.torch.model.forecast import DistributionForecast

    out = StudentTOutput()
    forecasts = []
    for s, b in zip(samples, begins, strict=True):
        scale = torch.tensor(float(np.abs(s).mean()) + 1e-3)
        loc = torch.tensor(s.mean(0)) / scale
        sd = torch.tensor(s.std(0)) / scale + 1e-3
        distr = out.distribution((torch.full_like(loc, 5.0), loc, sd),
                                 scale=scale.expand_as(loc))
        forecasts.append(DistributionForecast(distr, start_date=b))
    return forecasts


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--series", type=int, default=148)
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--horizon", type=int, default=12)
    ap.add_argument("--season-length", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed calls of each (gluonts takes seconds per call)")
    ap.add_argument("--synthetic", action="store_true",
                    help="random monthly series instead of the bundled US employment panel")
    ap.add_argument("--kind", choices=("sample", "quantile", "distribution"), default="sample",
                    help="forecast objects: SampleForecast (DP mixture, seasonal naive), "
                         "QuantileForecast (ETS) or DistributionForecast (DLinear's Student t)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the results")
    args = ap.parse_args(argv)

    from opacus_structured.forecasting.fast_metrics import score_forecasts
    from opacus_structured.forecasting.metrics import QUANTILES, evaluate_forecasts

    load_before = os.getloadavg()
    targets, starts = _panel(args.series, args.synthetic, args.seed)
    series, samples, begins = _forecasts(targets, starts, args.samples, args.horizon,
                                         args.seed + 1)

    def run_gluonts(forecasts):
        return evaluate_forecasts(forecasts, series, QUANTILES, args.season_length)

    def run_fast(forecasts):
        return score_forecasts(forecasts, series, QUANTILES, args.season_length)

    for fn in (run_gluonts, run_fast):  # warm-up: imports, caches
        fn(_fresh(samples, begins, args.kind, QUANTILES))
    times = {"gluonts": [], "fast": []}
    results = {}
    for _ in range(max(1, args.repeats)):  # interleaved, so load changes hit both
        for name, fn in (("gluonts", run_gluonts), ("fast", run_fast)):
            forecasts = _fresh(samples, begins, args.kind, QUANTILES)  # built, not timed
            t0 = time.perf_counter()
            results[name] = fn(forecasts)
            times[name].append(time.perf_counter() - t0)
    load_after = os.getloadavg()

    rel = {short: abs(results["fast"][long] - results["gluonts"][short])
           / max(abs(results["gluonts"][short]), 1e-300) for short, long in KEYS.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_name(), "cores": os.cpu_count(),
        "load_average_1min": {"before": load_before[0], "after": load_after[0]},
        "panel": "synthetic" if args.synthetic else "US employment (bundled)",
        "kind": args.kind,
        "series": args.series, "samples": args.samples, "horizon": args.horizon,
        "season_length": args.season_length, "repeats": args.repeats,
        "seconds": times, "median_s": med, "ratio_gluonts_over_fast": med["gluonts"] / med["fast"],
        "saved_per_job_s (6 calls)": 6 * (med["gluonts"] - med["fast"]),
        "metrics_gluonts": results["gluonts"],
        "metrics_fast": {short: results["fast"][long] for short, long in KEYS.items()},
        "max_relative_difference": max(rel.values()),
    }
    print(f"{args.series} series x {args.samples} samples x horizon {args.horizon} "
          f"({out['panel']}, {args.kind} forecasts), {out['cpu']}, {out['cores']} cores, load {load_before[0]:.1f} "
          f"-> {load_after[0]:.1f}")
    print(f"{'method':<10} {'median [s]':>11} {'min [s]':>9}")
    for name in ("gluonts", "fast"):
        print(f"{name:<10} {med[name]:>11.4f} {min(times[name]):>9.4f}")
    print(f"ratio gluonts / fast: {out['ratio_gluonts_over_fast']:.1f}x; saved per job "
          f"(6 calls): {out['saved_per_job_s (6 calls)']:.1f} s")
    print("metrics (fast): " + ", ".join(f"{k} {v:.6g}" for k, v in out["metrics_fast"].items())
          + f"; max relative difference to gluonts {out['max_relative_difference']:.2e}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
            fh.write("\n")
    return out


if __name__ == "__main__":
    main()
