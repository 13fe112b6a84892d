r"""The structured window sampler of Schuchardt et al. (ICML 2025), Algorithms 1 and 3–6.

:class:`StructuredWindowSampler` is a torch batch sampler over a dataset of :math:`N` series
(any lengths :math:`L_n`, univariate or multivariate: only the lengths matter here). Each batch
is a list of ``(series_index, start)`` pairs; ``start`` is 0-based in the **padded** series
``[0]*L_C + x_n``, so the window is padded positions ``start .. start + L_C + L_F - 1``: the
forecast is ``x_n[start : start + L_F]`` (never padded) and the context the ``L_C`` values before
it (zeros where the index is negative). Valid starts: ``0 <= start <= L_n - L_F``
(:math:`T_n = L_n - L_F + 1` of them). Feed the pairs to
:class:`~opacus_structured.forecasting.windowing.WindowDataset`.

Exact semantics per step (:math:`N' = \lfloor\Lambda/\lambda\rfloor`):

* **top level** — ``"wor"``: a fresh uniformly random set of :math:`N'` *distinct* series,
  independent of every other step (Algorithm 5; a series is in a step with probability
  :math:`\rho = N'/N`); ``"deterministic"``: step :math:`b` of every epoch uses series
  :math:`bN', \dots, (b+1)N' - 1` (Algorithm 3); ``"shuffle"``: one uniform permutation per
  epoch, step :math:`b` uses its block :math:`b`;
* **bottom level** — ``"wr"``: :math:`\lambda` starts i.i.d. uniform over the :math:`T_n`
  positions (duplicates possible; Algorithm 4); batch size is exactly :math:`N'\lambda`;
  ``"poisson"``: every start independently with probability :math:`\min(1, \lambda/T_n)`
  (Algorithm 6); batch sizes vary and a batch may be empty.

An epoch is ``len(sampler)`` = :math:`\lfloor N\lambda/\Lambda\rfloor` steps. The valid accountant
is :class:`~opacus_structured.accountants.structured.StructuredSubsamplingAccountant` built with
``from_sampler(sampler)`` (it reads :attr:`StructuredWindowSampler.scheme`).

Randomness comes only from a dedicated :class:`torch.Generator`; :meth:`state_dict` records its
state between draws (plus the position, epoch and the epoch permutation for ``"shuffle"``), so a
restored sampler draws exactly the batches the uninterrupted one would have.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler

from ..schemes.registry import register_sampler
from ..schemes.structured import StructuredScheme
from ._generator import fresh_seed as _fresh_seed  # noqa: F401
from ._generator import resolve_generator
from ._resumable import EpochResumableSampler

__all__ = ["StructuredWindowSampler"]



class StructuredWindowSampler(EpochResumableSampler, Sampler[list]):
    """Bi-level structured sampler: yields one list of ``(series, start)`` pairs per step.

    Args:
        scheme: the :class:`StructuredScheme` to implement (``scheme.sampler(...)`` builds this).
        series_lengths: length :math:`L_n` of each of the ``scheme.num_series`` series. Each must
            be >= ``forecast_length`` and >= ``scheme.series_length`` (the accounted length must
            be the worst case: use ``StructuredScheme.from_lengths``).
        generator: dedicated :class:`torch.Generator` (exclusive with ``seed``).
        seed: seed for a new generator (default: OS randomness).

    Attributes:
        scheme: the scheme whose accountant is valid for the batches drawn.

    ``scheme``, ``lengths``, ``steps`` and ``series_per_step`` are fixed once built: a draw
    after one was changed raises :class:`~.verification.SamplerParametersChangedError`.
    """

    def __init__(self, scheme: StructuredScheme, series_lengths: Sequence[int], *,
                 generator: Optional[torch.Generator] = None, seed: Optional[int] = None):
        if not isinstance(scheme, StructuredScheme):
            raise ValueError(f"scheme must be a StructuredScheme, got {type(scheme).__name__}")
        self.scheme = scheme
        lengths = np.asarray(list(series_lengths))
        if lengths.ndim != 1 or len(lengths) != scheme.num_series:
            raise ValueError(f"series_lengths must list one length per series "
                             f"(num_series={scheme.num_series}), got {len(lengths)} entries")
        if not np.all(np.equal(np.mod(lengths, 1), 0)):
            raise ValueError("series_lengths must be integers")
        lengths = lengths.astype(np.int64)
        L_F, L_C = scheme.forecast_length, scheme.context_length
        short = np.nonzero(lengths < L_F)[0]
        if len(short):
            n = int(short[0])
            raise ValueError(f"series {n} has length {int(lengths[n])} < forecast_length={L_F}: "
                             f"no window fits; drop that series")
        if lengths.min() < scheme.series_length:
            n = int(np.argmin(lengths))
            raise ValueError(
                f"series {n} has length {int(lengths[n])} < the scheme's series_length="
                f"{scheme.series_length}: the accountant would under-report; build the scheme "
                f"with StructuredScheme.from_lengths(lengths, ...)")
        if scheme.bottom_level == "poisson" and np.any(lengths != scheme.series_length):
            # Theorem E.8's pair is monotone in the rate min(1, λ/T) for a fixed window count k,
            # so the shortest series is the worst case only while k = L_C + L_F + ... is not
            # clamped by T (Appendix I.1); otherwise no ordering is proven.
            T_s = scheme.series_length - L_F + 1
            k_full = (L_C + L_F + scheme.w - 1 if scheme.relation == "event"
                      else scheme.w * (L_C + L_F))
            if T_s < k_full:
                raise ValueError(
                    f"bottom_level='poisson' with variable lengths needs every series at least "
                    f"L_C + L_F + (k - 1) long (series_length - forecast_length + 1 = {T_s} < "
                    f"k = {k_full}): no worst-case length is proven there; use equal lengths, "
                    f"drop short series, or bottom_level='wr'")
        self.lengths = lengths
        self._T = torch.as_tensor(lengths - L_F + 1, dtype=torch.float64)
        self.generator = resolve_generator(generator, seed, "StructuredWindowSampler")
        self.steps = scheme.steps_per_epoch()
        self.series_per_step = scheme.series_per_step
        self.epoch = 0
        self._position = 0
        self._perm: Optional[torch.Tensor] = None
        self._pending: Optional[dict] = None
        self._freeze_law()

    #: frozen at construction, checked before every draw (the draws read the scheme's levels,
    #: rates and batch size, and the series lengths)
    _LAW = ("scheme", "lengths", "steps", "series_per_step")

    # ---- properties ----------------------------------------------------------------------
    @property
    def expected_batch_size(self) -> int:
        """Λ: the denominator for gradient averaging (Opacus ``expected_batch_size``)."""
        return self.scheme.batch_size

    def __len__(self) -> int:
        return self.steps

    # ---- drawing -------------------------------------------------------------------------
    def _top(self, b: int) -> torch.Tensor:
        n_top, top = self.series_per_step, self.scheme.top_level
        if top == "wor":
            return torch.randperm(self.scheme.num_series, generator=self.generator)[:n_top]
        if top == "deterministic":
            return torch.arange(b * n_top, (b + 1) * n_top)
        if self._perm is None:  # shuffle: one permutation per epoch
            self._perm = torch.randperm(self.scheme.num_series, generator=self.generator)
        return self._perm[b * n_top:(b + 1) * n_top]

    def _bottom(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T = self._T[idx]
        lam = self.scheme.instances_per_series
        if self.scheme.bottom_level == "wr":
            u = torch.rand((len(idx), lam), generator=self.generator, dtype=torch.float64)
            starts = torch.minimum(torch.floor(u * T[:, None]), T[:, None] - 1).long()
            series = idx[:, None].expand(-1, lam)
            return series.reshape(-1), starts.reshape(-1)
        rate = torch.clamp(lam / T, max=1.0)
        t_max = int(T.max())
        u = torch.rand((len(idx), t_max), generator=self.generator, dtype=torch.float64)
        pos = torch.arange(t_max, dtype=torch.float64)
        mask = (u < rate[:, None]) & (pos[None, :] < T[:, None])
        rows, starts = mask.nonzero(as_tuple=True)
        return idx[rows], starts

    def __iter__(self) -> Iterator[list]:
        self._resume()
        while self._position < self.steps:
            self._check_law()
            series, starts = self._bottom(self._top(self._position))
            self._advance(len(series))
            yield list(zip(series.tolist(), starts.tolist(), strict=True))

    def _restore_extra(self, state) -> None:
        perm = None if state is None else state.get("permutation")
        self._perm = None if perm is None else torch.as_tensor(perm, dtype=torch.int64)

    def _end_epoch(self) -> None:
        self._perm = None

    # ---- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """State between draws (generator, position, epoch, shuffle permutation, scheme)."""
        if self._pending is not None:
            return dict(self._pending)
        state = self._epoch_state()
        perm = self._perm if state["position"] > 0 else None
        state.update({"permutation": None if perm is None else perm.clone(),
                      "scheme": self.scheme.to_dict(), "lengths": self.lengths.tolist()})
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the next ``iter()`` continues where it left off."""
        for key in ("generator_state", "position", "epoch", "scheme", "lengths"):
            if key not in state_dict:
                raise ValueError(f"sampler state lacks {key!r}")
        saved = StructuredScheme.from_dict(state_dict["scheme"])
        if saved != self.scheme:
            raise ValueError(f"sampler state is for {saved!r}, not {self.scheme!r}")
        if list(state_dict["lengths"]) != self.lengths.tolist():
            raise ValueError("sampler state was taken over series of other lengths")
        self._stage(state_dict)

    def __repr__(self) -> str:
        s = self.scheme
        return (f"StructuredWindowSampler(num_series={s.num_series}, top_level={s.top_level!r}, "
                f"bottom_level={s.bottom_level!r}, instances_per_series="
                f"{s.instances_per_series}, batch_size={s.batch_size}, steps={self.steps})")


@register_sampler(StructuredScheme)
def structured_window_sampler(scheme: StructuredScheme,
                              series_lengths: Optional[Sequence[int]] = None, *,
                              generator=None, **kwargs) -> StructuredWindowSampler:
    """``scheme.sampler(series_lengths, ...)``: windows over series of the given lengths
    (default: all ``num_series`` of length ``series_length``)."""
    if series_lengths is None:
        series_lengths = [scheme.series_length] * scheme.num_series
    return StructuredWindowSampler(scheme, series_lengths, generator=generator, **kwargs)
