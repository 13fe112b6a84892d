r"""What :class:`~opacus_structured.forecasting.dp_estimator.DPEstimator` does with each gluonts
setting: honoured (mapped onto DP training), replaced by the DP recipe, or refused with the
reason. Nothing a user sets is ignored silently.

Three sources of settings, each read here:

1. **The estimator's ``trainer_kwargs``** — only the ones the user passed (gluonts records
   them in ``estimator.__init_args__``; the ``{"max_epochs": 100, "gradient_clip_val": 10.0}``
   that gluonts adds on its own are *replaced* by the DP recipe and listed as such in the
   privacy report). :func:`trainer_settings` maps them:

   * ``max_steps``: DP-SGD steps (``-1``: no limit from it);
   * ``max_epochs``: ``max_epochs × num_batches_per_epoch`` steps (gluonts' epoch is
     ``num_batches_per_epoch`` batches; ``-1``: no limit); with ``max_steps`` too, the
     smaller (Lightning stops at the first limit reached);
   * ``accelerator``: ``"cpu"`` → cpu, ``"gpu"`` / ``"cuda"`` → cuda, ``"auto"`` → cuda when
     available, else cpu;
   * ``devices``: ``1``, ``"1"``, ``[0]``, ``"auto"`` (one device);
   * ``enable_progress_bar``: the progress bar;
   * ``callbacks``: model-summary callbacks only (:data:`SAFE_CALLBACKS`);
   * ``enable_model_summary``, ``deterministic``, ``benchmark``, ``default_root_dir``: passed
     to the Lightning ``Trainer`` (they change neither the steps, the batches nor the update);
   * the neutral values only: ``logger=False`` / ``None`` (nothing is logged),
     ``enable_checkpointing=False``, ``accumulate_grad_batches=1``, 32-bit ``precision``
     (``32``, ``"32"``, ``"32-true"``), ``gradient_clip_val=None`` (DP-SGD clips every
     window's gradient to ``max_grad_norm``), ``strategy="auto"``, ``num_nodes=1``.

   Every other key raises ``ValueError`` naming it and the reason (:data:`REFUSED_TRAINER_KWARGS`
   lists the reasons of the common ones).

2. **The estimator's own training settings** (:func:`estimator_settings`): ``lr`` and
   ``batch_size`` are used when the user changed them from gluonts' defaults, otherwise the
   recipe's (:mod:`~opacus_structured.forecasting.model_defaults`); ``num_batches_per_epoch``
   only counts the steps of ``trainer_kwargs["max_epochs"]`` (refused without it);
   ``train_sampler`` and ``validation_sampler`` must be left unset (the structured sampler is
   what the accountant prices; there is no validation); DeepAR's ``patience`` (its learning
   rate is lowered on a plateau of the noiseless training loss) must be left at gluonts'
   default, which DP training replaces by a constant learning rate.

3. **gluonts' ``train`` / ``train_from`` / ``train_model`` keyword arguments**
   (:func:`check_train_kwargs`): ``shuffle_buffer_length`` must be ``None``, ``cache_data`` is
   honoured (the transformed panel is always held in memory, which is what ``cache_data=True``
   asks for; ``False`` saves no memory here), ``ckpt_path`` must be ``None``; any other keyword
   raises.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

__all__ = ["REFUSED_TRAINER_KWARGS", "SAFE_CALLBACKS", "TrainerSettings", "trainer_settings",
           "user_trainer_kwargs", "gluonts_default_trainer_kwargs", "user_set",
           "estimator_settings", "check_train_kwargs", "public_architecture_mismatch"]

_NO_VALIDATION = ("no validation runs: validation_data is refused (selecting a model on "
                  "held-out data is outside the guarantee)")
_SAMPLING = ("it changes which batches are drawn: the structured sampler's draws (Λ series, "
             "one uniform window each, every step) are what the accountant prices")

#: Reasons for refusing the common Lightning ``Trainer`` arguments (any key not honoured and
#: not listed here is refused too, as unknown).
REFUSED_TRAINER_KWARGS = {
    "gradient_clip_val": "DP-SGD clips each window's gradient to max_grad_norm before adding "
                         "the noise; Lightning's clipping of the summed gradient is not what "
                         "the DP optimizer steps with: pass max_grad_norm=C to DPEstimator",
    "gradient_clip_algorithm": "DP-SGD clips each window's gradient (by norm) to "
                               "max_grad_norm: pass max_grad_norm=C to DPEstimator",
    "accumulate_grad_batches": "the accountant prices every batch of Λ windows as one step; "
                               "accumulating k batches into one update changes the batch and "
                               "its normalisation: use batch_size=k·Λ instead",
    "precision": "per-window gradients, their clipping and the noise are computed in 32-bit "
                 "floats (Opacus); other precisions are not supported",
    "strategy": "distributed strategies split each step's batch across processes; DP training "
                "draws, clips and prices one batch of Λ windows per step on one device",
    "num_nodes": "multi-node training splits each step's batch; DP training runs on one device",
    "max_time": "a wall-clock limit makes the number of steps depend on timing; σ is calibrated "
                "for the planned steps (and the tail average for the last of them): use "
                "max_steps",
    "min_epochs": "there is no early stopping: every planned step runs (use max_steps / "
                  "max_epochs)",
    "min_steps": "there is no early stopping: every planned step runs (use max_steps)",
    "limit_train_batches": _SAMPLING,
    "overfit_batches": _SAMPLING,
    "fast_dev_run": _SAMPLING,
    "use_distributed_sampler": _SAMPLING,
    "reload_dataloaders_every_n_epochs": _SAMPLING,
    "val_check_interval": _NO_VALIDATION,
    "check_val_every_n_epoch": _NO_VALIDATION,
    "limit_val_batches": _NO_VALIDATION,
    "num_sanity_val_steps": _NO_VALIDATION,
    "limit_test_batches": _NO_VALIDATION,
    "limit_predict_batches": _NO_VALIDATION,
    "log_every_n_steps": "nothing is logged (a logger would record the noiseless training "
                         "loss of private windows)",
    "logger": "a Lightning logger records the training loss of the private windows, computed "
              "without noise: not covered by ε (only logger=False / None)",
    "enable_checkpointing": "gluonts' checkpoint reloads the weights with the lowest "
                            "(noiseless, private) training loss: a data-dependent selection "
                            "that ε does not price; DPEstimator releases the (tail-averaged) "
                            "iterates (only enable_checkpointing=False)",
    "callbacks": "a callback sees every batch of private windows and the noiseless loss, and "
                 "can change the training (stop it, select weights, change the learning "
                 "rate); only the model-summary callbacks are accepted",
    "profiler": "not supported by DP training",
    "plugins": "not supported by DP training",
    "sync_batchnorm": "batch norm mixes the windows of a batch (per-window clipping needs "
                      "per-window gradients)",
    "detect_anomaly": "not supported by DP training",
    "barebones": "not supported by DP training",
    "inference_mode": "not supported by DP training",
    "enable_autolog_hparams": "nothing is logged",
    "model_registry": "not supported by DP training",
}

#: Lightning callbacks accepted in ``trainer_kwargs["callbacks"]`` (they print the model
#: summary: architecture and parameter counts, all public).
SAFE_CALLBACKS = ("ModelSummary", "RichModelSummary")

#: ``trainer_kwargs`` keys passed on to ``train_forecaster(trainer_options=...)``.
_PASSED_ON = ("enable_model_summary", "deterministic", "benchmark", "default_root_dir")


class TrainerSettings(dict):
    """What :func:`trainer_settings` made of ``trainer_kwargs`` (a dict): any of ``steps``
    (int or ``None``), ``device``, ``progress``, ``callbacks`` (list), ``trainer_options``
    (dict); :attr:`honoured` is the user's ``trainer_kwargs`` as accepted (JSON-ready)."""

    honoured: dict


