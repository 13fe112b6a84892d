r"""Resource guard: bound the memory of PLD composition *before* composing.

Composing a discretised privacy loss distribution (PLD) :math:`n` times is a power of its
Fourier transform (dp_accounting's ``self_convolve``). The output grid covers the Chernoff
interval :math:`[\ell, u]` of the :math:`n`-fold sum of privacy losses (dp_accounting's
``compute_self_convolve_bounds`` with tail mass :data:`~.pld.TAIL_MASS_TRUNCATION`), so the work
arrays have :math:`L = \mathrm{next\_fast\_len}(u - \ell + 1)` points, i.e. about

.. math::

    \text{bytes} \approx 128\,L \quad
    (\text{FFT input}, \hat p^{\,n}\text{, its inverse and pocketfft's buffer, complex128;
    real copies, float64})

per direction, plus the 8 bytes per point of the direction already composed. The grid has
:math:`L \approx (u-\ell)/d` points: it grows like :math:`\sqrt{n}` times the per-step spread of
the privacy loss (and like :math:`n\,\mathrm{KL}` where the Chernoff bound is loose) divided by
the discretisation :math:`d`. :func:`estimate_self_compose` computes exactly the bounds
dp_accounting will use (cheap: 40 log-MGF evaluations of the one-step PMF), and
:func:`check_self_compose` / :func:`check_compose` raise :class:`ResourceBudgetError` (a
``ValueError``: the CLI prints it as one line and exits 2) when the estimate exceeds the budget.
:func:`opacus_structured.accounting.pld.self_compose` and
:func:`~opacus_structured.accounting.pld.compose` call them, so no PLD composition in the package
can allocate past the budget.

What happens next is the scheme's choice (:meth:`opacus_structured.schemes.base.Scheme.epsilon`):
a closed form (μ-GDP, exact), an RDP upper bound (Poisson subsampling), a coarser *pessimistic*
grid (still an upper bound), or the error. Every route other than the requested PLD is labelled
(:class:`PricedEpsilon`): ε is never silently replaced by an optimistic shortcut.

Budget, highest priority first: an explicit ``budget=`` argument, :func:`memory_budget_scope`
(the CLI's ``--memory-budget``), the environment variable ``OPACUS_STRUCTURED_MEMORY_BUDGET``
(bytes, or with a unit: ``512MiB``, ``2GiB``, ``1.5GB``), and the default
:data:`DEFAULT_MEMORY_BUDGET`: ``min(2 GiB, physical memory / 4)``.

Sanity range of the grid step (:func:`check_discretization`): ``discretization`` must be
``<= MAX_DISCRETIZATION = 0.1`` — a grid step of 0.1 already rounds every privacy loss up by
up to 0.1 per composition, beyond that ε says more about the grid than about the mechanism —
and a value above :data:`WARN_DISCRETIZATION` (0.01) is accepted with a warning.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import os
import re
from typing import Iterator

import numpy as np

from .._warnings import warn
from .dense_pmf import dense_probs as _dense_probs
from .dense_pmf import self_convolve_bounds as _exact_bounds

#: Tail mass dropped by every PLD composition (dp_accounting's ``tail_mass_truncation``);
#: :mod:`.pld` composes with this value and the estimates below assume it.
TAIL_MASS_TRUNCATION = 1e-15

__all__ = [
    "ENV_VAR",
    "DEFAULT_MEMORY_BUDGET",
    "MAX_DISCRETIZATION",
    "WARN_DISCRETIZATION",
    "BYTES_PER_POINT",
    "ResourceBudgetError",
    "CompositionEstimate",
    "PricedEpsilon",
    "parse_bytes",
    "format_bytes",
    "memory_budget",
    "memory_budget_scope",
    "estimate_self_compose",
    "self_convolve_bounds",
    "check_self_compose",
    "check_compose",
    "check_discretization",
]

ENV_VAR = "OPACUS_STRUCTURED_MEMORY_BUDGET"
#: Bytes per point of the composed grid: the FFT input, its power and inverse in complex128,
#: pocketfft's own work buffer (C++, invisible to tracemalloc) and float64 copies. Measured
#: peak-RSS growth per point is 95-107 (both directions of an add/remove PLD); 128 is kept on
#: the safe side.
BYTES_PER_POINT = 128
MAX_DISCRETIZATION = 0.1
WARN_DISCRETIZATION = 0.01
_HARD_DEFAULT = 2 << 30


def _physical_memory() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _default_budget() -> int:
    phys = _physical_memory()
    return _HARD_DEFAULT if not phys else min(_HARD_DEFAULT, phys // 4)


#: Default budget of one composition: ``min(2 GiB, physical memory / 4)``.
DEFAULT_MEMORY_BUDGET = _default_budget()

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000 ** 2, "mb": 1000 ** 2,
          "g": 1000 ** 3, "gb": 1000 ** 3, "t": 1000 ** 4, "tb": 1000 ** 4,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


class ResourceBudgetError(ValueError):
    """A composition would need more memory than the budget (raised *before* allocating)."""

    def __init__(self, message: str, *, estimated_bytes: int, budget: int):
        super().__init__(message)
        self.estimated_bytes = int(estimated_bytes)
        self.budget = int(budget)


def parse_bytes(value) -> int:
    """``2147483648``, ``"2GiB"``, ``"512 MiB"``, ``"1.5GB"`` → bytes (> 0)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number, unit = float(value), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"memory budget (--memory-budget, ${ENV_VAR}) must be bytes or a "
                             f"size like '512MiB' or '2GiB', got {value!r}")
        number, unit = float(m.group(1)), m.group(2).lower()
    out = number * _UNITS[unit]
    if not math.isfinite(out) or out <= 0:
        raise ValueError(f"memory budget (--memory-budget, ${ENV_VAR}) must be > 0, "
                         f"got {value!r}")
    return int(out)


