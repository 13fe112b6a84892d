r"""A private score for a trial: the Gaussian mechanism on clipped per-example losses.

:func:`private_score` releases

.. math::
   s = \frac{1}{n}\Big(\sum_{i} \min(\max(\ell_i, 0), C) + \mathcal N(0, \sigma^2 C^2)\Big)

for per-example validation losses :math:`\ell_i` on a private held-out split of public size
:math:`n`. Adding, removing or replacing one example changes the clipped sum by at most
:math:`C`, so this is the Gaussian mechanism with noise multiplier :math:`\sigma`; its cost is
composed into the trial: a ``GaussianDpEvent(σ)`` with a dp_accounting event, or a
:class:`~opacus_structured.tuning.TrialCost` around one of our accountants. :math:`n` must be
public (e.g. the planned split size): under add/remove the realised count is private.
"""

from __future__ import annotations

import math
import secrets
from typing import Any, Optional

import numpy as np
from dp_accounting import dp_event

from .._validation import check_int, check_positive
from .pricing import TrialCost

__all__ = ["private_score"]


def _as_array(losses) -> np.ndarray:
    if hasattr(losses, "detach"):  # a torch tensor, without importing torch here
        losses = losses.detach().cpu().numpy()
    values = np.asarray(losses, dtype=np.float64).reshape(-1)
    if values.size == 0:
        raise ValueError("losses must hold at least one per-example loss")
    if np.any(np.isnan(values)):
        raise ValueError("losses must not contain NaN")
    return values


def private_score(losses, *, clip: float, noise_multiplier: float,
                  num_examples: Optional[int] = None, run: Any = None,
                  rng: Optional[np.random.Generator] = None) -> tuple[float, Any]:
    """``(score, trial)``: the noisy mean clipped loss (module docstring) and the trial's cost.

    Args:
        losses: per-example losses (array or tensor) on the private validation split.
        clip: :math:`C > 0`; each loss is clipped to :math:`[0, C]`.
        noise_multiplier: :math:`\\sigma > 0` (noise std :math:`\\sigma C` on the sum).
        num_examples: public :math:`n` to divide by (default ``len(losses)``, correct only
            when the split's size is public, e.g. under substitution).
        run: the training run's cost: a ``DpEvent`` (the trial becomes
            ``ComposedDpEvent([run, GaussianDpEvent(σ)])``), one of our accountants (the trial
            becomes ``TrialCost(run, (σ,))``), or ``None`` (the score alone).
        rng: numpy ``Generator`` for the noise (default OS entropy).
    """
    values = _as_array(losses)
    clip = check_positive("clip", clip)
    sigma = check_positive("noise_multiplier", noise_multiplier)
    n = len(values) if num_examples is None else check_int("num_examples", num_examples,
                                                          minimum=1)
    rng = np.random.default_rng(secrets.randbits(128)) if rng is None else rng
    total = float(np.sum(np.clip(values, 0.0, clip)))
    score = (total + float(rng.normal(0.0, sigma * clip))) / n
    if not math.isfinite(score):
        raise ValueError("the private score is not finite (check clip and losses)")
    gauss = dp_event.GaussianDpEvent(sigma)
    if run is None:
        trial: Any = gauss
    elif isinstance(run, dp_event.DpEvent):
        trial = dp_event.ComposedDpEvent([run, gauss])
    elif isinstance(run, TrialCost):
        trial = TrialCost(run.run, (*run.score_noise_multipliers, sigma))
    else:
        trial = TrialCost(run, (sigma,))
    return score, trial
