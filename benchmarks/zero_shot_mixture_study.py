"""Choose the zero-shot share ``w`` of the forecast mixture on PUBLIC panels only.

The released forecast is ``(1 − w)·fine-tuned + w·zero-shot``
(:mod:`opacus_structured.forecasting.zero_shot_mixture`). For each public study panel and seed
this trains the model once with its recipe at ε = 1 (δ = 1e-7, from the public weights) and
scores the released forecast at every ``w`` of ``--weights`` through
``TrainResult.create_predictor(zero_shot_weight=w)``, the product's own path. ``w = 1`` (not a
valid release) is scored as the zero-shot model itself. The score of a ``w`` is the mean over
the panels of (CRPS/SN + MASE/SN)/2, as in ``forecast_recipe.py``; the recipe keeps ``w = 0``
unless a mixture beats it by at least 1 % of the score. Panels, Λ and the test split are those
of ``forecast_recipe.py`` (test = last 12 months, Λ = round(N·64/148))::

    PYTHONPATH=. python benchmarks/zero_shot_mixture_study.py --models dlinear deepar \\
        --seeds 0 1 2 --json mixture_study.json
    PYTHONPATH=. python benchmarks/zero_shot_mixture_study.py --panels employment   # held out

``--corpora synthetic synthetic+competition synthetic+competition:500`` repeats the study from
public weights pretrained on each corpus (:data:`~opacus_structured.forecasting.pretraining.
CORPORA`; ``:N`` uses N of the competition series; the shipped recipe otherwise): the study of
the real corpus (docs/guides/forecasting.md, "Levers studied and not taken")::

    PYTHONPATH=benchmarks:. python benchmarks/zero_shot_mixture_study.py \
        --corpora synthetic synthetic+competition synthetic+competition:500 \
        synthetic+competition:250 --weights 0 0.1 0.25 0.4 0.5 1 --json corpus_study.json
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import warnings

from forecast_recipe import study_split, study_score, write_study_json

WEIGHTS = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["dlinear"])
    ap.add_argument("--panels", nargs="+", default=["txhousing", "economics", "synthetic"])
    ap.add_argument("--weights", nargs="+", type=float, default=list(WEIGHTS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--corpora", nargs="+", default=None,
                    help="pretraining corpora to compare (default: each model's recipe)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")

    from opacus_structured.forecasting.model_defaults import model_defaults
    from opacus_structured.forecasting.pretraining import (PRETRAIN_RECIPE, pretrained_weights,
                                                           zero_shot_predictor)
    from opacus_structured.forecasting.training import train_forecaster

    shipped = dict(PRETRAIN_RECIPE)
    starts = [(m, c) for m in args.models for c in (args.corpora or [shipped[m].corpus])]

    def recipe_of(model, corpus):
        name, _, count = corpus.partition(":")
        return dataclasses.replace(shipped[model], corpus=name,
                                   competition_series=int(count) if count else None)

    rows = []
    for panel_name in args.panels:
        train, batch, score, sn = study_split(panel_name)
        for model, corpus in starts:
            PRETRAIN_RECIPE[model] = recipe_of(model, corpus)
            recipe = model_defaults(model)
            state, _ = pretrained_weights(model, freq=train.freq, prediction_length=12)
            zero_shot = score(zero_shot_predictor(model, state, freq=train.freq,
                                                  prediction_length=12))
            for seed in args.seeds:
                res = train_forecaster(
                    model, train, prediction_length=12, batch_size=batch,
                    max_steps=recipe["max_steps"], lr=recipe["lr"],
                    max_grad_norm=recipe["max_grad_norm"], tail_average=recipe["tail_average"],
                    epsilon=1.0, delta=1e-7, seed=seed, init_seed=seed, init_state=state)
                for w in args.weights:
                    m = zero_shot if w == 1.0 else score(res.create_predictor(zero_shot_weight=w))
                    rows.append({"panel": panel_name, "model": model, "corpus": corpus,
                                 "seed": seed, "w": w,
                                 "crps": m["crps"], "mase": m["mase"],
                                 "rel": study_score(m, sn)})
                    print(f"{panel_name:10s} {model:8s} {corpus} seed {seed} w={w:<5g} CRPS "
                          f"{m['crps']:.5f} MASE {m['mase']:.3f}", flush=True)

    print()
    for model, corpus in starts:
        for w in args.weights:
            sel = [r for r in rows if r["model"] == model and r["corpus"] == corpus
                   and r["w"] == w]
            per_panel = {p: statistics.fmean(r["rel"] for r in sel if r["panel"] == p)
                         for p in args.panels}
            crps = {p: statistics.fmean(r["crps"] for r in sel if r["panel"] == p)
                    for p in args.panels}
            total = statistics.fmean(per_panel.values())
            print(f"{model:8s} {corpus:25s} w={w:<5g} score {total:.4f}  "
                  + "  ".join(f"{p} {c:.5f}" for p, c in crps.items()))
    write_study_json(args.json, args.panels, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
