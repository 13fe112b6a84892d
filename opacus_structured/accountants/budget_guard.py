r"""Charging a training run's noisy steps to a dataset budget, before each one is released.

:func:`guard_budget` installs a :class:`BudgetGuard` on a DP optimizer and the accountant
that prices it (``make_private(budget=...)``, ``DPCallback(budget=...)``,
``train_forecaster(budget=...)``). Opacus releases a step in this order: clip, **noise**,
scale, accountant hook, parameter update. The guard sits at the two ends:

* **before the noise** (a wrapper of the optimizer's ``add_noise``, which every DP optimizer
  of the package and of Opacus calls only for a step it releases, never for a skipped one):
  the step must be covered by the run's reservation in the budget file. If it is not, the
  guard reserves the next block of steps — the run's charge set to the RDP curve of every
  step the accountant has priced plus ``k`` more at the current noise multiplier and rate
  (:func:`~opacus_structured.accountants.budget_curves.accountant_rdp` of the projected
  history), for the largest ``k`` up to the block the filter admits
  (:meth:`DatasetBudget.reserve <opacus_structured.dataset_budget.DatasetBudget.reserve>`).
  A release whose draws the training driver counted (``DPCallback`` with
  ``accumulate_grad_batches``: ``n`` draws, each priced at ``σ/√n``) is reserved as the ``n``
  steps the accountant will record. When not even one more release fits, it raises
  :class:`~opacus_structured.dataset_budget.BudgetExhaustedError` there: the noisy sum is not
  formed, nothing is released, the parameters are not updated;
* **after the accountant's hook**: the step must have been priced as reserved (one more step at
  the reserved σ and rate, nothing unamplified). A step priced otherwise (observed releases
  that split the noise across draws, untraceable rows, draws the ledger pads in) is re-priced
  from the accountant's whole record; if it costs more than the reservation, the difference is
  charged at once, past the cap if need be (never under-reported), with a
  :class:`BudgetOverrunWarning`, and the next step is refused.

**Cost.** A covered step costs a few attribute reads and comparisons on each side; the file is
locked, read and appended to (``fsync``) once per block. Blocks double from
:data:`FIRST_BLOCK` to :data:`MAX_BLOCK` steps as the run proceeds, and shrink to what the
filter still admits near the cap (the reservation that does not fit is bisected), so the run
is refused exactly at the step that would pass the cap. Reserving ahead over-charges by at
most one block until the run **settles**: :meth:`BudgetGuard.settle` sets the run's charge to
the accountant's price of the steps released. It runs when the optimizer is freed, at
interpreter exit, at ``DPCallback``'s fit end, on
:meth:`DatasetBudget.settle <opacus_structured.dataset_budget.DatasetBudget.settle>`, and for
every other run of the same process on the same budget before a reservation is refused (a
finished loop whose optimizer is still alive holds a reservation it will not use). A process
that dies keeps its last reservation: an over-charge, never an under-charge.

**Runs.** Each guard charges one run id (``run_id=``, default a fresh one); the run's charge is
its accountant's whole record (a state loaded into the accountant is charged too: charging a
restored history twice over-charges, never under-charges). ``history_charged=True`` declares
that the accountant's record at attachment was already charged to ``run_id`` (a resume of that
run): then only what the accountant prices beyond it is added to the run's charge.

**Distributed training.** Every rank prices the same steps; only rank 0 charges the file
(the other ranks get no guard), so a refusal raises on rank 0.
"""

from __future__ import annotations

import math
import uuid
import weakref
from typing import Optional

import numpy as np

from .._warnings import warn
from ..dataset_budget import BudgetExhaustedError, DatasetBudget
from . import noise_lineage
from .budget_curves import accountant_rdp, curve_route
from .observed_release import split_sigma

__all__ = ["BudgetGuard", "guard_budget", "guards_of", "BudgetOverrunWarning",
           "FIRST_BLOCK", "MAX_BLOCK"]

#: Steps reserved by a run's first reservation; each full reservation doubles it.
FIRST_BLOCK = 8
#: The largest reservation, in steps.
MAX_BLOCK = 256

_KEY = "_dataset_budget_guards"

#: accountant -> weak references to the guards charging it (told when it re-prices a step)
_WATCHERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class BudgetOverrunWarning(UserWarning):
    """A released step cost more than its reservation (its price was only known after the
    accountant saw what it summed); the difference was charged at once."""


def guards_of(optimizer) -> dict:
    """The :class:`BudgetGuard` objects installed on ``optimizer``, by budget file path."""
    return getattr(optimizer, "__dict__", {}).get(_KEY, {})


