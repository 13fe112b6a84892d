r"""The forecast as a mixture of the DP fine-tuned model and the public zero-shot model.

With public weights :math:`\theta_0` (they read no private data) and the DP fine-tuned weights
:math:`\hat\theta`, the released forecast of every series and step is the mixture

.. math::

    F = (1 - w)\,F_{\hat\theta} + w\,F_{\theta_0}, \qquad 0 \le w < 1,

of the two models' predictive distributions, for the same input window. ``w`` is the
**zero-shot weight** (:data:`~.model_defaults.MODEL_DEFAULTS`' ``zero_shot_weight``; 0 is the DP
model alone).

**Privacy.** The mixture reads :math:`\hat\theta` (the DP release) and :math:`\theta_0`
(public), so it is post-processing: it costs no privacy beyond the training run's ε. The window
it forecasts from is read by both models alike (as by the DP model alone; see
:mod:`.private_inference` for private inputs).

**Why it helps.** CRPS is convex in the predictive distribution and, for
:math:`F = (1-w)F_1 + wF_2`,

.. math::

    \mathrm{CRPS}(F, y) = (1-w)\,\mathrm{CRPS}(F_1, y) + w\,\mathrm{CRPS}(F_2, y)
                          - w(1-w)\,\mathcal E(F_1, F_2),

with :math:`\mathcal E(F_1, F_2) = 2\mathbb E|X_1 - X_2| - \mathbb E|X_1 - X_1'| -
\mathbb E|X_2 - X_2'| \ge 0` the energy distance: the mixture gains where the two models
disagree. The DP model has learned from the panel but carries the DP noise; the public model has
no noise but has not seen the panel. ``w = 0`` for DLinear since the second pass of issue 47
(0.5 with the first pass's local forecasts, 0.25 before them) was chosen on the public study
panels only (docs/guides/forecasting.md, "Mixing in the zero-shot model", "Each series'
history at prediction, fewer trained parameters"); DeepAR mixes at 0.1.

**Samples.** The mixture is released as sample paths (gluonts' ``SampleForecast``). Of every
``num_samples`` paths a fraction ``w`` comes from the public model, interleaved so that every
prefix holds that fraction (gluonts' ``SampleForecastGenerator`` keeps a prefix when it needs
fewer paths). A model with a predictive distribution (DLinear, SimpleFeedForward) is sampled
by stratified inverse-CDF draws: at each step the :math:`n` draws take one uniform from each of
:math:`[k/n, (k+1)/n)`, shuffled across paths (independent steps, as the model states, with
quantiles as accurate as :math:`n` stratified points allow). A model that samples paths itself
(DeepAR) contributes its own paths.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn

from .._validation import check_int
from .model_defaults import check_zero_shot_weight, model_defaults

__all__ = ["ZeroShotMixtureModule", "public_rows", "zero_shot_mixture_predictor",
           "zero_shot_start"]


def public_rows(num_samples: int, weight: float) -> torch.Tensor:
    """Boolean mask of the sample paths drawn from the public model: path ``k`` is public iff
    ``floor((k + 1) w) > floor(k w)``, so every prefix of ``m`` paths holds ``floor(m w)`` public
    ones (a fraction ``w`` of any prefix, up to one path)."""
    k = torch.arange(num_samples, dtype=torch.float64)
    return torch.floor((k + 1) * weight) > torch.floor(k * weight)


def _stratified_draws(distribution, num_samples: int, like: torch.Tensor) -> torch.Tensor:
    """``num_samples`` draws per batch element and step, stratified in probability:
    shape ``(batch, num_samples, steps)``; the uniforms take ``like``'s dtype and device."""
    shape = distribution.batch_shape  # (batch, steps)
    strata = torch.arange(num_samples, dtype=torch.float64).view(-1, *([1] * len(shape)))
    u = (strata + torch.rand((num_samples, *shape), dtype=torch.float64)) / num_samples
    # shuffle the strata across paths, independently for each (series, step)
    order = torch.rand(u.shape).argsort(dim=0)
    u = torch.gather(u, 0, order).clamp(1e-9, 1 - 1e-9)
    try:
        draws = distribution.icdf(u.to(dtype=like.dtype, device=like.device))
    except NotImplementedError:
        draws = distribution.sample((num_samples,))
    return draws.movedim(0, 1)


