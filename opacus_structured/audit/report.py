r"""The audit's ROC curve against the accountant's predicted trade-off curve.

A mechanism whose privacy profile is :math:`\delta(\varepsilon)` (the ε–δ curve the accountant
computes: a PLD's, or a closed form's) is :math:`(\varepsilon, \delta(\varepsilon))`-DP for every
ε at once, so every membership test on it — threshold attacks on canary scores included — has,
at false-positive rate :math:`\alpha`, a true-positive rate at most

.. math::

    \mathrm{TPR}_{\max}(\alpha) = \min\Bigl(1,\ \inf_{\varepsilon \ge 0} \min\bigl(
        e^{\varepsilon}\alpha + \delta(\varepsilon),\
        1 - e^{-\varepsilon}\,(1 - \delta(\varepsilon) - \alpha)\bigr)\Bigr)

(the trade-off function :math:`f = \sup_\varepsilon f_{\varepsilon, \delta(\varepsilon)}`, Dong,
Roth & Su, "Gaussian differential privacy", JRSS-B 2022, Proposition 2.12, with
:math:`\mathrm{TPR} = 1 - f(\mathrm{FPR})`; the second term is the inequality of the other
direction). For the Gaussian mechanism it is the ROC of the likelihood-ratio test
:math:`1 - \Phi(\Phi^{-1}(1-\alpha) - \mu)`. The infimum is taken over a finite ε grid, which can
only raise the curve: an audited ROC *above* the plotted curve is a real contradiction of the
accountant (up to the audit's sampling error, which the ε lower bound accounts for).
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from ..accounting import pld as pld_lib
from .estimators import AuditScores, EpsilonLowerBound, roc_curve

__all__ = ["predicted_tradeoff", "default_epsilon_grid", "scheme_profile", "plot_audit"]


def default_epsilon_grid() -> np.ndarray:
    """ε grid for :func:`predicted_tradeoff`: steps of 0.01 up to 10, then of 0.1 up to 60."""
    return np.concatenate([np.linspace(0.0, 10.0, 1001), np.linspace(10.1, 60.0, 500)])


def predicted_tradeoff(delta_of_epsilon: Callable, fpr_grid, *,
                       epsilons: Optional[np.ndarray] = None) -> np.ndarray:
    r"""Largest TPR any test can reach at each FPR of ``fpr_grid`` under the privacy profile
    ``delta_of_epsilon`` (module docstring; minimum over the ``epsilons`` grid,
    :func:`default_epsilon_grid` when ``None``).

    Args:
        delta_of_epsilon: δ(ε), called once with the array of ``epsilons`` (or once per ε if it
            does not return an array of that shape); values in [0, 1].
        fpr_grid: false-positive rates in [0, 1].
    """
    fpr = np.asarray(fpr_grid, dtype=float)
    if fpr.ndim != 1 or fpr.size == 0 or not np.all((fpr >= 0) & (fpr <= 1)):
        raise ValueError("fpr_grid must be a non-empty 1-D array of rates in [0, 1]")
    eps = default_epsilon_grid() if epsilons is None else np.asarray(epsilons, dtype=float)
    if eps.ndim != 1 or eps.size == 0 or not np.all(np.isfinite(eps) & (eps >= 0)):
        raise ValueError("epsilons must be a non-empty 1-D array of finite values >= 0")
    try:
        deltas = np.asarray(delta_of_epsilon(eps), dtype=float)
    except (TypeError, ValueError):
        deltas = None
    if deltas is None or deltas.shape != eps.shape:
        deltas = np.array([float(delta_of_epsilon(float(e))) for e in eps])
    if not np.all((deltas >= -1e-12) & (deltas <= 1 + 1e-12)):
        raise ValueError("delta_of_epsilon must return values in [0, 1]")
    deltas = np.clip(deltas, 0.0, 1.0)
    e, d, a = np.exp(eps)[:, None], deltas[:, None], fpr[None, :]
    first = e * a + d
    second = 1.0 - (1.0 - d - a) / e
    return np.clip(np.minimum(first, second).min(axis=0), 0.0, 1.0)


def scheme_profile(scheme, noise_multiplier: float, steps: int, *,
                   discretization: float = 1e-3) -> Callable:
    """δ(ε) of ``scheme`` after ``steps`` steps at ``noise_multiplier``, as its accountant prices
    it (:meth:`~opacus_structured.schemes.Scheme.delta`), as a function of an ε array.

    :meth:`Scheme.delta` composes the PLD on every call, and some schemes accept a scalar ε
    only. The returned function therefore prefers one composed PLD: the scheme's ``pld``
    self-composed over its ``compositions(steps)``, used only if it reproduces
    ``scheme.delta`` at three probe values of ε (to 1e-9 relative); otherwise it calls
    ``scheme.delta`` with the whole array, or, for a scalar-only ``delta``, once per ε of a
    coarse grid (steps of 0.5 up to 12, or until δ < 1e-7; every ε takes the value at the grid
    point below it: δ is decreasing, so the curve can only rise, never fall below the
    accountant's)."""
    probes = np.array([0.0, 0.5, 2.0])
    try:
        expected = np.array([float(scheme.delta(noise_multiplier, steps, float(e),
                                                discretization=discretization))
                             for e in probes])
        composed = pld_lib.self_compose(
            scheme.pld(noise_multiplier, discretization=discretization),
            scheme.compositions(steps))
        got = np.asarray(pld_lib.delta_for_epsilon(composed, probes), dtype=float)
        if np.allclose(got, expected, rtol=1e-9, atol=1e-15):
            return lambda epsilons: pld_lib.delta_for_epsilon(
                composed, np.asarray(epsilons, dtype=float))
    except (NotImplementedError, TypeError, ValueError):
        pass

    coarse = np.arange(0.0, 12.0 + 1e-9, 0.5)
    cache: dict = {}

    def delta_of_epsilon(epsilons):
        eps = np.asarray(epsilons, dtype=float)
        try:
            out = np.asarray(scheme.delta(noise_multiplier, steps, eps,
                                          discretization=discretization), dtype=float)
            if out.shape == eps.shape:
                return out
        except (TypeError, ValueError):
            pass
        if "values" not in cache:
            values = []
            for e in coarse:  # stop once δ is negligible: δ(12) <= δ(ε) <= that value
                values.append(float(scheme.delta(noise_multiplier, steps, float(e),
                                                  discretization=discretization)))
                if values[-1] < 1e-7:
                    break
            cache["values"] = np.array(values + [values[-1]] * (coarse.size - len(values)))
        # round each ε down to the coarse grid: δ there is >= δ(ε), a valid (higher) profile
        idx = np.clip(np.searchsorted(coarse, eps, side="right") - 1, 0, coarse.size - 1)
        return cache["values"][idx]
    return delta_of_epsilon


def plot_audit(scores: AuditScores, path, *, delta_of_epsilon: Optional[Callable] = None,
               bound: Optional[EpsilonLowerBound] = None, title: Optional[str] = None):
    """Save the audit's empirical ROC (linear and log-log panels) to ``path``, with the
    accountant's predicted trade-off curve when ``delta_of_epsilon`` is given and the ε lower
    bound in the legend when ``bound`` is given. Returns ``path``. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fpr, tpr = roc_curve(scores.scores_with, scores.scores_without)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    label = "audit ROC (empirical)"
    if bound is not None:
        label += f": epsilon >= {bound.epsilon:.3g} ({bound.confidence:.0%} lower bound)"
    grid = np.unique(np.concatenate([np.logspace(-5, 0, 300), np.linspace(0, 1, 201)]))
    predicted = None if delta_of_epsilon is None else predicted_tradeoff(delta_of_epsilon, grid)
    for ax, log in zip(axes, (False, True), strict=True):
        ax.step(fpr, tpr, where="post", color="C0", label=label)
        if predicted is not None:
            ax.plot(grid, predicted, color="C3", linestyle="--",
                    label=f"accountant's bound (epsilon = {scores.reported_epsilon:.3g} at "
                          f"delta = {scores.delta:g})")
        ax.plot([0, 1], [0, 1], color="0.7", linewidth=0.8, label="chance")
        ax.set_xlabel("false-positive rate")
        ax.set_ylabel("true-positive rate")
        if log:
            floor = 0.5 / max(scores.scores_without.size, scores.scores_with.size)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlim(floor, 1)
            ax.set_ylim(floor, 1)
        else:
            ax.set_xlim(0, 1)
            ax.set_ylim(0, 1)
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(title or f"privacy audit: {scores.runs} runs ({scores.meta.get('scheme', '')})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
