"""What a :class:`~opacus_structured.forecasting.dp_estimator.DPEstimator` run starts from and
what it records: the training panel it reads (with static categorical features), the initial
weights (a predictor's, ``init_state``, a weights file or the package's public pretrained
weights), the ``privacy_report`` of the trained predictor, and the small argument checks and
Lightning callback of :meth:`~opacus_structured.forecasting.dp_estimator.DPEstimator.train_model`.

The functions take the ``DPEstimator`` (``dp``) whose settings they read; split out of
``dp_estimator.py`` when it passed 600 lines.
"""

# no ``from __future__ import annotations``, as in dp_estimator.py (gluonts' @validated)
import dataclasses
import os
import sys
import warnings
from collections.abc import Mapping

import numpy as np
import torch.nn as nn

from . import gluonts_parity as parity
from .data import Panel
from .dp_predictor import REPORT_FORMAT
from .estimators import build_estimator
from .pretraining import load_weights, pretrained_weights
from .provenance import json_ready as _json_ready
from .training import TrainResult
from .user_data import load_panel

__all__ = ["check_tail_average", "trainer_capture", "read_training_data", "initial_weights",
           "public_weights", "public_architecture_differences", "privacy_report"]


def check_tail_average(value) -> float:
    """``tail_average`` as a float in [0, 1], else a ``ValueError``."""
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"tail_average must be in [0, 1] (fraction of the last steps whose "
                         f"iterates are averaged), got {value}")
    return value


def trainer_capture():
    """A Lightning callback that keeps the ``Trainer`` (for ``train_model``'s ``TrainOutput``);
    it only stores a reference."""
    import lightning.pytorch as pl

    class _Capture(pl.Callback):
        trainer = None

        def on_fit_start(self, trainer, pl_module):
            self.trainer = trainer

    return _Capture()


def read_training_data(dp, training_data, *, freq, fill, min_length):
    """The panel (with its static categorical features when the estimator reads them)."""
    count = int(getattr(dp.estimator, "num_feat_static_cat", 0) or 0)
    if count == 0 or isinstance(training_data, Panel):
        return load_panel(training_data, freq=freq, fill=fill, min_length=min_length)
    if isinstance(training_data, (str, os.PathLike)) or hasattr(training_data, "columns"):
        raise ValueError(f"the estimator reads num_feat_static_cat={count} static "
                         f"categorical features, which a table does not carry: pass a "
                         f"gluonts dataset whose entries have 'feat_static_cat' (or a "
                         f"Panel with static_cats)")
    entries = list(training_data)
    cats = {}
    for k, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or "feat_static_cat" not in entry:
            item = entry.get("item_id", k) if isinstance(entry, Mapping) else k
            raise ValueError(f"series {item!r} has no 'feat_static_cat' (the estimator reads "
                             f"num_feat_static_cat={count})")
        values = np.asarray(entry["feat_static_cat"]).reshape(-1)
        if not np.all(np.equal(np.mod(values, 1), 0)):
            raise ValueError(f"series {entry.get('item_id', k)!r}: feat_static_cat must be "
                             f"integers, got {values.tolist()}")
        cats[str(entry.get("item_id", k))] = tuple(int(v) for v in values)
    panel, report = load_panel(entries, freq=freq, fill=fill, min_length=min_length)
    panel = dataclasses.replace(panel, static_cats=tuple(cats[i] for i in panel.item_ids))
    return panel, report

