"""Bridge to the structured-subsampling scheme, sampler and accountant.

Uses :mod:`opacus_structured.schemes.structured`, :mod:`opacus_structured.samplers.structured`
and :mod:`opacus_structured.accountants.structured` when they are importable. Until then a
minimal fallback implements the one configuration the forecasting job uses (λ = 1,
without-replacement top level, with-replacement bottom level, 1-event relation, Theorem 4.4 of
Schuchardt et al., ICML 2025) on the foundation core; it is replaced automatically.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .._validation import check_int
from ..accounting import pld as pld_lib
from ..accounting.mixture import MixturePair
from ..accounting.profiles import SwitchingProfile
from ..schemes.base import BoundKind, Scheme

__all__ = ["new_scheme", "new_sampler", "new_accountant", "USING_FALLBACK"]

try:  # pragma: no cover - depends on the tree state
    from ..accountants.structured import StructuredSubsamplingAccountant as _Accountant
    from ..schemes.structured import StructuredScheme as _Scheme

    USING_FALLBACK = False
except ImportError:  # pragma: no cover
    _Scheme = _Accountant = None
    USING_FALLBACK = True


@dataclasses.dataclass(frozen=True)
class _FallbackStructuredScheme(Scheme):
    """WOR top level + WR bottom level, λ = 1, 1-event (Theorem 4.4; tight, per step).

    Per step: ``P = (1 − q)·N(0, σ) + q·N(2, σ)`` vs ``Q = N(0, σ)`` with ``q = ρ·r``,
    ``ρ = Λ/N``, ``r = min(1, (L_C + L_F)/(L − L_F + 1))``; switching profile
    (``H(P||Q)`` for ε >= 0, ``H(Q||P)`` for ε < 0).
    """

    name = "structured-fallback"
    unit = "step"

    num_series: int
    series_length: int
    context_length: int
    forecast_length: int
    batch_size: int

    def __post_init__(self):
        check_int("num_series", self.num_series, minimum=1)
        check_int("context_length", self.context_length, minimum=0)
        check_int("forecast_length", self.forecast_length, minimum=1)
        check_int("series_length", self.series_length, minimum=self.forecast_length)
        check_int("batch_size", self.batch_size, minimum=1, maximum=self.num_series)

    @property
    def bound(self):
        return BoundKind.TIGHT

    def steps_per_epoch(self) -> int:
        return max(1, self.num_series // self.batch_size)

    def expected_sample_rate(self):
        return 1.0 / self.steps_per_epoch()

    def hit_probability(self) -> float:
        T = self.series_length - self.forecast_length + 1
        r = min(1.0, (self.context_length + self.forecast_length) / T)
        return (self.batch_size / self.num_series) * r

    def pld(self, noise_multiplier, *, sample_rate=None,
            discretization=pld_lib.DEFAULT_DISCRETIZATION):
        self.check_sample_rate(sample_rate)
        q = self.hit_probability()
        pair = MixturePair.from_components([2.0, 0.0], [q, 1.0 - q], [0.0], [1.0],
                                           noise_multiplier)
        return pld_lib.pld_from_profile(SwitchingProfile(pair), discretization=discretization)


class _FallbackSampler:
    """Per step: ``Λ`` distinct series uniformly without replacement (fresh each step), one
    window start per series uniform over ``0 .. L_n − L_F`` (padded-start convention of
    :class:`~opacus_structured.forecasting.training.WindowDataset`). Fixed batch size Λ."""

    def __init__(self, scheme, series_lengths, generator=None):
        import torch

        self.scheme = scheme
        self.lengths = np.asarray(series_lengths, dtype=np.int64)
        if len(self.lengths) != scheme.num_series:
            raise ValueError("series_lengths must have one entry per series")
        if self.lengths.min() < scheme.series_length:
            raise ValueError("a series is shorter than the scheme's series_length")
        self.generator = generator if generator is not None else torch.Generator()

    def __len__(self):
        return self.scheme.steps_per_epoch()

    def __iter__(self):
        import torch

        T = torch.as_tensor(self.lengths - self.scheme.forecast_length + 1)
        for _ in range(len(self)):
            idx = torch.randperm(self.scheme.num_series, generator=self.generator)
            idx = idx[: self.scheme.batch_size]
            u = torch.rand(len(idx), generator=self.generator, dtype=torch.float64)
            starts = torch.clamp((u * T[idx]).long(), max=T[idx] - 1)
            yield [(int(n), int(s)) for n, s in zip(idx, starts, strict=False)]

    def state_dict(self):
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state):
        self.generator.set_state(state["generator"])


def new_scheme(**kwargs):
    if _Scheme is not None:
        return _Scheme(**kwargs)
    return _FallbackStructuredScheme(**kwargs)


def new_sampler(scheme, series_lengths, generator=None):
    if _Scheme is not None:
        return scheme.sampler(series_lengths, generator=generator)
    return _FallbackSampler(scheme, series_lengths, generator=generator)


def new_accountant(scheme, discretization=pld_lib.DEFAULT_DISCRETIZATION):
    if _Accountant is not None:
        return _Accountant(scheme, discretization=discretization)
    from ..accountants.base import SchemeAccountant

    return SchemeAccountant(scheme, discretization=discretization)

