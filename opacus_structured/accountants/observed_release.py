r"""Pricing a noisy step from what it actually summed (issue 39).

:mod:`~opacus_structured.accountants.release_rows` observes, for every noisy step, which draws
of the scheme's sampler its rows come from, how many rows each sampled example gave
(``k_d`` for draw ``d``), and how many rows have no traceable example (untracked, or mixed by
an operation across rows). This module turns that into a price that never under-reports.

**Noise splitting.** A step releases ``S + N(0, σ²C²)`` with ``S = Σ_{i=1..m} S_i`` a sum of
``m`` parts (the rows of draw ``d_1``, of ``d_2``, …, and the untraceable rows). Since
``N(0, σ²C²)`` has the law of ``Σ_i N(0, σ²C²/m)``, the step is post-processing of the ``m``
releases ``S_i + N(0, (σ/√m)²C²)``, which compose (adaptively). So

* a part that is the rows of draw ``d`` with at most ``k_d`` rows per example (sensitivity
  ``k_d C``) is the scheme's own step on draw ``d`` at noise multiplier ``σ / (√m · k_d)``:
  the scheme's amplification by sampling still applies (the example is in the part only if
  the draw sampled it). One draw with one row per example (``m = 1``, ``k = 1``) is the
  scheme's step at ``σ``, unchanged: a loop that follows the scheme is priced exactly as
  before;
* the part of ``u`` untraceable rows is priced **without amplification**: changing one
  example can change each of those rows by at most ``2C`` (each is clipped to ``C``), so the
  part is a Gaussian mechanism of sensitivity ``2uC``, multiplier ``σ / (√m · 2u)``, applied
  whether or not the example was sampled. It is recorded apart from the scheme's history
  (``unamplified``) and composed with it; the accountant warns once, naming the cause and the
  fix (declare public rows with :func:`~opacus_structured.public` /
  :func:`~opacus_structured.public_rows`, keep the batch a torch tensor).

Manual accumulation across skipped steps, concatenated batches and several augmented views
per example are therefore priced, not refused.

**Counted, not observed** (``DPCallback`` under Lightning, whose batches carry no row tokens):
the callback knows which draws each step's clipped sum holds (the batches trained on since
the sum was last emptied: ``K`` of them with ``Trainer(accumulate_grad_batches=K)``) and
declares how many rows each example gives (``rows_per_example=k``); the sampler reports both
(:meth:`~opacus_structured.samplers.draw_ledger.DrawLedger.step_draws`) and the step is priced
as above from ``{draw: k}``. The clipped rows must fit: at most ``k`` times the examples of
those draws, else :class:`~opacus_structured.accountants.ledger.LedgerError` names the cause
(more rows per example than declared) and the fix. Correlated noise (``release_policy ==
"exact"``) ties each noise position to one draw, so a step that sums several draws or
untraceable rows raises :class:`~opacus_structured.accountants.ledger.LedgerError` there
(``k_d > 1`` is priced: the run at ``σ/k``).
"""

from __future__ import annotations

import math
from typing import Optional

from .._warnings import warn
from ..accounting import pld as pld_lib
from ..accounting.bandmf import gaussian_pld
from ..accounting.gaussian import gdp_epsilon
from ..accounting.numerics import NumericalPrecisionError
from ..accounting.resource_guard import ResourceBudgetError
from . import co_release
from .ledger import LedgerError
from .release_rows import ReleaseRows

__all__ = ["ObservedReleaseMixin", "UnamplifiedRowsWarning", "split_sigma"]


class UnamplifiedRowsWarning(UserWarning):
    """Some noisy steps summed rows whose examples could not be traced; they were priced
    without amplification by sampling (sound, and much larger)."""


def split_sigma(sigma: Optional[float], parts: int, rows_per_example: int = 1):
    """``σ / (√parts · k)``: the multiplier each draw of a step that sums ``parts`` draws with
    ``k`` rows per example is priced at (noise splitting, module docstring); ``None`` for
    ``None``."""
    if sigma is None:
        return None
    return sigma / (math.sqrt(max(parts, 1)) * max(rows_per_example, 1))


