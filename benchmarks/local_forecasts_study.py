"""Issue 47's levers on the PUBLIC study panels: local forecasts in the window, pretrained.

Each variant is a DLinear design: the local forecasts its baseline skip combines
(``--features``: :data:`~opacus_structured.forecasting.baseline_skip.SKIP_FEATURES`, the shipped
two, or the five of :mod:`~opacus_structured.forecasting.local_forecasts`), whether the public
weights are pretrained **with** that skip (``pre``: the zero-shot model already combines the
local methods) or without it (``plain``: the skip starts at zero; ``prior-<name>``: it starts
at the public prior combination :data:`PRIORS`; a suffix ``+s<v>`` adds the scale skip at
initial weight ``v``, which moves the predictive scale towards ETS's), the pretraining corpus
(``synthetic`` or ``synthetic+competition[:N]``), the skip's Adam step ``skip_lr`` and the
context (``c<L>``). A variant is written ``features/pretrain/corpus/skip_lr/context``, e.g.
``local5/pre/synthetic/1e-4/36``.

For each variant, study panel (txhousing, economics, the synthetic study panel of
``forecast_recipe.py``: test = last 12 months, Λ = round(N·64/148)) and seed, the model is
fine-tuned at ε = 1 (δ = 1e-7) with the rest of DLinear's recipe and scored at every zero-shot
share ``w`` of ``--weights`` (the product's ``create_predictor(zero_shot_weight=w)``), next to
its zero-shot model, seasonal naive and statsmodels ETS fitted per series (NOT PRIVATE,
:mod:`~opacus_structured.forecasting.ets`). The score of a design is the mean over the panels
of (CRPS/SN + MASE/SN)/2 (lower is better), as in the earlier studies; the table also counts
the panels where the release beats ETS on CRPS. The benchmark panels and the bundled panel
are never read here::

    OMP_NUM_THREADS=1 nice -n 5 python benchmarks/local_forecasts_study.py \\
        --variants skip2/plain/synthetic/default/36 local5/pre/synthetic/1e-4/36 \\
        --seeds 0 1 2 --json local_study.json

``--local-accuracy 36 60`` prints the MASE of each local method fitted on the last 36 or 60
steps of every study series (no network): whether a longer context helps the local fits
(``-3``: 3·H steps, ``0``: the whole training part). With ``--panels`` naming panels of
``forecast_panels.py`` it is a diagnostic of the benchmark (used to explain, never to choose).
Public weights of each pretraining are cached under ``$OPACUS_STRUCTURED_CACHE`` (their key
carries the recipe). ``--amplification`` prints σ at ε = 1 for each context on the study
panels' and the bundled panel's public geometry (its series lengths): the price of a longer
context (more windows contain a protected step: ``r = (L_C + L_F)/(L − L_F + 1)`` grows).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import platform
import statistics
import sys
import time
import warnings

from forecast_recipe import study_score, study_split

PANELS = ("txhousing", "economics", "synthetic")
WEIGHTS = (0.0, 0.1, 0.25, 0.5)
H = 12


@dataclasses.dataclass(frozen=True)
class Variant:
    features: str      # skip2 | local5 | ets-only ...
    pretrain: str      # plain | pre
    corpus: str        # synthetic | synthetic+competition[:N]
    skip_lr: str       # default | a float
    context: int

    @classmethod
    def parse(cls, text: str) -> "Variant":
        f, p, c, lr, ctx = text.split("/")
        return cls(f, p, c, lr, int(ctx))

    def __str__(self):
        return f"{self.features}/{self.pretrain}/{self.corpus}/{self.skip_lr}/{self.context}"


FEATURE_SETS = {"skip2": ("seasonal_naive", "naive"),
                "local5": ("seasonal_naive", "naive", "drift", "ets", "theta"),
                "local3": ("seasonal_naive", "ets", "theta"),
                # the five and their per-series backtest combination (backtest_combination.py)
                "local5c": ("seasonal_naive", "naive", "drift", "ets", "theta", "combination"),
                "ets": ("seasonal_naive", "naive", "ets")}


#: Initial effective skip weights (``prior-<name>``): public priors for the combination; the
#: network's own location keeps the weight ``1 - sum``.
PRIORS = {"ets": {"ets": 1.0}, "theta": {"theta": 1.0},
          "etsth": {"ets": 0.5, "theta": 0.5},
          "etsthmu": {"ets": 1 / 3, "theta": 1 / 3},
          "etsthsn": {"ets": 1 / 3, "theta": 1 / 3, "seasonal_naive": 1 / 3},
          "etsthsnmu": {"ets": 0.25, "theta": 0.25, "seasonal_naive": 0.25},
          # issue 47, prediction history: more weight on ETS
          "ets2thsn": {"ets": 0.5, "theta": 0.25, "seasonal_naive": 0.25},
          "ets2thsnmu": {"ets": 0.4, "theta": 0.2, "seasonal_naive": 0.2},
          "ets2thmu": {"ets": 0.5, "theta": 0.25},
          "etsmu": {"ets": 0.5}, "ets3mu": {"ets": 0.75},
          "ets2th": {"ets": 2 / 3, "theta": 1 / 3}, "etsth2": {"ets": 1 / 3, "theta": 2 / 3},
          # issue 47, third pass: the per-series backtest combination
          "comb": {"combination": 1.0},
          "combetsth": {"combination": 0.5, "ets": 0.25, "theta": 0.25}}


def configure(variant: Variant):
    """Set DLinear's recipe row and pretraining recipe to ``variant`` (in this process)."""
    from opacus_structured.forecasting import model_defaults as md
    from opacus_structured.forecasting import pretraining

    features = FEATURE_SETS[variant.features]
    md.MODEL_DEFAULTS["dlinear"]["skip_features"] = features
    prior, _, scale = variant.pretrain.partition("+s")
    md.MODEL_DEFAULTS["dlinear"]["skip_init"] = (
        PRIORS[prior.split("-", 1)[1]] if prior.startswith("prior-") else None)
    md.MODEL_DEFAULTS["dlinear"]["skip_scale"] = float(scale) if scale else None
    name, _, count = variant.corpus.partition(":")
    base = pretraining.PretrainRecipe()
    pretraining.PRETRAIN_RECIPE["dlinear"] = dataclasses.replace(
        base, corpus=name, competition_series=int(count) if count else None,
        skip_features=features if prior == "pre" else None)
    return None if variant.skip_lr == "default" else float(variant.skip_lr)


