"""``DPPyTorchPredictor``: the gluonts predictor a :class:`~opacus_structured.forecasting.dp_estimator.DPEstimator`
returns, carrying its privacy report (split from :mod:`~opacus_structured.forecasting.dp_estimator`,
which re-exports it, so predictors saved before the split still deserialize)."""

# no ``from __future__ import annotations``: gluonts' @validated reads the annotations
import json
from pathlib import Path
from typing import List, Optional, Union

import torch
import torch.nn as nn
from gluonts.core.component import validated
from gluonts.model.forecast_generator import ForecastGenerator, SampleForecastGenerator
from gluonts.model.predictor import OutputTransform
from gluonts.torch.model.predictor import PyTorchPredictor
from gluonts.transform import Transformation

from .estimators import LSTM_IMPLS, dp_safe_network

__all__ = ["DPPyTorchPredictor", "REPORT_FILE", "REPORT_FORMAT"]

#: File name of the human-readable copy of the report written by ``serialize``.
REPORT_FILE = "privacy_report.json"
#: Version tag of the report layout (the ``"format"`` field).
REPORT_FORMAT = "opacus_structured.privacy_report/1"


class DPPyTorchPredictor(PyTorchPredictor):
    """A gluonts ``PyTorchPredictor`` trained with DP-SGD, carrying its privacy report.

    ``privacy_report`` (a JSON-ready dict: ε, δ, σ, steps, bound, scheme, data report, ...;
    see :class:`DPEstimator`) and ``lstm_impl`` are constructor arguments, so gluonts'
    own serialization stores them in ``predictor.json`` and ``Predictor.deserialize``
    restores them. On construction the network gets the DP-safe layers it was trained
    with (:func:`~opacus_structured.forecasting.estimators.dp_safe_network`; a no-op for
    the trained network, the same architecture again for one gluonts rebuilt from its
    arguments), so the saved weights load into it.
    """

    @validated()
    def __init__(
        self,
        input_names: List[str],
        prediction_net: nn.Module,
        batch_size: int,
        prediction_length: int,
        input_transform: Transformation,
        forecast_generator: ForecastGenerator = SampleForecastGenerator(),  # noqa: B008
        output_transform: Optional[OutputTransform] = None,
        lead_time: int = 0,
        device: Union[str, torch.device] = "auto",
        privacy_report: Optional[dict] = None,
        lstm_impl: str = "fast",
    ) -> None:
        if privacy_report is None:
            raise ValueError("a DPPyTorchPredictor needs its privacy_report")
        if lstm_impl not in LSTM_IMPLS:
            raise ValueError(f"lstm_impl must be one of {LSTM_IMPLS}, got {lstm_impl!r}")
        network = getattr(prediction_net, "model", None)
        if isinstance(network, nn.Module):
            prediction_net.model, errors = dp_safe_network(network, lstm_impl)
        else:
            prediction_net, errors = dp_safe_network(prediction_net, lstm_impl)
        if errors:
            raise ValueError(f"the prediction network has layers without per-sample "
                             f"gradients: {errors}")
        super().__init__(input_names=input_names, prediction_net=prediction_net,
                         batch_size=batch_size, prediction_length=prediction_length,
                         input_transform=input_transform,
                         forecast_generator=forecast_generator,
                         output_transform=output_transform, lead_time=lead_time,
                         device=device)
        self.privacy_report = dict(privacy_report)
        self.lstm_impl = lstm_impl

    @classmethod
    def from_predictor(cls, predictor, *, privacy_report: dict,
                       lstm_impl: str = "fast") -> "DPPyTorchPredictor":
        """The ``PyTorchPredictor`` ``predictor`` (same network object, transformation
        and settings) with ``privacy_report`` attached."""
        args = dict(getattr(predictor, "__init_args__", {}))
        if not args:
            raise ValueError(f"{type(predictor).__name__} has no recorded constructor "
                             "arguments (not a gluonts PyTorchPredictor?)")
        return cls(**args, privacy_report=privacy_report, lstm_impl=lstm_impl)

    def serialize(self, path: Path) -> None:
        """gluonts' serialization (the report is in ``predictor.json``) plus
        ``privacy_report.json``, a readable copy of the report; ``path`` is created if
        missing."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        super().serialize(path)
        with (path / REPORT_FILE).open("w") as fp:
            json.dump(self.privacy_report, fp, indent=2, sort_keys=True)
            fp.write("\n")

    @classmethod
    def deserialize(cls, path: Path, device=None) -> "DPPyTorchPredictor":
        """gluonts' ``PyTorchPredictor.deserialize``; the report comes back from
        ``predictor.json`` (``privacy_report.json`` is only a copy and is not read)."""
        predictor = super().deserialize(Path(path), device=device)
        if not isinstance(predictor, DPPyTorchPredictor):
            raise ValueError(f"{path} holds a {type(predictor).__name__}, not a "
                             "DPPyTorchPredictor")
        return predictor