class ObservedReleaseMixin:
    """The part of :class:`~opacus_structured.accountants.base.SchemeAccountant` that prices
    observed releases (module docstring). ``unamplified`` maps a noise multiplier to the
    number of Gaussian parts priced at it."""

    unamplified: dict

    def _init_observed(self) -> None:
        self.unamplified = {}
        self._warned_unamplified = False

    def _release_observed(self, optimizer, rows: ReleaseRows, sample_rate: float, *,
                          parts: int = 0) -> None:
        """Price one noisy step from its :class:`ReleaseRows` (module docstring); ``parts``:
        split the noise into at least that many parts (empty ones cost nothing)."""
        sigma = float(optimizer.noise_multiplier)
        step_no = len(self) + 1
        loose = rows.untracked + rows.mixed
        parts = max(parts, len(rows.multiplicity) + (1 if loose else 0))
        if self.scheme.release_policy == "exact" and (len(rows.multiplicity) > 1 or loose):
            raise LedgerError(self._exact_message(rows, step_no))
        discovered = self._discover
        if discovered:
            self.check_draws()
        padding = self._ledger.take(self.scheme, priced_steps=len(self), optimizer=optimizer,
                                    draws=rows.draws)
        if not discovered:  # after the ledger; subclasses' bookkeeping runs here (shuffle)
            self.check_draws()
        if padding:
            self.step(noise_multiplier=sigma, sample_rate=sample_rate, num_steps=padding)
        for draw in rows.draws:
            own = split_sigma(sigma, parts, rows.multiplicity.get(draw, 1))
            self.step(noise_multiplier=own, sample_rate=sample_rate)
            if not loose:  # another module's step on this draw re-prices it (co_release)
                co_release.register(self._ledger.source, draw, self, optimizer, own,
                                    len(self) - 1)
        if loose:
            self._add_unamplified(split_sigma(sigma, parts, 2 * loose), rows, step_no)
        self._ledger.note_priced()
        self._hooked_steps += 1

    def _release_counted(self, optimizer, rows: Optional[ReleaseRows],
                         sample_rate: float) -> bool:
        """Price a step whose draws the training driver counted (module docstring); ``False``
        when none did, or when the step is the scheme's own (one draw, one row per example),
        which the ledger's path prices. ``rows``: what the clipping observed (no tokens)."""
        source = self._ledger.source
        report = source.step_draws() if callable(getattr(source, "step_draws", None)) else None
        if report is None or not self._exact_cursor:
            return False
        draws, k = report.draws, report.rows_per_example
        # the private rows the clipping summed, when it was seen (a forward may be recorded
        # twice: Lightning's DDP wrapper calls the module's forward to reach training_step)
        private = None if rows is None else (
            rows.private_rows if rows.clipped is None else max(rows.clipped - rows.public, 0))
        sizes = [source.size_of(d) for d in draws]
        if private is not None and None not in sizes and private > k * sum(sizes):
            raise LedgerError(self._counted_message(private, draws, sum(sizes), k, rows))
        if report.parts == 1 and k == 1:
            return False
        counted = ReleaseRows(multiplicity={int(d): int(k) for d in draws},
                              clipped=None if rows is None else rows.clipped,
                              clippings=0 if rows is None else rows.clippings)
        self._release_observed(optimizer, counted, sample_rate, parts=report.parts)
        return True

    def _counted_message(self, private: int, draws: list, examples: int, k: int,
                         rows: ReleaseRows) -> str:
        m = max(k + 1, -(-private // max(examples, 1)))
        batches = (f"the batch it trained on (draw {draws[0]})" if len(draws) == 1 else
                   f"the {len(draws)} batches it sums (draws {draws})")
        return (f"noisy step {len(self) + 1} summed {private} private rows in {rows.clippings} "
                f"clipping pass(es), but {batches} hold(s) {examples} examples and "
                f"rows_per_example={k} is declared: each example gives the step more rows "
                f"(augmented views of each example, each clipped on its own), and the batches "
                f"under Lightning carry no row tokens that would say how many. Fix: declare "
                f"the most rows one example gives, e.g. DPCallback(..., rows_per_example={m}) "
                f"for {m} views of each example (each draw is then priced at sigma/{m}: {m} "
                f"rows of one example move the clipped sum by up to {m}*C); declare generated "
                f"or public rows with opacus_structured.public(x) or `with "
                f"opacus_structured.public_rows():`")

    def _exact_message(self, rows: ReleaseRows, step_no: int) -> str:
        what = []
        if len(rows.multiplicity) > 1:
            what.append(f"rows of {len(rows.multiplicity)} draws ({rows.draws})")
        if rows.untracked:
            what.append(f"{rows.untracked} row(s) that do not come from the private "
                        f"DataLoader's batches")
        if rows.mixed:
            what.append(f"{rows.mixed} row(s) whose examples were mixed by "
                        f"{rows.lost_at!r}")
        return (f"noisy step {step_no} sums {' and '.join(what)}, but scheme "
                f"{self.scheme.name!r} adds correlated noise priced for one draw per noise "
                f"position. Fix: one optimizer.step() per batch of the loader make_private "
                f"returned (no accumulation across skipped steps, no concatenated batches); "
                f"declare generated or public rows with opacus_structured.public(x) or "
                f"`with opacus_structured.public_rows():`")

    def _add_unamplified(self, noise_multiplier: float, rows: ReleaseRows,
                         step_no: int) -> None:
        self.unamplified[noise_multiplier] = self.unamplified.get(noise_multiplier, 0) + 1
        self._cache.clear()
        if self._warned_unamplified:
            return
        self._warned_unamplified = True
        cause = []
        if rows.untracked:
            cause.append(f"{rows.untracked} row(s) without a private draw token (rows built "
                         f"outside torch from the batch, e.g. through NumPy, or rows that are "
                         f"not from the private DataLoader, e.g. generated samples)")
        if rows.mixed:
            cause.append(f"{rows.mixed} row(s) whose examples were mixed across the batch by "
                         f"{rows.lost_at!r}")
        warn(
            f"{type(self).__name__}: noisy step {step_no} summed {' and '.join(cause)}; they "
            f"are priced without amplification by sampling (sensitivity 2C per such row), a "
            f"sound but much larger epsilon. If the rows hold no private data, declare them: "
            f"opacus_structured.public(x) for a tensor, or `with "
            f"opacus_structured.public_rows():` around the forward; if they do, keep the "
            f"batch a torch tensor from the loader to the model, and apply operations that "
            f"mix examples (batch statistics) inside the model", UnamplifiedRowsWarning)

    def _unamplified_pld(self, discretization: float):
        """The composed PLD of the unamplified parts (``None``: none)."""
        return pld_lib.compose((gaussian_pld(s, discretization=discretization), n)
                               for s, n in sorted(self.unamplified.items()))

    def _with_unamplified(self, composed, discretization: float):
        extra = self._unamplified_pld(discretization) if self.unamplified else None
        if extra is None:
            return composed
        return extra if composed is None else composed.compose(extra)

    def _unamplified_mu(self) -> float:
        """The unamplified parts compose to a Gaussian mechanism: ``μ = √(Σ n/σ²)``."""
        return math.sqrt(sum(n / s ** 2 for s, n in self.unamplified.items()))

    def _epsilon_with_unamplified(self, delta: float, discretization: float) -> float:
        """ε(δ) of the scheme's history composed with the unamplified parts: the smaller of
        the PLD composition (when its grid fits) and basic composition at ``δ/2 + δ/2`` with
        the exact Gaussian (μ-GDP) curve of the unamplified parts; both are upper bounds."""
        mu = self._unamplified_mu()
        candidates = []
        if mu <= 12.0:
            try:
                composed = self._with_unamplified(self._composed(discretization), discretization)
                candidates.append(pld_lib.epsilon_for_delta(composed, delta))
            except (ValueError, ResourceBudgetError, NumericalPrecisionError):
                pass
        base = self._composed(discretization)
        scheme_eps = 0.0 if base is None else pld_lib.epsilon_for_delta(base, delta / 2)
        candidates.append(scheme_eps + gdp_epsilon(delta / 2, mu))
        return float(min(candidates))

    def _observed_state(self) -> Optional[dict]:
        if not self.unamplified:
            return None
        return {"unamplified": [[s, n] for s, n in sorted(self.unamplified.items())]}

    def _load_observed_state(self, state: Optional[dict]) -> None:
        self.unamplified = {float(s): int(n) for s, n in (state or {}).get("unamplified", [])}