#: Method sets a prediction history can be read by (``--histories MULT:SET``).
HISTORY_SETS = {"none": (), "ets": ("ets",), "ets+theta": ("ets", "theta"),
                "ets+drift": ("ets", "drift"),
                "all": ("seasonal_naive", "naive", "drift", "ets", "theta")}


def parse_history(text):
    """``MULT:SET`` → ``(multiple, methods)``: the predictor reads ``MULT·H`` past steps
    (``0``: the whole training part of the longest series; ``3``, DLinear's context, is the
    window alone) and the methods :data:`HISTORY_SETS` ``[SET]`` are fitted on all of them."""
    mult, _, name = text.partition(":")
    return int(mult), HISTORY_SETS[name or "ets"]


def history_length(multiple, train):
    """Past steps a predictor reads for ``multiple`` (:func:`parse_history`)."""
    return max(train.lengths) if multiple == 0 else multiple * H


def with_history(prepared, length, methods):
    """Point ``prepared``'s predictor at a prediction history (training is not affected:
    its windows keep the context)."""
    prepared.estimator.local_history_length = max(length, prepared.estimator.context_length)
    prepared.estimator.history_methods = tuple(methods)
    prepared.module.model.history_methods = tuple(methods)
    return prepared


#: ``--subsets`` the product trains by name (``train_forecaster(trained_parameters=...)``).
PRODUCT_SUBSETS = {"all": "all", "head": ("args_proj", "baseline_skip", "scale_skip"),
                   "skip": ("baseline_skip", "scale_skip")}


def run_name(variant, subset, lr):
    """A trained design's name: the variant, ``@subset`` unless every parameter is trained,
    ``@lr<x>`` unless the network's step is the recipe's 1e-4."""
    name = str(variant) if subset == "all" else f"{variant}@{subset}"
    return name if lr == 1e-4 else f"{name}@lr{lr:g}"


