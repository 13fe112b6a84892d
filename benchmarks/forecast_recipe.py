"""Choose the DP fine-tuning recipe on PUBLIC data only (no privacy spent on the user's panel).

Tuning hyper-parameters on the private panel would itself leak it (and is not covered by the
reported ε), so the defaults of ``opacus-structured forecast`` are chosen here, on two public
panels — Texas home sales (:func:`~opacus_structured.forecasting.data.load_txhousing_sales`, 26
cities × 187 months) and US macro series (:func:`~opacus_structured.forecasting.data.load_us_economics`,
5 × 574) — with test = the last 12 months, at ε = 1, δ = 1e-7, starting from the public
pretrained weights (:mod:`opacus_structured.forecasting.pretraining`). The batch size keeps the
series sampling rate ρ = Λ/N near the main job's 64/148 ≈ 0.43. The recipe with the best mean
of CRPS/seasonal-naive and MASE/seasonal-naive over the panels wins.

``--panels synthetic`` adds a third public panel with the bundled panel's *public* geometry
(148 monthly series, lengths 225–969, Λ = 64): :func:`~opacus_structured.forecasting.
public_corpus.synthetic_panel` with seed 1 (the pretraining corpus uses seed 0) and a shifted
distribution (stronger seasonality, 3–6× noisier), so fine-tuning has something to learn at
the signal-to-noise ratio Λ/σ of a 148-series panel, which the two small real panels (Λ = 11
and 2) cannot show. DeepAR's and SimpleFeedForward's rows of
``forecasting/model_defaults.py`` were chosen on all three panels.

Every trained row is scored as ``forecast`` releases it: with the model's zero-shot mixture
(``zero_shot_weight`` of the recipe; ``zero_shot_mixture_study.py`` chose it, after the tables of
the guide's earlier studies were measured without it).

Prints a table (CRPS, MASE per recipe, mean over seeds, next to seasonal naive, the zero-shot
pretrained model and non-private fine-tuning) and writes JSON with ``--json PATH``::

    python benchmarks/forecast_recipe.py --models dlinear --seeds 0 1 --json recipe.json
    python benchmarks/forecast_recipe.py --panels meat --lrs 1e-4 --steps 100 --tails 0.5
    python benchmarks/forecast_recipe.py --models deepar --panels txhousing economics \
        synthetic --lrs 1e-4 3e-4 1e-3 --steps 100 200 --tails 0.5 --clips 1e-4 --seeds 0 1
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import statistics
import time
import warnings

PANELS = ("txhousing", "economics")


def synthetic_study_panel(freq: str = "M"):
    """The public synthetic study panel (module docstring): 148 series, seed 1, shifted; at
    another pandas frequency its season follows (``deepar_lags_study.py``)."""
    from opacus_structured.forecasting.public_corpus import synthetic_panel

    return synthetic_panel(148, freq=freq, min_length=225, max_length=969, seed=1,
                           seasonal_amplitude=(10 ** -2, 10 ** -0.5),
                           noise_scale=(10 ** -2.5, 10 ** -1.2))


def _panel(name):
    from opacus_structured.forecasting import data

    return {"txhousing": data.load_txhousing_sales, "economics": data.load_us_economics,
            "meat": data.load_us_meat_production, "employment": data.load_us_employment,
            "synthetic": synthetic_study_panel}[name]()


H = 12


def study_score(metrics, sn) -> float:
    """The study score of one forecast: (CRPS/SN + MASE/SN)/2 against seasonal naive's ``sn``
    (lower is better)."""
    return (metrics["crps"] / sn["crps"] + metrics["mase"] / sn["mase"]) / 2


def write_study_json(path, panels, rows) -> None:
    """The rows of a study and the machine it ran on, as JSON at ``path`` (nothing if None)."""
    import json
    import platform

    if path:
        with open(path, "w") as fh:
            json.dump({"machine": platform.platform(), "panels": panels, "rows": rows}, fh,
                      indent=1)


def study_split(panel_name):
    """``(train, batch, score, sn)`` of a study panel: the training part (test = the last
    ``H`` = 12 steps), the batch size Λ = round(N·64/148) (the series sampling rate of the main
    job; the synthetic panel has its geometry), ``score(predictor)`` (CRPS, MASE, … on the test
    steps, 100 samples) and seasonal naive's scores."""
    from opacus_structured.forecasting.baselines import seasonal_naive_predictor
    from opacus_structured.forecasting.data import train_test_split
    from opacus_structured.forecasting.metrics import evaluate_predictor

    train, test = train_test_split(_panel(panel_name), H)
    test_ds = test.to_gluonts()

    def score(predictor):
        return evaluate_predictor(predictor, test_ds, num_samples=100)[0]

    return (train, max(1, round(len(train) * 64 / 148)), score,
            score(seasonal_naive_predictor(H, train.freq)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["dlinear"])
    ap.add_argument("--panels", nargs="+", default=list(PANELS))
    ap.add_argument("--lrs", nargs="+", type=float, default=[1e-4, 3e-4, 1e-3])
    ap.add_argument("--skip-lrs", nargs="+", type=float, default=[None],
                    help="Adam step sizes of DLinear's baseline skip (default: the recipe's)")
    ap.add_argument("--skip-lr-scalings", nargs="+", default=[None],
                    help="'none' or 'snr' (default: the recipe's)")
    ap.add_argument("--skip-gains", nargs="+", type=float, default=[None],
                    help="input gains of DLinear's baseline skip (default: the recipe's)")
    ap.add_argument("--steps", nargs="+", type=int, default=[100, 200])
    ap.add_argument("--tails", nargs="+", type=float, default=[0.0, 0.5])
    ap.add_argument("--clips", nargs="+", type=float, default=[1e-4],
                    help="per-window clipping norms C")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--nonprivate", action="store_true",
                    help="also fine-tune without DP with every recipe")
    ap.add_argument("--epsilon", type=float, default=1.0)
    ap.add_argument("--delta", type=float, default=1e-7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")

    from opacus_structured.forecasting.pretraining import pretrained_weights, zero_shot_predictor
    from opacus_structured.forecasting.training import train_forecaster

    rows = []
    for panel_name in args.panels:
        train, batch, score, sn = study_split(panel_name)
        rows.append({"panel": panel_name, "model": "-", "recipe": "seasonal naive", **sn,
                     "rel_crps": 1.0, "rel_mase": 1.0})

        def add(row, metrics):
            row.update(metrics)
            row["rel_crps"] = row["crps"] / sn["crps"]
            row["rel_mase"] = row["mase"] / sn["mase"]
            rows.append(row)
            print(f"{panel_name:10s} {row['model']:8s} {row['recipe']:40s} CRPS "
                  f"{row['crps']:.4f} ({row['rel_crps']:.2f}x SN)  MASE {row['mase']:.3f} "
                  f"({row['rel_mase']:.2f}x SN)", flush=True)

        for model in args.models:
            state, _ = pretrained_weights(model, freq=train.freq, prediction_length=H,
                                          log=print)
            add({"panel": panel_name, "model": model, "recipe": "pretrained, zero-shot"},
                score(zero_shot_predictor(model, state, freq=train.freq,
                                          prediction_length=H)))
            sigma_of_steps: dict = {}  # σ depends on the steps only: calibrate once each
            for lr, steps, tail, clip, skip_lr, gain, scaling in itertools.product(
                    args.lrs, args.steps, args.tails, args.clips, args.skip_lrs,
                    args.skip_gains, args.skip_lr_scalings):
                for private in (True, False) if args.nonprivate else (True,):
                    runs = []
                    for seed in args.seeds:
                        t0 = time.perf_counter()
                        sigma = sigma_of_steps.get(steps) if private else None
                        res = train_forecaster(
                            model, train, prediction_length=H, batch_size=batch,
                            max_steps=steps, lr=lr, max_grad_norm=clip,
                            epsilon=args.epsilon if private and sigma is None else None,
                            noise_multiplier=sigma,
                            delta=args.delta if private else None, seed=seed,
                            init_seed=seed, init_state=state, tail_average=tail,
                            skip_lr=skip_lr, skip_lr_scaling=scaling, estimator_kwargs=(
                                None if gain is None else {"skip_gain": gain}))
                        if private:
                            if res.epsilon > args.epsilon:
                                raise RuntimeError(f"spent {res.epsilon} > {args.epsilon}")
                            sigma_of_steps[steps] = res.noise_multiplier
                        runs.append({**score(res.create_predictor()),
                                     "seconds": time.perf_counter() - t0,
                                     "sigma": res.noise_multiplier})
                    metrics = {}
                    for key in ("crps", "mase"):
                        vals = [r[key] for r in runs]
                        metrics[key] = statistics.fmean(vals)
                        metrics[f"{key}_std"] = statistics.pstdev(vals)
                    add({"panel": panel_name, "model": model, "private": private, "lr": lr,
                         "steps": steps, "tail_average": tail, "batch_size": batch,
                         "max_grad_norm": clip, "sigma": runs[0]["sigma"], "skip_lr": skip_lr,
                         "skip_gain": gain, "skip_lr_scaling": scaling,
                         "recipe": f"{'DP' if private else 'non-DP'} lr={lr:g} "
                                   f"steps={steps} tail={tail:g}"
                                   + (f" C={clip:g}" if len(args.clips) > 1 else "")
                                   + (f" skip_lr={skip_lr:g}" if skip_lr is not None
                                      else "")
                                   + (f" gain={gain:g}" if gain is not None else "")
                                   + (f" scaling={scaling}" if scaling is not None else "")},
                        metrics)

    print()
    print(f"{'panel':10s} {'model':8s} {'recipe':40s} {'CRPS':>7s} {'xSN':>5s} {'MASE':>6s} "
          f"{'xSN':>5s}")
    for r in rows:
        print(f"{r['panel']:10s} {r['model']:8s} {r['recipe']:40s} {r['crps']:7.4f} "
              f"{r['rel_crps']:5.2f} {r['mase']:6.3f} {r['rel_mase']:5.2f}")
    # choose: mean over panels of (CRPS/SN + MASE/SN) / 2, DP recipes only
    by_recipe: dict = {}
    for r in rows:
        if r.get("private"):
            by_recipe.setdefault((r["model"], r["recipe"]), []).append(
                (r["rel_crps"] + r["rel_mase"]) / 2)
    complete = {k: statistics.fmean(v) for k, v in by_recipe.items()
                if len(v) == len(args.panels)}
    if complete:
        (model, recipe), value = min(complete.items(), key=lambda kv: kv[1])
        print(f"\nbest DP recipe on the public panels {args.panels}: {model} {recipe} "
              f"(mean relative score {value:.3f}; 1 = seasonal naive)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": platform.platform(), "panels": args.panels,
                       "epsilon": args.epsilon, "delta": args.delta, "rows": rows}, fh,
                      indent=2, default=lambda x: None if isinstance(x, float)
                      and not math.isfinite(x) else x)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
