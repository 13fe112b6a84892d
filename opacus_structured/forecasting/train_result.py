"""What :func:`~opacus_structured.forecasting.training.train_forecaster` returns
(:class:`TrainResult`: the trained model, its privacy report and record), split out of
:mod:`opacus_structured.forecasting.training`."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from . import provenance as prov
from .estimators import PreparedModel
from .model_defaults import check_zero_shot_weight
from .zero_shot_mixture import zero_shot_mixture_predictor

__all__ = ["TrainResult"]


# ---- results ---------------------------------------------------------------------------------
@dataclasses.dataclass
class TrainResult:
    """Outcome of :func:`train_forecaster`.

    ``epsilon`` is the accountant's ε at ``delta`` for the steps actually taken (``inf`` for
    non-private training); ``bound`` says whether it is a guarantee ("tight"/"upper").

    ``private`` is ``True`` only if the released model carries that guarantee: DP-SGD ran
    (``dp_sgd``) *and* its sampler and noise drew secret OS entropy. A run with a ``seed`` has
    ``dp_sgd=True`` but ``private=False``: its noise is reproducible from the seed, so ε
    describes the mechanism, not this model (``not_private_reason`` says so). ``seed`` is the
    caller's seed (``None``: OS entropy, recorded nowhere); ``init_seed`` the public seed of the
    weight initialisation.
    """

    prepared: PreparedModel
    scheme: Any
    accountant: Any
    dp_sgd: bool
    noise_multiplier: Optional[float]
    max_grad_norm: Optional[float]
    steps: int
    epsilon: float
    delta: Optional[float]
    target_epsilon: Optional[float]
    bound: Optional[str]
    train_seconds: float
    calibration_seconds: float
    seed: Optional[int] = None
    init_seed: Optional[int] = None
    #: where the sampling rate and the normaliser came from
    #: (:func:`~opacus_structured.samplers.public_sizes.sampling_constants`; DP runs only)
    sampling_constants: Optional[dict] = None
    #: ε of this run alone (``epsilon`` composes earlier runs on the same data with it; see
    #: :mod:`.provenance`); ``None`` without DP-SGD.
    run_epsilon: Optional[float] = None
    #: what :func:`~.provenance.resolve_init` found out about ``init_state`` (``None``: none)
    init_provenance: Optional[prov.InitProvenance] = None
    train_panel: Any = dataclasses.field(default=None, repr=False, compare=False)
    #: SHA-256 of the released weights, taken when training ended (:mod:`.provenance`)
    weights_hash: Optional[str] = None
    _record: Optional[dict] = dataclasses.field(default=None, repr=False, compare=False)
    #: share ``w`` of the public zero-shot model in the forecast mixture of
    #: :meth:`create_predictor` (:mod:`.zero_shot_mixture`); 0: the DP model alone
    zero_shot_weight: float = 0.0
    #: the public initial weights the mixture forecasts with (``None``: no public start)
    public_state: Optional[dict] = dataclasses.field(default=None, repr=False, compare=False)
    #: why the recipe's zero-shot weight was not applied (``None`` when it was, or was 0)
    zero_shot_note: Optional[str] = None
    #: ``{"names": "all" | [name prefixes], "count": trained scalars}``: what training
    #: updated (:mod:`.trained_parameters`); the other parameters kept their initial values
    trained_parameters: Optional[dict] = None

    @property
    def prior_runs(self) -> list:
        """The earlier runs ``init_state`` went through, labelled ``"composed"`` (this data)
        or not (other data); empty for public or random initial weights."""
        return [] if self.init_provenance is None else self.init_provenance.summary()

    @property
    def reproducible_noise(self) -> bool:
        """DP-SGD with seeded (reproducible, hence public) sampler and noise coins."""
        return self.dp_sgd and self.seed is not None

    @property
    def private(self) -> bool:
        """The (ε, δ) guarantee holds for the released model: DP-SGD with secret coins (and
        no earlier run on this data with seeded noise)."""
        return (self.dp_sgd and self.seed is None
                and (self.init_provenance is None
                     or self.init_provenance.not_private_reason is None))

    @property
    def not_private_reason(self) -> Optional[str]:
        """Why the released model is not private (``None`` when it is)."""
        if not self.dp_sgd:
            return "non-private training (no DP-SGD)"
        if self.seed is not None:
            return ("reproducible noise: the sampler and noise were seeded with seed="
                    f"{self.seed}, which regenerates the noise")
        if self.init_provenance is not None:
            return self.init_provenance.not_private_reason
        return None

    def state_dict(self) -> dict:
        """The released network weights (``prepared.module.model``), detached CPU copies."""
        return {k: v.detach().cpu().clone()
                for k, v in self.prepared.module.model.state_dict().items()}

    @property
    def privacy_record(self) -> dict:
        """The privacy record of the released weights (:mod:`.provenance`): every run they
        went through on non-public data, this one last, and the weights' hash. Pass it as
        ``init_record`` (with ``init_state=result.state_dict()``) to train again from them:
        runs on the same data are then composed."""
        if self._record is None:
            if self.train_panel is None or self.weights_hash is None:
                raise ValueError("this TrainResult has no training panel: no privacy record")
            if prov.weights_fingerprint(self.state_dict()) != self.weights_hash:
                raise ValueError("the weights changed after train_forecaster released them: "
                                 "their privacy record would not cover the change")
            earlier = [] if self.init_provenance is None else self.init_provenance.runs()
            this = prov.run_entry(panel=self.train_panel, dp_sgd=self.dp_sgd,
                                  private=self.dp_sgd and self.seed is None,
                                  accountant=self.accountant,
                                  noise_multiplier=self.noise_multiplier, steps=self.steps,
                                  delta=self.delta, epsilon=self.run_epsilon
                                  if self.dp_sgd else math.inf, bound=self.run_bound)
            self._record = {"format": prov.RECORD_FORMAT,
                            "weights": self.weights_hash,
                            "runs": [*earlier, this]}
        return self._record

    @property
    def run_bound(self) -> Optional[str]:
        """The bound kind of this run's own ε."""
        return None if self.accountant is None else self.accountant.bound

    def save_weights(self, path: str) -> None:
        """Write ``{"state_dict", "meta"}`` to ``path`` (the layout of
        :func:`~.pretraining.save_weights`), the meta holding the geometry and the
        :attr:`privacy_record`: ``forecast --init-from PATH`` and
        ``train_forecaster(init_state=..., init_record=...)`` then compose."""
        import os

        import torch

        meta = {"model": self.prepared.name, "prediction_length": self.prepared.prediction_length,
                "privacy_record": self.privacy_record}
        ctx = getattr(self.prepared.estimator, "context_length", None)
        if ctx is not None:
            meta["context_length"] = int(ctx)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        torch.save({"state_dict": self.state_dict(), "meta": meta}, path)

    @property
    def step_seconds(self) -> float:
        return self.train_seconds / self.steps if self.steps else float("nan")

    def create_predictor(self, zero_shot_weight: Optional[float] = None):
        """gluonts predictor of the released forecast: the fine-tuned network mixed with the
        public zero-shot model at ``zero_shot_weight`` (default: :attr:`zero_shot_weight`, the
        recipe's; :mod:`.zero_shot_mixture`). ``zero_shot_weight=0`` gives the fine-tuned
        network alone (gluonts' own predictor of it)."""
        weight = (self.zero_shot_weight if zero_shot_weight is None
                  else check_zero_shot_weight(zero_shot_weight))
        predictor = self.prepared.create_predictor()
        if weight == 0.0:
            return predictor
        if self.public_state is None:
            raise ValueError(f"zero_shot_weight={weight:g} mixes in the public zero-shot model, "
                             "but this run did not start from public weights: use "
                             "zero_shot_weight=0")
        return zero_shot_mixture_predictor(predictor, self.public_state, weight)

    @property
    def zero_shot_mixture(self) -> dict:
        """``{"weight", "public_start", "note"}``: the forecast mixture's zero-shot share, whether
        the run started from public weights, and why a recipe weight did not apply."""
        return {"weight": self.zero_shot_weight, "public_start": self.public_state is not None,
                "note": self.zero_shot_note}

    def summary(self) -> dict:
        """JSON-ready record (no model objects)."""
        out = {
            "model": self.prepared.name, "private": self.private, "dp_sgd": self.dp_sgd,
            "reproducible_noise": self.reproducible_noise,
            "not_private_reason": self.not_private_reason,
            "epsilon": self.epsilon, "delta": self.delta, "target_epsilon": self.target_epsilon,
            "noise_multiplier": self.noise_multiplier, "max_grad_norm": self.max_grad_norm,
            "steps": self.steps, "bound": self.bound, "train_seconds": self.train_seconds,
            "step_seconds": self.step_seconds, "calibration_seconds": self.calibration_seconds,
            "context_length_with_lags": self.prepared.past_length,
            "prediction_length": self.prepared.prediction_length,
            "scheme": None if self.scheme is None else self.scheme.describe(),
            "zero_shot_mixture": self.zero_shot_mixture,
            "trained_parameters": self.trained_parameters,
        }
        if self.init_provenance is not None:
            out.update(run_epsilon=self.run_epsilon, init=self.init_provenance.source,
                       init_note=self.init_provenance.note, prior_runs=self.prior_runs,
                       epsilon_composes_prior_runs=bool(self.init_provenance.composed))
        if self.train_panel is not None and self.weights_hash is not None:
            out["privacy_record"] = self.privacy_record
        if self.seed is not None:  # only a caller's seed; OS-entropy coins are never recorded
            out["seed"] = self.seed
        if self.init_seed is not None:
            out["init_seed"] = self.init_seed
        if self.sampling_constants is not None:
            out["sampling_constants"] = dict(self.sampling_constants)
        return out
