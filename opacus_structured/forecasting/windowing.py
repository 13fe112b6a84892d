r"""Torch-only windowing for structured subsampling (no gluonts): ``(series, start)`` → tensors.

:class:`WindowDataset` turns the pairs drawn by
:class:`~opacus_structured.samplers.structured.StructuredWindowSampler` into training windows
exactly as Algorithms 1, 2 and 4 of Schuchardt et al. (ICML 2025) prescribe:

* **padding** — the series is left-padded with :math:`L_\mathrm{eff}` zeros; ``start`` (0-based,
  ``0 <= start <= L_n - L_F``) indexes the padded series, so the forecast is always
  ``x_n[start : start + L_F]`` (never padded) and the past is the :math:`L_\mathrm{eff}` values
  before it, zeros (flagged in ``past_is_pad``) where the index is negative;
* **effective context** — every value the model reads is inside the window. With lags
  :math:`l_1, \dots, l_m` (DeepAR-style lagged inputs) the model reads values up to
  :math:`\max_i l_i` steps before its first context step, so the effective context length is
  :math:`L_\mathrm{eff} = L_C + \max_i l_i`, and *that* is the ``context_length`` the accountant
  must use (:meth:`WindowDataset.check_scheme` enforces it). Lag features are computed from the
  window only (:attr:`WindowDataset.lags`);
* **augmentation** (Eq. 1, optional) — fresh Gaussian noise with standard deviation
  :math:`\sigma_C v` on every past value and :math:`\sigma_F v` on every forecast value, drawn
  from the dataset's own :class:`torch.Generator` each time a window is produced; lag features and
  scaling are computed *after* augmentation. This is the online augmentation that Theorem G.1
  prices for :math:`(w, v)` relations (:math:`v` = ``value_bound``);
* **scaling** — per window only (``scaling="mean"``: divide by the mean absolute value of the
  observed past, like GluonTS' ``MeanScaler``). A normalisation computed from a whole series would
  read values outside the window and is *not* covered by the guarantee: normalise with public
  constants or per window.

Items are dicts of tensors: ``past`` (:math:`L_\mathrm{eff}` [× D]), ``context`` (last
:math:`L_C` values of ``past``), ``target`` (:math:`L_F` [× D]), ``past_is_pad``
(:math:`L_\mathrm{eff}`), ``lagged`` (:math:`(L_C + L_F) \times m` [× D] lag values for the
context and forecast positions; only with lags), ``scale``, ``window_series``, ``window_start``.

**gluonts models.** :class:`GluonTSWindowDataset` is the same dataset (same ``(series, start)``
keys, bounds, padding rule, ``window_series``/``window_start`` audit fields, collate and scheme
check) whose windows are cut by a gluonts estimator's own training ``InstanceSplitter``, so the
fields, time features and padding are exactly what that model expects.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch

from .._validation import check_int, check_nonnegative, check_positive
from ..samplers._generator import resolve_generator

__all__ = ["WindowDataset", "GluonTSWindowDataset", "collate_windows"]


class WindowDataset(torch.utils.data.Dataset):
    """Map-style dataset of padded training windows, keyed by ``(series_index, start)``.

    Args:
        series: list of 1-d (univariate, length :math:`L_n`) or 2-d (:math:`L_n \\times D`)
            arrays/tensors; all must have the same number of dimensions (and D).
        context_length: :math:`L_C`, the model's own context window.
        forecast_length: :math:`L_F` >= 1.
        lags: positive lags the model reads (e.g. ``[1, 24, 168]``); the effective context is
            ``context_length + max(lags)``.
        context_noise, forecast_noise: augmentation multipliers :math:`\\sigma_C, \\sigma_F`
            (std :math:`\\sigma v`), default 0 (no augmentation).
        value_bound: :math:`v`, the bound on a changed value in the :math:`(w, v)` relation;
            required when augmenting.
        scaling: ``None`` or ``"mean"`` (per-window mean-absolute scaling of the observed past).
        generator: :class:`torch.Generator` for the augmentation noise, or ``seed`` for a new
            one; neither (default): fresh OS entropy. The augmentation noise is part of the
            priced mechanism (Theorem G.1): a seeded generator makes it reproducible by whoever
            knows the seed, who can then remove it — seed for tests and evaluation only.
    """

    def __init__(self, series: Sequence, context_length: int, forecast_length: int, *,
                 lags: Sequence[int] = (), context_noise: float = 0.0,
                 forecast_noise: float = 0.0, value_bound: Optional[float] = None,
                 scaling: Optional[str] = None, generator: Optional[torch.Generator] = None,
                 seed: Optional[int] = None, dtype: torch.dtype = torch.float32):
        self.context_length = check_int("context_length", context_length, minimum=0)
        self.forecast_length = check_int("forecast_length", forecast_length, minimum=1)
        self.lags = tuple(check_int("lag", lag, minimum=1) for lag in lags)
        self.context_noise = check_nonnegative("context_noise", context_noise)
        self.forecast_noise = check_nonnegative("forecast_noise", forecast_noise)
        if (self.context_noise > 0 or self.forecast_noise > 0):
            if value_bound is None:
                raise ValueError("augmentation needs value_bound (v of the (w, v) relation): "
                                 "the noise std is context_noise * v / forecast_noise * v")
            value_bound = check_positive("value_bound", value_bound)
        self.value_bound = value_bound
        if scaling not in (None, "mean"):
            raise ValueError(f"scaling must be None or 'mean' (per window), got {scaling!r}")
        self.scaling = scaling
        self.dtype = dtype
        if len(series) == 0:
            raise ValueError("series must not be empty")
        tensors = [torch.as_tensor(np.asarray(s), dtype=dtype) for s in series]
        ndim = {t.ndim for t in tensors}
        if ndim - {1, 2} or len(ndim) != 1:
            raise ValueError(f"every series must be 1-d (univariate) or 2-d (length x D), all "
                             f"alike; got dimensions {sorted(ndim)}")
        if tensors[0].ndim == 2 and len({t.shape[1] for t in tensors}) != 1:
            raise ValueError("multivariate series must all have the same number of variables")
        for n, t in enumerate(tensors):
            if t.shape[0] < self.forecast_length:
                raise ValueError(f"series {n} has length {t.shape[0]} < forecast_length="
                                 f"{self.forecast_length}: no window fits")
            if not torch.isfinite(t).all():
                raise ValueError(f"series {n} contains NaN or infinite values")
        self.series = tensors
        self.lengths = [int(t.shape[0]) for t in tensors]
        self.generator = resolve_generator(generator, seed, "WindowDataset")

    # ---- geometry ------------------------------------------------------------------------
    @property
    def effective_context_length(self) -> int:
        """:math:`L_C + \\max(\\text{lags})`: every past value the model reads (accounting L_C)."""
        return self.context_length + (max(self.lags) if self.lags else 0)

    @property
    def augmented(self) -> bool:
        return self.context_noise > 0 or self.forecast_noise > 0

    def check_scheme(self, scheme) -> None:
        """Raise ValueError unless ``scheme`` prices the windows this dataset produces.

        Checks ``context_length`` (the scheme's must be at least the effective context length:
        a larger one only over-estimates ε), ``forecast_length``, ``num_series``, that
        ``series_length`` is at most the shortest series, and the augmentation multipliers.
        """
        if scheme.context_length < self.effective_context_length:
            raise ValueError(
                f"the model reads {self.effective_context_length} past values (context_length "
                f"{self.context_length} + max lag {self.effective_context_length - self.context_length})"
                f" but the scheme accounts context_length={scheme.context_length}: build the "
                f"scheme with context_length={self.effective_context_length}")
        if scheme.forecast_length != self.forecast_length:
            raise ValueError(f"scheme forecast_length={scheme.forecast_length} but the dataset "
                             f"forecasts {self.forecast_length} steps")
        if scheme.num_series != len(self.lengths):
            raise ValueError(f"scheme num_series={scheme.num_series} but the dataset has "
                             f"{len(self.lengths)} series")
        if scheme.series_length > min(self.lengths):
            raise ValueError(f"scheme series_length={scheme.series_length} exceeds the shortest "
                             f"series ({min(self.lengths)})")
        if (scheme.context_noise, scheme.forecast_noise) != (self.context_noise,
                                                             self.forecast_noise):
            raise ValueError(
                f"scheme augmentation (context_noise={scheme.context_noise}, forecast_noise="
                f"{scheme.forecast_noise}) differs from the dataset's ({self.context_noise}, "
                f"{self.forecast_noise})")

    @classmethod
    def from_scheme(cls, series: Sequence, scheme, *, lags: Sequence[int] = (), **kwargs):
        """Dataset whose effective context equals ``scheme.context_length`` (lags included)."""
        max_lag = max(lags) if lags else 0
        if scheme.context_length < max_lag:
            raise ValueError(f"scheme context_length={scheme.context_length} is smaller than "
                             f"the largest lag {max_lag}")
        kwargs.setdefault("context_noise", scheme.context_noise)
        kwargs.setdefault("forecast_noise", scheme.forecast_noise)
        ds = cls(series, scheme.context_length - max_lag, scheme.forecast_length, lags=lags,
                 **kwargs)
        ds.check_scheme(scheme)
        return ds

    def __len__(self) -> int:
        return len(self.lengths)

    # ---- items ---------------------------------------------------------------------------
    def _noise(self, shape, std: float) -> torch.Tensor:
        return torch.randn(shape, generator=self.generator, dtype=self.dtype) * std

    def _window_key(self, key) -> tuple[int, int]:
        """``(series_index, start)`` from a sampler's key, both checked against the geometry."""
        try:
            n, start = (int(k) for k in key)
        except (TypeError, ValueError):
            raise IndexError(f"{type(self).__name__} keys are (series_index, start) pairs, got "
                             f"{key!r}") from None
        if not 0 <= n < len(self.lengths):
            raise IndexError(f"series index {n} out of range [0, {len(self.lengths)})")
        last = self.lengths[n] - self.forecast_length
        if not 0 <= start <= last:
            raise IndexError(f"window start {start} of series {n} outside [0, {last}]")
        return n, start

    def __getitem__(self, key) -> dict[str, torch.Tensor]:
        n, start = self._window_key(key)
        x = self.series[n]
        L_eff, L_F = self.effective_context_length, self.forecast_length
        # original indices start - L_eff .. start + L_F - 1; negative ones are padding zeros
        lo = start - L_eff
        pad = max(0, -lo)
        window = torch.zeros((L_eff + L_F, *x.shape[1:]), dtype=self.dtype)
        window[pad:] = x[max(lo, 0):start + L_F]
        past_is_pad = torch.zeros(L_eff, dtype=torch.bool)
        past_is_pad[:pad] = True
        if self.augmented:
            v = self.value_bound
            window[:L_eff] += self._noise(window[:L_eff].shape, self.context_noise * v)
            window[L_eff:] += self._noise(window[L_eff:].shape, self.forecast_noise * v)
        scale = torch.ones(x.shape[1:], dtype=self.dtype)
        if self.scaling == "mean":
            observed = window[:L_eff][~past_is_pad]
            if len(observed):
                scale = observed.abs().mean(dim=0).clamp_min(1e-10)
        window = window / scale
        out = {"past": window[:L_eff], "context": window[L_eff - self.context_length:L_eff],
               "target": window[L_eff:], "past_is_pad": past_is_pad, "scale": scale,
               "window_series": torch.tensor(n), "window_start": torch.tensor(start)}
        if self.lags:
            # positions of the context and forecast steps inside the window, minus each lag
            pos = torch.arange(L_eff - self.context_length, L_eff + L_F)
            idx = pos[:, None] - torch.tensor(self.lags)[None, :]
            out["lagged"] = window[idx]
        return out

    def collate(self, items: Sequence[dict]) -> dict[str, torch.Tensor]:
        """:func:`collate_windows` that also handles an **empty** batch (Poisson bottom level)."""
        if items:
            return collate_windows(items)
        if self.series[0].ndim == 2:
            d = (self.series[0].shape[1],)
        else:
            d = ()
        L_eff, L_C, L_F = self.effective_context_length, self.context_length, self.forecast_length
        out = {"past": torch.zeros((0, L_eff, *d)), "context": torch.zeros((0, L_C, *d)),
               "target": torch.zeros((0, L_F, *d)),
               "past_is_pad": torch.zeros((0, L_eff), dtype=torch.bool),
               "scale": torch.zeros((0, *d)), "window_series": torch.zeros(0, dtype=torch.int64),
               "window_start": torch.zeros(0, dtype=torch.int64)}
        if self.lags:
            out["lagged"] = torch.zeros((0, L_C + L_F, len(self.lags), *d))
        return {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in out.items()}

    # ---- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Augmentation-noise generator state (so a resumed run draws the same noise)."""
        return {"generator_state": self.generator.get_state().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "generator_state" not in state:
            raise ValueError("window dataset state lacks 'generator_state'")
        self.generator.set_state(torch.as_tensor(state["generator_state"], dtype=torch.uint8))


class GluonTSWindowDataset(WindowDataset):
    """:class:`WindowDataset` whose windows are cut by a gluonts estimator's training splitter.

    ``dataset[(series, start)]`` is the window the splitter's ``_split_instance`` cuts at split
    point ``start`` of the transformed entry ``series`` — the same padding rule as
    :class:`WindowDataset` (the forecast is ``x_n[start : start + L_F]``; the ``L_C`` context
    values before it are zeros, marked unobserved / ``past_is_pad``, where the index is
    negative), with ``L_C`` the splitter's ``past_length`` (the model's context plus its largest
    lag: every value the network reads). Only the model's ``input_names`` (plus
    ``future_target`` / ``future_observed_values`` for the loss) are kept, as torch tensors
    (integer fields int64, the rest float32), with the ``window_series`` / ``window_start`` audit
    fields. No augmentation and no scaling here: gluonts models scale per window themselves.

    Args:
        entries: the estimator's transformed training entries (``transformation.apply(...,
            is_train=True)``), one per series, in the scheme's series order.
        splitter: the estimator's training ``InstanceSplitter``.
        input_names: the fields the model's ``forward``/``loss`` read.
    """

    def __init__(self, entries: Sequence[dict], splitter, input_names: Sequence[str]):
        self.entries = list(entries)
        if not self.entries:
            raise ValueError("entries must not be empty")
        self.splitter = splitter
        self.input_names = list(dict.fromkeys(
            [*input_names, "future_target", "future_observed_values"]))
        self.context_length = check_int("past_length", int(splitter.past_length), minimum=0)
        self.forecast_length = check_int("future_length", int(splitter.future_length),
                                         minimum=1)
        self.lags = ()
        self.context_noise = self.forecast_noise = 0.0
        self.value_bound = None
        self.scaling = None
        self.dtype = torch.float32
        self.lengths = [int(np.shape(e["target"])[-1]) for e in self.entries]
        for n, length in enumerate(self.lengths):
            if length < self.forecast_length:
                raise ValueError(f"series {n} has length {length} < forecast_length="
                                 f"{self.forecast_length}: no window fits")
        self.generator = None  # nothing random here

    def __getitem__(self, key) -> dict[str, torch.Tensor]:
        n, start = self._window_key(key)
        item = self.splitter._split_instance(self.entries[n], start)
        out = {}
        for name in self.input_names:
            arr = np.asarray(item[name])
            out[name] = torch.as_tensor(
                arr, dtype=torch.int64 if np.issubdtype(arr.dtype, np.integer)
                else torch.float32)
        out["window_series"] = torch.tensor(n)
        out["window_start"] = torch.tensor(start)
        return out

    def collate(self, items: Sequence[dict]) -> dict[str, torch.Tensor]:
        """:func:`collate_windows` (the structured sampler never draws an empty batch)."""
        return collate_windows(items)

    def state_dict(self) -> dict[str, Any]:
        """Nothing to save: the windows are a deterministic function of the key."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"GluonTSWindowDataset keeps no state, got keys {sorted(state)}")


def collate_windows(items: Sequence[dict]) -> dict[str, torch.Tensor]:
    """Stack window dicts into batch tensors (use ``dataset.collate`` to allow empty batches)."""
    if not items:
        raise ValueError("empty batch: use WindowDataset.collate, which builds empty tensors "
                         "(Poisson bottom-level sampling can draw no window)")
    return {key: torch.stack([it[key] for it in items]) for key in items[0]}
