r"""gluonts-native DP training: :class:`DPEstimator` wraps a gluonts torch estimator.

.. code-block:: python

    from gluonts.torch.model.deepar import DeepAREstimator
    from opacus_structured.forecasting.dp_estimator import DPEstimator

    dp = DPEstimator(DeepAREstimator(freq="M", prediction_length=12, context_length=24,
                                     lags_seq=[1, 2, 3, 12, 13]),
                     epsilon=1.0, delta=1e-7, max_steps=1000, batch_size=64)
    predictor = dp.train(train_ds)          # a gluonts PyTorchPredictor (subclass)
    predictor.privacy_report["epsilon"]     # ε spent, at predictor.privacy_report["delta"]
    predictor.serialize(path)               # also writes path / "privacy_report.json"
    Predictor.deserialize(path).privacy_report   # the report comes back with the model

``train`` returns a :class:`DPPyTorchPredictor`, a ``PyTorchPredictor`` subclass, so
``make_evaluation_predictions``, ``Evaluator``, ``predictor.serialize`` and gluonts'
``Predictor.deserialize`` work unchanged.

What is trained, and how
------------------------

``train`` reads the data with :func:`~opacus_structured.forecasting.user_data.load_panel` (a
gluonts dataset, a ``pandas.DataFrame``, a CSV path or a
:class:`~opacus_structured.forecasting.data.Panel`) and trains the estimator's network with
:func:`~opacus_structured.forecasting.training.train_forecaster` — the one DP wiring path of
the package (structured-subsampling DP-SGD through ``DPCallback``; nothing here re-wires DP).
One step (Algorithm 1 of Schuchardt et al., ICML 2025, λ = 1):

1. ``Λ = batch_size`` distinct series are drawn without replacement out of the ``N`` training
   series, and one window start per drawn series, uniform over the ``L_n − L_F + 1`` split
   points (with ``L_C`` zeros prepended);
2. each window (context ``L_C`` = the network's ``past_length``, lags included, forecast
   ``L_F`` = ``prediction_length``) gives one gradient, clipped to norm ``C =
   max_grad_norm``; ``N(0, σ²C²I)`` is added to the sum, which is divided by ``Λ``; Adam steps
   (``lr`` and ``weight_decay`` of the estimator);
3. the structured accountant prices the step (Theorem 4.4: ``P = (1 − ρr)·N(0, σ) +
   ρr·N(2, σ)`` against ``N(0, σ)``, ``ρ = Λ/N``, ``r = (L_C + L_F)/(L − L_F + 1)``, ``L`` the
   shortest training series), composed over the steps with privacy-loss distributions.

``σ`` is calibrated before any data is touched so that ``max_steps`` (or ``epochs``) steps
spend at most ``epsilon`` at ``delta``; with ``noise_multiplier`` given, ``σ`` is fixed and
training stops before the first step that would exceed ``epsilon`` (or runs all steps and
reports ε when ``epsilon`` is ``None``).

What ε covers
-------------

The released network weights — and so every forecast the predictor makes, which is
post-processing — are (ε, δ)-DP with respect to the *training data* under the scheme's
neighbouring relation: by default **1-event**, one time step of one series changes (a
substitution; the report's ``scheme.relation`` / ``scheme.w``). The protection of each series
comes from structured subsampling: a value reaches a step only through the few windows that
contain it, only if its series is drawn, and then only through a clipped, noised gradient.

Not covered: the *inputs* given to ``predict`` (forecasts condition on them without noise; see
:mod:`~opacus_structured.forecasting.private_inference` for inference-time privacy),
hyper-parameter choices, and the data report's metadata (number of series, lengths, excluded,
filled and trimmed series, which the accountant and the report treat as public).

A run with ``seed`` draws its sampler and noise from that seed: it is reproducible and **not
private** (whoever knows the seed regenerates the noise); its report says ``"private":
false`` with ``"not_private_reason"``. Leave ``seed=None`` (fresh OS entropy, recorded
nowhere) for a model you release. ``init_seed`` seeds only public randomness (initialisation,
forecast sampling).

The estimator
-------------

Supported: gluonts' ``DLinearEstimator``, ``SimpleFeedForwardEstimator`` (``batch_norm=False``)
and ``DeepAREstimator`` (no covariates), with ``lead_time=0``. Its network, transformation,
``prediction_length``, ``context_length`` (and lags), ``lr`` and ``weight_decay`` are used as
they are; the layers are made DP-safe (``nn.LSTM`` → ``FastDPLSTM`` or Opacus' ``DPLSTM``,
batch-coupled ``MeanScaler`` → ``default_scale=1.0``). Its ``trainer_kwargs`` (e.g. gluonts'
``gradient_clip_val``), training sampler, ``num_batches_per_epoch`` and early stopping are
**not** used: steps, batches and clipping are DP-SGD's. ``batch_size`` (default: the
estimator's) is Λ, the number of series per step that the accountant prices; the estimator's
own ``batch_size`` is only the predictor's inference batch size.

Serialization
-------------

:class:`DPPyTorchPredictor` records the report (and the DP layer choice) as constructor
arguments, so gluonts writes them into ``predictor.json`` and its ``Predictor.deserialize`` —
which dispatches on the class named in ``gluonts-config.json`` — rebuilds a
``DPPyTorchPredictor`` with the report; the rebuilt network gets the same DP-safe layers
before the trained weights are loaded, so forecasts are unchanged. ``serialize`` also writes
the report as ``privacy_report.json`` for people and other tools.
"""

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

