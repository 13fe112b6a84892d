"""DLinear with a learned skip to the free baselines (seasonal naive and naive).

A DP fine-tune from public weights barely moves a network's thousands of weights: every
coordinate gets noise ``σC/Λ`` per step, and Adam moves a noise-dominated coordinate at random.
On panels where the public weights are poor and the baselines are good (random walks, daily
cycles the synthetic corpus did not teach, levels after a break) the DP model then stays worse
than seasonal naive, which costs no privacy. :class:`BaselineSkipDLinearModel` gives the model
three more weights that can reach the baselines directly: the location of each forecast step
``h`` (in the scaler's units, before the affine de-scaling) is

.. math::

    \\mu'_h = \\mu_h + w_1\\,(\\tilde y_{T-m+(h \\bmod m)} - \\mu_h) + w_2\\,(\\tilde y_T - \\mu_h),

where ``μ_h`` is DLinear's own location, ``ỹ`` the scaled context, ``m`` the season length (the
seasonal-naive forecast; the naive one when ``m = 1`` or ``m`` exceeds the context) and ``ỹ_T``
its last value (the naive forecast); the two differences are multiplied by ``skip_gain`` before
the weights ``w`` (below). ``w = (0, 0)`` at the start, so the network forecasts
exactly as the public weights do (the zero-shot model is unchanged), and fine-tuning learns how
far to move towards each baseline. The inputs are *differences* to ``μ_h``: the three forecasts
are nearly collinear (all near the series' level), and on raw inputs Adam, which steps every
coordinate by about ``lr``, would move all weights together (a level bias) instead of learning
the mix. ``w`` is the weight of one ``nn.Linear(2, 1, bias=False)`` (``baseline_skip``): Opacus
has its per-window gradients, and DP-SGD prices it like any other weight. The released forecast is a
function of the DP weights and of the series' own context only, as DLinear's is.

**Local forecasts** (issue 47). ``skip_features`` chooses the inputs of the skip from the local
methods of :mod:`.local_forecasts`, each fitted on the window's own context: besides seasonal
naive and naive, the drift forecast, a damped-trend additive-seasonal ETS(A,Ad,A) and the Theta
method. The location becomes

.. math::

    \\mu'_h = \\mu_h + \\sum_k w_k \\cdot g\\,(f_{k,h} - \\mu_h),

a learned combination of the network and the local forecasts (as FFORMA combines forecasts,
Montero-Manso et al. 2020, with global rather than per-series weights), with ``g`` the gain.
The local forecasts are a deterministic function of the window's context (no parameter, no
other window), so per-window clipping bounds one window's influence as before: the privacy
analysis is unchanged. :data:`LOCAL_FEATURES` is the set the DLinear recipe uses;
:data:`FEATURES` adds ``"combination"``, the five combined per series by their backtest errors
(:mod:`.backtest_combination`; studied in issue 47 and not the recipe's).

``skip_init`` gives the effective weights ``g·w`` the skip starts at (a public prior; the
recipe's is ¼ seasonal naive + ¼ ETS + ¼ Theta, leaving ¼ to the network), so the zero-shot
model already combines the local methods and DP fine-tuning adapts the combination.
``skip_scale`` adds a **scale skip**: the distribution's scale ``s_h`` (in the scaler's units)
becomes

.. math::

    \\log s'_h = \\log s_h + v \\cdot g\\,(\\log \\sigma_h - \\log s_h),

with ``σ_h`` ETS's ``h``-step forecast standard deviation in the window
(:func:`~.local_forecasts.ets_forecast`, floored at :data:`MIN_ETS_STD`) and ``v`` the weight
of one more ``nn.Linear(1, 1, bias=False)`` (``scale_skip``) starting at ``skip_scale / g``.

Public weights are plain DLinear's (pretrained without the skip):
:meth:`BaselineSkipDLinearModel.load_state_dict` accepts such a state and starts the skip at
its initial weights (``skip_init``, else zero; the scale skip at ``skip_scale``).
``PretrainRecipe(skip_features=...)`` pretrains with the skip instead (:mod:`.pretraining`).

:class:`BaselineSkipDLinearEstimator` is gluonts' ``DLinearEstimator`` building this network
(``season_length`` is one more constructor argument, so gluonts' serialization of a predictor
rebuilds the same network).
"""