def noise_rule_weight(sigma, batch, w_max=0.25):
    """The noise-aware zero-shot share ``w_max · min(1, σ/Λ)``: public quantities only."""
    return w_max * min(1.0, float(sigma) / float(batch))


def ets_scores(train, test):
    """statsmodels ETS (NOT PRIVATE) of a study panel: its CRPS and MASE."""
    from forecast_panels import _truth

    from opacus_structured.forecasting.ets import ets_reference
    from opacus_structured.forecasting.seasonality import season_length

    truth = [_truth(test, i) for i in range(len(test))]
    ets = ets_reference(train, truth, H, season_length(train.freq))
    return {"crps": ets["crps"], "mase": ets["mase"]}


def amplification(contexts, epsilon=1.0, delta=1e-7, steps=100):
    """σ at ε for each context on the public geometry of the study panels and the bundled
    panel (N, shortest training series, Λ), DLinear's window (context + 12)."""
    from forecast_recipe import _panel

    from opacus_structured.accounting.calibration import calibrate_noise_multiplier
    from opacus_structured.forecasting.data import train_test_split
    from opacus_structured.schemes.structured import StructuredScheme

    out = []
    for name in (*PANELS, "employment"):
        train, _ = train_test_split(_panel(name), H)
        n = len(train)
        batch = 64 if name in ("synthetic", "employment") else max(1, round(n * 64 / 148))
        shortest = train.min_length
        for ctx in contexts:
            scheme = StructuredScheme(num_series=n, series_length=shortest, context_length=ctx,
                                      forecast_length=H, batch_size=batch)
            sigma = calibrate_noise_multiplier(
                lambda s, scheme=scheme: scheme.epsilon(s, steps, delta, discretization=1e-3),
                epsilon,
                rtol=1e-2)
            out.append({"panel": name, "context": ctx, "N": n, "L": shortest, "batch": batch,
                        "sigma": sigma})
            print(f"{name:10s} context {ctx:3d}: N {n}, shortest L {shortest}, Λ {batch}, "
                  f"σ(ε={epsilon:g}) = {sigma:.3f}", flush=True)
    return out


def _accuracy_panel(name):
    """``(train, test, H, m)`` of a study panel, or of a benchmark panel of
    ``forecast_panels.py`` (a diagnostic only: the benchmark chooses nothing)."""
    from forecast_recipe import _panel

    from opacus_structured.forecasting.data import train_test_split
    from opacus_structured.forecasting.seasonality import season_length

    if name in (*PANELS, "employment"):
        train, test = train_test_split(_panel(name), H)
        return train, test, H, season_length(train.freq)
    import forecast_panels

    from opacus_structured.forecasting.user_data import load_panel

    spec = forecast_panels.PANELS[name]
    path, _ = forecast_panels.panel_csv(name)
    h = spec.prediction_length
    panel, _ = load_panel(path, freq=spec.freq, min_length=2 * h)
    train, test = train_test_split(panel, h)
    return train, test, h, season_length(train.freq)


def _scaled_contexts(train, test, h, m, ctx):
    """``(contexts, observed, truth, mase_scales)`` arrays: each series' last ``ctx`` training
    steps (padded in front) divided by their mean absolute value, the last ``h`` test steps
    in the same units, and the in-sample seasonal-naive MAE in those units (MASE's scale)."""
    import numpy as np

    ys, obs, truth, scales = [], [], [], []
    for tr, te in zip(train.targets, test.targets, strict=True):
        tr = np.asarray(tr, float)
        c = tr[-ctx:]
        o = np.r_[np.zeros(ctx - len(c)), np.ones(len(c))]
        c = np.r_[np.zeros(ctx - len(c)), c]
        s = max(np.abs(c[o > 0]).mean(), 1e-10)
        ys.append(c / s)
        obs.append(o)
        truth.append(np.asarray(te, float)[-h:] / s)
        lag = m if len(tr) > m else 1
        scales.append(max(np.mean(np.abs(tr[lag:] - tr[:-lag])) / s, 1e-10))
    return np.array(ys), np.array(obs), np.array(truth), np.array(scales)


