r"""Public sampling constants: the sampling rate and the mean-reduction normaliser.

Under add/remove adjacency the dataset size :math:`n` is private: neighbours have :math:`n` and
:math:`n \pm 1` examples. Everything a DP-SGD run releases must then be computed from public
values only. Two quantities are usually derived from :math:`n`:

* the **sampling rate** :math:`q`. Opacus' ``make_private`` sets
  :math:`q = 1/\mathrm{len}(\text{loader}) = 1/\lceil n/B \rceil`: with :math:`B = 60`,
  :math:`n = 600` gives :math:`q = 0.1` and :math:`n = 601` gives :math:`q = 1/11`. The Poisson
  analysis prices neighbours sampled at *one* rate, not two;
* the **normaliser** of ``loss_reduction="mean"``: Opacus' ``DPOptimizer`` divides the noisy
  clipped sum by ``expected_batch_size``, which ``make_private`` sets to
  :math:`\lfloor n q \rfloor` (60 for :math:`n = 600`, 54 for :math:`n = 601`). A released
  update :math:`(S + Z)/k` whose scale :math:`1/k` differs between neighbours tells them apart:
  :math:`\|Z\|` concentrates to a relative spread of about :math:`1/\sqrt{2d}` for :math:`d`
  parameters (Opacus issue #819).

The fix is to take both from declared public values: ``dataset_size`` (a public :math:`n`,
with the loader's public ``batch_size`` :math:`B`: :math:`q = 1/\lceil n/B\rceil`, the
normaliser :math:`n q`, a float), or ``sample_rate`` (:math:`q` itself, :math:`1/k` for an
integer :math:`k` of batches per epoch) and ``expected_batch_size`` (the normaliser itself).
Then the sampler draws every one of the *actual* examples at the public rate, and the
normaliser is one constant for all neighbours.

When nothing is declared, the paths keep their behaviour (rate and normaliser from the data, as
Opacus does), record ``dataset_size_source = "data"`` in :func:`sampling_constants` (kept by the
accountant and the training reports) and warn once per process
(:class:`DatasetSizeFromDataWarning`) how to declare it.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from .._validation import check_int, check_positive, check_probability
from .._warnings import warn

__all__ = ["DatasetSizeFromDataWarning", "warn_dataset_size_from_data", "sampling_constants",
           "check_declared", "steps_per_epoch_from_rate", "DATA", "DECLARED", "SCHEME"]

#: ``dataset_size_source`` values.
DATA = "data"
DECLARED = "declared"
SCHEME = "scheme"

_warned: set = set()


class DatasetSizeFromDataWarning(UserWarning):
    """The sampling rate / normaliser were derived from the (private) dataset size."""


def warn_dataset_size_from_data(where: str, n: int, *, how: str) -> None:
    """Warn once per process and path (``where``) that the rate and the normaliser come from
    the private dataset size ``n``; ``how`` names the arguments that declare it."""
    if where in _warned:
        return
    _warned.add(where)
    warn(
        f"{where}: the sampling rate and the mean-reduction normaliser were derived from the "
        f"dataset size n = {n} read from the data. Under add/remove adjacency n is private and "
        f"a neighbour (n + 1 examples) can get another rate and another normaliser (Opacus "
        f"issue #819). Declare public constants: {how}. This warning is shown once; the "
        f"accountant records dataset_size_source='data'.", DatasetSizeFromDataWarning)


def check_declared(*, dataset_size=None, sample_rate=None,
                   expected_batch_size=None) -> tuple[Optional[int], Optional[float],
                                                      Optional[float]]:
    """Validate the declared public constants (each may be ``None``)."""
    if dataset_size is not None:
        dataset_size = check_int("dataset_size", dataset_size, minimum=1)
    if sample_rate is not None:
        sample_rate = check_probability("sample_rate", sample_rate)
    if expected_batch_size is not None:
        expected_batch_size = check_positive("expected_batch_size", expected_batch_size)
        if not math.isfinite(expected_batch_size):
            raise ValueError(f"expected_batch_size must be finite, got {expected_batch_size}")
    return dataset_size, sample_rate, expected_batch_size


def steps_per_epoch_from_rate(sample_rate: float) -> int:
    """``k`` with ``sample_rate = 1/k`` (relative tolerance 1e-9); raises otherwise, naming
    the nearest admissible rates: the paths that derive the epoch from the rate need a whole
    number of batches per epoch."""
    q = check_probability("sample_rate", sample_rate)
    k = round(1.0 / q)
    if k < 1 or not math.isclose(1.0 / k, q, rel_tol=1e-9):
        lo, hi = max(1, math.floor(1.0 / q)), math.ceil(1.0 / q)
        raise ValueError(f"sample_rate must be 1/k for a whole number k of batches per epoch, "
                         f"got {q!r} (nearest: 1/{hi} = {1.0 / hi:.6g} or 1/{lo} = "
                         f"{1.0 / lo:.6g}); or declare dataset_size instead")
    return k


def sampling_constants(*, sample_rate: float, expected_batch_size: Optional[float],
                       dataset_size: Optional[int], dataset_size_source: str,
                       normaliser_source: str) -> dict[str, Any]:
    """The JSON-ready record of where the rate and the normaliser came from.

    ``dataset_size_source`` is ``"declared"`` (public constants given by the user),
    ``"scheme"`` (the scheme's relation makes the size public, e.g. structured subsampling's
    substitution relation over a fixed number of series) or ``"data"`` (read from the private
    data: the undeclared fallback).
    """
    if dataset_size_source not in (DATA, DECLARED, SCHEME):
        raise ValueError(f"dataset_size_source must be one of {(DATA, DECLARED, SCHEME)}, got "
                         f"{dataset_size_source!r}")
    return {"sample_rate": float(sample_rate),
            "expected_batch_size": (None if expected_batch_size is None
                                    else float(expected_batch_size)),
            "dataset_size": None if dataset_size is None else int(dataset_size),
            "dataset_size_source": dataset_size_source,
            "normaliser_source": normaliser_source,
            "public": dataset_size_source != DATA}
