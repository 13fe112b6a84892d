"""Wall time of the ``forecast`` command's ETS reference row on the bundled panel (issue 41,
item 6), one process against the forked workers of
:func:`~opacus_structured.forecasting.ets.ets_forecasts`, and the check that both give the
same forecasts.

Each run is a fresh interpreter (so the statsmodels import, which the row pays in the main
job, is counted): ``--workers 1`` and the default (:func:`~opacus_structured.forecasting.ets.
ets_workers`). Prints the import time, the fit-and-score time, CRPS and MASE, the largest
difference between the two runs' quantiles, and the 1-minute load average (a busy machine
inflates every number)::

    python benchmarks/ets_reference.py [--prediction-length 12] [--json out.json]

``--statsforecast`` adds statsforecast's ``AutoETS`` (model ``AAA``, damped; same scaling,
quantiles from its prediction intervals) with per-series MASE / CRPS against statsmodels; it
needs ``pip install statsforecast`` (not a dependency of the package).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from _machine import cpu_name  # benchmarks/_machine.py (scripts run from benchmarks/)

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import numpy as np
from opacus_structured.forecasting.data import load_us_employment, train_test_split
from opacus_structured.forecasting.user_data import load_panel
from opacus_structured.forecasting.baselines import seasonal_naive_predictor
from opacus_structured.forecasting.metrics import QUANTILES, evaluate_forecasts
from gluonts.evaluation import make_evaluation_predictions
mode, h, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
panel, _ = load_panel(load_us_employment(), min_length=2 * h)
train, test = train_test_split(panel, h)
_, ts = make_evaluation_predictions(test.to_gluonts(), seasonal_naive_predictor(h, "M"),
                                    num_samples=1)
truth = list(ts)
t1 = time.perf_counter()
if mode == "statsforecast":
    from gluonts.model.forecast import QuantileForecast
    from statsforecast.models import AutoETS
    t_import = time.perf_counter() - t1
    t2 = time.perf_counter()
    keys = [str(q) for q in QUANTILES]
    fcs = []
    for y, start, item in zip(train.targets, train.starts, train.item_ids):
        y = np.asarray(y, float)
        s = float(np.mean(np.abs(y))) or 1.0
        f = AutoETS(season_length=12, model="AAA", damped=True).fit(y / s).predict(
            h, level=[20, 40, 60, 80])
        q = np.vstack([f["lo-80"], f["lo-60"], f["lo-40"], f["lo-20"], f["mean"], f["hi-20"],
                       f["hi-40"], f["hi-60"], f["hi-80"]]) * s
        fcs.append(QuantileForecast(q.astype(np.float32), start_date=start + len(y),
                                    forecast_keys=keys, item_id=item))
    metrics = evaluate_forecasts(fcs, truth, season_length=12)
    workers = 1
else:
    from opacus_structured.forecasting.ets import ets_reference, ets_unavailable_reason
    assert ets_unavailable_reason() is None  # imports statsmodels' ETSModel
    t_import = time.perf_counter() - t1
    t2 = time.perf_counter()
    ref = ets_reference(train, truth, h, 12, workers=1 if mode == "serial" else None)
    fcs, metrics, workers = ref["forecasts"], ref, ref["workers"]
t_fit = time.perf_counter() - t2
items = [evaluate_forecasts([f], [s], season_length=12) for f, s in zip(fcs, truth)]
np.save(out + ".npy", np.stack([f.forecast_array for f in fcs]))
json.dump({"mode": mode, "workers": workers, "import_s": t_import, "fit_and_score_s": t_fit,
           "process_s": time.perf_counter() - t0, "crps": metrics["crps"],
           "mase": metrics["mase"], "series": len(fcs),
           "item_mase": [m["mase"] for m in items], "item_crps": [m["crps"] for m in items]},
          open(out, "w"))
"""


def _run(mode: str, h: int, tmp: str) -> dict:
    out = os.path.join(tmp, f"{mode}.json")
    subprocess.run([sys.executable, "-c", CHILD, mode, str(h), out], check=True)
    with open(out) as fh:
        res = json.load(fh)
    res["load_1min"] = os.getloadavg()[0]
    return res


def main(argv=None) -> int:
    import numpy as np

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prediction-length", type=int, default=12)
    p.add_argument("--statsforecast", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    modes = ["serial", "parallel"] + (["statsforecast"] if args.statsforecast else [])
    with tempfile.TemporaryDirectory() as tmp:
        res = {m: _run(m, args.prediction_length, tmp) for m in modes}
        arrays = {m: np.load(os.path.join(tmp, f"{m}.json.npy")) for m in modes}
    print(f"{'run':<14} {'workers':>7} {'import [s]':>10} {'fit+score [s]':>13} "
          f"{'CRPS':>8} {'MASE':>7} {'load':>5}")
    for m, r in res.items():
        print(f"{m:<14} {r['workers']:>7} {r['import_s']:>10.2f} {r['fit_and_score_s']:>13.2f} "
              f"{r['crps']:>8.5f} {r['mase']:>7.4f} {r['load_1min']:>5.2f}")
    diff = float(np.max(np.abs(arrays["serial"] - arrays["parallel"])))
    print(f"largest |serial - parallel| quantile difference: {diff:g}")
    summary = {"runs": res, "serial_vs_parallel_max_abs_diff": diff,
               "cpu": cpu_name(), "cpus": os.cpu_count()}
    if args.statsforecast:
        a, b = np.array(res["serial"]["item_mase"]), np.array(res["statsforecast"]["item_mase"])
        rel = np.abs(a - b) / a
        print(f"statsforecast vs statsmodels, per-series MASE: median relative difference "
              f"{np.median(rel):.2f}, > 10 % on {int(np.sum(rel > 0.1))} of {a.size} series")
        summary["statsforecast_item_mase_rel_diff_median"] = float(np.median(rel))
        summary["statsforecast_item_mase_over_10pct"] = int(np.sum(rel > 0.1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
