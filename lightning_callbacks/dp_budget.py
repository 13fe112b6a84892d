"""``DPCallback``'s accounting part: price every step, guard the budget, log ε.

:class:`PrivacyBudget` holds the accountant (``SchemeAccountant(scheme)`` by default: the
accountant the scheme registry names for the scheme) and

* **refuses** what is no guarantee: a scheme or accountant whose bound kind is "lower"; an
  estimate (``BoundKind.MONTE_CARLO``, or another kind that is not a guarantee) unless
  ``allow_estimate``, and then ``target_epsilon`` unless ``stop_on_estimate``;
* **attaches** the accountant to the DataLoader the run trains on
  (:meth:`PrivacyBudget.attach`): a :class:`~opacus_structured.accountants.base.SchemeAccountant`
  checks the loader and counts its sampler's draws with the same rules as under Opacus'
  ``make_private`` (``attach`` + ``check_draws``, through its own Opacus step hook), and prices
  each step from the draws it sums (one per step; ``n`` under ``accumulate_grad_batches``,
  each at ``σ/√n``: noise splitting) and the rows per example declared (``k``: ``σ/k``); an
  accountant without ``attach`` (e.g. ``"individual-gdp"``) records the same steps only;
* **prices** ε(δ) (:meth:`PrivacyBudget.epsilon`, memoised on the accountant's history) and the
  ε of one more release (:meth:`PrivacyBudget.prospective_epsilon`, on a copy of its state:
  ``parts`` draws at ``σ/(√parts·k)``), which :meth:`PrivacyBudget.exhausted` compares with
  ``target_epsilon``;
* **logs** ε under :attr:`PrivacyBudget.epsilon_metric` (``<prefix>epsilon`` for a guarantee,
  ``<prefix>epsilon_mc_estimate`` / ``<prefix>epsilon_estimate`` for an estimate, never
  ``<prefix>epsilon``) and δ, as float32 rounded **up** (loggers store float32; ε is never
  rounded down).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import numpy as np

from opacus_structured.accountants.base import SchemeAccountant
from opacus_structured.accountants.release_guard import ClipNormLedger
from opacus_structured.schemes.base import BoundKind, Scheme

from .dp_accumulation import split_sigma

__all__ = ["PrivacyBudget", "float32_up"]


def float32_up(x: float) -> float:
    """``x`` as a float32 rounded *up*: loggers store float32, and ε must not be rounded down."""
    y = np.float32(x)
    if float(y) < x:
        y = np.nextafter(y, np.float32(np.inf))
    return float(y)


def _estimate_metric(kind) -> str:
    return "epsilon_mc_estimate" if kind == BoundKind.MONTE_CARLO else "epsilon_estimate"


class PrivacyBudget:
    """The accountant of a ``DPCallback`` run, its budget and its metrics (module docstring).

    Args: as the same-named arguments of ``DPCallback``; ``accountant=None`` builds
    ``SchemeAccountant(scheme, discretization=discretization)``.
    """

    def __init__(self, scheme: Scheme, accountant=None, *, delta: float,
                 target_epsilon: Optional[float], discretization: float,
                 allow_estimate: bool, stop_on_estimate: bool, log_prefix: str):
        if scheme.bound == BoundKind.LOWER:
            raise ValueError(f"scheme {scheme.name!r} only yields a lower bound on ε, "
                             f"which is no privacy guarantee; pick a scheme with an upper bound")
        self.scheme = scheme
        self.accountant = accountant if accountant is not None else SchemeAccountant(
            scheme, discretization=discretization)
        self.delta = delta
        self.target_epsilon = target_epsilon
        self.allow_estimate = bool(allow_estimate)
        self.stop_on_estimate = bool(stop_on_estimate)
        self.log_prefix = log_prefix
        self._check_bound_kind()
        self.epsilon_metric = (f"{log_prefix}epsilon" if self.is_guarantee
                               else f"{log_prefix}{_estimate_metric(self.bound_kind)}")
        self._memo: dict = {}

    def _check_bound_kind(self) -> None:
        kind = self.bound_kind
        if kind == BoundKind.LOWER:
            raise ValueError(f"the accountant ({type(self.accountant).__name__}) only yields a "
                             f"lower bound on ε, which is no privacy guarantee")
        if not self.is_guarantee:
            if not self.allow_estimate:
                raise ValueError(
                    f"the accountant's ε is a {kind} estimate (bound kind {str(kind)!r}), not a "
                    f"guarantee: DPCallback would log it as {self.log_prefix}epsilon and stop on "
                    f"it as if it bounded ε. Pass allow_estimate=True to log it, labelled, as "
                    f"{self.log_prefix}{_estimate_metric(kind)} (certify the noise multiplier "
                    f"first, e.g. scheme.certify(...)), or use a scheme with an upper bound")
            if self.target_epsilon is not None and not self.stop_on_estimate:
                raise ValueError(
                    f"target_epsilon={self.target_epsilon} with a {kind} estimate of ε: "
                    f"stopping on an estimate keeps ε below the target only with the "
                    f"estimate's confidence; pass stop_on_estimate=True to stop on it anyway, "
                    f"or drop target_epsilon")
        elif self.stop_on_estimate:
            raise ValueError("stop_on_estimate=True needs an accountant whose ε is an estimate "
                             "(and allow_estimate=True); this accountant gives a guarantee")

    # ---- what kind of ε -------------------------------------------------------------------
    @property
    def bound_kind(self):
        """The accountant's bound kind (its ``bound``, else the scheme's): a
        :class:`~opacus_structured.accounting.bounds.BoundKind` when it is a known one."""
        kind = getattr(self.accountant, "bound", None)
        if kind is None:
            kind = self.scheme.bound
        try:
            return BoundKind(kind)
        except ValueError:
            return kind

    @property
    def is_guarantee(self) -> bool:
        """Whether the reported ε is a certain upper bound (bound kind tight or upper)."""
        kind = self.bound_kind
        return isinstance(kind, BoundKind) and kind.is_guarantee

    # ---- feeding the accountant -----------------------------------------------------------
    def attach(self, data_loader, sample_rate: float,
               step_draws: Optional[Callable[[], Any]] = None
               ) -> Callable[[Any], None]:
        """Attach the accountant to ``data_loader`` (the loader the run trains on); returns the
        function the optimizer's step hook calls to price one step (module docstring).
        ``step_draws()``: the draws and rows per example of the step being released (the tracked
        sampler's; a ``SchemeAccountant`` reads them from the sampler itself)."""
        accountant = self.accountant
        if isinstance(accountant, SchemeAccountant):
            # attach(data_loader) now; check_draws + step at every step: make_private's path
            return accountant.get_optimizer_hook_fn(sample_rate, data_loader=data_loader)
        attach = getattr(accountant, "attach", None)
        if callable(attach):
            attach(data_loader)
        clip_norms = ClipNormLedger()  # one clip norm, as a SchemeAccountant's hook checks

        def record(optimizer) -> None:
            clip_norms.check(optimizer, step=len(accountant) + 1)
            report = step_draws() if step_draws is not None else None
            parts, k = (1, 1) if report is None else (report.parts, report.rows_per_example)
            for _ in range(max(parts, 1)):  # noise splitting: each draw at σ/(√parts·k)
                accountant.step(noise_multiplier=split_sigma(optimizer.noise_multiplier,
                                                             parts, k),
                                sample_rate=sample_rate)

        return record

    @property
    def steps(self) -> int:
        """Noisy optimizer steps priced so far (including before a resume)."""
        return len(self.accountant)

    def forget(self) -> None:
        """Drop memoised ε values (after the accountant's state was replaced)."""
        self._memo = {}

    # ---- pricing --------------------------------------------------------------------------
    def _key(self):
        try:
            return tuple(tuple(h) for h in self.accountant.history)
        except TypeError:
            return None

    def epsilon(self):
        """ε(δ) of the steps priced so far (0 before the first); a guarantee as a float, an
        allowed estimate as the accountant returns it (label included)."""
        if len(self.accountant) == 0:
            return 0.0
        key = self._key()
        if key is not None and key in self._memo:
            return self._memo[key]
        eps = self.accountant.get_epsilon(self.delta)
        if self.is_guarantee:
            if getattr(eps, "estimate", None) is not None:  # a labelled estimate after all
                raise ValueError(
                    f"the accountant reports bound kind {str(self.bound_kind)!r} but returned "
                    f"an estimate ({eps}); refusing to report it as a guarantee")
            eps = float(eps)
        if key is not None:
            self._memo = {key: eps}
        return eps

    def prospective_epsilon(self, noise_multiplier: Optional[float],
                            sample_rate: Optional[float], *, parts: int = 1,
                            rows_per_example: int = 1):
        """ε(δ) if one more step were taken at ``noise_multiplier`` and ``sample_rate``; either
        ``None`` is the last recorded step's (the rate then falls back to the scheme's). A
        step summing ``parts`` draws with ``rows_per_example`` rows each is priced as ``parts``
        steps at ``σ/(√parts·rows_per_example)`` (noise splitting, as the release is)."""
        history = getattr(self.accountant, "history", None) or []
        rate = sample_rate
        if rate is None:  # restored before fit: the last recorded step's rate
            rate = history[-1][1] if history else self.scheme.expected_sample_rate()
        sigma = noise_multiplier
        if sigma is None:
            sigma = history[-1][0] if history else None
        if sigma is None or rate is None:
            raise ValueError("prospective_epsilon needs the noise multiplier and sample rate "
                             "of the next step: pass noise_multiplier= or call it during fit")
        # A scheme accountant's pricing depends on its history alone: roll that back (loading
        # a whole state would also rewind its ledger and sampler, and refuse an older state).
        scheme_history = isinstance(self.accountant, SchemeAccountant)
        saved = (list(self.accountant.history) if scheme_history
                 else copy.deepcopy(self.accountant.state_dict()))
        memo = dict(self._memo)
        split = (sigma if parts == 1 and rows_per_example == 1
                 else split_sigma(sigma, parts, rows_per_example))
        if scheme_history:
            self.accountant.step(noise_multiplier=split, sample_rate=rate, num_steps=parts)
        else:
            for _ in range(parts):
                self.accountant.step(noise_multiplier=split, sample_rate=rate)
        try:
            eps = self.epsilon()
            memo[self._key()] = eps
        finally:
            if scheme_history:
                self.accountant.history = saved
            else:
                self.accountant.load_state_dict(saved)
            self._memo = memo
        return eps

    def exhausted(self, noise_multiplier: Optional[float], sample_rate: Optional[float],
                  *, parts: int = 1, rows_per_example: int = 1) -> bool:
        """Whether one more step would take ε above ``target_epsilon`` (never without one)."""
        if self.target_epsilon is None:
            return False
        if not self.is_guarantee and not self.stop_on_estimate:  # refused at construction
            return False
        return self.prospective_epsilon(noise_multiplier, sample_rate, parts=parts,
                                        rows_per_example=rows_per_example) > self.target_epsilon

    # ---- logging --------------------------------------------------------------------------
    @staticmethod
    def _has_logger(pl_module) -> bool:
        """Whether the trainer has a logger (else the values go to ``callback_metrics`` and the
        progress bar only, without Lightning's "no logger configured" warning)."""
        return bool(getattr(pl_module.trainer, "loggers", None))

    def log_step(self, pl_module, eps) -> None:
        """Log ε (rounded up to float32) and δ for this step."""
        logger = self._has_logger(pl_module)
        pl_module.log(self.epsilon_metric, float32_up(eps), on_step=True, on_epoch=False,
                      prog_bar=True, logger=logger, batch_size=1)
        pl_module.log(f"{self.log_prefix}delta", self.delta, on_step=True, on_epoch=False,
                      logger=logger, batch_size=1)

    def log_epoch(self, pl_module, eps) -> None:
        """Log ε (rounded up to float32) at the end of an epoch."""
        pl_module.log(f"{self.epsilon_metric}_epoch", float32_up(eps), on_step=False,
                      on_epoch=True, logger=self._has_logger(pl_module), batch_size=1)