# no ``from __future__ import annotations``: gluonts' @validated reads the annotations
import math
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn as nn
from gluonts.core.component import validated
from gluonts.dataset.field_names import FieldName
from gluonts.torch.distributions import DistributionOutput, StudentTOutput
from gluonts.torch.model.d_linear import DLinearEstimator
from gluonts.torch.model.d_linear.lightning_module import DLinearLightningModule
from gluonts.torch.model.d_linear.module import DLinearModel
from gluonts.transform import InstanceSampler, InstanceSplitter, TestSplitSampler

from .._validation import check_finite, check_int, check_positive
from .backtest_combination import COMBINATION, backtest_combination
from .local_forecasts import METHODS, check_methods, local_forecasts_with_history

__all__ = ["BaselineSkipDLinearModel", "BaselineSkipDLinearLightningModule",
           "BaselineSkipDLinearEstimator", "SKIP_PARAMETER", "SKIP_FEATURES", "LOCAL_FEATURES",
           "SCALE_SKIP_PARAMETER", "MIN_ETS_STD", "skip_parameters", "describe_skip",
           "check_skip_init", "check_history_methods", "FEATURES", "check_skip_features",
           "skip_local_forecasts"]

#: The constructor arguments the skip adds to DLinear's (model and estimator alike).
_SKIP_ARGS = ("season_length", "skip_gain", "skip_features", "skip_init", "skip_scale",
             "history_methods")
#: The state_dict key of the skip's weight ``w`` (shape (1, K)).
SKIP_PARAMETER = "baseline_skip.weight"
#: The state_dict key of the scale skip's weight ``v`` (shape (1, 1)).
SCALE_SKIP_PARAMETER = "scale_skip.weight"
#: ETS's standard deviation is floored here (in the scaler's units) before its logarithm.
MIN_ETS_STD = 1e-4
#: The inputs of the original baseline skip, in order (each minus DLinear's own location
#: ``μ_h``): the default of the model and estimator classes.
SKIP_FEATURES = ("seasonal_naive", "naive")
#: The local forecasts of the DLinear recipe (``model_defaults``' ``skip_features``): all of
#: :data:`~.local_forecasts.METHODS`.
LOCAL_FEATURES = METHODS
#: Every name ``skip_features`` accepts: the local methods and their per-series backtest
#: combination (:mod:`.backtest_combination`).
FEATURES = (*METHODS, COMBINATION)


def check_skip_features(features) -> tuple:
    """``features`` as a tuple of distinct names from :data:`FEATURES`."""
    return check_methods(features, FEATURES)


def skip_local_forecasts(y, observed, window, m, horizon, features, history_methods=(), *,
                         with_ets_std=False, recent_std=False):
    """``(B, H, K)`` forecasts of the skip's ``features`` (:data:`FEATURES`) for inputs ``y``
    ``(B, T)``: :func:`~.local_forecasts.local_forecasts_with_history` for the local methods,
    and for ``"combination"`` :func:`~.backtest_combination.backtest_combination` over all
    five of :data:`~.local_forecasts.METHODS` (fitted as configured, once for both uses); with
    ``with_ets_std`` also ETS's ``(B, H)`` standard deviation."""
    features = check_skip_features(features)
    base = METHODS if COMBINATION in features else features
    out = local_forecasts_with_history(y, observed, window, m, horizon, base, history_methods,
                                       with_ets_std=with_ets_std, recent_std=recent_std)
    if COMBINATION not in features:
        return out
    forecasts, std = out if with_ets_std else (out, None)
    combined = backtest_combination(y, observed, window, m, horizon, METHODS, history_methods,
                                    forecasts=forecasts)
    columns = [combined if k == COMBINATION else forecasts[..., base.index(k)]
               for k in features]
    stacked = torch.stack(columns, dim=-1)
    return (stacked, std) if with_ets_std else stacked


#: The last prediction's local forecasts (``BaselineSkipDLinearModel.local_forecasts``):
#: reused, at prediction only (no autograd), when the next call has equal inputs.
_LAST_PREDICTION: dict = {}


