r"""Phase schedules: a run resumed under another scheme goes on as a new phase (issue 46).

A common recipe trains with small batches first and larger ones later, or changes the rate, σ
or clip norm at a resume. A batch-size change is a change of scheme (the sampler's law), so an
accountant built for the new scheme used to refuse the old checkpoint. Instead, loading the
state of a run priced under another scheme **starts a new phase**:

* the earlier phases (the loaded run's own phases, then the loaded run itself) are kept as
  frozen accountant states and priced by the accountant of *their* scheme;
* this accountant prices the new phase from its first step, with its own sampler (a new draw
  stream: the ledger's draws start again; the noise lineage goes on under a new id, so no
  earlier noise is drawn again and a correlated-noise optimizer starts its new phase's stream at
  position 0);
* ε is read from the **composition** of the phases' pessimistic PLDs
  (:func:`~opacus_structured.accounting.pld.compose`; μ-GDP phases enter as the Gaussian PLD of
  their μ).

Sequential composition of the phases' dominating pairs bounds the run when the schedule is
fixed in advance (as for Opacus' own accountants, whose history composes steps of different σ
and rates). A phase chosen *after* looking at the earlier phases' outputs is an adaptive choice
of mechanism; its sound total is a fully adaptive filter over the runs
(:class:`opacus_structured.DatasetBudget`).

A phase of a scheme without a PLD (the truncated-Poisson baseline analysis, a Monte Carlo
estimate) cannot be composed this way: the phase change is refused with the cause and the fix.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

from ..accounting import pld as pld_lib
from ..accounting.bandmf import gaussian_pld
from ..schemes.base import Scheme

__all__ = ["PhasesMixin", "PhaseNotComposableError"]

#: keys of an accountant state that describe its run's draws, not what it priced
_DRAW_KEYS = ("ledger", "phases")


class PhaseNotComposableError(ValueError):
    """A phase change where a phase's price has no PLD to compose (module docstring)."""


def _frozen(state: dict[str, Any]) -> dict[str, Any]:
    """The part of an accountant state that prices its phase (no draw ledger, no phases)."""
    return {k: copy.deepcopy(v) for k, v in state.items() if k not in _DRAW_KEYS}


class PhasesMixin:
    """The earlier phases of a run and their composed price (module docstring); part of
    :class:`~opacus_structured.accountants.base.SchemeAccountant`."""

    def _init_phases(self) -> None:
        #: frozen accountant states of the earlier phases, oldest first
        self.phases: list[dict[str, Any]] = []
        self._phase_cache: dict = {}

    @property
    def total_steps(self) -> int:
        """Steps of every phase (``len(accountant)`` counts the current phase's)."""
        return sum(sum(int(n) for _, _, n in p.get("history", [])) for p in self.phases) \
            + len(self)

    # ---- starting a phase ----------------------------------------------------------------
    def _start_phase(self, state: dict[str, Any], saved: Scheme) -> None:
        """``state`` was saved under ``saved``, another scheme than this accountant's: keep it
        (and its own earlier phases) as earlier phases; this accountant's run is the new
        phase. Its draw ledger starts again (a new sampler); the noise lineage goes on under a
        new id, at position 0 of the new phase."""
        earlier = [dict(p) for p in state.get("phases", [])] + [_frozen(state)]
        for acc in [self] + [self._phase_accountant(p) for p in earlier]:
            why = acc.phase_refusal()
            if why is not None:  # refused before anything changes
                raise PhaseNotComposableError(
                    f"the checkpoint was priced under {saved!r} and this accountant prices "
                    f"{self.scheme!r}: a resume under another scheme starts a new phase, "
                    f"composed with the earlier ones, but {acc.scheme!r} {why}. Resume with the "
                    f"checkpoint's scheme, or start a new run and compose the two with a "
                    f"DatasetBudget")
        self.phases = earlier
        self._phase_cache.clear()
        ledger = state.get("ledger") or {}
        self._ledger.noise.load_state_dict(ledger.get("noise"))
        self._ledger.noise.fork(position=0)

    def _phase_accountant(self, phase: dict[str, Any]):
        """A fresh accountant of the phase's scheme, loaded with the phase's state."""
        scheme = Scheme.from_dict(phase["scheme"])
        acc = self._accountant_for(scheme)
        acc.load_state_dict(phase)
        return acc

    # ---- pricing -------------------------------------------------------------------------
    def phase_refusal(self) -> Optional[str]:
        """Why this accountant's run cannot be one phase of a composed run (``None``: it can);
        overridden where the price is not a PLD."""
        return None

    def phase_pld(self, discretization: float):
        """The pessimistic PLD of this phase alone (``None``: no step). Accountants whose
        price is not a composed PLD override it (a μ-GDP run: the Gaussian PLD of its μ), or
        raise :class:`PhaseNotComposableError`."""
        return self._with_unamplified(self._composed(discretization), discretization)

    @staticmethod
    def _gaussian_phase_pld(mu: float, discretization: float):
        """The PLD of a μ-GDP phase (the Gaussian mechanism at σ = 1/μ, pessimistic)."""
        if mu <= 0.0:
            return None
        return gaussian_pld(1.0 / mu, discretization=discretization)

    def _earlier_plds(self, discretization: float) -> list:
        key = discretization
        if key not in self._phase_cache:
            plds = []
            for phase in self.phases:
                plds.append(self._phase_accountant(phase).phase_pld(discretization))
            self._phase_cache = {key: plds}
        return self._phase_cache[key]

    def _phases_composed(self, discretization: float):
        """Every phase's PLD, composed (``None``: no step anywhere)."""
        parts = [p for p in self._earlier_plds(discretization) if p is not None]
        current = self.phase_pld(discretization) if len(self) else None
        if current is not None:
            parts.append(current)
        return pld_lib.compose((p, 1) for p in parts)

    def _phases_epsilon(self, delta: float, discretization: Optional[float]) -> float:
        d = self.discretization if discretization is None else discretization
        return pld_lib.epsilon_for_delta(self._phases_composed(d), delta)

    def _phases_delta(self, epsilon: float, discretization: Optional[float]) -> float:
        d = self.discretization if discretization is None else discretization
        return pld_lib.delta_for_epsilon(self._phases_composed(d), float(epsilon))

    def _phases_state(self) -> Optional[list]:
        return [copy.deepcopy(p) for p in self.phases] if self.phases else None
