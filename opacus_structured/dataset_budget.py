r"""One privacy budget per private dataset, in a file: :class:`DatasetBudget`.

.. code-block:: python

    import opacus_structured
    budget = opacus_structured.DatasetBudget("data/patients.budget", epsilon=8.0, delta=1e-5)

    # every release on that dataset is charged to the file, in this process or any other
    model, optimizer, loader = opacus_structured.make_private(
        engine, module=model, optimizer=optimizer, data_loader=loader,
        noise_multiplier=1.0, max_grad_norm=1.0, budget=budget)
    ...
    budget.spent()      # ε, at the budget's δ, of every release charged so far (from the file)

**The cap is a privacy filter.** A release that would take the total past the cap
``(epsilon, delta)`` is refused *before* it happens (:class:`BudgetExhaustedError`), never
after, so :meth:`DatasetBudget.spent` stays ≤ the cap and the whole sequence of releases —
however each was chosen after seeing the earlier ones (a search, then the retrain of its
winner; a second forecast run because the first looked poor) — is (ε, δ)-DP. The route is the
Rényi filter of :mod:`opacus_structured.accounting.renyi_filter` (Feldman & Zrnic 2021 at each
of a fixed grid of orders, a union bound across them; the module docstring has the proof and
why that filter): ``budget.route`` names it and is stored in the file.

**What is charged.** A per-order RDP curve per release (and, for releases priced from a
pessimistic PLD, the tail mass of its grid): the exact curve of a Poisson-subsampled Gaussian
step (dp_accounting's ``RdpAccountant``), ``α/(2σ²)`` for a Gaussian release, the RDP of the
scheme's pessimistic PLD for other schemes. ``make_private(budget=...)``, ``DPCallback``,
``PrivateSelection``, ``train_forecaster`` and ``forecast --budget`` charge their runs
themselves (:mod:`opacus_structured.accountants.budget_guard`); :meth:`DatasetBudget.charge`
charges any other release (a curve, or a dp_accounting ``DpEvent``).

**The file** is JSON lines, append-only: line 1 is the header (format, version, the cap ε and
δ, the orders, the tail share, the route, when and with which id it was created); every later
line is one record: ``seq`` (1, 2, ...), ``run`` (the run id), ``kind`` (``"charge"``,
``"reserve"``, ``"settle"``, ``"note"``, ...), ``time`` (UTC, ISO 8601), ``pid``, and for
charging kinds ``run_rdp`` / ``run_tail`` — the run's *cumulative* curve (``null`` = ∞ at an
order) and tail mass after the record — plus ``epsilon`` (the budget's total after it) and
what was charged (``event``). The total is the sum over runs of each run's last ``run_rdp``.
Optional fields ride along: ``noise_stream`` (which noise stream a release drew from: the noise
lineage) and any JSON value passed as ``**fields``.

* **Concurrency**: every read takes a shared ``fcntl.flock`` on the file, every write an
  exclusive one; a charge reads what other processes appended, checks the filter on the new
  total and appends its line, all under the lock, then ``fsync``\ s before returning. Two
  processes charging one file lose nothing.
* **Crashes**: a charge is committed when its line, newline included, is on disk — and the
  release it guards happens only after that. A torn last line (no newline: a crash mid-write,
  before the release) is ignored when reading and cut off by the next write. Any other
  malformed line raises :class:`BudgetFileError` naming the line: a budget that cannot be read
  is never guessed.

**Journal hooks** (for resumes and the noise lineage): :meth:`DatasetBudget.record` appends a
record that charges nothing (``kind="note"`` by default), :meth:`DatasetBudget.last_record` /
:meth:`DatasetBudget.records` read them back (per run, optionally per kind).

Anchors: diffprivlib's ``BudgetAccountant`` (a spent/remaining budget object shared by
mechanisms), Tumult Analytics sessions (a budget consumed by queries, refused beyond it),
OpenDP's odometers and filters (fully adaptive composition). None of them is file-backed across
processes, or serves Opacus.
"""

from __future__ import annotations

import math
import os
import threading
import weakref
from typing import Callable, Optional, Sequence

import numpy as np