def user_trainer_kwargs(estimator) -> dict:
    """The ``trainer_kwargs`` the user passed to the estimator (``{}`` when none): gluonts
    records the constructor arguments in ``__init_args__`` before adding its defaults."""
    given = dict(getattr(estimator, "__init_args__", {}) or {}).get("trainer_kwargs")
    return dict(given or {})


def gluonts_default_trainer_kwargs(estimator) -> dict:
    """The ``trainer_kwargs`` entries gluonts added by itself (e.g. ``max_epochs=100``,
    ``gradient_clip_val=10.0``): DP training replaces them by its recipe."""
    given = user_trainer_kwargs(estimator)
    return {k: v for k, v in dict(getattr(estimator, "trainer_kwargs", {}) or {}).items()
            if k not in given}


def _refuse(key: str, value, reason: Optional[str] = None) -> ValueError:
    reason = reason or REFUSED_TRAINER_KWARGS.get(key) or (
        "not a Trainer argument DP training can honour (honoured: max_steps, max_epochs, "
        "accelerator, devices, enable_progress_bar, callbacks, logger, enable_checkpointing, "
        "enable_model_summary, deterministic, benchmark, default_root_dir, and the neutral "
        "values of accumulate_grad_batches, precision, gradient_clip_val, strategy, "
        "num_nodes)")
    return ValueError(f"trainer_kwargs[{key!r}]={value!r} is refused: {reason}")