class ZeroShotMixtureModule(nn.Module):
    """Prediction network of the mixture: ``private`` (DP fine-tuned) and ``public``
    (zero-shot) gluonts Lightning modules of one architecture, fed the same inputs.

    ``forward`` returns sample paths ``(batch, num_samples, prediction_length)`` for gluonts'
    ``SampleForecastGenerator``; a share ``public_weight`` of them comes from ``public``
    (:func:`public_rows`). ``num_samples`` is the number of paths per call for models with a
    predictive distribution; a sampling model (DeepAR) gives its own number per call.
    ``__getnewargs_ex__`` gives the constructor's arguments, so gluonts' serde (and with it
    the predictor's serialization) rebuilds the module from them, as it does a ``@validated``
    class; the two networks' weights come back from the state dict.
    """

    def __init__(self, private: nn.Module, public: nn.Module, public_weight: float,
                 num_samples: int = 100) -> None:
        super().__init__()
        self.private = private
        self.public = public
        self.public_weight = check_zero_shot_weight(public_weight)
        self.num_samples = check_int("num_samples", num_samples, minimum=1)

    def __getnewargs_ex__(self):
        return (), {"private": self.private, "public": self.public,
                    "public_weight": self.public_weight, "num_samples": self.num_samples}

    @staticmethod
    def _draws(module: nn.Module, out, args, kwargs, count: int) -> torch.Tensor:
        """``count`` paths from ``module`` whose forward on the inputs returned ``out``."""
        if isinstance(out, torch.Tensor):  # the model samples paths itself (DeepAR)
            chunks, have = [out], out.shape[1]
            while have < count:
                chunks.append(module(*args, **kwargs))
                have += chunks[-1].shape[1]
            return torch.cat(chunks, dim=1)[:, :count]
        distr_args, loc, scale = out
        distribution = module.model.distr_output.distribution(distr_args, loc, scale)
        return _stratified_draws(distribution, count, like=loc)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        out = self.private(*args, **kwargs)
        total = out.shape[1] if isinstance(out, torch.Tensor) else self.num_samples
        mask = public_rows(total, self.public_weight)
        n_public = int(mask.sum())
        private = self._draws(self.private, out, args, kwargs, total - n_public)
        if n_public == 0:
            return private
        if isinstance(out, torch.Tensor):  # a sampling model draws only the paths it gives
            kwargs = {**kwargs, "num_parallel_samples": n_public}
        public = self._draws(self.public, self.public(*args, **kwargs), args, kwargs, n_public)
        paths = torch.empty((private.shape[0], total, private.shape[2]), dtype=private.dtype,
                            device=private.device)
        mask = mask.to(paths.device)
        paths[:, ~mask] = private
        paths[:, mask] = public.to(private.dtype)
        return paths


def zero_shot_mixture_predictor(predictor, public_state: dict, public_weight: float,
                                num_samples: int = 100):
    """``predictor`` (a gluonts ``PyTorchPredictor`` of the DP fine-tuned network) with its
    forecast replaced by the mixture with the public weights ``public_state``
    (:class:`ZeroShotMixtureModule`, sample forecasts). ``public_weight = 0`` returns
    ``predictor`` itself."""
    from gluonts.model.forecast_generator import SampleForecastGenerator

    weight = check_zero_shot_weight(public_weight)
    if weight == 0.0:
        return predictor
    args = dict(getattr(predictor, "__init_args__", {}))
    if not args:
        raise ValueError(f"{type(predictor).__name__} has no recorded constructor arguments "
                         "(not a gluonts PyTorchPredictor?)")
    private = predictor.prediction_net
    if isinstance(private, ZeroShotMixtureModule):
        raise ValueError("predictor already forecasts a zero-shot mixture (public_weight="
                         f"{private.public_weight:g}): pass the fine-tuned network's own "
                         "predictor (TrainResult.create_predictor(zero_shot_weight=0))")
    public = copy.deepcopy(private)
    try:
        public.model.load_state_dict(public_state)
    except RuntimeError as err:
        raise ValueError(f"public_state does not fit the fine-tuned network: {err}") from None
    public.eval()
    args["prediction_net"] = ZeroShotMixtureModule(private, public, weight,
                                                   num_samples=num_samples)
    args["forecast_generator"] = SampleForecastGenerator()
    return type(predictor)(**args)


def zero_shot_start(model: str, weight: Optional[float], init_state: Optional[dict],
                    provenance) -> tuple:
    """``(w, public_state, note)`` of the forecast mixture (``zero_shot_weight`` of
    :func:`~.training.train_forecaster`): the recipe's ``w`` unless given; public weights
    only (``provenance``: :func:`~.provenance.resolve_init`'s answer, ``None`` without
    ``init_state``)."""
    given = weight is not None
    weight = check_zero_shot_weight(
        weight if given else model_defaults(model).get("zero_shot_weight", 0.0))
    public = provenance is not None and provenance.source in ("public", "declared public")
    if public:  # kept at any weight: create_predictor(zero_shot_weight=w) may ask for it
        return weight, {k: v.detach().cpu().clone() for k, v in init_state.items()}, None
    if weight == 0.0:
        return 0.0, None, None
    start = ("random initial weights" if init_state is None else
             f"initial weights with source {provenance.source!r}")
    if given:
        raise ValueError(f"zero_shot_weight={weight:g} mixes in the public zero-shot model, but "
                         f"training starts from {start}: pass public init_state (or "
                         "init_public=True), or zero_shot_weight=0")
    return 0.0, None, (f"the recipe's zero_shot_weight {weight:g} does not apply: training "
                       f"started from {start}, not public weights")

