"""gluonts torch estimators prepared for per-window DP-SGD.

:func:`build_estimator` creates a gluonts estimator (``"deepar"``, ``"dlinear"`` or
``"simpleff"``) with small CPU-friendly defaults and :func:`prepare_estimator` returns the pieces
DP training needs: the data transformation, the Lightning module (with DP-safe layers), the
window splitter and the names of the model's training inputs.

What "DP-safe" means here (each point is needed for per-window clipping to bound one window's
influence, Algorithm 2 of Schuchardt et al., ICML 2025):

* ``nn.LSTM`` is replaced by :class:`~opacus_structured.forecasting.fast_rnn.FastDPLSTM`
  (``lstm_impl="fast"``, the default: the same per-sample gradients, much faster) or by Opacus'
  ``DPLSTM`` (``lstm_impl="opacus"``, via ``ModuleValidator.fix``), so per-sample gradients
  exist for every parameter.
* gluonts' ``MeanScaler`` without ``default_scale`` falls back to a **batch-wide** scale for a
  window whose context is entirely unobserved (e.g. the all-padding window at split point 0): the
  gradient of one window would then depend on the other windows in the batch, and per-window
  clipping would not bound its sensitivity. :func:`per_window_scalers` replaces such scalers by
  ``MeanScaler(default_scale=1.0)`` (a constant), so every window is scaled from its own context
  only.
* DeepAR's dropout defaults to 0 (the paper's setting) and no batch norm is used.

The **model input window** is ``past_length`` steps (for DeepAR ``context_length + max(lags) -
1`` in gluonts' 1-based lag convention, i.e. every past value a lag can reach); that is the
``L_C`` the structured accountant must be given (every past value the model reads: context plus the largest lag).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from .._validation import check_int
from .baseline_skip import SKIP_FEATURES, BaselineSkipDLinearEstimator
from .fast_rnn import replace_lstm
from .model_defaults import default_context_length as _table_context_length
from .model_defaults import model_defaults
from .seasonality import season_length as default_season_length

__all__ = ["MODELS", "LSTM_IMPLS", "ESTIMATOR_CLASSES", "build_estimator", "prepare_estimator",
           "PreparedModel", "per_window_scalers", "default_context_length", "estimator_model",
           "dp_safe_network", "check_static_cats"]

MODELS = ("deepar", "dlinear", "simpleff")
#: LSTM implementations for DP training: "fast" (FastDPLSTM) or "opacus" (DPLSTM).
LSTM_IMPLS = ("fast", "opacus")


def default_context_length(model: str, prediction_length: int) -> int:
    """Default context length (before lags) per model: ``context_multiple`` × L_F from
    :data:`~opacus_structured.forecasting.model_defaults.MODEL_DEFAULTS` (3 × L_F for DLinear
    and SimpleFeedForward, 2 × L_F for DeepAR)."""
    _check_model(model)
    return _table_context_length(model, prediction_length)


def _check_model(model: str) -> str:
    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}")
    return model


#: gluonts torch estimator class (module path, class name) of every model in :data:`MODELS`.
ESTIMATOR_CLASSES = {
    "dlinear": ("gluonts.torch.model.d_linear", "DLinearEstimator"),
    "simpleff": ("gluonts.torch.model.simple_feedforward", "SimpleFeedForwardEstimator"),
    "deepar": ("gluonts.torch.model.deepar", "DeepAREstimator"),
}


def estimator_model(estimator) -> str:
    """The model name (one of :data:`MODELS`) of a user-built gluonts estimator.

    ``DLinearEstimator`` → ``"dlinear"``, ``SimpleFeedForwardEstimator`` → ``"simpleff"``,
    ``DeepAREstimator`` → ``"deepar"`` (subclasses included); any other object raises a
    ValueError naming the supported classes. Only these three are supported because DP training
    needs to know the network's training inputs and that every layer has per-window gradients.
    """
    import importlib

    for name, (module, cls) in ESTIMATOR_CLASSES.items():
        if isinstance(estimator, getattr(importlib.import_module(module), cls)):
            return name
    supported = ", ".join(f"{m}.{c}" for m, c in ESTIMATOR_CLASSES.values())
    raise ValueError(f"unsupported estimator {type(estimator).__module__}."
                     f"{type(estimator).__qualname__}: DP training supports the gluonts torch "
                     f"estimators {supported}")


def _check_user_estimator(model: str, estimator) -> None:
    """Reject estimator settings that per-window DP-SGD on a target-only panel cannot honour."""
    if model == "simpleff" and getattr(estimator, "batch_norm", False):
        raise ValueError("batch_norm=True mixes windows in a batch; per-window clipping needs "
                         "SimpleFeedForwardEstimator(batch_norm=False)")
    if model == "deepar":
        extra = {k: getattr(estimator, k, 0) for k in
                 ("num_feat_dynamic_real", "num_feat_static_real")}
        extra = {k: v for k, v in extra.items() if v}
        if extra:
            raise ValueError(f"DP training reads target-only panels (no covariates; static "
                             f"categorical features only: num_feat_static_cat), but the "
                             f"DeepAREstimator expects {extra}: set them to 0 (real-valued "
                             f"covariates would need a neighbouring relation that covers them)")


def check_static_cats(estimator, panel) -> None:
    """Raise ValueError unless ``panel`` carries the static categorical features that
    ``estimator`` (a ``DeepAREstimator`` with ``num_feat_static_cat > 0``) reads: one tuple of
    ``num_feat_static_cat`` ints per series, feature ``j`` in ``[0, cardinality[j])`` (the
    rows of its embedding). Estimators without static features accept any panel (gluonts
    drops the field, as it does without DP)."""
    count = int(getattr(estimator, "num_feat_static_cat", 0) or 0)
    if count == 0:
        return
    cats = getattr(panel, "static_cats", None)
    if cats is None:
        raise ValueError(f"the estimator reads num_feat_static_cat={count} static categorical "
                         f"features but the training data has none: give each series its "
                         f"'feat_static_cat' (a gluonts dataset) or pass a Panel with "
                         f"static_cats")
    cardinality = list(getattr(estimator, "cardinality", None) or [])
    if len(cardinality) != count:
        raise ValueError(f"cardinality={cardinality} must list one count per static "
                         f"categorical feature (num_feat_static_cat={count})")
    for item, row in zip(panel.item_ids, cats, strict=True):
        if len(row) != count:
            raise ValueError(f"series {item!r} has {len(row)} static categorical features, "
                             f"the estimator reads num_feat_static_cat={count}")
        for j, (value, card) in enumerate(zip(row, cardinality, strict=True)):
            if not 0 <= int(value) < int(card):
                raise ValueError(f"series {item!r}: feat_static_cat[{j}]={value} is outside "
                                 f"[0, cardinality[{j}]={card})")


def build_estimator(model: str, *, freq: str, prediction_length: int,
                    context_length: Optional[int] = None, batch_size: int = 32,
                    lr: float = 1e-3, weight_decay: float = 1e-8, **kwargs: Any):
    """A gluonts torch estimator with small defaults (override any estimator argument).

    Defaults: DLinear hidden 20, kernel 13, with the baseline skip of
    :mod:`~opacus_structured.forecasting.baseline_skip` (``baseline_skip=False``: gluonts'
    plain ``DLinearEstimator``; ``season_length`` default from ``freq``; the recipe's
    ``skip_features`` with its prior ``skip_init`` and ``skip_scale``, and its prediction-time
    ``history_methods`` read from ``local_history_length = local_history_multiple · L_F``
    past steps, unless ``skip_features`` is given, then these are the given ones, default
    none); SimpleFeedForward hidden [64, 64], no batch norm;
    DeepAR 2 layers × 40, dropout 0, lags ``[1, 2, 3, 12, 13]`` (monthly seasonality) and
    ``default_scale=1.0``. All output Student-t distributions (gluonts' default).
    """
    _check_model(model)
    h = check_int("prediction_length", prediction_length, minimum=1)
    ctx = default_context_length(model, h) if context_length is None else check_int(
        "context_length", context_length, minimum=1)
    batch_size = check_int("batch_size", batch_size, minimum=1)
    common = dict(prediction_length=h, context_length=ctx, batch_size=batch_size, lr=lr,
                  weight_decay=weight_decay)
    if model == "dlinear":
        from gluonts.torch.model.d_linear import DLinearEstimator

        skip = kwargs.pop("baseline_skip", True)
        season = kwargs.pop("season_length", None)
        gain = kwargs.pop("skip_gain", None)
        features = kwargs.pop("skip_features", None)
        init = kwargs.pop("skip_init", None)
        scale_init = kwargs.pop("skip_scale", None)
        history = kwargs.pop("local_history_length", None)
        history_methods = kwargs.pop("history_methods", None)
        params = dict(hidden_dimension=20, kernel_size=13)
        params.update(common, **kwargs)
        if params["kernel_size"] % 2 == 0:
            raise ValueError(f"kernel_size must be odd, got {params['kernel_size']}")
        if not skip:
            if (season, gain, features, init, scale_init, history,
                    history_methods) != (None,) * 7:
                raise ValueError("season_length, skip_gain, skip_features, skip_init, "
                                 "skip_scale, local_history_length and history_methods are "
                                 "read by the baseline skip only: drop them or keep "
                                 "baseline_skip=True")
            return DLinearEstimator(**params)
        season = (default_season_length(freq) if season is None
                  else check_int("season_length", season, minimum=1))
        recipe = model_defaults("dlinear")
        gain = recipe["skip_gain"] if gain is None else gain
        if features is None:  # the recipe's features and their initial weights
            features = tuple(recipe.get("skip_features", SKIP_FEATURES))
            if init is None and recipe.get("skip_init"):
                init = tuple(float(recipe["skip_init"].get(f, 0.0)) for f in features)
            if scale_init is None:
                scale_init = recipe.get("skip_scale")
            if history_methods is None:
                history_methods = tuple(recipe.get("history_methods") or ())
            if history is None and recipe.get("local_history_multiple"):
                history = int(recipe["local_history_multiple"]) * h
        return BaselineSkipDLinearEstimator(season_length=season, skip_gain=gain,
                                            skip_features=tuple(features), skip_init=init,
                                            skip_scale=scale_init, local_history_length=history,
                                            history_methods=tuple(history_methods or ()),
                                            **params)
    if model == "simpleff":
        from gluonts.torch.model.simple_feedforward import SimpleFeedForwardEstimator

        params = dict(hidden_dimensions=[64, 64], batch_norm=False)
        params.update(common, **kwargs)
        if params["batch_norm"]:
            raise ValueError("batch_norm=True mixes windows in a batch; per-window clipping "
                             "needs batch_norm=False")
        return SimpleFeedForwardEstimator(**params)
    from gluonts.torch.model.deepar import DeepAREstimator

    params = dict(freq=freq, num_layers=2, hidden_size=40, dropout_rate=0.0,
                  lags_seq=[1, 2, 3, 12, 13], default_scale=1.0)
    params.update(common, **kwargs)
    return DeepAREstimator(**params)


def per_window_scalers(module) -> int:
    """Replace batch-coupled gluonts ``MeanScaler``\\ s in ``module`` (recursively); returns the count.

    A ``MeanScaler`` with ``default_scale=None`` uses the batch's mean scale for windows with no
    observed context value, which makes one window's gradient depend on the others.
    """
    from gluonts.torch.scaler import MeanScaler

    count = 0
    for sub in module.modules():
        for name, value in list(vars(sub).items()):
            if isinstance(value, MeanScaler) and value.default_scale is None:
                setattr(sub, name, MeanScaler(dim=value.dim, keepdim=value.keepdim,
                                              default_scale=1.0,
                                              minimum_scale=value.minimum_scale))
                count += 1
    return count


@dataclasses.dataclass
class PreparedModel:
    """Everything DP training needs from one gluonts estimator.

    Fields:

    * ``name``: model name (one of :data:`MODELS`).
    * ``estimator``: the gluonts estimator (used again for ``create_predictor``).
    * ``transformation``: the estimator's data transformation (applied with ``is_train=True``).
    * ``module``: the Lightning module, with DP-safe layers (``module.model`` is the network).
    * ``splitter``: the estimator's training ``InstanceSplitter``; its ``past_length`` is the
      model input window ``L_C`` and its ``future_length`` is ``L_F``.
    * ``input_names``: the batch fields the training step reads.

    """

    name: str
    estimator: Any
    transformation: Any
    module: Any
    splitter: Any
    input_names: list

    @property
    def past_length(self) -> int:
        """Model input window L_C (lags included): what the accountant must be given."""
        return int(self.splitter.past_length)

    @property
    def prediction_length(self) -> int:
        return int(self.splitter.future_length)

    def create_predictor(self):
        """gluonts predictor for the (trained) module."""
        return self.estimator.create_predictor(self.transformation, self.module)


def _training_input_names(model: str) -> list:
    if model == "dlinear":
        from gluonts.torch.model.d_linear.estimator import TRAINING_INPUT_NAMES
    elif model == "simpleff":
        from gluonts.torch.model.simple_feedforward.estimator import TRAINING_INPUT_NAMES
    else:
        from gluonts.torch.model.deepar.estimator import TRAINING_INPUT_NAMES
    return list(TRAINING_INPUT_NAMES)


def dp_safe_network(network, lstm_impl: str = "fast"):
    """``network`` with DP-safe layers, and the remaining ``ModuleValidator`` errors.

    ``lstm_impl="fast"`` replaces ``nn.LSTM`` by ``FastDPLSTM``
    (:func:`~opacus_structured.forecasting.fast_rnn.replace_lstm`), ``"opacus"`` lets
    ``ModuleValidator.fix`` replace it by ``DPLSTM`` (both copy the weights); then
    :func:`per_window_scalers` removes batch-coupled scaling (in place). Deterministic in the
    network's architecture, and a no-op on a network that is already DP-safe (the same object
    is returned): applying it to a freshly built gluonts network gives the trained network's
    architecture again, which is how a serialized DP predictor is rebuilt
    (:class:`~opacus_structured.forecasting.dp_estimator.DPPyTorchPredictor`).
    """
    import torch.nn as nn
    from opacus.layers import DPLSTM
    from opacus.validators import ModuleValidator

    if lstm_impl not in LSTM_IMPLS:
        raise ValueError(f"lstm_impl must be one of {LSTM_IMPLS}, got {lstm_impl!r}")
    training = network.training
    network.train()  # Opacus validates modules in training mode only
    if lstm_impl == "fast" and any(isinstance(m, (nn.LSTM, DPLSTM)) for m in network.modules()):
        network = replace_lstm(network)
    if ModuleValidator.validate(network, strict=False):
        network = ModuleValidator.fix(network)
    per_window_scalers(network)
    errors = ModuleValidator.validate(network, strict=False)
    network.train(training)
    return network, errors


def prepare_estimator(model: Optional[str], estimator=None, *, lstm_impl: str = "fast",
                      **build_kwargs) -> PreparedModel:
    """Build (or take) an estimator and return its :class:`PreparedModel` with DP-safe layers.

    With ``estimator`` (a user-built ``DLinearEstimator``, ``SimpleFeedForwardEstimator`` or
    ``DeepAREstimator``) no build arguments may be given; ``model`` may be ``None`` (inferred by
    :func:`estimator_model`) or must name the estimator's model.

    The network is made DP-safe by :func:`dp_safe_network`; ``ModuleValidator.validate`` must
    then report no error, otherwise a ValueError lists them.
    """
    if lstm_impl not in LSTM_IMPLS:
        raise ValueError(f"lstm_impl must be one of {LSTM_IMPLS}, got {lstm_impl!r}")
    if estimator is None:
        if model is None:
            raise ValueError(f"pass a model name (one of {MODELS}) or an estimator")
        _check_model(model)
        estimator = build_estimator(model, **build_kwargs)
    else:
        if build_kwargs:
            raise ValueError("pass either an estimator or build arguments, not both")
        inferred = estimator_model(estimator)
        if model is not None and _check_model(model) != inferred:
            raise ValueError(f"model={model!r} does not match the estimator "
                             f"{type(estimator).__name__} ({inferred!r})")
        model = inferred
        _check_user_estimator(model, estimator)
    if getattr(estimator, "lead_time", 0) != 0:
        raise ValueError("lead_time must be 0 (the structured accountant assumes the forecast "
                         "window starts right after the context)")
    transformation = estimator.create_transformation()
    module = estimator.create_lightning_module()
    module.model, errors = dp_safe_network(module.model, lstm_impl)
    if errors:
        raise ValueError(f"model {model!r} is not compatible with per-sample clipping: {errors}")
    splitter = estimator._create_instance_splitter(module, "training")
    if splitter.lead_time != 0:
        raise ValueError("the training splitter has lead_time != 0")
    return PreparedModel(model, estimator, transformation, module, splitter,
                         _training_input_names(model))
