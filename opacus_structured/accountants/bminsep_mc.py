"""Opacus accountant for BandMF + b-min-sep priced by Monte Carlo (``"bminsep-mc"``).

``get_epsilon`` returns the high-confidence upper estimate as a
:class:`~opacus_structured.accounting.monte_carlo.MonteCarloEpsilon` (a float that prints its
"Monte Carlo, holds w.p. ≥ 1 − q" label), ``bound`` is ``"monte-carlo"`` and
``get_privacy_spent`` returns the full :class:`MonteCarloEstimate`. It is never a deterministic
guarantee; certify σ before training with Algorithm 5 (``scheme.certify``).

The scheme's Monte Carlo seed (fresh OS entropy unless given) is part of the scheme and of
``state_dict``: a checkpoint resumes only with the same seed (rebuild the scheme with
``Scheme.from_dict(state["scheme"])``), so a resumed run reports the same estimate instead of
a new draw.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from .._validation import check_open_unit
from ..accounting.bounds import BoundKind
from ..accounting.monte_carlo import MonteCarloEstimate
from ..schemes.base import Scheme
from ..schemes.bminsep_mc import BMinSepMonteCarloScheme
from .base import SchemeAccountant

__all__ = ["BMinSepMonteCarloAccountant"]


class BMinSepMonteCarloAccountant(SchemeAccountant):
    """``SchemeAccountant`` over :class:`BMinSepMonteCarloScheme`.

    Opacus' registry builds accountants without arguments, so register a configured one with
    ``register_scheme_accountant("my-bminsep", scheme, base=BMinSepMonteCarloAccountant)``.
    A history with several noise multipliers is priced at the smallest one (more noise is
    post-processing: never under-reports).
    """

    mechanism_name = "bminsep-mc"
    scheme_class = BMinSepMonteCarloScheme

    def __init__(self, scheme: Optional[BMinSepMonteCarloScheme] = None, **kwargs):
        super().__init__(scheme, **kwargs)
        if not isinstance(self.scheme, BMinSepMonteCarloScheme):
            raise ValueError(f"BMinSepMonteCarloAccountant needs a BMinSepMonteCarloScheme, got "
                             f"{self.scheme!r}")

    @property
    def bound(self) -> str:
        return BoundKind.MONTE_CARLO

    def _sigma_steps(self) -> tuple[float, int]:
        steps = len(self)
        sigma = min((s for s, _, n in self.history if n), default=math.inf)
        return sigma, steps

    def get_epsilon(self, delta: float, **kwargs):
        """High-confidence upper ε estimate (labelled float; Monte Carlo, not a bound)."""
        delta = check_open_unit("delta", delta)
        sigma, steps = self._sigma_steps()
        return self.scheme.epsilon(sigma if steps else 1.0, steps, delta)

    def get_delta(self, epsilon: float, **kwargs) -> float:
        sigma, steps = self._sigma_steps()
        return self.scheme.delta(sigma if steps else 1.0, steps, epsilon)

    def load_state_dict(self, state_dict):
        """As :meth:`SchemeAccountant.load_state_dict`; a checkpoint that differs from this
        accountant's scheme only in the Monte Carlo seed gets an error that says so."""
        saved = state_dict.get("scheme") if hasattr(state_dict, "get") else None
        if saved is not None:
            other = Scheme.from_dict(saved)
            if isinstance(other, BMinSepMonteCarloScheme) and other.seed != self.scheme.seed \
                    and dataclasses.replace(other, seed=self.scheme.seed) == self.scheme:
                raise ValueError(
                    f"checkpoint was priced with Monte Carlo seed {other.seed} but this "
                    f"accountant's scheme has seed {self.scheme.seed} (seed=None draws a fresh "
                    f"one): rebuild it with seed={other.seed} or "
                    f"Scheme.from_dict(state_dict['scheme']); a new seed would silently replace "
                    f"the reported estimate by a new draw")
        super().load_state_dict(state_dict)

    def get_privacy_spent(self, *, delta: float) -> tuple[MonteCarloEstimate, str]:
        """``(MonteCarloEstimate, "monte-carlo")``: the estimate states its confidence."""
        return self.get_epsilon(delta).estimate, self.bound
