r"""Privacy profiles: :math:`\delta(\varepsilon)` curves that a PLD is built from.

A *privacy profile* :math:`H(e^\varepsilon)` of a mechanism (Balle et al. 2018) is what the
connect-the-dots discretisation (Doroshenko et al. 2022, Algorithm 1) needs: the values of
:math:`\delta(\varepsilon)` on a finite grid of :math:`\varepsilon`, for negative
:math:`\varepsilon` too. Structured subsampling (Schuchardt et al., ICML 2025) uses three kinds:

* :class:`PairProfile` — :math:`H_{e^\varepsilon}(P\|Q)` of a dominating pair, for all
  :math:`\varepsilon`;
* :class:`SwitchingProfile` — :math:`H(P\|Q)` for :math:`\varepsilon \ge 0` and :math:`H(Q\|P)`
  for :math:`\varepsilon < 0` (the "switching" profile of a symmetric, substitution-type
  relation; Lemma D.11 of Schuchardt et al. 2025 shows it is a valid profile);
* :class:`WeightedProfile` — convex combinations such as Theorems F.1/F.2,
  :math:`(1-\rho)\max(0, 1-e^\varepsilon) + \rho\,H_{e^\varepsilon}(P\|Q)`, with
  :data:`PERFECT_PRIVACY` the profile of a mechanism that releases nothing.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Sequence

import numpy as np

from .mixture import MixturePair

__all__ = [
    "PrivacyProfile",
    "PairProfile",
    "SwitchingProfile",
    "WeightedProfile",
    "PerfectPrivacyProfile",
    "PERFECT_PRIVACY",
]


class PrivacyProfile(abc.ABC):
    """A privacy profile :math:`\\varepsilon \\mapsto \\delta(\\varepsilon)` on all reals."""

    @abc.abstractmethod
    def delta(self, epsilon) -> np.ndarray:
        """Vectorised :math:`\\delta(\\varepsilon)`; must be exact or an upper bound."""

    @abc.abstractmethod
    def epsilon_range(self) -> tuple[float, float]:
        """An interval holding the support of the privacy loss (up to ~1e-19 of mass)."""


@dataclasses.dataclass(frozen=True)
class PairProfile(PrivacyProfile):
    """:math:`H_{e^\\varepsilon}(P\\|Q)` of one dominating pair, for every real ε."""

    pair: MixturePair

    def delta(self, epsilon):
        return self.pair.delta(epsilon)

    def epsilon_range(self):
        return self.pair.loss_range()


@dataclasses.dataclass(frozen=True)
class SwitchingProfile(PrivacyProfile):
    r""":math:`H(P\|Q)` for :math:`\varepsilon \ge 0`, :math:`H(Q\|P)` for :math:`\varepsilon < 0`."""

    pair: MixturePair

    def delta(self, epsilon):
        eps = np.asarray(epsilon, dtype=np.float64)
        scalar = eps.ndim == 0
        eps = np.atleast_1d(eps)
        out = np.empty_like(eps)
        pos = eps >= 0
        if np.any(pos):
            out[pos] = self.pair.delta(eps[pos])
        if np.any(~pos):
            out[~pos] = self.pair.reversed().delta(eps[~pos])
        return float(out[0]) if scalar else out

    def epsilon_range(self):
        lo1, hi1 = self.pair.loss_range()
        lo2, hi2 = self.pair.reversed().loss_range()
        return min(lo1, lo2), max(hi1, hi2)


@dataclasses.dataclass(frozen=True)
class PerfectPrivacyProfile(PrivacyProfile):
    r""":math:`\delta(\varepsilon) = \max(0, 1 - e^\varepsilon)`: the profile of :math:`P = Q`."""

    def delta(self, epsilon):
        eps = np.asarray(epsilon, dtype=np.float64)
        out = np.maximum(0.0, -np.expm1(np.minimum(eps, 0.0)))
        return float(out) if out.ndim == 0 else out

    def epsilon_range(self):
        return 0.0, 0.0


PERFECT_PRIVACY = PerfectPrivacyProfile()


@dataclasses.dataclass(frozen=True)
class WeightedProfile(PrivacyProfile):
    r""":math:`\sum_k c_k H_k` with :math:`c_k \ge 0`, :math:`\sum_k c_k = 1` (a valid profile)."""

    weights: Sequence[float]
    profiles: Sequence[PrivacyProfile]

    def __post_init__(self):
        w = np.asarray(self.weights, dtype=np.float64)
        if len(w) != len(self.profiles) or len(w) == 0:
            raise ValueError("weights and profiles must be non-empty and of equal length")
        if np.any(w < 0) or abs(w.sum() - 1.0) > 1e-9:
            raise ValueError(f"weights must be >= 0 and sum to 1, got {list(w)}")
        object.__setattr__(self, "weights", tuple(float(x) for x in w))
        object.__setattr__(self, "profiles", tuple(self.profiles))

    def delta(self, epsilon):
        eps = np.asarray(epsilon, dtype=np.float64)
        pairs = zip(self.weights, self.profiles, strict=True)
        out = sum(w * np.asarray(p.delta(eps)) for w, p in pairs if w > 0)
        out = np.clip(out, 0.0, 1.0)
        return float(out) if np.ndim(out) == 0 else out

    def epsilon_range(self):
        pairs = zip(self.weights, self.profiles, strict=True)
        ranges = [p.epsilon_range() for w, p in pairs if w > 0]
        return min(r[0] for r in ranges), max(r[1] for r in ranges)