from ._validation import check_finite
from .accounting.renyi_filter import (
    DEFAULT_ORDERS,
    TAIL_SHARE,
    RenyiFilter,
    check_curve,
    event_rdp,
)
from .budget_file import (
    FORMAT,
    VERSION,
    BudgetFile,
    BudgetFileError,
    BudgetState,
    encode_curve,
    now,
)

__all__ = ["DatasetBudget", "BudgetExhaustedError", "BudgetFileError", "FORMAT", "VERSION"]

#: Record keys the budget sets itself (``**fields`` may not override them).
_RESERVED = frozenset({"seq", "run", "kind", "time", "pid", "run_rdp", "run_tail", "epsilon",
                       "event", "reserved"})
_CHARGING = ("charge", "reserve", "settle")


class BudgetExhaustedError(RuntimeError):
    """A release would take the dataset's total past its cap; it was refused before it
    happened. ``spent`` is the total before it, ``cap`` the budget's ε, ``requested`` the
    total it would have made (``inf`` when no order stays finite)."""

    def __init__(self, message: str, *, spent: float, cap: float, requested: float):
        super().__init__(message)
        self.spent = spent
        self.cap = cap
        self.requested = requested


def _check_run_id(run_id) -> str:
    if not isinstance(run_id, str) or not run_id or len(run_id) > 200:
        raise ValueError(f"run_id must be a non-empty string of at most 200 characters, got "
                         f"{run_id!r}")
    return run_id