def local_accuracy(contexts, panels=PANELS):
    """MASE of every local method fitted on the last ``context`` training steps of each series
    (point forecasts, no network): how much context the local fits need. ``contexts`` are
    multiples of the horizon when negative (``-3``: 3·H, the DLinear default; ``0``: the whole
    training part)."""
    import numpy as np
    import torch

    from opacus_structured.forecasting.local_forecasts import METHODS, local_forecasts

    out = []
    for name in panels:
        train, test, h, m = _accuracy_panel(name)
        for given in contexts:
            ctx = (-given * h if given < 0 else given) or max(train.lengths)
            ys, obs, truth, scales = _scaled_contexts(train, test, h, m, ctx)
            f = local_forecasts(torch.tensor(ys), torch.tensor(obs), m, h).numpy()
            err = np.abs(f - truth[:, :, None]).mean(1) / scales[:, None]
            row = {"panel": name, "context": int(ctx),
                   **{k: float(err[:, i].mean()) for i, k in enumerate(METHODS)}}
            out.append(row)
            print(f"{name:15s} context {ctx:5d} MASE: " + "  ".join(
                f"{k} {row[k]:.3f}" for k in METHODS), flush=True)
    return out


def combination_accuracy(panels=PANELS, multiple=80):
    """MASE of the local forecasts as the predictor fits them (ETS on up to ``multiple``·H
    past steps, the others on the last 3·H), of the recipe's prior ½ ETS + ½ Theta and of the
    per-series backtest combination (``backtest_combination.py``, inverse squared errors;
    ``inv1``: inverse errors) — point forecasts, no network (issue 47, third pass)."""
    import numpy as np
    import torch

    from opacus_structured.forecasting.backtest_combination import backtest_weights
    from opacus_structured.forecasting.local_forecasts import (
        METHODS,
        local_forecasts_with_history,
    )

    out = []
    for name in panels:
        train, test, h, m = _accuracy_panel(name)
        ctx = multiple * h
        ys, obs, truth, scales = _scaled_contexts(train, test, h, m, ctx)
        y, o = torch.tensor(ys), torch.tensor(obs)
        window = min(3 * h, ctx)
        f = local_forecasts_with_history(y, o, window, m, h, METHODS, ("ets",)).numpy()

        def mase(point, truth=truth, scales=scales):
            return float((np.abs(point - truth).mean(1) / scales).mean())

        row = {"panel": name, **{k: mase(f[:, :, i]) for i, k in enumerate(METHODS)}}
        row["prior"] = mase(0.5 * f[:, :, METHODS.index("ets")]
                            + 0.5 * f[:, :, METHODS.index("theta")])
        for label, power in (("combination", 2.0), ("inv1", 1.0)):
            v = backtest_weights(y, o, window, m, h, METHODS, ("ets",), power=power).numpy()
            row[label] = mase((f * v[:, None, :]).sum(-1))
        out.append(row)
        print(f"{name:16s} N {len(ys):4d} MASE: " + "  ".join(
            f"{k} {v:.3f}" for k, v in row.items() if k != "panel"), flush=True)
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=["skip2/plain/synthetic/default/36",
                                                       "local5/pre/synthetic/1e-4/36"])
    ap.add_argument("--panels", nargs="+", default=list(PANELS),
                    help="study panels (the benchmark's for --local-accuracy diagnostics only)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--weights", nargs="+", type=float, default=list(WEIGHTS))
    ap.add_argument("--nonprivate", action="store_true", help="also fine-tune without DP")
    ap.add_argument("--histories", nargs="+", default=["3:none"], metavar="MULT:SET",
                    help="prediction histories to score every trained model with: MULT·H past "
                         "steps (0: the whole training part), SET of methods fitted on them "
                         f"({', '.join(HISTORY_SETS)}); 3:none is the window alone")
    ap.add_argument("--whole-std", action="store_true",
                    help="ETS's spread from a prediction history over all its steps (default: "
                         "its last context_length steps)")
    ap.add_argument("--lrs", nargs="+", type=float, default=[1e-4],
                    help="Adam step sizes of the network (DLinear's recipe: 1e-4)")
    ap.add_argument("--subsets", nargs="+", default=["all"],
                    help="parameters DP fine-tuning trains (fine_tune_subset_study.py: all, "
                         "skip, head, bias, lora-R)")
    ap.add_argument("--no-train", action="store_true",
                    help="zero-shot rows only (no fine-tuning)")
    ap.add_argument("--amplification", nargs="*", type=int, default=None, metavar="CONTEXT",
                    help="print σ at ε = 1 per context (e.g. 36 60) and exit")
    ap.add_argument("--local-accuracy", nargs="*", type=int, default=None, metavar="CONTEXT",
                    help="print the MASE of every local method per context and exit")
    ap.add_argument("--combination-accuracy", action="store_true",
                    help="print the MASE of the local forecasts as the predictor fits them, of "
                         "the prior and of the backtest combination, and exit")
    ap.add_argument("--json", default=None)
    return ap