def format_bytes(n: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


_SCOPE: contextvars.ContextVar[int | None] = contextvars.ContextVar("memory_budget", default=None)


def memory_budget(budget=None) -> int:
    """The budget in bytes: ``budget`` if given, else the innermost :func:`memory_budget_scope`,
    else ``$OPACUS_STRUCTURED_MEMORY_BUDGET``, else :data:`DEFAULT_MEMORY_BUDGET`."""
    if budget is not None:
        return parse_bytes(budget)
    scoped = _SCOPE.get()
    if scoped is not None:
        return scoped
    env = os.environ.get(ENV_VAR)
    if env:
        try:
            return parse_bytes(env)
        except ValueError as exc:
            raise ValueError(f"${ENV_VAR}: {exc}") from None
    return DEFAULT_MEMORY_BUDGET


@contextlib.contextmanager
def memory_budget_scope(budget) -> Iterator[int]:
    """Use ``budget`` (bytes or a size string; ``None`` keeps the current one) inside the block."""
    value = None if budget is None else parse_bytes(budget)
    token = _SCOPE.set(value if value is not None else _SCOPE.get())
    try:
        yield memory_budget()
    finally:
        _SCOPE.reset(token)


@dataclasses.dataclass(frozen=True)
class CompositionEstimate:
    """Grid points and bytes a composition will use (the largest of its directions)."""

    points: int
    bytes: int

    def __str__(self):
        return f"{self.points:,} grid points, about {format_bytes(self.bytes)}"


def _directions(pld) -> list:
    pmfs = [pld._pmf_remove]  # pylint: disable=protected-access
    if not getattr(pld, "_symmetric", False):
        pmfs.append(pld._pmf_add)  # pylint: disable=protected-access
    return pmfs


def self_convolve_bounds(probs, count: int, tail_mass_truncation: float) -> tuple[int, int]:
    r"""dp_accounting's ``common.compute_self_convolve_bounds`` (the Chernoff bound at the 40
    orders :math:`\theta \in \{\pm1, \dots, \pm20\}/L`; bit for bit its value, computed by
    :func:`.dense_pmf.self_convolve_bounds` in one vectorised pass), widened by one grid point on
    each side as a margin: :math:`u = \min_{\theta>0} \lceil (n \log M(\theta) +
    \log(2/\tau))/\theta \rceil`, :math:`\ell = \max_{\theta<0} \lfloor \cdot \rfloor`,
    :math:`M(\theta) = \sum_k p_k e^{\theta k}`.
    """
    probs = np.asarray(probs, dtype=np.float64)
    upper, lower = (len(probs) - 1) * count, 0
    if tail_mass_truncation == 0 or len(probs) <= 1 or not np.any(probs > 0):
        return lower, upper
    return _widen(_exact_bounds(probs, count, tail_mass_truncation), len(probs), count)


def _widen(bounds: tuple[int, int], size: int, count: int) -> tuple[int, int]:
    lo, hi = bounds
    return (lo - 1 if lo > 0 else lo), (hi + 1 if hi < (size - 1) * count else hi)


def estimate_self_compose(pld, count: int, *, bounds=None) -> CompositionEstimate:
    """Points and bytes of ``pld.self_compose(count)`` (the bounds dp_accounting will use).

    ``bounds``: dp_accounting's exact windows per direction
    (:func:`.dense_pmf.composition_bounds`), when the caller has them; they are widened here as
    :func:`self_convolve_bounds` widens its own."""
    from scipy import fft  # lazy: scipy.fft only when a composition is priced

    points, total = 0, 0
    retained = 0
    for i, pmf in enumerate(_directions(pld)):
        probs = _dense_probs(pmf)
        if count <= 1:
            n_out = len(probs)
            fast = n_out
        else:
            if bounds is None:
                lo, hi = self_convolve_bounds(probs, count, TAIL_MASS_TRUNCATION)
            else:
                lo, hi = _widen(bounds[i], len(probs), count)
            n_out = int(hi - lo + 1)
            fast = int(fft.next_fast_len(max(n_out, len(probs))))
        points = max(points, fast)
        total = max(total, BYTES_PER_POINT * fast + retained)
        retained += 8 * n_out
    return CompositionEstimate(points, total)


def _estimate_compose(a, b) -> CompositionEstimate:
    points, total, retained = 0, 0, 0
    for pa, pb in zip(_directions(a), _directions(b), strict=False):
        n = len(_dense_probs(pa)) + len(_dense_probs(pb)) - 1
        points = max(points, n)
        total = max(total, BYTES_PER_POINT * n + retained)
        retained += 8 * n
    return CompositionEstimate(points, total)


def _refuse(what: str, est: CompositionEstimate, budget: int):
    return ResourceBudgetError(
        f"{what} needs {est} for the privacy-loss grid, over the memory budget of "
        f"{format_bytes(budget)}; raise it with --memory-budget (or ${ENV_VAR}), use a coarser "
        f"--discretization, or take fewer steps",
        estimated_bytes=est.bytes, budget=budget)


def check_self_compose(pld, count: int, *, budget=None, bounds=None) -> CompositionEstimate:
    """Raise :class:`ResourceBudgetError` unless ``pld.self_compose(count)`` fits the budget
    (``bounds``: as in :func:`estimate_self_compose`)."""
    limit = memory_budget(budget)
    est = estimate_self_compose(pld, count, bounds=bounds)
    if est.bytes > limit:
        raise _refuse(f"composing {count:,} times", est, limit)
    return est


def check_compose(a, b, *, budget=None) -> CompositionEstimate:
    """Raise :class:`ResourceBudgetError` unless ``a.compose(b)`` fits the budget."""
    limit = memory_budget(budget)
    est = _estimate_compose(a, b)
    if est.bytes > limit:
        raise _refuse("composing the parts", est, limit)
    return est


def check_discretization(discretization: float, *, flag: str = "--discretization") -> float:
    """Refuse a grid step outside ``(0, MAX_DISCRETIZATION]``; warn above
    :data:`WARN_DISCRETIZATION`. Returns the value."""
    d = float(discretization)
    if not (math.isfinite(d) and d > 0):
        raise ValueError(f"{flag} must be a positive number, got {discretization}")
    if d > MAX_DISCRETIZATION:
        raise ValueError(f"{flag} {d:g} is outside the sane range (0, {MAX_DISCRETIZATION:g}]: "
                         f"it is the privacy-loss grid step, and each composition may round "
                         f"the loss up by one step (default 1e-4)")
    if d > WARN_DISCRETIZATION:
        warn(f"{flag} {d:g} is coarse (> {WARN_DISCRETIZATION:g}): epsilon stays an "
                      f"upper bound but may be much looser than at the default 1e-4",
             UserWarning)
    return d


class PricedEpsilon(float):
    """An ε (a float) that records which route priced it when that is not the requested PLD.

    Its fields (documented here once; autodoc lists them as annotated members):

    * ``route``: ``"pld"``, ``"closed-form"``, ``"rdp"`` or ``"coarse-pld"``;
    * ``note``: one sentence: what the route is and how much looser than the PLD it is known to be;
    * ``details``: extra JSON-able fields (the coarser discretisation, the estimate refused).
    """

    route: str
    note: str
    details: dict

    def __new__(cls, value: float, route: str, note: str = "", **details):
        obj = super().__new__(cls, value)
        obj.route = route
        obj.note = note
        obj.details = details
        return obj

    def __repr__(self):
        return f"PricedEpsilon({float.__repr__(self)}, route={self.route!r})"

    def __reduce__(self):  # pickle / copy.deepcopy (checkpoints, logged metrics)
        return (_priced_epsilon, (float(self), self.route, self.note, dict(self.details)))

    def record(self) -> dict:
        """``{"route": ..., "route_note": ..., **details}`` for JSON reports."""
        return {"route": self.route, "route_note": self.note, **self.details}


def _priced_epsilon(value, route, note, details):
    return PricedEpsilon(value, route, note, **details)