class BaselineSkipDLinearModel(DLinearModel):
    #: ETS's spread from a prediction history: its one-step error over the last
    #: ``context_length`` steps (True) or over the whole history (False)
    recent_std = True

    """gluonts' ``DLinearModel`` whose location mixes in local forecasts (seasonal naive and
    naive by default; ``skip_features``) and whose scale can follow ETS's (module
    docstring). ``season_length`` ``m >= 1``; the distribution must have a ``loc`` argument
    (Student-t, normal, Laplace, ...)."""

    @validated()
    def __init__(self, prediction_length: int, context_length: int, hidden_dimension: int,
                 distr_output: DistributionOutput = StudentTOutput(),  # noqa: B008
                 kernel_size: int = 25, scaling: Optional[str] = "mean",
                 season_length: int = 1, skip_gain: float = 1.0,
                 skip_features: Tuple[str, ...] = SKIP_FEATURES,
                 skip_init: Optional[Tuple[float, ...]] = None,
                 skip_scale: Optional[float] = None,
                 history_methods: Tuple[str, ...] = ()) -> None:
        super().__init__(prediction_length=prediction_length, context_length=context_length,
                         hidden_dimension=hidden_dimension, distr_output=distr_output,
                         kernel_size=kernel_size, scaling=scaling)
        season_length = check_int("season_length", season_length, minimum=1)
        skip_gain = check_positive("skip_gain", skip_gain)
        self.skip_features = check_skip_features(skip_features)
        self.skip_init = check_skip_init(skip_init, self.skip_features)
        self.skip_scale = None if skip_scale is None else check_finite("skip_scale", skip_scale)
        self.history_methods = check_history_methods(history_methods)
        names = list(distr_output.args_dim)
        if "loc" not in names:
            raise ValueError(f"the baseline skip shifts the distribution's location, but "
                             f"{type(distr_output).__name__} has no 'loc' argument ({names})")
        self.season_length = season_length
        self.skip_gain = skip_gain
        self._loc_index = names.index("loc")
        if self.skip_scale is not None and "scale" not in names:
            raise ValueError(f"skip_scale moves the distribution's scale towards ETS's, but "
                             f"{type(distr_output).__name__} has no 'scale' argument ({names})")
        self._scale_index = names.index("scale") if "scale" in names else None
        self.baseline_skip = nn.Linear(len(self.skip_features), 1, bias=False)
        with torch.no_grad():
            self.baseline_skip.weight.copy_(self.initial_skip_weight())
        # the scale skip: log s' = log s + v·g·(log σ_h − log s), σ_h ETS's h-step std
        self.scale_skip = None
        if self.skip_scale is not None:
            self.scale_skip = nn.Linear(1, 1, bias=False)
            with torch.no_grad():
                self.scale_skip.weight.fill_(self.skip_scale / self.skip_gain)

    def initial_skip_weight(self) -> torch.Tensor:
        """The skip's weight ``w`` (shape (1, K)) before training: ``skip_init / skip_gain``
        (the effective weights ``gain · w`` are ``skip_init``), zeros without one."""
        if self.skip_init is None:
            return torch.zeros(1, len(self.skip_features))
        return torch.tensor([self.skip_init], dtype=torch.float32) / self.skip_gain

    def local_forecasts(self, past_target_scaled: torch.Tensor,
                        past_observed_values: torch.Tensor, *, with_ets_std: bool = False):
        """``(B, H, K)``: the skip's local forecasts of every input row, in the scaler's units
        (and ETS's ``(B, H)`` standard deviation with ``with_ets_std``). A training window's
        input is its own context (``context_length`` steps): every method is fitted on it. A
        longer input (a series' history at prediction time, ``local_history_length`` of the
        estimator) is read whole by :attr:`history_methods` only; the other methods read its
        last ``context_length`` steps, as in training."""
        ctx = self.context_length
        config = (ctx, self.season_length, self.prediction_length, self.skip_features,
                  self.history_methods, bool(with_ets_std), bool(self.recent_std))
        memo = None if torch.is_grad_enabled() else _LAST_PREDICTION
        if memo is not None and memo.get("config") == config:
            x, o, out = memo["inputs"] + (memo["out"],)
            if x.shape == past_target_scaled.shape and torch.equal(x, past_target_scaled) \
                    and torch.equal(o, past_observed_values):
                return out
        out = skip_local_forecasts(
            past_target_scaled, past_observed_values, ctx, self.season_length,
            self.prediction_length, self.skip_features, self.history_methods,
            with_ets_std=with_ets_std, recent_std=self.recent_std)
        if memo is not None:
            # one entry: the public network of a zero-shot mixture forecasts the same inputs
            # right after the fine-tuned one (zero_shot_mixture.py); the local forecasts are a
            # function of the inputs and the configuration only, so they are computed once
            memo.clear()
            memo.update(config=config, inputs=(past_target_scaled, past_observed_values),
                        out=out)
        return out

    def forward(self, past_target: torch.Tensor, past_observed_values: torch.Tensor):
        ctx = self.context_length
        if past_target.shape[-1] < ctx:
            raise ValueError(f"the input holds {past_target.shape[-1]} steps, fewer than the "
                             f"model's context_length={ctx}")
        # DLinear reads the last context_length steps (the whole input of a training window)
        args, loc, scale = super().forward(past_target[:, -ctx:],
                                           past_observed_values[:, -ctx:])
        distr_args = list(args)
        # the input in the scaler's units: every gluonts scaler returns (x - loc) / scale
        past_target_scaled = (past_target - loc) / scale
        mu = distr_args[self._loc_index]                                    # (B, H)
        context = past_target_scaled.detach()
        if self.scale_skip is None:
            local = self.local_forecasts(context, past_observed_values)
        else:
            local, ets_std = self.local_forecasts(context, past_observed_values,
                                                  with_ets_std=True)
        features = self.skip_gain * (local - mu.unsqueeze(-1))             # (B, H, K)
        distr_args[self._loc_index] = mu + self.baseline_skip(features).squeeze(-1)
        if self.scale_skip is not None:
            s = distr_args[self._scale_index]                               # (B, H), > 0
            log_ratio = torch.log(ets_std.clamp(min=MIN_ETS_STD)) - torch.log(s)
            shift = self.scale_skip(self.skip_gain * log_ratio.unsqueeze(-1)).squeeze(-1)
            distr_args[self._scale_index] = s * torch.exp(shift)
        return tuple(distr_args), loc, scale

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """As ``nn.Module.load_state_dict``; a plain DLinear state (no ``baseline_skip.weight``,
        e.g. the public weights) loads with the skip at its initial weight
        (:meth:`initial_skip_weight`: ``skip_init``, else zero)."""
        if SKIP_PARAMETER not in state_dict:
            state_dict = dict(state_dict)
            state_dict[SKIP_PARAMETER] = self.initial_skip_weight()
        if self.scale_skip is not None and SCALE_SKIP_PARAMETER not in state_dict:
            state_dict = dict(state_dict)
            state_dict[SCALE_SKIP_PARAMETER] = torch.full((1, 1),
                                                          self.skip_scale / self.skip_gain)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


