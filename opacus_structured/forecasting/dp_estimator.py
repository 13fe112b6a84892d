r"""gluonts-native DP training: :class:`DPEstimator`, a gluonts ``Estimator`` wrapping a gluonts
torch estimator.

.. code-block:: python

    from opacus_structured.forecasting.dp_estimator import DPEstimator
    from opacus_structured.forecasting.estimators import build_estimator

    dp = DPEstimator(build_estimator("dlinear", freq="M", prediction_length=12),
                     epsilon=1.0, delta=1e-7)  # public weights, the CLI's recipe
    predictor = dp.train(train_ds)          # a gluonts PyTorchPredictor (subclass)
    predictor.privacy_report["epsilon"]     # ε spent, at predictor.privacy_report["delta"]
    predictor.serialize(path)               # also writes path / "privacy_report.json"
    Predictor.deserialize(path).privacy_report   # the report comes back with the model
    dp.train_from(predictor, train_ds)      # continues; the two runs' ε compose

``train`` returns a :class:`DPPyTorchPredictor`, a ``PyTorchPredictor`` subclass, so
``make_evaluation_predictions``, ``Evaluator``, ``backtest_metrics``, ``predictor.serialize``
and gluonts' ``Predictor.deserialize`` work unchanged. ``train``, ``train_model`` (gluonts'
``TrainOutput``) and ``train_from`` take gluonts' arguments; each gluonts setting is honoured
or refused with its reason, none is ignored
(:mod:`~opacus_structured.forecasting.gluonts_parity`).

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

Supported: gluonts' ``DLinearEstimator`` (and its subclass
:class:`~opacus_structured.forecasting.baseline_skip.BaselineSkipDLinearEstimator`, the
command's network), ``SimpleFeedForwardEstimator`` (``batch_norm=False``)
and ``DeepAREstimator`` (static categorical features allowed, no real-valued covariates), with
``lead_time=0``. Its network, transformation, ``prediction_length``, ``context_length`` (and
lags) and ``weight_decay`` are used as they are; the layers are made DP-safe (``nn.LSTM`` →
``FastDPLSTM`` or Opacus' ``DPLSTM``, batch-coupled ``MeanScaler`` → ``default_scale=1.0``).
Steps, batches and clipping are DP-SGD's: the estimator's ``trainer_kwargs`` are mapped onto
them or refused, its ``lr`` and ``batch_size`` are used when changed from gluonts' defaults
(else the recipe's), and its training sampler, ``num_batches_per_epoch`` (without
``max_epochs``) and DeepAR's ``patience`` are refused
(:mod:`~opacus_structured.forecasting.gluonts_parity`). ``batch_size`` is Λ, the number of
series per step that the accountant prices; the estimator's own ``batch_size`` is also the
predictor's inference batch size.

Defaults and the initial weights
--------------------------------

What the user does not set comes from
:mod:`~opacus_structured.forecasting.model_defaults`, the table ``opacus-structured forecast``
reads (``MODEL_DEFAULTS[model]``: clipping norm, learning rate from weights / from scratch,
steps, tail average; Λ = ``min(64, N)``, :data:`DEFAULT_MAX_BATCH_SIZE`), and training starts, as the command does, from the
package's public pretrained weights (:func:`~.pretraining.pretrained_weights`: shipped,
cached or pretrained now on the synthetic public corpus; public, so free). They were trained
with :func:`~.estimators.build_estimator`'s architecture. An estimator that differs in an
architecture argument (e.g. gluonts' own defaults: ``DLinearEstimator``'s ``kernel_size=25``)
still trains when ``init_from`` is left unset: from a random initialisation, with a
``UserWarning`` and ``privacy_report["init_weights"]["init"] = "random (no public weights for
kernel_size=25 (public weights: 13); ...)"``; an explicit ``init_from="public"`` is refused with
the differences (``init_from="none"`` says random on purpose).

Static categorical features
---------------------------

A ``DeepAREstimator(num_feat_static_cat=k, cardinality=[...])`` reads each series'
``feat_static_cat`` (a gluonts dataset's field, or ``Panel.static_cats``), checked against
``cardinality``. They are public metadata, like the series ids: neighbouring datasets differ in
target values only, so the guarantee protects the targets and not the categories (the report's
``"static_features"`` says so).

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
import math
import os
from typing import Optional

from gluonts.model.estimator import Estimator
from gluonts.torch.model.estimator import TrainOutput

from .._validation import check_int, check_open_unit, check_positive
from ..accounting import pld as pld_lib
from . import gluonts_parity as parity
from .dp_estimator_setup import (  # noqa: F401  (the old private names: re-exported)
    check_tail_average,
    initial_weights,
    privacy_report,
    public_weights,
    read_training_data,
    trainer_capture,
)
from .dp_estimator_setup import check_tail_average as _check_tail_average  # noqa: F401
from .dp_estimator_setup import trainer_capture as _trainer_capture  # noqa: F401
from .dp_predictor import REPORT_FILE, REPORT_FORMAT, DPPyTorchPredictor  # noqa: F401
from .estimators import LSTM_IMPLS, _check_user_estimator, estimator_model
from .model_defaults import check_zero_shot_weight, model_defaults
from .training import train_forecaster

__all__ = ["DPEstimator", "DPPyTorchPredictor", "REPORT_FILE", "REPORT_FORMAT",
           "DEFAULT_MAX_BATCH_SIZE"]

#: Largest default Λ: ``min(DEFAULT_MAX_BATCH_SIZE, N)`` series per step, the rule of
#: ``opacus-structured forecast`` (its ``DEFAULTS["batch_size"]``; a test keeps the two equal).
#: A ``"batch_size"`` in the model's row of ``model_defaults.MODEL_DEFAULTS`` overrides it.
DEFAULT_MAX_BATCH_SIZE = 64


class DPEstimator(Estimator):
    """Differentially private training of a gluonts torch estimator: a gluonts ``Estimator``
    (``train``, ``train_model``, ``train_from``; see the module docstring).

    Defaults come from the one table the command line reads too,
    :mod:`~opacus_structured.forecasting.model_defaults` (per model: clipping norm, learning
    rate, steps, tail average; Λ = ``min(64, N)``), and training starts from the
    package's public pretrained weights, as ``opacus-structured forecast`` does.

    Args:
        estimator: a gluonts ``DLinearEstimator``, ``SimpleFeedForwardEstimator`` or
            ``DeepAREstimator`` (``lead_time=0``); its network and settings are trained as
            they are, with DP-safe layers. Its ``trainer_kwargs`` and training settings are
            honoured or refused one by one (:mod:`~opacus_structured.forecasting.gluonts_parity`).
            For the public weights (the default start) build it with
            :func:`~opacus_structured.forecasting.estimators.build_estimator`, the architecture
            they were trained with.
        epsilon: target ε (> 0, finite): σ is calibrated so that the planned steps spend at
            most ``epsilon`` at ``delta``. ``None`` needs ``noise_multiplier`` (ε reported).
        delta: δ in (0, 1), e.g. ``1e-7``; well below ``1 / number of series``.
        max_steps: number of DP-SGD steps (>= 1); or ``epochs`` (> 0; one epoch is
            ``floor(N / batch_size)`` steps, rounded up). At most one of the two; without
            either, the estimator's ``trainer_kwargs`` ``max_steps`` / ``max_epochs`` (×
            ``num_batches_per_epoch``, gluonts' epoch), else the recipe's ``max_steps``.
        batch_size: Λ, series drawn per step (one window each), ``1 <= Λ <= N``. Default: the
            estimator's ``batch_size`` if you changed it from gluonts' 32, else
            ``min(64, N)`` for the ``N`` training series (the command's rule).
        max_grad_norm: per-window clipping norm ``C`` (> 0); default the model's recipe value.
        lr: Adam's learning rate (> 0). Default: the estimator's ``lr`` if you changed it from
            gluonts' 1e-3, else the recipe's (``lr`` when fine-tuning weights,
            ``lr_from_scratch`` from a random initialisation).
        noise_multiplier: fixed σ (> 0) instead of calibrating it; with ``epsilon`` training
            stops before the step that would exceed it.
        seed: seeds the sampler and the noise: reproducible, hence **not private** (the report
            says so). ``None`` (default): fresh OS entropy, recorded nowhere.
        init_seed: seeds only the public randomness (initialisation, forecast sampling).
        init_from: where training starts: ``"public"`` (the package's public pretrained
            weights for the model, the panel's frequency, ``prediction_length`` and
            ``context_length``: shipped, cached, or pretrained now on the synthetic public
            corpus, as the CLI's ``--init-from public``), ``"none"`` (random initialisation),
            or the path of a weights file written by ``--save-weights`` /
            ``TrainResult.save_weights`` / ``opacus-structured pretrain`` (its privacy record
            comes with it). Default: ``"public"``, or ``init_state`` when given; left unset for
            an architecture the public weights do not have, a labelled random start (a
            warning and the report's ``init_weights``).
        init_state: initial weights (a ``state_dict`` of the estimator's network): weights
            declared public (``init_public``), or an earlier run's weights with its
            ``init_record`` (runs on the same data are composed; see :meth:`train_from` and
            :mod:`~opacus_structured.forecasting.provenance`).
        init_record: the privacy record of ``init_state`` (``predictor.privacy_report
            ["privacy_record"]`` of the run that trained it).
        init_public: declare ``init_state`` (or the ``init_from`` file) public: never trained
            on the training data.
        tail_average: fraction in [0, 1] of the last steps whose iterates are averaged (free
            post-processing); default the recipe's.
        zero_shot_weight: share ``w`` in [0, 1) of the public zero-shot model in the trained
            predictor's forecast, ``(1 − w)·fine-tuned + w·zero-shot``
            (:mod:`~opacus_structured.forecasting.zero_shot_mixture`; post-processing, no
            privacy cost; public initial weights only). Default: the recipe's (DLinear 0.5,
            DeepAR 0.1); ``0``: the fine-tuned network alone.
        season_length: the seasonal period of the public pretraining corpus (default from the
            frequency); used only with ``init_from="public"``.
        discretization: PLD grid (> 0) for calibration and reporting (pessimistic: a coarser
            grid only over-reports ε).
        progress: show a progress bar (default: ``trainer_kwargs["enable_progress_bar"]``,
            else off).
        device: ``"cpu"`` or ``"cuda"`` (default: ``trainer_kwargs["accelerator"]``, else
            ``"cpu"``).
        lstm_impl: ``"fast"`` (``FastDPLSTM``) or ``"opacus"`` (``DPLSTM``) for DeepAR.
        grad_sample_mode: ``"hooks"`` or ``"ghost"`` (book-keeping), the same ε.
        num_workers: DataLoader workers that cut windows.
        dataset_size: a declared **public** number of training series N (at most the
            panel's): the sampling rate, the epoch length and the default Λ then come from N,
            not from the data (``train_forecaster``'s ``dataset_size``). Default: the panel's
            own count, read from the data (a ``DatasetSizeFromDataWarning`` says so once).

    Attributes:
        last_result: the :class:`~opacus_structured.forecasting.training.TrainResult` of the
            latest training (``None`` before).
        last_data_report: the :class:`~opacus_structured.forecasting.user_data.DataReport` of
            the latest training.
    """

    def __init__(self, estimator, *, epsilon: Optional[float] = None,
                 delta: Optional[float] = None, max_steps: Optional[int] = None,
                 epochs: Optional[float] = None, batch_size: Optional[int] = None,
                 max_grad_norm: Optional[float] = None, lr: Optional[float] = None,
                 noise_multiplier: Optional[float] = None, seed: Optional[int] = None,
                 init_seed: Optional[int] = None, init_from: Optional[str] = None,
                 init_state: Optional[dict] = None, init_record: Optional[dict] = None,
                 init_public: bool = False, tail_average: Optional[float] = None,
                 zero_shot_weight: Optional[float] = None,
                 season_length: Optional[int] = None,
                 discretization: float = pld_lib.DEFAULT_DISCRETIZATION,
                 progress: Optional[bool] = None, device: Optional[str] = None,
                 lstm_impl: str = "fast", grad_sample_mode: str = "hooks",
                 num_workers: int = 0, dataset_size: Optional[int] = None):
        super().__init__(lead_time=0)
        self.model = estimator_model(estimator)  # raises for unsupported estimators
        _check_user_estimator(self.model, estimator)
        if getattr(estimator, "lead_time", 0) != 0:
            raise ValueError(f"estimator lead_time must be 0 (the structured accountant "
                             f"assumes the forecast window starts right after the context), "
                             f"got {estimator.lead_time}")
        # gluonts settings: honoured, replaced or refused, one by one (gluonts_parity.py)
        self.trainer_settings = parity.trainer_settings(estimator)
        own = parity.estimator_settings(estimator, self.model)
        self.estimator = estimator
        self.prediction_length = int(estimator.prediction_length)
        if delta is None:
            raise ValueError("delta is required, in (0, 1) (e.g. 1e-7)")
        self.delta = check_open_unit("delta", delta)
        if epsilon is None and noise_multiplier is None:
            raise ValueError("pass epsilon (> 0; the noise multiplier is calibrated to it) or "
                             "noise_multiplier (> 0; epsilon is reported): DPEstimator always "
                             "trains with DP-SGD (train the gluonts estimator itself for a "
                             "non-private baseline)")
        if epsilon is not None and not math.isfinite(float(epsilon)):
            raise ValueError(f"epsilon must be finite (DPEstimator always trains with DP-SGD), "
                             f"got {epsilon}")
        self.epsilon = None if epsilon is None else check_positive("epsilon", epsilon)
        self.noise_multiplier = (None if noise_multiplier is None
                                 else check_positive("noise_multiplier", noise_multiplier))
        if max_steps is not None and epochs is not None:
            raise ValueError("pass at most one of max_steps (>= 1) and epochs (> 0)")
        self.max_steps = None if max_steps is None else check_int("max_steps", max_steps,
                                                                  minimum=1)
        self.epochs = None if epochs is None else check_positive("epochs", epochs)
        trainer_steps = self.trainer_settings.get("steps")
        if trainer_steps is not None and (max_steps is not None or epochs is not None):
            raise ValueError(f"max_steps / epochs given twice: to DPEstimator and in the "
                             f"estimator's trainer_kwargs ({trainer_steps} steps); keep one")
        recipe = model_defaults(self.model)  # the model's row (model_defaults.py)
        self._batch_cap = int(recipe.get("batch_size", DEFAULT_MAX_BATCH_SIZE))
        self._lr_defaults = {key: recipe[key] for key in ("lr", "lr_from_scratch")}
        self.defaults = {}  # what came from the recipe table (model_defaults.py)
        if self.max_steps is None and self.epochs is None:
            if trainer_steps is not None:
                self.max_steps = int(trainer_steps)
            else:
                self.max_steps = int(recipe["max_steps"])
                self.defaults["max_steps"] = self.max_steps
        if batch_size is not None:
            self.batch_size = check_int("batch_size", batch_size, minimum=1)
        elif "batch_size" in own:
            self.batch_size = check_int("batch_size", own["batch_size"], minimum=1)
        else:
            self.batch_size = None  # min(64, N), fixed when the panel is read
        if lr is not None and "lr" in own and float(lr) != float(own["lr"]):
            raise ValueError(f"lr={lr} differs from the estimator's lr={own['lr']}: set it in "
                             f"one place")
        self.lr = None if lr is None and "lr" not in own else check_positive(
            "lr", lr if lr is not None else own["lr"])
        if max_grad_norm is None:
            max_grad_norm = recipe["max_grad_norm"]
            self.defaults["max_grad_norm"] = max_grad_norm
        self.max_grad_norm = check_positive("max_grad_norm", max_grad_norm)
        if tail_average is None:
            tail_average = recipe["tail_average"]
            self.defaults["tail_average"] = tail_average
        self.tail_average = check_tail_average(tail_average)
        self.seed = None if seed is None else check_int("seed", seed, minimum=0)
        self.init_seed = None if init_seed is None else check_int("init_seed", init_seed,
                                                                  minimum=0)
        if init_state is not None and not hasattr(init_state, "keys"):
            raise ValueError(f"init_state must be a state_dict (mapping of parameter names to "
                             f"tensors), got {type(init_state).__name__}")
        if init_from is not None and not isinstance(init_from, (str, os.PathLike)):
            raise ValueError(f"init_from must be 'public', 'none' or a weights file path, got "
                             f"{type(init_from).__name__}")
        if init_state is not None and init_from is not None:
            raise ValueError(f"init_from={init_from!r} and init_state both say where training "
                             "starts: pass one")
        if init_record is not None and init_state is None:
            raise ValueError("init_record describes init_state: pass init_state too (or use "
                             "train_from(predictor, ...))")
        if init_public and init_state is None and init_from in (None, "public", "none"):
            raise ValueError("init_public declares init_state (or an init_from file) public: "
                             "pass one of them")
        self.init_from = (None if init_state is not None else
                          "public" if init_from is None else os.fspath(init_from))
        self._init_given = init_state is not None or init_from is not None
        self.init_state = init_state
        self.init_record = init_record
        self.init_public = bool(init_public)
        self.zero_shot_weight = (None if zero_shot_weight is None
                                 else check_zero_shot_weight(zero_shot_weight))
        self.season_length = (None if season_length is None
                              else check_int("season_length", season_length, minimum=1))
        if self.season_length is not None and self.init_from != "public":
            raise ValueError("season_length sets the public pretraining corpus' period: it "
                             "applies to init_from='public' only")
        self.discretization = check_positive("discretization", discretization)
        if progress is not None and "progress" in self.trainer_settings and bool(
                progress) != self.trainer_settings["progress"]:
            raise ValueError("progress differs from trainer_kwargs['enable_progress_bar']: set "
                             "it in one place")
        self.progress = bool(self.trainer_settings.get("progress", False) if progress is None
                             else progress)
        if device is not None and device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        if device is not None and "device" in self.trainer_settings and \
                device != self.trainer_settings["device"]:
            raise ValueError(f"device={device!r} differs from trainer_kwargs['accelerator'] "
                             f"({self.trainer_settings['device']!r}): set it in one place")
        self.device = device or self.trainer_settings.get("device", "cpu")
        if lstm_impl not in LSTM_IMPLS:
            raise ValueError(f"lstm_impl must be one of {LSTM_IMPLS}, got {lstm_impl!r}")
        self.lstm_impl = lstm_impl
        if grad_sample_mode not in ("hooks", "ghost"):
            raise ValueError(f"grad_sample_mode must be 'hooks' or 'ghost', got "
                             f"{grad_sample_mode!r}")
        self.grad_sample_mode = grad_sample_mode
        self.num_workers = check_int("num_workers", num_workers, minimum=0)
        self.dataset_size = (None if dataset_size is None
                             else check_int("dataset_size", dataset_size, minimum=1))
        self.last_result = None
        self.last_data_report = None

    # ---- gluonts' Estimator API --------------------------------------------------------------
    def train(self, training_data, validation_data=None, shuffle_buffer_length=None,
              cache_data: bool = False, ckpt_path=None, *, freq: Optional[str] = None,
              fill: str = "error", min_length: int = 1, **kwargs):
        """Train with DP-SGD and return a :class:`DPPyTorchPredictor` with its report
        (gluonts' ``Estimator.train``).

        Args:
            training_data: a gluonts dataset (``ListDataset``, ``PandasDataset``, any iterable
                of ``{"start", "target"}`` dicts; ``feat_static_cat`` for a DeepAR with
                static categorical features), a ``pandas.DataFrame``, a CSV path or a
                :class:`~opacus_structured.forecasting.data.Panel`; read by
                :func:`~opacus_structured.forecasting.user_data.load_panel` (univariate
                targets).
            validation_data: must be ``None``: validation-driven early stopping or checkpoint
                selection would consult data outside the guarantee. Evaluate the returned
                predictor instead (e.g. ``make_evaluation_predictions``).
            shuffle_buffer_length: must be ``None`` (a shuffle buffer is another sampling
                scheme than the one the accountant prices).
            cache_data: honoured: the transformed panel is always held in memory.
            ckpt_path: must be ``None`` (a resumed Lightning checkpoint has no accountant; use
                :meth:`train_from`).
            freq, fill, min_length: passed to ``load_panel`` (frequency, interior missing
                values, shortest series kept); every exclusion is in the report's ``"data"``.
            kwargs: none accepted (gluonts ignores unknown keywords; this raises).

        Returns:
            a ``DPPyTorchPredictor`` (a gluonts ``PyTorchPredictor``) whose
            ``privacy_report`` is :meth:`TrainResult.summary` plus ``"format"``,
            ``"estimator"``, ``"batch_size"``, ``"data"`` (the ``DataReport``), ``"init_weights"``,
            ``"defaults"``, ``"trainer_kwargs"`` and ``"static_features"``.
        """
        parity.check_train_kwargs("train", shuffle_buffer_length=shuffle_buffer_length,
                                  ckpt_path=ckpt_path, cache_data=cache_data, **kwargs)
        return self.train_model(training_data, validation_data,
                                shuffle_buffer_length=shuffle_buffer_length,
                                cache_data=cache_data, ckpt_path=ckpt_path, freq=freq,
                                fill=fill, min_length=min_length).predictor

    def train_from(self, predictor, training_data, validation_data=None,
                   shuffle_buffer_length=None, cache_data: bool = False, ckpt_path=None, *,
                   freq: Optional[str] = None, fill: str = "error", min_length: int = 1,
                   init_public: bool = False):
        """Train with DP-SGD starting from ``predictor``'s network weights (gluonts'
        ``Estimator.train_from``).

        Privacy: fine-tuning weights that were trained on private data releases a model
        that went through both runs. A :class:`DPPyTorchPredictor` carries the privacy record
        of its weights (``privacy_report["privacy_record"]``): its earlier runs on the same
        data (a series id in common) are **composed** with this one — the report's
        ``"epsilon"`` covers all of them, ``"run_epsilon"`` this run alone, and ``epsilon``
        is the budget of the composition (refused when the earlier runs alone reach it).
        Runs on other data are listed, not composed. Any other predictor's weights (e.g. a
        gluonts estimator trained without DP) cannot be priced: they are refused with a
        ``ValueError`` unless declared public (``init_public=True``: never trained on
        ``training_data``). The DPEstimator's own ``init_from`` / ``init_state`` must be left
        unset (this method says where training starts).
        """
        parity.check_train_kwargs("train_from", shuffle_buffer_length=shuffle_buffer_length,
                                  ckpt_path=ckpt_path, cache_data=cache_data)
        net = getattr(predictor, "prediction_net", None)
        if net is None:
            raise ValueError(f"train_from needs a gluonts PyTorchPredictor, got "
                             f"{type(predictor).__name__}")
        if self._init_given:
            raise ValueError("train_from starts from the predictor's weights; this DPEstimator "
                             "was given init_from / init_state as well: build it without them")
        return self.train_model(training_data, validation_data, from_predictor=predictor,
                                shuffle_buffer_length=shuffle_buffer_length,
                                cache_data=cache_data, ckpt_path=ckpt_path, freq=freq,
                                fill=fill, min_length=min_length,
                                init_public=init_public).predictor

    def train_model(self, training_data, validation_data=None, from_predictor=None,
                    shuffle_buffer_length=None, cache_data: bool = False, ckpt_path=None, *,
                    freq: Optional[str] = None, fill: str = "error", min_length: int = 1,
                    init_public: bool = False, **kwargs) -> TrainOutput:
        """gluonts' ``PyTorchLightningEstimator.train_model``: a ``TrainOutput``
        (``transformation``, ``trained_net`` — the Lightning module, ``trainer`` — the
        Lightning ``Trainer`` that ran the DP steps, ``predictor`` — the
        :class:`DPPyTorchPredictor`). Arguments as :meth:`train`; ``from_predictor`` as
        :meth:`train_from`'s ``predictor`` (with ``init_public``)."""
        parity.check_train_kwargs("train_model", shuffle_buffer_length=shuffle_buffer_length,
                                  ckpt_path=ckpt_path, cache_data=cache_data, **kwargs)
        if from_predictor is not None and self._init_given:
            raise ValueError("train_from / from_predictor starts from the predictor's weights; "
                             "this DPEstimator was given init_from / init_state as well: build "
                             "it without them")
        if validation_data is not None:
            raise ValueError("validation_data is not supported: early stopping or checkpoint "
                             "selection on validation data is not covered by the DP guarantee; "
                             "evaluate the returned predictor instead")
        if init_public and from_predictor is None:
            raise ValueError("init_public applies to from_predictor / train_from; for "
                             "init_state pass init_public to DPEstimator")
        panel, data_report = read_training_data(self, training_data, freq=freq, fill=fill,
                                                min_length=min_length)
        start = initial_weights(self, panel, from_predictor, init_public)
        defaults = dict(self.defaults)
        batch_size = self.batch_size
        if batch_size is None:
            batch_size = min(self._batch_cap, self.dataset_size or len(panel))
            defaults["batch_size"] = f"min({self._batch_cap}, N)"
        if batch_size > len(panel):
            raise ValueError(f"batch_size={batch_size} exceeds the {len(panel)} training "
                             f"series ({data_report.summary()}): each step draws batch_size "
                             f"distinct series")
        lr = self.lr
        if lr is None:
            key = "lr" if start["state"] is not None else "lr_from_scratch"
            lr = self._lr_defaults[key]
            defaults["lr"] = f"{lr:g} ({key})"
        estimator = self.estimator
        if float(getattr(estimator, "lr", lr)) != float(lr):  # the same estimator, lr set
            estimator = type(estimator)(**{**estimator.__init_args__, "lr": lr})
        capture = trainer_capture()
        result = train_forecaster(
            None, panel, estimator=estimator, batch_size=batch_size,
            epsilon=self.epsilon, delta=self.delta, noise_multiplier=self.noise_multiplier,
            max_grad_norm=self.max_grad_norm, max_steps=self.max_steps, epochs=self.epochs,
            device=self.device, seed=self.seed, init_seed=self.init_seed,
            progress=self.progress, discretization=self.discretization,
            init_state=start["state"], init_record=start["record"],
            init_public=start["public"], tail_average=self.tail_average,
            zero_shot_weight=self.zero_shot_weight, lstm_impl=self.lstm_impl,
            grad_sample_mode=self.grad_sample_mode,
            num_workers=self.num_workers, dataset_size=self.dataset_size,
            callbacks=[*self.trainer_settings.get("callbacks", []), capture],
            trainer_options=self.trainer_settings.get("trainer_options"))
        self.last_result = result
        self.last_data_report = data_report
        report = privacy_report(self, result, data_report, batch_size, start["describe"],
                                estimator, defaults)
        predictor = DPPyTorchPredictor.from_predictor(
            result.create_predictor(), privacy_report=report, lstm_impl=self.lstm_impl)
        return TrainOutput(transformation=result.prepared.transformation,
                           trained_net=result.prepared.module, trainer=capture.trainer,
                           predictor=predictor)
