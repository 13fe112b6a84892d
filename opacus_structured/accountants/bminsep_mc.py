"""Opacus accountant for BandMF + b-min-sep priced by Monte Carlo (``"bminsep-mc"``).

``get_epsilon`` returns the high-confidence upper estimate as a
:class:`~opacus_structured.accounting.monte_carlo.MonteCarloEpsilon` (a float that prints its
"Monte Carlo, holds w.p. ≥ 1 − q" label), ``bound`` is ``BoundKind.MONTE_CARLO`` and
``get_privacy_spent`` returns the full :class:`MonteCarloEstimate`. It is never a deterministic
guarantee; certify σ before training with Algorithm 5 (``scheme.certify``).

The scheme describes the mechanism; the run's
:class:`~opacus_structured.runners.monte_carlo.MonteCarloSettings` (samples, seed, confidence,
workers, device) are the accountant's. It fixes its seed when built (fresh OS entropy unless
the settings give one), so every estimate it reports comes from the same seed, and its
``state_dict`` records the settings used (``"monte_carlo"``). A checkpoint resumes exactly:
an accountant built without settings adopts the checkpoint's, one built with settings must
match them (a different ``seed`` is refused — a new seed would silently replace the reported
estimate by a new draw — unless its settings left the seed open and it has reported nothing
yet).
"""

from __future__ import annotations

import math
from typing import ClassVar, Optional

from .._validation import check_open_unit
from ..accounting.bounds import BoundKind
from ..accounting.monte_carlo import MonteCarloEstimate, MonteCarloSettings
from ..schemes.bminsep_mc import BMinSepMonteCarloScheme
from .base import SchemeAccountant, _check_no_alphas

__all__ = ["BMinSepMonteCarloAccountant"]