def initial_weights(dp, panel, from_predictor, init_public) -> dict:
    """Initial weights, their record, whether declared public, and their description."""
    if from_predictor is not None:
        net = getattr(from_predictor, "prediction_net", None)
        if net is None:
            raise ValueError(f"from_predictor must be a gluonts PyTorchPredictor, got "
                             f"{type(from_predictor).__name__}")
        net = net.model if isinstance(getattr(net, "model", None), nn.Module) else net
        state = {k: v.detach().cpu().clone() for k, v in net.state_dict().items()}
        report = getattr(from_predictor, "privacy_report", None) or {}
        return {"state": state, "record": report.get("privacy_record"),
                "public": bool(init_public),
                "describe": {"source": "predictor", "class": type(from_predictor).__name__,
                             "declared_public": bool(init_public)}}
    if dp.init_state is not None:
        return {"state": dp.init_state, "record": dp.init_record,
                "public": dp.init_public,
                "describe": {"source": "init_state", "declared_public": dp.init_public}}
    if dp.init_from == "none":
        return {"state": None, "record": None, "public": False,
                "describe": {"source": "none"}}
    if dp.init_from == "public":
        differ = public_architecture_differences(dp, panel)
        if differ and not dp._init_given:  # the default start: a labelled random start
            why = f"no public weights for {differ}"
            warnings.warn(
                f"init: random ({why}; the package's public weights were trained with "
                f"build_estimator({dp.model!r}, ...)). DP training starts from a random "
                f"initialisation (lr_from_scratch), which needs more signal than fine-tuning; "
                f"build the estimator with opacus_structured.forecasting.estimators."
                f"build_estimator({dp.model!r}, freq=..., prediction_length=...) to fine-tune "
                f"the public weights, or pass init_from='none' to say random on purpose",
                UserWarning, stacklevel=_caller_stacklevel())
            return {"state": None, "record": None, "public": False,
                    "describe": {"source": "none", "init": f"random ({why})",
                                 "requested": "public (the default)"}}
        if differ:
            raise ValueError(
                f"init_from='public': the public pretrained weights were trained with "
                f"build_estimator({dp.model!r}, ...), whose architecture differs from this "
                f"{type(dp.estimator).__name__}: {differ}. Build the estimator with "
                f"opacus_structured.forecasting.estimators.build_estimator({dp.model!r}, "
                f"freq=..., prediction_length=...) to fine-tune the public weights, or pass "
                f"init_from='none' (or leave init_from unset: a labelled random start)")
        state, meta = public_weights(dp, panel)  # record without runs: public
        return {"state": state, "record": meta.get("privacy_record"), "public": False,
                "describe": {"source": "public", "weights": meta.get("source"),
                             "key": meta.get("key"), "path": meta.get("path"),
                             **({"base": meta["base"]["describe"]} if "base" in meta else {})}}
    if not os.path.isfile(dp.init_from):
        raise ValueError(f"init_from={dp.init_from!r}: no such file (init_from is "
                         f"'public', 'none' or the path of a weights file)")
    state, meta = load_weights(dp.init_from)
    want = {"model": dp.model, "prediction_length": dp.prediction_length,
            "context_length": int(dp.estimator.context_length)}
    for key, value in want.items():
        if key in meta and meta[key] != value:
            raise ValueError(f"init_from={dp.init_from!r}: the weights were trained for "
                             f"{key}={meta[key]!r} but this estimator has {key}={value!r}")
    return {"state": state, "record": meta.get("privacy_record"),
            "public": dp.init_public,
            "describe": {"source": "file", "path": dp.init_from,
                         "declared_public": dp.init_public}}

def public_architecture_differences(dp, panel) -> str:
    """The architecture arguments in which this estimator differs from the one the public
    weights were trained with (``"kernel_size=25 (public weights: 13); ..."``), or ``""``."""
    est = dp.estimator
    reference = build_estimator(dp.model, freq=panel.freq,
                                prediction_length=dp.prediction_length,
                                context_length=int(est.context_length))
    differ = parity.public_architecture_mismatch(est, reference)
    return "; ".join(f"{k}={a!r} (public weights: {b!r})" for k, (a, b) in differ.items())


def public_weights(dp, panel):
    """The package's public pretrained weights for this estimator's geometry (its context
    length fixed: a DLinear of a longer shipped horizon serves only at that horizon's context).
    A pretraining run is announced on stderr before it starts (estimate, how to skip) and
    followed there (a bar with ``progress``, else a line at most every ~10 s)."""
    return pretrained_weights(dp.model, freq=panel.freq,
                              prediction_length=dp.prediction_length,
                              context_length=int(dp.estimator.context_length),
                              progress=dp.progress, log=None,  # None: stderr
                              season_length=dp.season_length)


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside this package (a warning then points at
    the user's call)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level

def privacy_report(dp, result: TrainResult, data_report, batch_size, init, estimator,
                   defaults) -> dict:
    """The trained predictor's ``privacy_report`` (JSON-ready): ``TrainResult.summary()`` plus
    the estimator, data, initial weights, defaults and trainer settings."""
    est = type(dp.estimator)
    report = {"format": REPORT_FORMAT, "estimator": f"{est.__module__}.{est.__qualname__}",
              "batch_size": batch_size}
    report.update(result.summary())
    report["data"] = data_report.to_dict()
    report["init_weights"] = init
    report["lr"] = float(estimator.lr)
    report["tail_average"] = dp.tail_average
    report["defaults"] = defaults
    report["trainer_kwargs"] = {
        "honoured": dict(dp.trainer_settings.honoured),
        "replaced_gluonts_defaults": parity.gluonts_default_trainer_kwargs(dp.estimator)}
    count = int(getattr(dp.estimator, "num_feat_static_cat", 0) or 0)
    report["static_features"] = None if count == 0 else {
        "num_feat_static_cat": count,
        "cardinality": list(getattr(dp.estimator, "cardinality", None) or []),
        "privacy": "public metadata, like the series ids: not protected (the neighbouring "
                   "relation changes target values only)"}
    return _json_ready(report)