def _device(value) -> str:
    import torch

    if value in ("cpu",):
        return "cpu"
    if value in ("gpu", "cuda"):
        return "cuda"
    if value == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    raise _refuse("accelerator", value, "DP training runs on 'cpu' or 'cuda' ('gpu', 'auto')")


def trainer_settings(estimator) -> TrainerSettings:
    """Map the user's ``trainer_kwargs`` (module docstring table); raise ``ValueError`` naming
    the first key that cannot be honoured and why."""
    kwargs = user_trainer_kwargs(estimator)
    out = TrainerSettings()
    out.honoured = {}
    steps: list[int] = []
    options: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key == "max_steps":
            if value in (None, -1):
                pass
            elif isinstance(value, int) and not isinstance(value, bool) and value >= 1:
                steps.append(int(value))
            else:
                raise _refuse(key, value, "must be an int >= 1 (or -1: no limit)")
        elif key == "max_epochs":
            if value in (None, -1):
                pass
            elif isinstance(value, int) and not isinstance(value, bool) and value >= 1:
                per_epoch = int(getattr(estimator, "num_batches_per_epoch", 50))
                steps.append(int(value) * per_epoch)
            else:
                raise _refuse(key, value, "must be an int >= 1 (or -1: no limit)")
        elif key == "accelerator":
            out["device"] = _device(value)
        elif key == "devices":
            if value not in (1, "1", "auto", [0], (0,)):
                raise _refuse(key, value, "DP training draws, clips and prices one batch of Λ "
                                          "windows per step on one device (devices=1)")
        elif key == "enable_progress_bar":
            out["progress"] = bool(value)
        elif key == "callbacks":
            callbacks = list(value or [])
            for cb in callbacks:
                if type(cb).__name__ not in SAFE_CALLBACKS or not type(cb).__module__.startswith(
                        "lightning.pytorch.callbacks"):
                    raise _refuse(key, value, f"{type(cb).__name__}: "
                                              + REFUSED_TRAINER_KWARGS["callbacks"])
            out["callbacks"] = callbacks
        elif key == "logger":
            if value not in (False, None):
                raise _refuse(key, value)
        elif key == "enable_checkpointing":
            if value:
                raise _refuse(key, value)
        elif key in _PASSED_ON:
            options[key] = value
        elif key == "accumulate_grad_batches":
            if value != 1:
                raise _refuse(key, value)
        elif key == "precision":
            if value not in (32, "32", "32-true"):
                raise _refuse(key, value)
        elif key == "gradient_clip_val":
            if value is not None:
                raise _refuse(key, value)
        elif key == "strategy":
            if value != "auto":
                raise _refuse(key, value)
        elif key == "num_nodes":
            if value != 1:
                raise _refuse(key, value)
        else:
            raise _refuse(key, value)
        out.honoured[key] = (value if key != "callbacks"
                             else [type(cb).__name__ for cb in out["callbacks"]])
    if steps:
        out["steps"] = min(steps)
    if "max_epochs" in kwargs and kwargs["max_epochs"] not in (None, -1):
        out.honoured["steps_per_epoch"] = int(getattr(estimator, "num_batches_per_epoch", 50))
    if options:
        out["trainer_options"] = options
    return out


def user_set(estimator, name: str) -> bool:
    """Whether the user gave ``name`` a value other than the estimator class's default
    (gluonts records every constructor argument, defaults included, in ``__init_args__``)."""
    args = dict(getattr(estimator, "__init_args__", {}) or {})
    if name not in args:
        return False
    try:
        default = inspect.signature(type(estimator).__init__).parameters[name].default
    except (KeyError, ValueError, TypeError):
        return True
    if default is inspect.Parameter.empty:
        return True
    return repr(args[name]) != repr(default)