class DatasetBudget:
    r"""A privacy budget ``(epsilon, delta)`` for one private dataset, kept in the file
    ``path`` (module docstring).

    Args:
        path: the budget file. Created (with this cap) if it does not exist; otherwise it must
            have been created with the same ``epsilon`` and ``delta`` (and ``orders`` /
            ``tail_share`` when given), else :class:`BudgetFileError`.
        epsilon: the cap ε > 0 on the total of every release charged to the file.
        delta: the cap δ in (0, 1).
        orders: Rényi orders of the filter (default
            :data:`~opacus_structured.accounting.renyi_filter.DEFAULT_ORDERS`; fixed when the
            file is created: the filter must not change after releases were seen).
        tail_share: share of δ set aside for the tail masses of PLD-priced releases (default
            1 %).

    Attributes:
        path, epsilon, delta, orders, route (the filter's label, e.g.
        ``"rdp-filter (Feldman & Zrnic 2021; union bound over 21 orders 1.25..256; ...)"``),
        filter (the :class:`~opacus_structured.accounting.renyi_filter.RenyiFilter`), id (the
        file's id, a UUID written at creation).
    """

    def __init__(self, path, *, epsilon: float, delta: float,
                 orders: Optional[Sequence[float]] = None, tail_share: Optional[float] = None):
        try:
            self.path = os.fspath(path)
        except TypeError:
            raise ValueError(f"path must be a file path, got {path!r}") from None
        asked = RenyiFilter(epsilon, delta,
                            DEFAULT_ORDERS if orders is None else tuple(orders),
                            TAIL_SHARE if tail_share is None else tail_share)
        self._mutex = threading.RLock()
        self._settlers: list = []
        self._file = BudgetFile(self.path)
        if not os.path.exists(self.path):
            self._file.create(asked)
        self._state = self._file.open_state()
        filt = self._state.filter
        mismatch = [name for name, mine, theirs in (
            ("epsilon", asked.epsilon, filt.epsilon), ("delta", asked.delta, filt.delta),
            ("orders", None if orders is None else asked.orders, filt.orders),
            ("tail_share", None if tail_share is None else asked.tail_share, filt.tail_share))
            if mine is not None and mine != theirs]
        if mismatch:
            said = ", ".join(f"{n}={getattr(filt, n)!r} (asked {getattr(asked, n)!r})"
                             for n in mismatch)
            raise BudgetFileError(
                f"{self.path} was created with another cap: {said}. A budget's cap is fixed "
                f"when its file is created (changing it after releases were seen would void "
                f"the filter): open it with the same epsilon and delta, or "
                f"DatasetBudget.open(path) to read them from the file")
        self.filter = filt
        self.epsilon = filt.epsilon
        self.delta = filt.delta
        self.orders = filt.orders
        self.tail_share = filt.tail_share
        self.route = str(self._state.header["route"])
        self.id = str(self._state.header.get("id", ""))

    @classmethod
    def open(cls, path) -> "DatasetBudget":
        """The budget of an existing file, with the cap the file holds."""
        path = os.fspath(path)
        if not os.path.exists(path):
            raise BudgetFileError(f"{path}: no such budget file (create it with "
                                  f"DatasetBudget(path, epsilon=..., delta=...))")
        header = BudgetFile(path).read_header()
        return cls(path, epsilon=header["epsilon"], delta=header["delta"],
                   orders=header["orders"], tail_share=header["tail_share"])

    def _read(self) -> BudgetState:
        """A snapshot of the file's state now."""
        with self._mutex, self._file.locked(exclusive=False) as fd:
            self._file.refresh(self._state, fd)
            return self._state.snapshot()

    # ---- reading ---------------------------------------------------------------------------
    def spent(self) -> float:
        """ε, at the budget's δ, of every release charged so far, read from the file (another
        process sees the same value): the smallest cap whose filter would have admitted them
        all (:meth:`RenyiFilter.epsilon_of`); never above :attr:`epsilon` for charges the
        filter admitted."""
        state = self._read()
        return self.filter.epsilon_of(state.total, state.tail)

    def remaining(self) -> float:
        """``epsilon - spent()`` (≥ 0)."""
        return max(0.0, self.epsilon - self.spent())

    def total_rdp(self) -> np.ndarray:
        """The total RDP curve charged so far, one value per order (``inf``: no bound)."""
        return self._read().total.copy()

    def total_tail_mass(self) -> float:
        """The total tail mass charged so far (releases priced from pessimistic PLDs)."""
        return float(self._read().tail)

    def runs(self) -> dict[str, dict]:
        """Each run's charge: ``{run_id: {"rdp": curve, "tail_mass": β, "epsilon": ε}}``,
        ε being the run's curve alone through the filter's conversion."""
        state = self._read()
        return {run: {"rdp": curve.copy(), "tail_mass": tail,
                      "epsilon": self.filter.epsilon_of(curve, tail)}
                for run, (curve, tail) in state.runs.items()}

    def run_rdp(self, run_id: str) -> tuple[Optional[np.ndarray], float]:
        """``(curve, tail_mass)`` charged to ``run_id`` (``(None, 0.0)`` if none)."""
        curve, tail = self._read().runs.get(_check_run_id(run_id), (None, 0.0))
        return (None if curve is None else curve.copy()), tail

    def records(self, run_id: Optional[str] = None, *, kind: Optional[str] = None) -> list:
        """The file's records (copies), optionally of one run and / or one kind."""
        state = self._read()
        return [dict(r) for r in state.records
                if (run_id is None or r["run"] == run_id) and (kind is None or r["kind"] == kind)]

    def last_record(self, run_id: str, *, kind: Optional[str] = None) -> Optional[dict]:
        """The latest record of ``run_id`` (of ``kind`` if given), or ``None``: the journal hook
        a resume reads to continue from its run's last released step."""
        _check_run_id(run_id)
        for record in reversed(self._read().records):
            if record["run"] == run_id and (kind is None or record["kind"] == kind):
                return dict(record)
        return None

    # ---- what a release costs --------------------------------------------------------------
    def curve_of(self, *, rdp=None, event=None) -> np.ndarray:
        """The per-order curve of a release given as ``rdp`` (one value per order of
        :attr:`orders`) or as a dp_accounting ``DpEvent`` (exactly one of them)."""
        if (rdp is None) == (event is None):
            raise ValueError("give the release's cost as exactly one of rdp= (a curve over "
                             "budget.orders) or event= (a dp_accounting DpEvent)")
        if event is not None:
            return event_rdp(event, self.orders)
        return check_curve("rdp", rdp, self.orders)

    def would_admit(self, *, rdp=None, event=None, tail_mass: float = 0.0) -> bool:
        """Whether a release of this cost, charged now, would be admitted (no record)."""
        curve = self.curve_of(rdp=rdp, event=event)
        tail = _check_tail(tail_mass)
        state = self._read()
        return self.filter.admits(state.total + curve, state.tail + tail)

    # ---- charging --------------------------------------------------------------------------
    def charge(self, run_id: str, *, rdp=None, event=None, tail_mass: float = 0.0,
               **fields) -> float:
        """Charge one release to ``run_id`` (added to what the run was charged before), or
        refuse it: raises :class:`BudgetExhaustedError`, recording nothing, when the total
        would pass the cap. Call it *before* the release. Returns :meth:`spent` after it.

        ``rdp`` (a curve over :attr:`orders`) or ``event`` (a dp_accounting ``DpEvent``) is
        the cost; ``tail_mass`` the release's :math:`\\beta_P+\\beta_Q` if priced from a
        pessimistic PLD; ``fields`` are stored in the record (JSON values; e.g.
        ``noise_stream=...``, ``note=...``; ``event`` is the event's description)."""
        run_id = _check_run_id(run_id)
        curve = self.curve_of(rdp=rdp, event=event)
        tail = _check_tail(tail_mass)
        if event is not None:
            fields.setdefault("event_repr", repr(event))

        def new_total(old_curve, old_tail):
            base = np.zeros(len(self.orders)) if old_curve is None else old_curve
            return base + curve, old_tail + tail

        return self._commit(run_id, "charge", new_total, check=True, fields=fields)

    def set_run_total(self, run_id: str, rdp, *, tail_mass: float = 0.0, kind: str = "reserve",
                      check: bool = True, event: Optional[dict] = None, **fields) -> float:
        """Set ``run_id``'s cumulative charge to ``rdp`` (and ``tail_mass``): the primitive of
        the training guards (:mod:`opacus_structured.accountants.budget_guard`), which reserve
        a block of steps ahead (``kind="reserve"``; refused with
        :class:`BudgetExhaustedError` past the cap when ``check``) and settle to what was
        released (``kind="settle"``). Lowering a run's total is sound only to a curve that
        still covers every release of the run: the guards settle to the accountant's price
        of the steps released. ``check=False`` records a total even past the cap (a price
        learnt after a release: never under-report). Returns :meth:`spent` after it."""
        run_id = _check_run_id(run_id)
        curve = check_curve("rdp", rdp, self.orders)
        tail = _check_tail(tail_mass)
        if event is not None:
            fields["event"] = event
        return self._commit(run_id, kind, lambda *_: (curve, tail), check=check, fields=fields)

    def record(self, run_id: str, *, kind: str = "note", **fields) -> dict:
        """Append a record that charges nothing (the journal hook: e.g. which step a run last
        released, its ``noise_stream``); returns it. ``kind`` must not be a charging kind."""
        run_id = _check_run_id(run_id)
        if not isinstance(kind, str) or not kind or kind in _CHARGING:
            raise ValueError(f"kind must be a non-empty string other than {_CHARGING}, got "
                             f"{kind!r}")
        with self._mutex, self._file.locked(exclusive=True) as fd:
            state = self._state
            self._file.refresh(state, fd, repair=True)
            return self._file.append(state, fd, self._new_record(state, run_id, kind, fields))

    def reserve(self, run_id: str, total_for: Callable[[int], tuple], max_count: int, *,
                kind: str = "reserve", event: Optional[dict] = None, **fields) -> tuple:
        """Set ``run_id``'s cumulative charge to ``total_for(k)`` — a ``(curve, tail_mass)``
        non-decreasing in ``k`` — for the largest ``k`` in ``1..max_count`` the filter admits,
        all under one lock (a training guard reserving up to ``max_count`` steps ahead).
        Returns ``(k, spent after)``; raises :class:`BudgetExhaustedError`, recording
        nothing, when even ``k = 1`` would pass the cap."""
        run_id = _check_run_id(run_id)
        if not isinstance(max_count, int) or max_count < 1:
            raise ValueError(f"max_count must be an integer >= 1, got {max_count!r}")
        with self._mutex, self._file.locked(exclusive=True) as fd:
            state = self._state
            self._file.refresh(state, fd, repair=True)
            others, others_tail = state.sum_runs(without=run_id)

            def priced(k):
                curve, tail = total_for(k)
                curve = check_curve("rdp", curve, self.orders)
                tail = _check_tail(tail)
                return curve, tail, self.filter.epsilon_of(others + curve, others_tail + tail)

            lo, best = 1, priced(1)
            if not best[2] <= self.epsilon:
                self._refuse(state, best[2])
            hi = max_count
            top = priced(hi) if hi > 1 else best
            if top[2] <= self.epsilon:
                lo, best = hi, top
            else:  # admitted at lo, refused at hi: bisect
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    at = priced(mid)
                    if at[2] <= self.epsilon:
                        lo, best = mid, at
                    else:
                        hi = mid
            if event is not None:
                fields["event"] = event
            fields["reserved"] = lo
            self._write_total(state, fd, run_id, kind, best[0], best[1], best[2], fields)
            return lo, best[2]

    def _commit(self, run_id: str, kind: str, total_of: Callable, *, check: bool,
                fields: dict) -> float:
        with self._mutex, self._file.locked(exclusive=True) as fd:
            state = self._state
            self._file.refresh(state, fd, repair=True)
            old_curve, old_tail = state.runs.get(run_id, (None, 0.0))
            curve, tail = total_of(old_curve, old_tail)
            others, others_tail = state.sum_runs(without=run_id)
            raised = old_curve is None or bool(np.any(curve > old_curve)) or tail > old_tail
            eps_after = self.filter.epsilon_of(others + curve, others_tail + tail)
            if check and raised and not eps_after <= self.epsilon:
                self._refuse(state, eps_after)
            self._write_total(state, fd, run_id, kind, curve, tail, eps_after, fields)
            return eps_after

    def _refuse(self, state: BudgetState, eps_after: float) -> None:
        spent = self.filter.epsilon_of(state.total, state.tail)
        raise BudgetExhaustedError(
            f"dataset budget {self.path}: this release would take the total to "
            f"epsilon={eps_after:.6g} at delta={self.delta:g}, past the cap "
            f"epsilon={self.epsilon:g} (spent so far: {spent:.6g}); it was refused before it "
            f"happened. The cap is fixed when the budget file is created",
            spent=spent, cap=self.epsilon, requested=eps_after)

    def _write_total(self, state: BudgetState, fd: int, run_id: str, kind: str, curve, tail: float,
                     eps_after: float, fields: dict) -> None:
        record = self._new_record(state, run_id, kind, fields)
        record["run_rdp"] = encode_curve(curve)
        record["run_tail"] = float(tail)
        record["epsilon"] = eps_after if math.isfinite(eps_after) else None
        self._file.append(state, fd, record)

    def _new_record(self, state: BudgetState, run_id: str, kind: str, fields: dict) -> dict:
        bad = sorted(set(fields) & _RESERVED - {"event", "reserved"})
        if bad:
            raise ValueError(f"record fields {bad} are set by the budget itself")
        record = {"seq": len(state.records) + 1, "run": run_id, "kind": kind, "time": now(),
                  "pid": os.getpid()}
        record.update(fields)
        return record

    # ---- guards of this process ------------------------------------------------------------
    def _register_settler(self, settle: Callable[[], None]) -> None:
        """A guard's settle function (held weakly when it is a bound method)."""
        try:
            ref = weakref.WeakMethod(settle)
        except TypeError:  # a plain function: held strongly

            def ref(fn=settle):
                return fn
        self._settlers.append(ref)

    def settle(self, *, exclude: Optional[Callable] = None) -> bool:
        """Settle every live training guard of this process on this budget: each run's
        reservation ahead is released, its total set to the price of the steps it released
        (guards also settle when their optimizer is freed and at interpreter exit).
        ``exclude``: a guard's settle function to leave out. Returns whether any run's charge
        changed."""
        changed = False
        for ref in list(self._settlers):
            fn = ref()
            if fn is None:
                self._settlers.remove(ref)
                continue
            if exclude is None or fn != exclude:
                changed = bool(fn()) or changed
        return changed

    def __repr__(self) -> str:
        return (f"DatasetBudget({self.path!r}, epsilon={self.epsilon:g}, delta={self.delta:g}, "
                f"route={self.route!r})")


def _check_tail(tail_mass) -> float:
    tail = check_finite("tail_mass", tail_mass)
    if tail < 0:
        raise ValueError(f"tail_mass must be >= 0, got {tail_mass!r}")
    return tail
