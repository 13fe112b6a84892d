"""Pure-math accounting for banded matrix factorization (BandMF) and random allocation.

No torch imports.

1. BandMF with cyclic Poisson sampling (Choquette-Choo et al. 2023, "Amplified banded matrix
   factorization", Theorem 4; restated by Dong & Ganesh, arXiv:2602.09338, §3).
   The dataset is split into ``b`` groups; step ``i`` Poisson-samples group ``i mod b`` at rate
   ``q = b·p0`` (``p0 = B/|D|``). With a ``b``-banded lower-triangular non-negative ``C`` the
   participations of one example (steps ``j, j+b, j+2b, …``) touch disjoint rows of ``C x``,
   so the mechanism is the **composition of ceil(n/b) Poisson-subsampled Gaussian mechanisms**
   with sampling rate ``q`` and noise multiplier ``σ / max_j ‖C[:, j]‖`` (the strategy is
   normalised so that the maximal column norm is 1 for the named strategies). Each is priced by
   the pessimistic PLD of the foundation (add/remove, both directions).

2. DP-SGD (C = I) with random allocation / balls-in-bins, priced by the ``pld-accounting``
   package (Feldman & Shenfeld's PLD accountant for random allocation; imported lazily).

   * *k-of-t random allocation*, fresh every epoch: each example is in ``k`` uniformly random
     distinct steps of each epoch of ``t`` steps; an epoch is priced by
     ``PLD_accounting.gaussian_allocation_pld(num_steps=t, num_selected=k)`` (dominating bound).
   * *balls-in-bins with the bins reused for ``E`` epochs* (Schuchardt & Kalinin, Definition 2.7):
     each example has
     one uniform bin of ``T`` and participates in steps ``bin, bin+T, …``. With ``C = I`` the
     ``T`` mixture means ``m_i = Σ_e e_{i+eT}`` are orthogonal with norm ``√E``, so by rotation
     invariance of the Gaussian the pair equals the 1-of-T allocation pair at noise multiplier
     ``σ/√E`` (Lemma 2.8 of Schuchardt & Kalinin with C = I). Composing ``E`` independent
     epochs instead would *under-report* (bins are not redrawn), so the whole run is one unit.
"""

from __future__ import annotations

import functools
import math

from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution

from .._validation import check_int, check_positive, check_probability
from . import pld as pld_lib
from .mixture import MixturePair
from .profiles import PairProfile

__all__ = ["cyclic_poisson_rate", "bandmf_cyclic_poisson_pld", "bandmf_cyclic_poisson_epsilon",
           "random_allocation_pld", "balls_in_bins_pld", "gaussian_pld"]


def cyclic_poisson_rate(dataset_size: int, batch_size: float, bands: int) -> float:
    """``q = b · B / |D|``, the per-group Poisson rate of cyclic Poisson (must be ≤ 1)."""
    n = check_int("dataset_size", dataset_size, minimum=1)
    B = check_positive("batch_size", batch_size)
    b = check_int("bands", bands, minimum=1)
    if b > n:
        raise ValueError(f"bands must be <= dataset_size, got bands={b}, dataset_size={n}")
    q = b * B / n
    if q > 1 + 1e-12:
        raise ValueError(f"cyclic Poisson needs bands * batch_size <= dataset_size (rate "
                         f"q = b*B/|D| <= 1), got q = {b}*{B}/{n} = {q:.6g}; use fewer bands or "
                         f"a smaller batch")
    return min(q, 1.0)


def bandmf_cyclic_poisson_pld(noise_multiplier: float, sample_rate: float, *,
                              column_norm: float = 1.0,
                              discretization: float = pld_lib.DEFAULT_DISCRETIZATION
                              ) -> PrivacyLossDistribution:
    """PLD of one cycle (``b`` steps) of BandMF with cyclic Poisson: the Poisson-subsampled
    Gaussian with rate ``q`` and noise multiplier ``σ / column_norm`` (Choquette-Choo et al.
    2023, Thm. 4). ``column_norm`` = ``max_j ‖C[:, j]‖₂``."""
    sigma = check_positive("noise_multiplier", noise_multiplier)
    q = check_probability("sample_rate", sample_rate)
    col = check_positive("column_norm", column_norm)
    pair = MixturePair.from_components([1.0, 0.0], [q, 1.0 - q], [0.0], [1.0], sigma / col)
    return pld_lib.pld_from_profile(PairProfile(pair), PairProfile(pair.reversed()),
                                    discretization=discretization)


def bandmf_cyclic_poisson_epsilon(noise_multiplier: float, *, steps: int, bands: int,
                                  sample_rate: float, delta: float, column_norm: float = 1.0,
                                  discretization: float = pld_lib.DEFAULT_DISCRETIZATION
                                  ) -> float:
    """ε(δ) after ``steps`` steps: ``ceil(steps/bands)`` composed cycles."""
    steps = check_int("steps", steps, minimum=0)
    bands = check_int("bands", bands, minimum=1)
    k = math.ceil(steps / bands)
    if k == 0:
        return 0.0
    one = bandmf_cyclic_poisson_pld(noise_multiplier, sample_rate, column_norm=column_norm,
                                    discretization=discretization)
    return pld_lib.epsilon_for_delta(pld_lib.self_compose(one, k), delta)