def _is_rank_zero() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return True
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class BudgetGuard:
    """Charges one DP optimizer's releases to a :class:`DatasetBudget` (module docstring).

    Args:
        budget: the dataset's budget.
        optimizer: the DP optimizer (Opacus ``DPOptimizer`` or a subclass).
        accountant: the scheme accountant pricing its steps.
        sample_rate: the rate the accountant's step hook receives per batch (Opacus'
            ``1/len(data_loader)``; multiplied by ``optimizer.accumulated_iterations`` as the
            hook does).
        run_id: the run's id in the budget file (default ``"<label>-<12 hex>"``).
        label: a readable prefix of the default run id (``"make_private"``, ``"DPCallback"``).
        history_charged: the accountant's record at attachment was already charged to
            ``run_id`` (module docstring).
    """

    def __init__(self, budget: DatasetBudget, optimizer, accountant, *, sample_rate: float,
                 run_id: Optional[str] = None, label: str = "run",
                 history_charged: bool = False):
        if not isinstance(budget, DatasetBudget):
            raise ValueError(f"budget must be an opacus_structured.DatasetBudget, got "
                             f"{type(budget).__name__}")
        self.budget = budget
        self.accountant = accountant
        self.sample_rate = float(sample_rate)
        self.run_id = run_id if run_id is not None else f"{label}-{uuid.uuid4().hex[:12]}"
        self._optimizer = weakref.ref(optimizer)
        orders = budget.orders
        attached, attached_tail = self._priced()  # raises for what cannot be charged
        existing, existing_tail = budget.run_rdp(self.run_id)
        if history_charged:
            if existing is None:
                raise ValueError(f"history_charged=True but run {self.run_id!r} has no charge "
                                 f"in {budget.path}")
            both = np.isinf(existing) & np.isinf(attached)  # no bound at that order either way
            with np.errstate(invalid="ignore"):
                base = np.where(both, 0.0, existing - attached)
            base_tail = existing_tail - attached_tail
            if np.any(base < -1e-9 * np.maximum(1.0, existing)) or base_tail < -1e-300:
                raise ValueError(
                    f"history_charged=True but run {self.run_id!r}'s charge in {budget.path} "
                    f"does not cover the accountant's record: resume with a fresh run id "
                    f"(history_charged=False), which charges the record again")
            base, base_tail = np.maximum(base, 0.0), max(base_tail, 0.0)
        elif existing is not None:
            base, base_tail = existing, existing_tail
        else:
            base, base_tail = np.zeros(len(orders)), 0.0
        self._base = (base, base_tail)
        self._block = FIRST_BLOCK
        self._reservation = None  # (sigma, rate, history length, steps reserved, form)
        self._forms: dict = {}    # (sigma, rate) -> how the accountant records such a step
        self._used = 0            # steps released under the reservation
        self._before = None       # (len, unamplified parts, σ, rate, steps) before a release
        self._released_len = len(accountant)
        self._dirty = False       # released steps not yet settled
        self._install(optimizer)
        try:
            _WATCHERS.setdefault(accountant, []).append(weakref.ref(self))
        except TypeError:  # pragma: no cover - an accountant that cannot be weakly referenced
            pass
        budget._register_settler(self.settle)
        weakref.finalize(optimizer, _settle_quietly, self)

    # ---- prices ----------------------------------------------------------------------------
    def _priced(self, history=None) -> tuple[np.ndarray, float]:
        return accountant_rdp(self.accountant, self.budget.orders, history=history)

    def _total(self, history=None) -> tuple[np.ndarray, float]:
        curve, tail = self._priced(history)
        return self._base[0] + curve, self._base[1] + tail

    def _next_step(self, optimizer, release=None) -> tuple[float, float, int]:
        """``(σ, rate, steps)``: what the next release adds to the accountant's record. One
        step at the loader's rate times the accumulated batches, or, where the training driver
        counted the draws the release sums (``DPCallback``: a
        :class:`~opacus_structured.samplers.draw_ledger.StepDraws`, or ``release = (parts,
        rows_per_example)`` projected), ``parts`` steps at ``σ/(√parts·k)`` (noise splitting,
        as :mod:`~opacus_structured.accountants.observed_release` prices them)."""
        sigma = float(optimizer.noise_multiplier)
        if release is None:
            source = getattr(getattr(self.accountant, "_ledger", None), "source", None)
            report = source.step_draws() if callable(getattr(source, "step_draws", None)) \
                else None
            release = None if report is None else (report.parts, report.rows_per_example)
        if release is not None and (release[0] > 1 or release[1] > 1):
            parts = int(release[0])
            return split_sigma(sigma, parts, int(release[1])), self.sample_rate, parts
        try:
            batches = int(optimizer.accumulated_iterations)
        except (AttributeError, ValueError, TypeError):
            batches = 1
        return sigma, self.sample_rate * max(batches, 1), 1

    # ---- before the noise ------------------------------------------------------------------
    def _covered(self, sigma: float, rate: float, steps: int = 1) -> bool:
        r = self._reservation
        return (r is not None and self._used + steps <= r[3] and sigma == r[0]
                and rate == r[1] and len(self.accountant) == r[2] + self._used)

    def _cover(self, optimizer, release=None) -> tuple[float, float, int]:
        """Reserve the next release (:meth:`_next_step`) unless the reservation covers it;
        returns its ``(σ, rate, steps)``. Raises :class:`BudgetExhaustedError` when it does
        not fit."""
        sigma, rate, steps = self._next_step(optimizer, release)
        if not self._covered(sigma, rate, steps):
            self._reserve(sigma, rate, steps)
        return sigma, rate, steps

    def ensure(self, optimizer) -> None:
        """Make sure the next step is reserved (reserve a block if not); raises
        :class:`BudgetExhaustedError` when it does not fit."""
        sigma, rate, steps = self._cover(optimizer)
        self._before = (len(self.accountant), _parts(self.accountant), sigma, rate, steps)

    def admits_next(self, release=None) -> bool:
        """Whether the next step (at the optimizer's current σ; ``release = (parts,
        rows_per_example)`` projects a release that sums several draws) fits the budget,
        reserving it if it does: a callback stops training gracefully on ``False``."""
        optimizer = self._optimizer()
        if optimizer is None:
            return True
        try:
            self._cover(optimizer, release)
        except BudgetExhaustedError:
            return False
        return True

    def _reserve(self, sigma: float, rate: float, steps: int = 1) -> None:
        history = [tuple(h) for h in self.accountant.history]
        length = len(self.accountant)
        # how the accountant recorded the last step released at this (σ, rate): e.g. at the
        # loader's rate, not times the accumulated physical batches, when it saw one draw
        form = self._forms.get((sigma, rate), (sigma, rate))

        def total_for(k: int):  # k releases of `steps` steps each
            return self._total(history + [(form[0], form[1], k * steps)])

        event = {"accountant": type(self.accountant).__name__,
                 "scheme": getattr(self.accountant.scheme, "name", None),
                 "noise_multiplier": sigma, "sample_rate": rate, "steps_priced": length,
                 "curve": curve_route(self.accountant)}
        journal = self._journal()  # the noise this reservation lets the run draw

        def reserve():
            return self.budget.reserve(self.run_id, total_for, max(1, self._block // steps),
                                       event=event, **journal)

        try:
            k, _ = reserve()
        except BudgetExhaustedError:
            # other runs of this process may hold reservations ahead they will not use (a
            # finished loop whose optimizer is still alive): settle them, then try once more
            if not self.budget.settle(exclude=self.settle):
                raise
            k, _ = reserve()
        if k * steps >= self._block:
            self._block = min(2 * self._block, MAX_BLOCK)
        self._reservation = (sigma, rate, length, k * steps, form)
        self._used = 0

    # ---- after the accountant's hook -------------------------------------------------------
    def after_release(self) -> None:
        """Check that the step was priced as reserved; re-price and charge any excess."""
        before, self._before = self._before, None
        self._dirty = True
        r = self._reservation
        acc = self.accountant
        one_step = (before is not None and len(acc) == before[0] + before[4]
                    and _parts(acc) == before[1])
        if one_step and r is not None and tuple(acc.history[-1][:2]) == r[4]:
            self._used += before[4]  # the common step: priced exactly as reserved
            self._released_len = len(acc)
            return
        if one_step:  # learn how such a step is recorded; reserve with it from now on
            self._forms[(before[2], before[3])] = tuple(float(v) for v in acc.history[-1][:2])
        self._released_len = max(self._released_len, len(acc))
        self._reservation = None  # the next step reserves from the accountant's record
        self._charge_excess()

    def on_repriced(self) -> None:
        """The accountant re-priced a step it had released (a co-release: another module's
        noisy sum of the same draw, :meth:`SchemeAccountant.reprice_step
        <opacus_structured.accountants.base.SchemeAccountant.reprice_step>`): the reservation no
        longer describes its record. Charge the record's price at once where it passes the
        run's charge, and reserve afresh from the record at the next step."""
        self._reservation = None
        self._dirty = True
        self._charge_excess()

    def _charge_excess(self) -> None:
        """Charge the accountant's whole record where it costs more than the run's charge
        (past the cap if need be, with a :class:`BudgetOverrunWarning`)."""
        acc = self.accountant
        actual, tail = self._total()
        run_curve, run_tail = self.budget.run_rdp(self.run_id)
        if run_curve is not None and np.all(actual <= run_curve) and tail <= run_tail:
            return
        spent = self.budget.set_run_total(self.run_id, actual, tail_mass=tail, kind="overrun",
                                          check=False, steps_priced=len(acc))
        warn(f"dataset budget {self.budget.path}: step {len(acc)} of run {self.run_id!r} was "
             f"priced above its reservation (a release whose price the accountant learnt from "
             f"what it summed); the difference was charged (total epsilon now {spent:.6g} "
             f"of {self.budget.epsilon:g})", BudgetOverrunWarning)

    # ---- settling --------------------------------------------------------------------------
    def settle(self) -> bool:
        """Set the run's charge to the accountant's price of the steps released (releasing
        the reservation ahead); returns whether it wrote a record. Never lowers the charge when
        the accountant's record shrank below the steps this guard saw released (a state loaded
        over it)."""
        if not self._dirty and self._reservation is None:
            return False
        if len(self.accountant) < self._released_len:
            return False
        try:
            actual, tail = self._total()
        except ValueError:
            return False
        self._reservation = None
        self._dirty = False
        charged, charged_tail = self.budget.run_rdp(self.run_id)
        if charged is not None and np.array_equal(charged, actual) and charged_tail == tail:
            return False
        self.budget.set_run_total(self.run_id, actual, tail_mass=tail, kind="settle",
                                  check=False, steps_priced=len(self.accountant),
                                  **self._journal())
        return True

    def _journal(self) -> dict:
        """The ``noise_stream`` field of a record: the noise lineage and position of the run
        (so a resume in another process can prove it continues from the last release:
        :func:`~opacus_structured.accountants.noise_lineage.may_restore`)."""
        optimizer = self._optimizer()
        entry = None if optimizer is None else noise_lineage.journal_entry(optimizer)
        return {} if entry is None else {"noise_stream": entry}

    # ---- installation ----------------------------------------------------------------------
    def _install(self, optimizer) -> None:
        guard = self
        plain_add_noise = optimizer.add_noise

        def add_noise(*args, **kwargs):
            guard.ensure(optimizer)
            return plain_add_noise(*args, **kwargs)

        optimizer.add_noise = add_noise
        plain_hook = optimizer.step_hook

        def step_hook(opt):
            if plain_hook is not None:
                plain_hook(opt)
            guard.after_release()

        optimizer.step_hook = step_hook
        optimizer.__dict__.setdefault(_KEY, {})[self.budget.path] = self

    def __repr__(self) -> str:
        return f"BudgetGuard(run_id={self.run_id!r}, budget={self.budget!r})"


def _settle_quietly(guard: BudgetGuard) -> None:
    """Settle when the optimizer is freed or the interpreter exits: a failure there (the file
    removed, say) leaves the last reservation, an over-charge, and prints one line."""
    try:
        guard.settle()
    except Exception as err:  # noqa: BLE001 - at exit there is nobody to raise to
        warn(f"dataset budget {guard.budget.path}: run {guard.run_id!r} could not settle "
             f"({err}); its last reservation stays charged", BudgetOverrunWarning)


def repriced(accountant) -> None:
    """``accountant`` re-priced steps it had released: every live guard charging it re-prices
    its run (:meth:`BudgetGuard.on_repriced`)."""
    try:
        refs = _WATCHERS.get(accountant)
    except TypeError:  # pragma: no cover
        return
    for ref in list(refs or ()):
        guard = ref()
        if guard is not None:
            guard.on_repriced()


def _parts(accountant) -> int:
    """Unamplified Gaussian parts priced so far (observed releases)."""
    return int(sum((getattr(accountant, "unamplified", None) or {}).values()))


def guard_budget(budget, optimizer, accountant, *, sample_rate: float,
                 run_id: Optional[str] = None, label: str = "run",
                 history_charged: bool = False) -> Optional[BudgetGuard]:
    """Charge ``optimizer``'s releases, priced by ``accountant``, to ``budget`` (a
    :class:`DatasetBudget`, or ``None``: nothing to do). Idempotent per budget file; ``None``
    on ranks other than 0 (module docstring). Call it after the optimizer's step hook is
    attached (``make_private`` / ``DPCallback`` do)."""
    if budget is None:
        return None
    if not isinstance(budget, DatasetBudget):
        raise ValueError(f"budget must be an opacus_structured.DatasetBudget, got "
                         f"{type(budget).__name__}")
    existing = guards_of(optimizer).get(budget.path)
    if existing is not None:
        return existing
    if not _is_rank_zero():
        return None
    if not math.isfinite(float(sample_rate)) or not 0 < float(sample_rate) <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
    return BudgetGuard(budget, optimizer, accountant, sample_rate=sample_rate, run_id=run_id,
                       label=label, history_charged=history_charged)
