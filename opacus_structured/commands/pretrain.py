"""``opacus-structured pretrain``: public (non-private) pretraining for DP fine-tuning.

Trains a gluonts model on the synthetic public corpus
(:func:`~opacus_structured.forecasting.public_corpus.synthetic_panel`) with the fixed recipe of
:data:`~opacus_structured.forecasting.pretraining.PRETRAIN_RECIPE` and fixed seeds, and writes
the weights to the user cache (where ``forecast --init-from public`` finds them) or to
``--output``. Nothing private is read: the weights are public, and ``forecast`` fine-tunes
them with DP on your panel (the guarantee covers the fine-tuning panel only).

``--verify`` retrains and compares with the weights shipped in the package (the base
geometries of :mod:`~opacus_structured.forecasting.public_weights`, e.g. ``--freq Q
--prediction-length 8``): the command reproduces them. ``forecast`` needs no ``pretrain`` run
for a frequency family whose weights ship; this command serves the other geometries.

Examples::

    opacus-structured pretrain --model dlinear                  # cache for monthly, h = 12
    opacus-structured pretrain --model dlinear --freq W --prediction-length 8
    opacus-structured pretrain --model dlinear --output weights.pt
    opacus-structured forecast --init-from weights.pt
    opacus-structured pretrain --model dlinear --verify         # reproduces the shipped file
    opacus-structured pretrain --model dlinear --freq Q --prediction-length 8 --verify
    opacus-structured pretrain --corpus synthetic+competition --output m3.pt   # real series too

``--corpus synthetic+competition`` adds the real M1/M3 competition series at yearly, quarterly
and monthly frequencies (:mod:`~opacus_structured.forecasting.competition_corpus`, less those
that overlap an evaluation panel of the project). It is not the default: on the public study
panels it made the zero-shot model better but not the DP fine-tuned one
(docs/guides/forecasting.md, "Levers studied and not taken").
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .. import _progress
from ..forecasting.warning_filters import known_harmless_warnings_filtered
from ._registry import register_command

__all__ = ["add_arguments", "run", "run_pretrain", "CORPUS_CHOICES"]

#: ``--corpus`` choices (``forecasting.pretraining.CORPORA``; not imported here: the command
#: registers without gluonts, and a test keeps the two equal)
CORPUS_CHOICES = ("synthetic", "synthetic+competition")

#: ``--verify``: largest difference to the shipped weights, relative to their largest weight
#: (torch's CPU kernels round the last bit differently on AVX2 and AVX-512 machines, and a long
#: pretraining run carries it: 1.4e-5 seen between the two)
VERIFY_TOLERANCE = 1e-4


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=("deepar", "dlinear", "simpleff"), default="dlinear",
                   help="gluonts model (default %(default)s)")
    p.add_argument("--freq", default="M",
                   help="pandas frequency of the data to be fine-tuned on (sets the corpus' "
                        "season length; default %(default)s)")
    p.add_argument("--season-length", type=int, default=None, metavar="M",
                   help="steps per seasonal cycle of the corpus (default: from --freq, e.g. "
                        "12 for M, 48 for 30min; as forecast --season-length)")
    p.add_argument("--prediction-length", type=int, default=12,
                   help="forecast horizon L_F (default %(default)s)")
    p.add_argument("--context-length", type=int, default=None,
                   help="model context before lags (default 3·L_F, DeepAR 2·L_F)")
    p.add_argument("--corpus", choices=CORPUS_CHOICES, default=None,
                   help="public pretraining corpus (default: the model's recipe, synthetic); "
                        "synthetic+competition adds the real M1/M3 series at Y, Q and M")
    p.add_argument("--competition-series", type=int, default=None, metavar="N",
                   help="with --corpus synthetic+competition: use N of the competition series "
                        "(a fixed public draw; default all)")
    p.add_argument("--output", default=None, metavar="PATH",
                   help="write the weights here (default: the user cache, "
                        "$OPACUS_STRUCTURED_CACHE or ~/.cache/opacus-structured/pretrained)")
    p.add_argument("--force", action="store_true",
                   help="pretrain even if the cache already holds these weights")
    p.add_argument("--verify", action="store_true",
                   help="pretrain and compare with the weights shipped in the package (exit "
                        "status 1 if they differ beyond float round-off)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run_pretrain(args) -> dict:
    """Pretrain (or find cached) weights as ``args`` says; returns a JSON-ready record."""
    from ..forecasting.pretraining import (  # optional: gluonts
        cache_dir,
        load_weights,
        pretrain,
        recipe_for,
        save_weights,
        shipped_weights_path,
        weights_key,
    )

    if args.prediction_length < 1:
        raise ValueError(f"--prediction-length must be >= 1, got {args.prediction_length}")
    if args.context_length is not None and args.context_length < 1:
        raise ValueError(f"--context-length must be >= 1, got {args.context_length}")
    season = getattr(args, "season_length", None)
    if season is not None and season < 1:
        raise ValueError(f"--season-length must be >= 1, got {season}")
    shipped_recipe = recipe_for(args.model, args.freq)
    recipe = _recipe(args, shipped_recipe)
    key = weights_key(args.model, freq=args.freq, prediction_length=args.prediction_length,
                      context_length=args.context_length, season_length=season, recipe=recipe)
    progress = _progress.enabled(args.no_progress)
    log = None if progress else (lambda m: print(m, file=sys.stderr, flush=True))
    record = {"model": args.model, "freq": args.freq, "key": key}
    if args.verify:
        if recipe is not shipped_recipe:
            raise ValueError("--verify compares the shipped recipe's weights; drop --corpus / "
                             "--competition-series")
        shipped = shipped_weights_path(key)
        if shipped is None:
            raise ValueError(f"no weights are shipped for {key} (only the base geometries of "
                             "forecasting.public_weights are); --verify compares with a shipped file")
        reference, _ = load_weights(shipped)
        state, meta = pretrain(args.model, freq=args.freq,
                               prediction_length=args.prediction_length,
                               context_length=args.context_length, progress=progress,
                               season_length=season, log=log)
        diffs = {name: float((state[name].double() - reference[name].double()).abs().max())
                 for name in reference}
        worst = max(diffs.values()) if diffs else 0.0
        scale = max(float(t.double().abs().max()) for t in reference.values())
        same_keys = set(state) == set(reference)
        # a long public pretraining run carries the last-bit differences of torch's CPU
        # kernels (AVX2 and AVX-512 dispatch round differently): reproduced up to 1e-4 × scale
        record.update(path=shipped, max_abs_difference=worst, max_abs_weight=scale,
                      tolerance=VERIFY_TOLERANCE * max(1.0, scale),
                      reproduced=same_keys and worst <= VERIFY_TOLERANCE * max(1.0, scale),
                      train_seconds=meta["train_seconds"])
        return record
    path = args.output or os.path.join(cache_dir(), f"{key}.pt")
    if os.path.isfile(path) and not args.force and args.output is None:
        record.update(path=path, source="cache (already there; --force retrains)")
        return record
    state, meta = pretrain(args.model, freq=args.freq, prediction_length=args.prediction_length,
                           context_length=args.context_length, progress=progress,
                           season_length=season, log=log, recipe=recipe)
    save_weights(path, state, meta)
    record.update(path=path, source="pretrained now", train_seconds=meta["train_seconds"],
                  recipe=meta["recipe"], corpus=meta["corpus"], bytes=os.path.getsize(path))
    return record


def _recipe(args, shipped):
    """The model's recipe, with ``--corpus`` / ``--competition-series`` applied (the shipped
    recipe object itself when neither is given)."""
    import dataclasses

    corpus = getattr(args, "corpus", None)
    count = getattr(args, "competition_series", None)
    if count is not None and (corpus or shipped.corpus) != "synthetic+competition":
        raise ValueError("--competition-series needs --corpus synthetic+competition")
    if count is not None and count < 1:
        raise ValueError(f"--competition-series must be >= 1, got {count}")
    if corpus is None and count is None:
        return shipped
    return dataclasses.replace(shipped, corpus=corpus or shipped.corpus,
                               competition_series=count)


def run(args) -> int:
    with known_harmless_warnings_filtered():
        record = run_pretrain(args)
    if args.json:
        print(json.dumps(record, sort_keys=True))
    elif args.verify:
        verdict = "reproduced" if record["reproduced"] else "DIFFERS"
        print(f"{record['key']}: {verdict} the shipped weights (max |difference| "
              f"{record['max_abs_difference']:.3g}, max |weight| "
              f"{record['max_abs_weight']:.3g}) — {record['path']}")
    else:
        print(f"{record['key']}: {record['source']} — {record['path']}")
    return 0 if record.get("reproduced", True) else 1


register_command("pretrain", "public (non-private) pretraining for DP fine-tuning (cached)",
                 add_arguments, run)