def _zero_shot_rows(panel, variant, train, score, sn, histories):
    """``(public state, rows)``: the variant's public weights and its zero-shot model's scores
    under every prediction history."""
    from opacus_structured.forecasting.estimators import prepare_estimator
    from opacus_structured.forecasting.pretraining import pretrained_weights

    ctx = variant.context
    state, _ = pretrained_weights("dlinear", freq=train.freq, prediction_length=H,
                                  context_length=ctx, log=print)
    zero = prepare_estimator("dlinear", freq=train.freq, prediction_length=H,
                             context_length=ctx)
    zero.module.model.load_state_dict(state)
    zero.module.eval()
    rows = []
    for hist, mult, methods in histories:
        with_history(zero, history_length(mult, train), methods)
        zs = score(zero.create_predictor())
        rows.append({"panel": panel, "variant": str(variant), "kind": "zero-shot",
                     "history": hist, "crps": zs["crps"], "mase": zs["mase"],
                     "rel": study_score(zs, sn)})
        print(f"{panel:10s} {variant!s:45s} {hist:12s} zero-shot CRPS "
              f"{zs['crps']:.5f} MASE {zs['mase']:.3f}", flush=True)
    return state, rows


def _fine_tuned_rows(args, panel, variant, skip_lr, state, train, batch, score, sn, histories):
    """The scores of every fine-tuning of ``variant`` (subset, step size, DP or not, seed) at
    every prediction history and zero-shot share."""
    import fine_tune_subset_study as subsets

    from opacus_structured.forecasting import training
    from opacus_structured.forecasting.baseline_skip import describe_skip
    from opacus_structured.forecasting.training import train_forecaster

    stock = training._window_module
    rows = []
    for subset, lr, private in itertools.product(
            args.subsets, args.lrs, (True, False) if args.nonprivate else (True,)):
        name = run_name(variant, subset, lr)
        for seed in args.seeds:
            t0 = time.perf_counter()
            trained = PRODUCT_SUBSETS.get(subset, "all")
            if subset not in PRODUCT_SUBSETS:  # the harness freezes (bias, lora-R)
                subsets.install(subset)
            res = train_forecaster(
                "dlinear", train, prediction_length=H, context_length=variant.context,
                batch_size=batch, max_steps=100, lr=lr, max_grad_norm=1e-4,
                tail_average=0.5, epsilon=1.0 if private else None,
                delta=1e-7 if private else None, seed=seed, init_seed=seed,
                init_state=state, skip_lr=skip_lr, trained_parameters=trained)
            training._window_module = stock
            subsets.released(res.prepared.module.model)
            secs = time.perf_counter() - t0
            rule = (noise_rule_weight(res.noise_multiplier, batch) if private
                    else 0.0)
            for (hist, mult, methods), w in itertools.product(
                    histories, (*args.weights, "rule")):
                with_history(res.prepared, history_length(mult, train), methods)
                m = score(res.create_predictor(
                    zero_shot_weight=rule if w == "rule" else w))
                rows.append({"panel": panel, "variant": name,
                             "kind": "DP" if private else "non-private", "seed": seed,
                             "history": hist, "w": w, "crps": m["crps"],
                             "mase": m["mase"], "rel": study_score(m, sn),
                             "seconds": secs, "sigma": res.noise_multiplier,
                             "skip": describe_skip(res.prepared.module.model)})
                print(f"{panel:10s} {name:45s} {hist:12s} "
                      f"{'DP' if private else 'non-DP'} seed {seed} w={str(w):<4s} "
                      f"CRPS {m['crps']:.5f} MASE {m['mase']:.3f} ({secs:.0f} s)",
                      flush=True)
    return rows


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.combination_accuracy:
        combination_accuracy(args.panels)
        return 0
    if args.local_accuracy is not None:
        local_accuracy(args.local_accuracy or [36, 60], args.panels)
        return 0
    if args.amplification is not None:
        rows = amplification(args.amplification or [36, 60])
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"machine": platform.platform(), "amplification": rows}, fh, indent=1)
        return 0

    from forecast_recipe import _panel

    from opacus_structured.forecasting.baseline_skip import BaselineSkipDLinearModel
    from opacus_structured.forecasting.data import train_test_split

    histories = [(text, *parse_history(text)) for text in args.histories]
    if args.whole_std:
        BaselineSkipDLinearModel.recent_std = False

    variants = [Variant.parse(v) for v in args.variants]
    rows, refs = [], {}
    for panel in args.panels:
        train, batch, score, sn = study_split(panel)
        _, test = train_test_split(_panel(panel), H)
        ets = ets_scores(train, test)
        refs[panel] = {"seasonal_naive": sn, "ets": ets}
        print(f"{panel:10s} seasonal naive CRPS {sn['crps']:.5f} MASE {sn['mase']:.3f}; ETS "
              f"(NOT PRIVATE) CRPS {ets['crps']:.5f} MASE {ets['mase']:.3f}", flush=True)
        for variant in variants:
            skip_lr = configure(variant)
            state, zero_rows = _zero_shot_rows(panel, variant, train, score, sn, histories)
            rows += zero_rows
            if not args.no_train:
                rows += _fine_tuned_rows(args, panel, variant, skip_lr, state, train, batch,
                                         score, sn, histories)
    print()
    names = [run_name(v, s, lr) for v in variants for s in args.subsets for lr in args.lrs]
    summary = summarize(rows, refs, names, args)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": platform.platform(), "panels": args.panels, "refs": refs,
                       "rows": rows, "summary": summary}, fh, indent=1)
    return 0