class BaselineSkipDLinearLightningModule(DLinearLightningModule):
    """``DLinearLightningModule`` around a :class:`BaselineSkipDLinearModel`."""

    @validated()
    def __init__(self, model_kwargs: dict, lr: float = 1e-3, weight_decay: float = 1e-8):
        plain = {k: v for k, v in model_kwargs.items() if k not in _SKIP_ARGS}
        super().__init__(model_kwargs=plain, lr=lr, weight_decay=weight_decay)
        self.model = BaselineSkipDLinearModel(**model_kwargs)
        self.inputs = self.model.describe_inputs()


class BaselineSkipDLinearEstimator(DLinearEstimator):
    """gluonts' ``DLinearEstimator`` with the baseline skip (module docstring); every
    ``DLinearEstimator`` argument plus ``season_length`` (``m >= 1``)."""

    @validated()
    def __init__(self, prediction_length: int, season_length: int = 1, skip_gain: float = 1.0,
                 skip_features: Tuple[str, ...] = SKIP_FEATURES,
                 skip_init: Optional[Tuple[float, ...]] = None,
                 skip_scale: Optional[float] = None,
                 local_history_length: Optional[int] = None,
                 history_methods: Tuple[str, ...] = (),
                 context_length: Optional[int] = None, hidden_dimension: Optional[int] = None,
                 lr: float = 1e-3, weight_decay: float = 1e-8, scaling: Optional[str] = "mean",
                 distr_output: DistributionOutput = StudentTOutput(),  # noqa: B008
                 kernel_size: int = 25, batch_size: int = 32, num_batches_per_epoch: int = 50,
                 trainer_kwargs: Optional[Dict[str, Any]] = None,
                 train_sampler: Optional[InstanceSampler] = None,
                 validation_sampler: Optional[InstanceSampler] = None) -> None:
        super().__init__(prediction_length=prediction_length, context_length=context_length,
                         hidden_dimension=hidden_dimension, lr=lr, weight_decay=weight_decay,
                         scaling=scaling, distr_output=distr_output, kernel_size=kernel_size,
                         batch_size=batch_size, num_batches_per_epoch=num_batches_per_epoch,
                         trainer_kwargs=trainer_kwargs, train_sampler=train_sampler,
                         validation_sampler=validation_sampler)
        self.season_length = check_int("season_length", season_length, minimum=1)
        self.skip_gain = check_positive("skip_gain", skip_gain)
        self.skip_features = check_skip_features(skip_features)
        self.skip_init = check_skip_init(skip_init, self.skip_features)
        self.skip_scale = None if skip_scale is None else check_finite("skip_scale", skip_scale)
        self.history_methods = check_history_methods(history_methods)
        self.local_history_length = (
            None if local_history_length is None
            else max(check_int("local_history_length", local_history_length, minimum=1),
                     int(self.context_length)))

    def _create_instance_splitter(self, module, mode: str):
        """gluonts' splitter; at prediction (``mode="test"``) it passes the last
        ``local_history_length`` steps of each series (padded in front when shorter) instead
        of ``context_length``: the :attr:`history_methods` read them all, DLinear its last
        ``context_length``. Training and validation windows keep ``context_length`` steps."""
        splitter = super()._create_instance_splitter(module, mode)
        if mode != "test" or self.local_history_length in (None, self.context_length):
            return splitter
        return InstanceSplitter(
            target_field=FieldName.TARGET, is_pad_field=FieldName.IS_PAD,
            start_field=FieldName.START, forecast_start_field=FieldName.FORECAST_START,
            instance_sampler=TestSplitSampler(), past_length=self.local_history_length,
            future_length=self.prediction_length,
            time_series_fields=[FieldName.OBSERVED_VALUES],
            dummy_value=self.distr_output.value_in_support)

    def create_lightning_module(self):
        return BaselineSkipDLinearLightningModule(
            lr=self.lr, weight_decay=self.weight_decay,
            model_kwargs={"prediction_length": self.prediction_length,
                          "context_length": self.context_length,
                          "hidden_dimension": self.hidden_dimension,
                          "distr_output": self.distr_output,
                          "kernel_size": self.kernel_size, "scaling": self.scaling,
                          **{k: getattr(self, k) for k in _SKIP_ARGS}})