def estimator_settings(estimator, model: str) -> dict:
    """The estimator's own training settings DP training honours, as ``{"lr": ...,
    "batch_size": ...}`` (present only when the user changed them from gluonts' defaults);
    ``ValueError`` for ``train_sampler``, ``validation_sampler``, DeepAR's ``patience`` and a
    ``num_batches_per_epoch`` without ``trainer_kwargs["max_epochs"]`` (module docstring)."""
    name = type(estimator).__name__
    for key, reason in (
            ("train_sampler", "the structured sampler (Λ series, one uniform window start each, "
                              "every step) is what the accountant prices"),
            ("validation_sampler", _NO_VALIDATION)):
        if (getattr(estimator, "__init_args__", {}) or {}).get(key) is not None:
            raise ValueError(f"{name}({key}=...) is refused: {reason}; leave it unset")
    if model == "deepar" and user_set(estimator, "patience"):
        raise ValueError(f"{name}(patience={estimator.__init_args__['patience']}) is refused: "
                         "gluonts' DeepAR lowers its learning rate on a plateau of the noiseless "
                         "training loss of the private windows; DP training keeps the learning "
                         "rate constant: leave patience at its default")
    if user_set(estimator, "num_batches_per_epoch") and user_trainer_kwargs(estimator).get(
            "max_epochs") in (None, -1):
        raise ValueError(f"{name}(num_batches_per_epoch=...) is refused: it only counts the "
                         "steps of trainer_kwargs['max_epochs'] (a gluonts epoch), which is not "
                         "given; pass max_steps or epochs to DPEstimator instead")
    return {key: getattr(estimator, key) for key in ("lr", "batch_size")
            if user_set(estimator, key)}


def check_train_kwargs(method: str, *, shuffle_buffer_length=None, ckpt_path=None,
                       cache_data=False, **kwargs) -> None:
    """Refuse gluonts ``train`` keywords DP training cannot honour (module docstring)."""
    if shuffle_buffer_length is not None:
        raise ValueError(f"{method}(shuffle_buffer_length={shuffle_buffer_length!r}) is refused: "
                         "a shuffle buffer reorders a stream of windows, a sampling scheme "
                         "the accountant does not price; DP training draws Λ distinct series "
                         "and one uniform window each at every step (leave it None)")
    if ckpt_path is not None:
        raise ValueError(f"{method}(ckpt_path={ckpt_path!r}) is refused: resuming a Lightning "
                         "checkpoint continues a run without its accountant (its earlier steps "
                         "would go unpriced); continue from a trained predictor with "
                         "train_from(predictor, ...), which composes its privacy record")
    if not isinstance(cache_data, bool):
        raise ValueError(f"{method}(cache_data={cache_data!r}): must be True or False")
    if kwargs:
        raise ValueError(f"{method}() got unsupported keyword argument(s) "
                         f"{sorted(kwargs)}: gluonts ignores unknown ones, DP training refuses "
                         f"them rather than ignore them")


#: Estimator arguments that do not change the trained function of a given geometry (training or
#: inference settings), left out when comparing with the public weights' estimator.
_NOT_ARCHITECTURE = ("batch_size", "lr", "weight_decay", "num_batches_per_epoch",
                     "trainer_kwargs", "train_sampler", "validation_sampler",
                     "num_parallel_samples", "patience", "nonnegative_pred_samples",
                     "dropout_rate", "freq", "context_length",
                     # what a DLinear predictor reads at prediction time (baseline_skip.py)
                     "local_history_length", "history_methods")


def public_architecture_mismatch(estimator, reference) -> dict:
    """``{argument: (estimator's, reference's)}`` for the architecture arguments in which
    ``estimator`` differs from ``reference`` (the estimator the public weights were trained
    with, :func:`~opacus_structured.forecasting.estimators.build_estimator`); empty when the
    weights fit. DeepAR's ``default_scale=None`` counts as ``1.0`` (the DP-safe scaler)."""
    mine = dict(getattr(estimator, "__init_args__", {}) or {})
    ref = dict(getattr(reference, "__init_args__", {}) or {})
    out = {}
    for key in sorted(set(mine) | set(ref)):
        if key in _NOT_ARCHITECTURE:
            continue
        a = getattr(estimator, key, None)  # resolved (e.g. DLinear's hidden_dimension)
        a = mine.get(key) if a is None else a
        b = getattr(reference, key, None)
        b = ref.get(key) if b is None else b
        if key == "default_scale":
            a, b = (1.0 if a is None else a), (1.0 if b is None else b)
        if repr(a) != repr(b):
            out[key] = (a, b)
    return out