def summarize(rows, refs, variants, args):
    """Per variant, history and w: the study score, per-panel CRPS and wins over ETS
    (printed)."""
    out = []
    for variant, hist in itertools.product(map(str, variants), args.histories):
        base = variant.split("@")[0]
        zs = [r for r in rows if r["variant"] == base and r["kind"] == "zero-shot"
              and r["history"] == hist]
        zs_score = statistics.fmean(r["rel"] for r in zs) if zs else None
        if zs:
            crps = "  ".join(f"{r['panel']} {r['crps']:.5f}" for r in zs)
            print(f"{variant:45s} {hist:12s} zero-shot   score {zs_score:.4f}  {crps}")
        for kind in ("DP", "non-private"):
            for w in (*args.weights, "rule"):
                sel = [r for r in rows if r["variant"] == variant and r["kind"] == kind
                       and r.get("w") == w and r["history"] == hist]
                if not sel:
                    continue
                panels = [p for p in args.panels if any(r["panel"] == p for r in sel)]
                crps = {p: statistics.fmean(r["crps"] for r in sel if r["panel"] == p)
                        for p in panels}
                crps_sd = {p: statistics.pstdev([r["crps"] for r in sel if r["panel"] == p])
                           for p in panels}
                score = statistics.fmean(statistics.fmean(r["rel"] for r in sel
                                                          if r["panel"] == p) for p in panels)
                beats_ets = [p for p in panels if crps[p] < refs[p]["ets"]["crps"]]
                out.append({"variant": variant, "history": hist, "kind": kind, "w": w,
                            "score": score,
                            "zero_shot_score": zs_score, "crps": crps, "crps_std": crps_sd,
                            "beats_ets": beats_ets})
                print(f"{variant:45s} {hist:12s} {kind:11s} w={str(w):<4s} score "
                      f"{score:.4f} (zero-shot "
                      f"{zs_score:.4f})  " + "  ".join(
                          f"{p} {crps[p]:.5f}±{crps_sd[p]:.5f}" for p in panels)
                      + f"  beats ETS on {len(beats_ets)}/{len(panels)}", flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
