"""Scores of a canary audit: the likelihood-ratio test of the released coordinate against the
mixture over the canary's participation patterns, and the patterns of Bernoulli participation
(split from :mod:`~opacus_structured.audit.pipelines`, which re-exports every name)."""

from __future__ import annotations

import itertools
import math
from typing import Optional

import numpy as np

from .._validation import check_positive, check_probability
from .runs import MAX_PATTERNS


# ---- scoring ----------------------------------------------------------------------------------
def _log_mixture(y: np.ndarray, means: np.ndarray, log_probs: np.ndarray,
                 sigma2: float) -> np.ndarray:
    r""":math:`\log\sum_S P(S)\exp((\langle y, m_S\rangle - \|m_S\|^2/2)/\sigma^2)` per row of
    ``y`` (the Gaussian mixture density up to the factor common to all mixtures)."""
    logits = log_probs[None, :] + (y @ means.T - 0.5 * np.sum(means * means, axis=1)[None, :]) \
        / sigma2
    top = logits.max(axis=1, keepdims=True)
    return (top + np.log(np.exp(logits - top).sum(axis=1, keepdims=True))).reshape(-1)


def likelihood_ratio_scores(observed, patterns, log_probs, noise_multiplier: float,
                            strategy: Optional[np.ndarray] = None, patterns_without=None,
                            log_probs_without=None) -> np.ndarray:
    r"""Log likelihood ratio of "canary present" for each row of ``observed`` (module docstring).

    Args:
        observed: ``(R, T)`` released canary-coordinate values :math:`y` in units of ``C``.
        patterns: ``(P, T)`` mean vectors :math:`b_S` of the canary coordinate "with" (0/1
            participation patterns :math:`1_S`, or e.g. :math:`2 \cdot 1_S - B` when an
            included canary displaces another example).
        log_probs: ``(P,)`` :math:`\log P(S)`.
        noise_multiplier: σ of the Gaussian noise (in units of ``C``).
        strategy: ``(T, T)`` matrix ``C`` of the matrix mechanism (``None``: the identity).
        patterns_without, log_probs_without: the same for the "without" runs (default: the
            single pattern 0, probability 1).

    Returns:
        ``(R,)`` :math:`\log\frac{\sum_S P(S)\,\varphi_\sigma(Cy - Cb_S)}
        {\sum_{S'} P'(S')\,\varphi_\sigma(Cy - Cb'_{S'})}`, :math:`\varphi_\sigma` the
        :math:`\mathcal N(0, \sigma^2 I)` density.
    """
    y = np.asarray(observed, dtype=np.float64)
    s = np.asarray(patterns, dtype=np.float64)
    lp = np.asarray(log_probs, dtype=np.float64)
    if patterns_without is None:
        s0, lp0 = np.zeros((1, s.shape[1] if s.ndim == 2 else 0)), np.zeros(1)
    else:
        s0 = np.asarray(patterns_without, dtype=np.float64)
        lp0 = np.asarray(log_probs_without, dtype=np.float64)
    for a, b in ((s, lp), (s0, lp0)):
        if y.ndim != 2 or a.ndim != 2 or a.shape[1] != y.shape[1] or b.shape != (a.shape[0],):
            raise ValueError(f"observed (R, T), patterns (P, T) and log_probs (P,) must agree, "
                             f"got {y.shape}, {a.shape}, {b.shape}")
    sigma2 = check_positive("noise_multiplier", noise_multiplier) ** 2
    if strategy is not None:
        c = np.asarray(strategy, dtype=np.float64)
        y, s, s0 = y @ c.T, s @ c.T, s0 @ c.T
    return _log_mixture(y, s, lp, sigma2) - _log_mixture(y, s0, lp0, sigma2)


def bernoulli_patterns(steps: int, eligible, rate: float) -> tuple[np.ndarray, np.ndarray]:
    r"""Every pattern of independent participation with probability ``rate`` at each step of
    ``eligible`` (never at the others): :math:`P(S) = q^{|S|}(1-q)^{|E|-|S|}` for
    :math:`S \subseteq E`."""
    eligible = list(eligible)
    if 2 ** len(eligible) > MAX_PATTERNS:
        raise ValueError(f"steps: {len(eligible)} eligible steps give 2^{len(eligible)} "
                         f"participation patterns (max {MAX_PATTERNS}); audit fewer steps")
    q = check_probability("rate", rate)
    rows, lps = [], []
    for bits in itertools.product((0, 1), repeat=len(eligible)):
        k = sum(bits)
        if (q == 1.0 and k < len(eligible)):
            continue
        row = np.zeros(steps)
        row[[e for e, b in zip(eligible, bits, strict=True) if b]] = 1.0
        rows.append(row)
        lps.append(k * math.log(q) + (len(eligible) - k) * (math.log1p(-q) if q < 1 else 0.0))
    return np.array(rows), np.array(lps)


