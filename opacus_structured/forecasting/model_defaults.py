"""The defaults of DP fine-tuning, in one table read by the CLI and by ``DPEstimator``.

``opacus-structured forecast`` (:mod:`opacus_structured.commands.forecast`) and
:class:`~opacus_structured.forecasting.dp_estimator.DPEstimator` take every default they do not
get from the user from here, so a recipe chosen for one model (on public panels only, see
docs/guides/forecasting.md) changes both at once:

* :data:`COMMON_DEFAULTS`: the defaults that do not depend on the model (target ε and δ,
  horizon, forecast samples; and, unless a model's entry overrides them, the steps and the
  largest number of series per step Λ, which defaults to ``min(batch_size, N)`` for ``N``
  training series);
* :data:`MODEL_DEFAULTS`: one entry per model (``"dlinear"``, ``"simpleff"``, ``"deepar"``):
  per-window clipping norm ``max_grad_norm`` (C), Adam's ``lr`` when fine-tuning the public
  pretrained weights, ``lr_from_scratch`` from a random initialisation, and ``tail_average``
  (the fraction of the last iterates averaged into the released model). A model's entry may
  also carry any key of :data:`COMMON_DEFAULTS` (e.g. its own ``max_steps``); it then wins.

:func:`default_for` is the one lookup: the model's entry first, then the common table.

The clipping norm: the paper uses C = 1e-4 (found by shrinking C until the noise-free loss got
worse); with Adam the update is nearly invariant to C, only the noise-to-signal ratio
σ·C/(Λ·C) = σ/Λ matters.
"""

from __future__ import annotations

__all__ = ["COMMON_DEFAULTS", "MODEL_DEFAULTS", "default_for", "model_defaults"]

#: Model-independent defaults (a model's entry in :data:`MODEL_DEFAULTS` may override a key).
COMMON_DEFAULTS = dict(model="dlinear", epsilon=1.0, delta=1e-7, max_steps=100, batch_size=64,
                       prediction_length=12, num_samples=100)

_RECIPE = dict(max_grad_norm=1e-4, lr=1e-4, lr_from_scratch=1e-2, tail_average=0.5)

#: Per-model recipe (chosen on public panels only; ``benchmarks/forecast_recipe.py``).
MODEL_DEFAULTS = {
    "dlinear": dict(_RECIPE),
    "simpleff": dict(_RECIPE),
    "deepar": dict(_RECIPE),
}


def _check(model: str) -> str:
    if model not in MODEL_DEFAULTS:
        raise ValueError(f"model must be one of {tuple(MODEL_DEFAULTS)}, got {model!r}")
    return model


def default_for(model: str, key: str):
    """The default of ``key`` for ``model``: its :data:`MODEL_DEFAULTS` entry, else
    :data:`COMMON_DEFAULTS`; a ``KeyError`` names an unknown key."""
    own = MODEL_DEFAULTS[_check(model)]
    if key in own:
        return own[key]
    if key in COMMON_DEFAULTS and key != "model":
        return COMMON_DEFAULTS[key]
    raise KeyError(f"no default for {key!r} (known: {sorted(set(own) | set(COMMON_DEFAULTS))})")


def model_defaults(model: str) -> dict:
    """Every default for ``model`` (common ones overridden by the model's own)."""
    merged = {k: v for k, v in COMMON_DEFAULTS.items() if k != "model"}
    merged.update(MODEL_DEFAULTS[_check(model)])
    return merged