def _allocation_config(discretization: float):
    # FFT convolution: a dominating (upper) bound, ~0.3 s per epoch PLD at 1e-3. The package's
    # tighter GEOM method needs numba to be practical (90 s per PLD without it). The loss grid is
    # capped at 1e-3 because FFT at 1e-2 is very loose (ε 1.54 vs 0.735 at σ=1, t=100).
    from PLD_accounting import AllocationSchemeConfig, ConvolutionMethod

    disc = min(check_positive("discretization", discretization), 1e-3)
    return AllocationSchemeConfig(loss_discretization=disc,
                                  convolution_method=ConvolutionMethod.FFT)


def random_allocation_pld(noise_multiplier: float, *, num_steps: int, num_selected: int = 1,
                          discretization: float = pld_lib.DEFAULT_DISCRETIZATION
                          ) -> PrivacyLossDistribution:
    """Dominating PLD (both directions) of one epoch of DP-SGD with k-of-t random allocation
    (``PLD_accounting.gaussian_allocation_pld``, Feldman & Shenfeld; FFT convolution,
    dominating bound)."""
    sigma = check_positive("noise_multiplier", noise_multiplier)
    t = check_int("num_steps", num_steps, minimum=1)
    k = check_int("num_selected", num_selected, minimum=1, maximum=t)
    return _random_allocation_pld(sigma, t, k, discretization)


@functools.lru_cache(maxsize=16)
def _random_allocation_pld(sigma: float, t: int, k: int, discretization: float):
    """:func:`random_allocation_pld`, cached per ``(σ, t, k, discretization)`` (1-2 s a build;
    accountants, calibrations' last steps and a scheme's ``epsilon`` and ``pld`` ask again for
    the same one; PLDs are values: composition builds new objects). Checked against a fresh
    build in ``tests/test_bandmf_accounting.py``."""
    from PLD_accounting import BoundType, PrivacyParams, gaussian_allocation_pld

    params = PrivacyParams(sigma=sigma, num_steps=t, num_selected=k, num_epochs=1)
    try:
        return gaussian_allocation_pld(params=params, config=_allocation_config(discretization),
                                       bound_type=BoundType.DOMINATES)
    except ValueError as err:
        if not _degenerate_grid(err):
            raise
    # At large σ the allocation's privacy losses span less than one grid interval and
    # PLD_accounting cannot build its loss grid ("x_max must be greater than x_min"). Price the
    # epoch without amplification instead: k participations of sensitivity 1 are the Gaussian
    # mechanism with sensitivity √k, which dominates k-of-t allocation in both directions (each
    # allocation pair is a mixture, over the k-subsets, of pairs N(Σ_{i∈S} e_i, σ²I) vs
    # N(0, σ²I), each a Gaussian pair of sensitivity √k; the hockey-stick divergence is jointly
    # convex). A sound upper bound, and ε is already small there.
    return gaussian_pld(sigma / math.sqrt(k), discretization=discretization)


def _degenerate_grid(err: ValueError) -> bool:
    """Whether ``err`` is PLD_accounting's empty loss grid (all losses in one interval)."""
    return "x_max must be greater than x_min" in str(err)


def gaussian_pld(noise_multiplier: float, *,
                 discretization: float = pld_lib.DEFAULT_DISCRETIZATION
                 ) -> PrivacyLossDistribution:
    """Pessimistic PLD (both directions) of the Gaussian mechanism with sensitivity 1 and
    noise multiplier σ: N(1, σ²) vs N(0, σ²)."""
    sigma = check_positive("noise_multiplier", noise_multiplier)
    pair = MixturePair.from_components([1.0], [1.0], [0.0], [1.0], sigma)
    return pld_lib.pld_from_profile(PairProfile(pair), PairProfile(pair.reversed()),
                                    discretization=discretization)


def balls_in_bins_pld(noise_multiplier: float, *, num_bins: int, epochs: int,
                      discretization: float = pld_lib.DEFAULT_DISCRETIZATION
                      ) -> PrivacyLossDistribution:
    """Dominating PLD of a whole run of DP-SGD with balls-in-bins (bins fixed for ``epochs``
    epochs): the 1-of-``num_bins`` allocation at ``σ/√epochs`` (module docstring, item 2)."""
    sigma = check_positive("noise_multiplier", noise_multiplier)
    epochs = check_int("epochs", epochs, minimum=1)
    return random_allocation_pld(sigma / math.sqrt(epochs), num_steps=num_bins,
                                 num_selected=1, discretization=discretization)
