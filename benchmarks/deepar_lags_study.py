"""DeepAR's lags at frequencies other than monthly, compared on PUBLIC synthetic panels.

DeepAR reads the lags ``[1, 2, 3, 12, 13]`` at every frequency (``estimators.build_estimator``):
one year back for monthly data and three years (a whole number of seasons) for quarterly data,
but half a day back for hourly data. This script compares them (``monthly``) with lags one
season back, ``[1, 2, 3, m, m + 1]`` (``one-season``). It uses the synthetic study panel of
``forecast_recipe.py`` generated at another frequency (148 series, lengths 225–969, seed 1, the
shifted distribution; public). Each lag set starts from public weights pretrained with it, and
is run with DeepAR's recipe at ε = 1 (δ = 1e-7) and as the zero-shot model. Score:
(CRPS/SN + MASE/SN)/2, lower is better.

The synthetic panels favour a lag one season back on hourly data, but their seasonality is
clean by construction. The benchmark's real hourly and daily panels did worse with it, so the
lags were kept (docs/guides/forecasting.md, "Every model has a recipe of its own")::

    PYTHONPATH=benchmarks:. python benchmarks/deepar_lags_study.py --freq h --prediction-length 24
    PYTHONPATH=benchmarks:. python benchmarks/deepar_lags_study.py --freq Q --prediction-length 8
"""

from __future__ import annotations

import argparse
import statistics
import warnings

from forecast_recipe import synthetic_study_panel, study_score, write_study_json

MONTHLY_LAGS = [1, 2, 3, 12, 13]


def use_lags(which: str, season: int) -> None:
    """Make every DeepAR the product builds read ``which`` lags: ``"monthly"``: the shipped
    ``[1, 2, 3, 12, 13]``; ``"one-season"``: ``[1, 2, 3, m, m + 1]``. Weights pretrained with
    one-season lags are cached apart (``$OPACUS_STRUCTURED_CACHE/lags-one-season``): the
    product's weights key does not name the lags."""
    import os

    from opacus_structured.forecasting import estimators, pretraining

    if not hasattr(estimators, "_stock_build_estimator"):
        estimators._stock_build_estimator = estimators.build_estimator
        estimators._stock_cache = os.environ.get("OPACUS_STRUCTURED_CACHE")
    stock = estimators._stock_build_estimator
    lags = MONTHLY_LAGS if which == "monthly" else sorted({1, 2, 3, season, season + 1})

    def build(model, **kwargs):
        if model == "deepar":
            kwargs.setdefault("lags_seq", list(lags))
        return stock(model, **kwargs)

    estimators.build_estimator = build
    root = estimators._stock_cache or os.path.dirname(pretraining.cache_dir())
    if which == "monthly":
        if estimators._stock_cache is None:
            os.environ.pop("OPACUS_STRUCTURED_CACHE", None)
        else:
            os.environ["OPACUS_STRUCTURED_CACHE"] = estimators._stock_cache
    else:
        os.environ["OPACUS_STRUCTURED_CACHE"] = os.path.join(root, "lags-one-season")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--freq", default="h")
    ap.add_argument("--prediction-length", type=int, default=24)
    ap.add_argument("--lags", nargs="+", default=["monthly", "one-season"],
                    choices=["monthly", "one-season"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")

    from opacus_structured.forecasting.baselines import seasonal_naive_predictor
    from opacus_structured.forecasting.data import train_test_split
    from opacus_structured.forecasting.metrics import evaluate_predictor
    from opacus_structured.forecasting.model_defaults import model_defaults
    from opacus_structured.forecasting.pretraining import (pretrained_weights,
                                                           zero_shot_predictor)
    from opacus_structured.forecasting.seasonality import season_length
    from opacus_structured.forecasting.training import train_forecaster

    h, season = args.prediction_length, season_length(args.freq)
    train, test = train_test_split(synthetic_study_panel(args.freq), h)
    test_ds = test.to_gluonts()

    def score(predictor):
        return evaluate_predictor(predictor, test_ds, num_samples=100,
                                  season_length=season)[0]

    sn = score(seasonal_naive_predictor(h, train.freq, season_length=season))
    recipe = model_defaults("deepar")
    rows = []
    for which in args.lags:
        use_lags(which, season)
        state, _ = pretrained_weights("deepar", freq=args.freq, prediction_length=h,
                                         log=print)
        runs = [("zero-shot", None)] + [("DP ε=1", s) for s in args.seeds]
        for label, seed in runs:
            if seed is None:
                predictor = zero_shot_predictor("deepar", state, freq=args.freq,
                                                prediction_length=h)
            else:
                predictor = train_forecaster(
                    "deepar", train, prediction_length=h, batch_size=64,
                    max_steps=recipe["max_steps"], lr=recipe["lr"],
                    max_grad_norm=recipe["max_grad_norm"], tail_average=recipe["tail_average"],
                    epsilon=1.0, delta=1e-7, seed=seed, init_seed=seed,
                    init_state=state).create_predictor()
            m = score(predictor)
            lags_seq = (MONTHLY_LAGS if which == "monthly"
                        else sorted({1, 2, 3, season, season + 1}))
            rows.append({"lags": which, "lags_seq": lags_seq,
                         "run": label, "seed": seed, "crps": m["crps"], "mase": m["mase"],
                         "rel": study_score(m, sn)})
            print(f"{which:8s} {label:9s} seed {seed} CRPS {m['crps']:.5f} MASE "
                  f"{m['mase']:.3f}", flush=True)
    print(f"\nseasonal naive: CRPS {sn['crps']:.5f} MASE {sn['mase']:.3f}")
    print("| lags | zero-shot CRPS / MASE / score | DP ε=1 CRPS / MASE / score (mean) |")
    print("|---|---|---|")
    for which in args.lags:
        zs = next(r for r in rows if r["lags"] == which and r["seed"] is None)
        dp = [r for r in rows if r["lags"] == which and r["seed"] is not None]
        print(f"| {which} {zs['lags_seq']} | {zs['crps']:.5f} / {zs['mase']:.3f} / "
              f"{zs['rel']:.3f} | "
              + " / ".join(f"{statistics.fmean(r[k] for r in dp):.{d}f}"
                           for k, d in (("crps", 5), ("mase", 3), ("rel", 3))) + " |")
    write_study_json(args.json, [f"synthetic-{args.freq}"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