class BMinSepMonteCarloAccountant(SchemeAccountant):
    """``SchemeAccountant`` over :class:`BMinSepMonteCarloScheme`.

    Args:
        scheme: the scheme (``None``: the class' ``default_scheme``).
        settings: how estimates are made (``None``: the class' ``default_settings``, else
            :class:`MonteCarloSettings` defaults); a ``seed=None`` is drawn here, once.
        kwargs: as :class:`SchemeAccountant` (``discretization`` does not apply).

    It always needs a scheme (it is never *unbound*, so it is not registered with Opacus by its
    bare name, and ``opacus_structured.make_private`` refuses Monte Carlo schemes). Opacus'
    registry builds accountants without arguments, so register a configured one with
    ``register_scheme_accountant("my-bminsep", scheme, base=BMinSepMonteCarloAccountant)`` (a
    subclass may set ``default_settings``). A history with several noise multipliers is priced
    at the smallest one (more noise is post-processing: never under-reports).
    """

    mechanism_name = "bminsep-mc"
    scheme_class = BMinSepMonteCarloScheme
    #: Settings used when constructed without ``settings`` (Opacus' registry calls ``cls()``).
    default_settings: ClassVar[Optional[MonteCarloSettings]] = None

    def __init__(self, scheme: Optional[BMinSepMonteCarloScheme] = None, *,
                 settings: Optional[MonteCarloSettings] = None, **kwargs):
        super().__init__(scheme, **kwargs)
        if not isinstance(self.scheme, BMinSepMonteCarloScheme):
            # never unbound: a Monte Carlo estimate is not a guarantee, so this accountant is
            # not built by name (Opacus' registry) nor installed by make_private
            raise ValueError(f"BMinSepMonteCarloAccountant needs a BMinSepMonteCarloScheme, got "
                             f"{self.scheme!r}: build it as BMinSepMonteCarloAccountant(scheme, "
                             f"settings=...), or register a configured one with "
                             f"register_scheme_accountant(name, scheme, "
                             f"base=BMinSepMonteCarloAccountant)")
        given = settings if settings is not None else self.default_settings
        if given is not None and not isinstance(given, MonteCarloSettings):
            raise ValueError(f"settings must be a MonteCarloSettings, got "
                             f"{type(given).__name__}")
        self._settings_given = given is not None
        self._seed_given = given is not None and given.seed is not None
        self._reported = False
        self.settings = (given if given is not None else MonteCarloSettings()).resolved()

    @property
    def bound(self) -> BoundKind:
        return BoundKind.MONTE_CARLO

    def phase_refusal(self):
        return "is priced by a Monte Carlo estimate, not a PLD"

    def _sigma_steps(self) -> tuple[float, int]:
        steps = len(self)
        sigma = min((s for s, _, n in self.history if n), default=math.inf)
        return sigma, steps

    def get_epsilon(self, delta: float, **kwargs):
        """High-confidence upper ε estimate (labelled float; Monte Carlo, not a bound).

        Raises :class:`~opacus_structured.accountants.base.AccountantNotAttachedError` if the
        accountant saw nothing (as every accountant of this package)."""
        self._require_observed()
        delta = check_open_unit("delta", delta)
        if self.without_noise:
            return math.inf
        sigma, steps = self._sigma_steps()
        self._reported = self._reported or steps > 0
        return self.scheme.epsilon(sigma if steps else 1.0, steps, delta, settings=self.settings)

    def get_delta(self, epsilon: float, **kwargs) -> float:
        self._require_observed()
        if self.without_noise:
            return 1.0
        sigma, steps = self._sigma_steps()
        self._reported = self._reported or steps > 0
        return self.scheme.delta(sigma if steps else 1.0, steps, epsilon, settings=self.settings)

    def get_privacy_spent(self, *, delta: float,
                          alphas=None) -> tuple[MonteCarloEstimate, BoundKind]:
        """``(MonteCarloEstimate, BoundKind.MONTE_CARLO)``: the estimate states its confidence
        (Opacus' call shape; ``alphas`` must be ``None``, see
        :mod:`opacus_structured.accountants.base`)."""
        _check_no_alphas(alphas, type(self).__name__)
        eps = self.get_epsilon(delta)
        return (eps if self.without_noise else eps.estimate), self.bound

    # ---- state ---------------------------------------------------------------------------
    def state_dict(self, destination=None):
        """:meth:`SchemeAccountant.state_dict` plus ``"monte_carlo"``: the settings used (with
        the seed)."""
        destination = super().state_dict(destination)
        destination["monte_carlo"] = self.settings.to_dict()
        return destination

    def load_state_dict(self, state_dict):
        """As :meth:`SchemeAccountant.load_state_dict`, and continue the checkpoint's run.

        Settings that change the estimates (``samples``, ``seed``, ``failure_probability``,
        ``shard_size``, the backend of ``device``) are adopted from the checkpoint when this
        accountant was built without settings and the seed when its settings left it open —
        unless it has already reported an estimate from its own. Otherwise they must match;
        the error names what differs and how to rebuild the accountant.
        """
        saved = state_dict.get("monte_carlo") if hasattr(state_dict, "get") else None
        adopted = None
        if saved is not None:
            theirs = MonteCarloSettings.from_dict(saved)
            differ = self.settings.differences(theirs)
            if differ:
                adoptable = set() if self._reported else (
                    set(differ) if not self._settings_given
                    else {"seed"} if not self._seed_given else set())
                refused = [name for name in differ if name not in adoptable]
                if "seed" in refused:
                    raise ValueError(
                        f"checkpoint was priced with Monte Carlo seed {theirs.seed} but this "
                        f"accountant uses seed {self.settings.seed}: build it with "
                        f"settings=MonteCarloSettings.from_dict(state_dict['monte_carlo']) (or "
                        f"without settings); a new seed would silently replace the reported "
                        f"estimate by a new draw")
                if refused:
                    raise ValueError(
                        f"checkpoint was priced with Monte Carlo settings {theirs!r} but this "
                        f"accountant uses {self.settings!r} (they differ in "
                        f"{', '.join(refused)}): build it with settings=MonteCarloSettings."
                        f"from_dict(state_dict['monte_carlo']) (or without settings)")
                adopted = self._adopt(theirs)
        super().load_state_dict(state_dict)
        if adopted is not None:
            self.settings = adopted

    def _adopt(self, theirs: MonteCarloSettings) -> MonteCarloSettings:
        """The checkpoint's result-determining settings, with this accountant's ``workers``,
        ``progress``, executor and device (when on the same backend), which never change a
        result."""
        ours = self.settings
        device = ours.device if ours.backend == theirs.backend else theirs.device
        return MonteCarloSettings(samples=theirs.samples, seed=theirs.seed,
                                  failure_probability=theirs.failure_probability,
                                  workers=ours.workers, device=device, progress=ours.progress,
                                  shard_size=theirs.shard_size, executor=ours.executor,
                                  scheduler=ours.scheduler)

    def __repr__(self):
        return (f"{type(self).__name__}(scheme={self.scheme!r}, settings={self.settings!r}, "
                f"steps={len(self)})")