def check_skip_init(skip_init, features) -> Optional[tuple]:
    """``skip_init`` as a tuple of finite floats, one per feature (None stays None); a
    ValueError names the argument otherwise."""
    if skip_init is None:
        return None
    values = tuple(float(v) for v in skip_init)
    if len(values) != len(features) or not all(math.isfinite(v) for v in values):
        raise ValueError(f"skip_init must give one finite effective weight per skip feature "
                         f"{tuple(features)}, got {skip_init!r}")
    return values


def check_history_methods(history_methods) -> tuple:
    """``history_methods`` as a tuple of distinct local methods (possibly empty)."""
    history_methods = tuple(history_methods or ())
    return check_methods(history_methods) if history_methods else ()


def skip_parameters(network) -> list:
    """The parameters of ``network``'s baseline skip (empty for a network without one)."""
    params = []
    for name in ("baseline_skip", "scale_skip"):
        skip = getattr(network, name, None)
        if isinstance(skip, nn.Module):
            params += list(skip.parameters())
    return params


def describe_skip(network) -> Optional[dict]:
    """What ``network``'s baseline skip learned, for a report (``None`` without a skip):
    ``season_length``, ``skip_gain`` and the effective weights ``gain · w`` by name (0: the
    location is DLinear's own; 1: it is that baseline's forecast)."""
    if not isinstance(network, BaselineSkipDLinearModel):
        return None
    weights = (network.skip_gain * network.baseline_skip.weight.detach().cpu()).flatten()
    out = {"season_length": network.season_length, "skip_gain": network.skip_gain,
           "weights": {name: float(w) for name, w in zip(network.skip_features,
                                                         weights.tolist(), strict=True)}}
    if network.scale_skip is not None:
        out["scale_weight"] = float(network.skip_gain * network.scale_skip.weight.detach())
    if network.history_methods:
        out["history_methods"] = list(network.history_methods)
    return out