from .._validation import check_int, check_open_unit, check_positive
from ..accounting import pld as pld_lib
from .estimators import LSTM_IMPLS, _check_user_estimator, dp_safe_network, estimator_model
from .provenance import json_ready as _json_ready
from .training import DEFAULT_MAX_GRAD_NORM, TrainResult, train_forecaster
from .user_data import load_panel

__all__ = ["DPEstimator", "DPPyTorchPredictor", "REPORT_FILE", "REPORT_FORMAT"]

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


def _check_tail_average(value) -> float:
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"tail_average must be in [0, 1] (fraction of the last steps whose "
                         f"iterates are averaged), got {value}")
    return value


class DPEstimator:
    """Differentially private training of a gluonts torch estimator (see the module docstring).

    Args:
        estimator: a gluonts ``DLinearEstimator``, ``SimpleFeedForwardEstimator`` or
            ``DeepAREstimator`` (``lead_time=0``); its network and settings are trained as
            they are, with DP-safe layers.
        epsilon: target ε (> 0, finite): σ is calibrated so that the planned steps spend at
            most ``epsilon`` at ``delta``. ``None`` needs ``noise_multiplier`` (ε reported).
        delta: δ in (0, 1), e.g. ``1e-7``; well below ``1 / number of series``.
        max_steps: number of DP-SGD steps (>= 1); or ``epochs`` (> 0; one epoch is
            ``floor(N / batch_size)`` steps, rounded up). Exactly one of the two.
        batch_size: Λ, series drawn per step (one window each), ``1 <= Λ <= N``; default the
            estimator's ``batch_size``.
        max_grad_norm: per-window clipping norm ``C`` (> 0).
        noise_multiplier: fixed σ (> 0) instead of calibrating it; with ``epsilon`` training
            stops before the step that would exceed it.
        seed: seeds the sampler and the noise: reproducible, hence **not private** (the report
            says so). ``None`` (default): fresh OS entropy, recorded nowhere.
        init_seed: seeds only the public randomness (initialisation, forecast sampling).
        init_state: initial weights (a ``state_dict`` of the estimator's network) to
            fine-tune from: the package's public pretrained weights, weights declared public
            (``init_public``), or an earlier run's weights with its ``init_record`` (runs on
            the same data are composed; see :meth:`train_from` and
            :mod:`~opacus_structured.forecasting.provenance`).
        init_record: the privacy record of ``init_state`` (``predictor.privacy_report
            ["privacy_record"]`` of the run that trained it).
        init_public: declare ``init_state`` public (never trained on the training data).
        tail_average: fraction in [0, 1] of the last steps whose iterates are averaged (free
            post-processing).
        discretization: PLD grid (> 0) for calibration and reporting (pessimistic: a coarser
            grid only over-reports ε).
        progress: show a progress bar.
        device: ``"cpu"`` or ``"cuda"``.
        lstm_impl: ``"fast"`` (``FastDPLSTM``) or ``"opacus"`` (``DPLSTM``) for DeepAR.
        grad_sample_mode: ``"hooks"`` or ``"ghost"`` (book-keeping), the same ε.
        num_workers: DataLoader workers that cut windows.

    Attributes:
        last_result: the :class:`~opacus_structured.forecasting.training.TrainResult` of the
            latest :meth:`train` (``None`` before).
        last_data_report: the :class:`~opacus_structured.forecasting.user_data.DataReport` of
            the latest :meth:`train`.
    """

    def __init__(self, estimator, *, epsilon: Optional[float] = None,
                 delta: Optional[float] = None, max_steps: Optional[int] = None,
                 epochs: Optional[float] = None, batch_size: Optional[int] = None,
                 max_grad_norm: float = DEFAULT_MAX_GRAD_NORM,
                 noise_multiplier: Optional[float] = None, seed: Optional[int] = None,
                 init_seed: Optional[int] = None, init_state: Optional[dict] = None,
                 init_record: Optional[dict] = None, init_public: bool = False,
                 tail_average: float = 0.0,
                 discretization: float = pld_lib.DEFAULT_DISCRETIZATION,
                 progress: bool = False, device: str = "cpu", lstm_impl: str = "fast",
                 grad_sample_mode: str = "hooks", num_workers: int = 0):
        self.model = estimator_model(estimator)  # raises for unsupported estimators
        _check_user_estimator(self.model, estimator)
        if getattr(estimator, "lead_time", 0) != 0:
            raise ValueError(f"estimator lead_time must be 0 (the structured accountant "
                             f"assumes the forecast window starts right after the context), "
                             f"got {estimator.lead_time}")
        self.estimator = estimator
        if delta is None:
            raise ValueError("delta is required, in (0, 1) (e.g. 1e-7)")
        self.delta = check_open_unit("delta", delta)
        if epsilon is None and noise_multiplier is None:
            raise ValueError("pass epsilon (> 0; the noise multiplier is calibrated to it) or "
                             "noise_multiplier (> 0; epsilon is reported): DPEstimator always "
                             "trains with DP-SGD (train the gluonts estimator itself for a "
                             "non-private baseline)")
        self.epsilon = None if epsilon is None else check_positive("epsilon", epsilon)
        self.noise_multiplier = (None if noise_multiplier is None
                                 else check_positive("noise_multiplier", noise_multiplier))
        if (max_steps is None) == (epochs is None):
            raise ValueError("pass exactly one of max_steps (>= 1) and epochs (> 0)")
        self.max_steps = None if max_steps is None else check_int("max_steps", max_steps,
                                                                  minimum=1)
        self.epochs = None if epochs is None else check_positive("epochs", epochs)
        self.batch_size = check_int("batch_size", estimator.batch_size if batch_size is None
                                    else batch_size, minimum=1)
        self.max_grad_norm = check_positive("max_grad_norm", max_grad_norm)
        self.seed = None if seed is None else check_int("seed", seed, minimum=0)
        self.init_seed = None if init_seed is None else check_int("init_seed", init_seed,
                                                                  minimum=0)
        if init_state is not None and not hasattr(init_state, "keys"):
            raise ValueError(f"init_state must be a state_dict (mapping of parameter names to "
                             f"tensors), got {type(init_state).__name__}")
        self.init_state = init_state
        if (init_record is not None or init_public) and init_state is None:
            raise ValueError("init_record / init_public describe init_state: pass init_state "
                             "too (or use train_from(predictor, ...))")
        self.init_record = init_record
        self.init_public = bool(init_public)
        self.tail_average = _check_tail_average(tail_average)
        self.discretization = check_positive("discretization", discretization)
        self.progress = bool(progress)
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        self.device = device
        if lstm_impl not in LSTM_IMPLS:
            raise ValueError(f"lstm_impl must be one of {LSTM_IMPLS}, got {lstm_impl!r}")
        self.lstm_impl = lstm_impl
        if grad_sample_mode not in ("hooks", "ghost"):
            raise ValueError(f"grad_sample_mode must be 'hooks' or 'ghost', got "
                             f"{grad_sample_mode!r}")
        self.grad_sample_mode = grad_sample_mode
        self.num_workers = check_int("num_workers", num_workers, minimum=0)
        self.last_result = None
        self.last_data_report = None

    # gluonts estimators expose these; evaluation helpers read them
    @property
    def prediction_length(self) -> int:
        return int(self.estimator.prediction_length)

    @property
    def lead_time(self) -> int:
        return 0

    def train(self, training_data, validation_data=None, *, freq: Optional[str] = None,
              fill: str = "error", min_length: int = 1):
        """Train with DP-SGD and return a :class:`DPPyTorchPredictor` with its report.

        Args:
            training_data: a gluonts dataset (``ListDataset``, ``PandasDataset``, any iterable
                of ``{"start", "target"}`` dicts), a ``pandas.DataFrame``, a CSV path or a
                :class:`~opacus_structured.forecasting.data.Panel`; read by
                :func:`~opacus_structured.forecasting.user_data.load_panel` (univariate
                targets, no covariates).
            validation_data: must be ``None``: validation-driven early stopping or checkpoint
                selection would consult data outside the guarantee. Evaluate the returned
                predictor instead (e.g. ``make_evaluation_predictions``).
            freq, fill, min_length: passed to ``load_panel`` (frequency, interior missing
                values, shortest series kept); every exclusion is in the report's ``"data"``.

        Returns:
            a ``DPPyTorchPredictor`` (a gluonts ``PyTorchPredictor``) whose
            ``privacy_report`` is :meth:`TrainResult.summary` plus ``"format"``,
            ``"estimator"``, ``"batch_size"`` and ``"data"`` (the ``DataReport``).
        """
        return self._train(training_data, validation_data, freq=freq, fill=fill,
                           min_length=min_length, init_state=self.init_state,
                           init_record=self.init_record, init_public=self.init_public)

    def train_from(self, predictor, training_data, validation_data=None, *,
                   freq: Optional[str] = None, fill: str = "error", min_length: int = 1,
                   init_public: bool = False):
        """Train with DP-SGD starting from ``predictor``'s network weights (gluonts'
        ``Estimator.train_from``).

        A :class:`DPPyTorchPredictor` carries the privacy record of its weights (in
        ``privacy_report["privacy_record"]``): earlier runs on the same data are composed
        with this one (the report's ``"epsilon"`` covers all of them, ``"run_epsilon"`` this
        run; ``epsilon`` is the budget of the composition). Any other predictor's weights are
        used only when declared public (``init_public=True``: never trained on
        ``training_data``); otherwise ``ValueError``.
        """
        net = getattr(predictor, "prediction_net", None)
        if net is None:
            raise ValueError(f"train_from needs a gluonts PyTorchPredictor, got "
                             f"{type(predictor).__name__}")
        net = net.model if isinstance(getattr(net, "model", None), nn.Module) else net
        state = {k: v.detach().cpu().clone() for k, v in net.state_dict().items()}
        report = getattr(predictor, "privacy_report", None) or {}
        return self._train(training_data, validation_data, freq=freq, fill=fill,
                           min_length=min_length, init_state=state,
                           init_record=report.get("privacy_record"), init_public=init_public)

    def _train(self, training_data, validation_data, *, freq, fill, min_length, init_state,
               init_record, init_public):
        if validation_data is not None:
            raise ValueError("validation_data is not supported: early stopping or checkpoint "
                             "selection on validation data is not covered by the DP guarantee; "
                             "evaluate the returned predictor instead")
        panel, data_report = load_panel(training_data, freq=freq, fill=fill,
                                        min_length=min_length)
        if self.batch_size > len(panel):
            raise ValueError(f"batch_size={self.batch_size} exceeds the {len(panel)} training "
                             f"series ({data_report.summary()}): each step draws batch_size "
                             f"distinct series")
        result = train_forecaster(
            None, panel, estimator=self.estimator, batch_size=self.batch_size,
            epsilon=self.epsilon, delta=self.delta, noise_multiplier=self.noise_multiplier,
            max_grad_norm=self.max_grad_norm, max_steps=self.max_steps, epochs=self.epochs,
            device=self.device, seed=self.seed, init_seed=self.init_seed,
            progress=self.progress, discretization=self.discretization,
            init_state=init_state, init_record=init_record, init_public=init_public,
            tail_average=self.tail_average,
            lstm_impl=self.lstm_impl, grad_sample_mode=self.grad_sample_mode,
            num_workers=self.num_workers)
        self.last_result = result
        self.last_data_report = data_report
        report = self._report(result, data_report)
        return DPPyTorchPredictor.from_predictor(
            result.create_predictor(), privacy_report=report, lstm_impl=self.lstm_impl)

    def _report(self, result: TrainResult, data_report) -> dict:
        est = type(self.estimator)
        report = {"format": REPORT_FORMAT, "estimator": f"{est.__module__}.{est.__qualname__}",
                  "batch_size": self.batch_size}
        report.update(result.summary())
        report["data"] = data_report.to_dict()
        return _json_ready(report)
