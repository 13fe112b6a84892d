r"""Structured subsampling for global time-series forecasting (Schuchardt et al., ICML 2025).

One DP-SGD step (Algorithm 1 of the paper) draws

1. a **top level** set of series: ``"wor"`` — a fresh uniform without-replacement sample of
   :math:`N' = \lfloor\Lambda/\lambda\rfloor` of the :math:`N` series at *every* step
   (Algorithm 5); ``"deterministic"`` — consecutive blocks of :math:`N'` series (Algorithm 3);
   ``"shuffle"`` — one random permutation per epoch, then consecutive blocks (accounted like
   ``"deterministic"``: each series is used in at most one step per epoch);
2. a **bottom level** set of windows from each drawn series (after prepending :math:`L_C` zeros):
   ``"wr"`` — :math:`\lambda` starts uniform with replacement over the :math:`T = L - L_F + 1`
   positions (Algorithm 4, fixed batch size :math:`N'\lambda`); ``"poisson"`` — every start
   independently with probability :math:`\min(1, \lambda/T)` (Algorithm 6, variable batch size);
3. per-window clipping to :math:`C`, :math:`\mathcal{N}(0, \sigma^2 C^2 I)` noise on the sum,
   division by the expected batch size :math:`\Lambda`.

The relation is substitution-type: :math:`w`-event (one contiguous run of :math:`w` values of one
series changes) or :math:`w`-user (up to :math:`w` values of one series change), optionally with a
bound :math:`v` on each change when augmentation noise is used (Eq. 1; the scheme's
``context_noise``/``forecast_noise`` are the multipliers :math:`\sigma_C, \sigma_F` of
:math:`v`). Pricing: :mod:`opacus_structured.accounting.structured` (see its table: Theorems
4.2, 4.4, E.8 tight; E.1, F.1, F.2, G.1 upper; 4.3, F.7, F.8 optimistic lower bounds).

The accounting **unit** is a step for ``"wor"`` and an epoch for ``"deterministic"`` /
``"shuffle"``; an epoch has :math:`\lfloor N\lambda/\Lambda \rfloor` steps.

**Padding and short series.** The :math:`L_C` prepended zeros are public constants (the same
under both neighbours), so they never weaken the guarantee: a protected value lies in at most
:math:`k = \min(L_C + L_F + w - 1, T)` windows (w-user: :math:`\min(w(L_C + L_F), T)`) and
:math:`k` is priced. A context plus forecast as long as the series is accepted: when
:math:`k` reaches :math:`T` every window of a drawn series can contain the protected value,
ε is priced with :math:`r = 1` (``"wr"``: no amplification from window sampling, only from
sampling series) and :meth:`StructuredScheme.padding` / :meth:`StructuredScheme.describe` /
the CLI say so (:func:`~opacus_structured.accounting.structured.padding_summary`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Any, Sequence

from .._validation import check_int, check_nonnegative
from ..accounting import pld as pld_lib
from ..accounting import structured as st
from .base import BoundKind, Scheme, register_scheme

__all__ = ["StructuredScheme"]


@functools.lru_cache(maxsize=32)
def _cached_pld(scheme: "StructuredScheme", sigma: float, discretization: float):
    profile = st.structured_profile(scheme.setting(), sigma)
    return pld_lib.pld_from_profile(profile, discretization=discretization)


@register_scheme
@dataclasses.dataclass(frozen=True)
class StructuredScheme(st.StructuredSetting, Scheme):
    """Bi-level structured subsampling of windows from time series (Schuchardt et al., ICML 2025).

    Args:
        num_series: :math:`N`, number of training series.
        series_length: :math:`L` used for accounting — the **shortest** series for variable
            lengths (worst case, Appendix I.1; see :meth:`from_lengths`).
        context_length: :math:`L_C`, every past value the model reads for a window (context
            plus the largest lag, e.g. DeepAR's ``past_length``), >= 0.
        forecast_length: :math:`L_F` >= 1.
        batch_size: :math:`\\Lambda`, expected number of windows per step.
        instances_per_series: :math:`\\lambda` windows per drawn series (1 is optimal,
            Theorem 4.1; > 1 only has upper/lower bounds for ``"wr"``).
        top_level: ``"wor"`` (per-step accounting), ``"deterministic"`` or ``"shuffle"``
            (per-epoch accounting).
        bottom_level: ``"wr"`` or ``"poisson"``.
        relation: ``"event"`` or ``"user"``; ``w`` >= 1 its size.
        bound: ``"tight"`` (default), ``"upper"`` or ``"lower"`` (an optimistic lower bound:
            never a guarantee). ``"tight"`` where no tight result exists raises and names
            ``"upper"``.
        context_noise, forecast_noise: augmentation multipliers :math:`\\sigma_C, \\sigma_F`
            >= 0 (Theorem G.1; needs ``bound="upper"``, WOR + WR, λ = 1).
    """

    name = "structured"
    summary = ("structured subsampling of time-series windows (Schuchardt et al. ICML 2025: "
               "Thm 4.2/4.4/E.8 tight, E.1/F.1/F.2/G.1 upper, 4.3/F.7/F.8 lower)")

    # The fields are those of :class:`~opacus_structured.accounting.structured.StructuredSetting`
    # (inherited: one list of parameters). The ``bound`` field is the user's choice of
    # analysis and satisfies the ``Scheme.bound`` contract: it is stored as a BoundKind.

    def __post_init__(self):
        ints = {
            "num_series": check_int("num_series", self.num_series, minimum=1),
            "context_length": check_int("context_length", self.context_length, minimum=0),
            "forecast_length": check_int("forecast_length", self.forecast_length, minimum=1),
            "instances_per_series": check_int("instances_per_series",
                                              self.instances_per_series, minimum=1),
            "w": check_int("w", self.w, minimum=1),
        }
        ints["series_length"] = check_int("series_length", self.series_length, minimum=1)
        ints["batch_size"] = check_int("batch_size", self.batch_size,
                                       minimum=ints["instances_per_series"])
        for key, value in ints.items():
            object.__setattr__(self, key, value)
        for key in ("context_noise", "forecast_noise"):
            object.__setattr__(self, key, check_nonnegative(key, getattr(self, key)))
        for key, allowed in (("top_level", st.TOP_LEVELS), ("bottom_level", st.BOTTOM_LEVELS),
                             ("relation", st.RELATIONS), ("bound", st.BOUNDS)):
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key} must be one of {allowed}, got {getattr(self, key)!r}")
        object.__setattr__(self, "bound", BoundKind(self.bound))
        st.start_positions(self.series_length, self.forecast_length)  # L >= L_F
        self.setting().rho()  # floor(Λ/λ) <= N
        if (self.num_series * self.instances_per_series) // self.batch_size < 1:
            raise ValueError(
                f"batch_size={self.batch_size} exceeds num_series * instances_per_series = "
                f"{self.num_series * self.instances_per_series}: an epoch would have no step")
        st.select_theorem(self.setting())  # raises if no result covers this configuration

    # ---- derived quantities --------------------------------------------------------------
    @classmethod
    def from_lengths(cls, lengths: Sequence[int], **kwargs) -> "StructuredScheme":
        """Scheme for series of the given (possibly variable) lengths.

        ``num_series = len(lengths)`` and ``series_length`` = the shortest length (the worst
        case for every with-replacement bound, Appendix I.1; for Poisson the sampler checks that
        the shortest length is also the worst case).
        """
        if "forecast_length" not in kwargs:
            raise ValueError("from_lengths needs forecast_length")
        lengths = list(lengths)
        L = st.worst_case_series_length(lengths, kwargs["forecast_length"])
        kwargs.setdefault("num_series", len(lengths))
        if kwargs["num_series"] != len(lengths):
            raise ValueError(f"num_series={kwargs['num_series']} but {len(lengths)} lengths given")
        return cls(series_length=L, **kwargs)

    @classmethod
    def from_training(cls, *, dataset_size: int, steps_per_epoch: int, epochs=None,
                      series_lengths: Sequence[int] = None, context_length: int = None,
                      forecast_length: int = None, batch_size: int = None,
                      **options) -> "StructuredScheme":
        """The scheme of a window dataset of ``dataset_size`` series with ``series_lengths``
        (the shortest is accounted, :meth:`from_lengths`), the model's ``context_length``
        (lags included) and ``forecast_length`` (all required: a
        :class:`~opacus_structured.forecasting.windowing.WindowDataset` has them) and
        ``batch_size`` windows per step (default ``round(N·λ/steps_per_epoch)``); ``options``
        are the other fields (``top_level``, ``bottom_level``, ``relation``, ``w``, ``bound``,
        ``instances_per_series``, augmentation). ``epochs`` is not needed."""
        n = check_int("dataset_size", dataset_size, minimum=1)
        k = check_int("steps_per_epoch", steps_per_epoch, minimum=1)
        for key, value in (("series_lengths", series_lengths),
                           ("context_length", context_length),
                           ("forecast_length", forecast_length)):
            if value is None:
                raise ValueError(f"structured needs {key} (a WindowDataset has it): windows are "
                                 f"drawn from series, so the scheme needs the window geometry")
        lengths = list(series_lengths)
        if len(lengths) != n:
            raise ValueError(f"dataset_size={n} but {len(lengths)} series_lengths given")
        lam = check_int("instances_per_series", options.get("instances_per_series", 1),
                        minimum=1)
        if batch_size is None:
            batch_size = max(lam, round(n * lam / k))
        return cls.from_lengths(lengths, context_length=context_length,
                                forecast_length=forecast_length, batch_size=batch_size,
                                **options)

    def implemented_by(self, sampler_scheme) -> bool:
        r"""This scheme, or — ``top_level="wor"`` only — this scheme over **at least as many**
        series (a declared public ``num_series`` N below the panel's N' >= N).

        A sampler that draws :math:`\lfloor\Lambda/\lambda\rfloor` of :math:`N' \ge N`
        series without replacement includes each with probability
        :math:`\rho' = \lfloor\Lambda/\lambda\rfloor/N' \le \rho`, and every WOR bound
        (Theorems 4.4, F.1, F.2, G.1) is non-decreasing in ρ: the mixture
        :math:`(1-\rho')Q + \rho' P` is :math:`(1 - t)Q + t[(1-\rho)Q + \rho P]` with
        :math:`t = \rho'/\rho`, and the hockey-stick divergence is jointly convex. So pricing
        with the public N never under-reports. Per-epoch top levels
        (``"deterministic"``/``"shuffle"``) need N itself: the epoch is N'/Λ steps long.
        """
        if sampler_scheme == self:
            return True
        if not isinstance(sampler_scheme, StructuredScheme) or self.top_level != "wor":
            return False
        return (sampler_scheme.num_series >= self.num_series
                and dataclasses.replace(sampler_scheme, num_series=self.num_series) == self)

    def setting(self) -> st.StructuredSetting:
        return st.StructuredSetting(**{f.name: getattr(self, f.name)
                                       for f in dataclasses.fields(st.StructuredSetting)})

    @property
    def unit(self) -> str:  # type: ignore[override]
        """``"step"`` for WOR top level, ``"epoch"`` for deterministic/shuffle."""
        return "step" if self.top_level == "wor" else "epoch"

    @property
    def theorem(self) -> str:
        """The function of :mod:`opacus_structured.accounting.structured` pricing this scheme."""
        return st.select_theorem(self.setting())

    @property
    def series_per_step(self) -> int:
        """:math:`N' = \\lfloor \\Lambda / \\lambda \\rfloor`."""
        return self.batch_size // self.instances_per_series

    def steps_per_epoch(self) -> int:
        """:math:`\\lfloor N \\lambda / \\Lambda \\rfloor`."""
        return (self.num_series * self.instances_per_series) // self.batch_size

    def expected_sample_rate(self) -> float:
        """``1/steps_per_epoch``: what Opacus' hook reports with this scheme's sampler."""
        return 1.0 / self.steps_per_epoch()

    def windows_per_element(self) -> int:
        return self.setting().windows()

    def hit_probability(self) -> float:
        """``r``: window hit probability k/T (WR) or Poisson rate min(1, λ/T)."""
        return self.setting().r()

    def series_sampling_rate(self) -> float:
        """ρ = floor(Λ/λ)/N (used by the WOR results)."""
        return self.setting().rho()

    # ---- pricing -------------------------------------------------------------------------
    def profile(self, noise_multiplier: float):
        """Privacy profile of one accounting unit (:attr:`unit`)."""
        return st.structured_profile(self.setting(), noise_multiplier)

    def pld(self, noise_multiplier, *, sample_rate=None,
            discretization=pld_lib.DEFAULT_DISCRETIZATION):
        """Pessimistic PLD of one step (``wor``) or one epoch (otherwise); symmetric relation."""
        self.check_sample_rate(sample_rate)
        sigma = float(noise_multiplier)
        return _cached_pld(self, sigma, float(discretization))

    # ---- sampler -------------------------------------------------------------------------
    def sampler_for_dataset(self, num_examples: int, *, generator=None):
        """Refused: windows are drawn from series, so the sampler needs the series lengths."""
        raise ValueError(f"scheme {self.name!r} draws (series, start) windows: build "
                         f"scheme.sampler(series_lengths, ...) over a WindowDataset and pass it "
                         f"explicitly")

    # ---- CLI -----------------------------------------------------------------------------
    @classmethod
    def add_cli_arguments(cls, parser: argparse.ArgumentParser) -> None:
        a = parser.add_argument
        a("--num-series", type=int, required=True, metavar="N", help="number of series N")
        a("--series-length", type=int, required=True, metavar="L",
          help="series length L (the shortest one for variable lengths)")
        a("--context-length", type=int, required=True, metavar="LC",
          help="context length L_C incl. lags (every past value the model reads)")
        a("--forecast-length", type=int, required=True, metavar="LF", help="forecast length L_F")
        a("--batch-size", type=int, required=True, metavar="B",
          help="expected batch size Lambda in windows")
        a("--instances-per-series", type=int, default=1, metavar="LAMBDA",
          help="windows per drawn series lambda (default 1)")
        a("--top-level", choices=st.TOP_LEVELS, default="wor",
          help="series sampling: wor (fresh per step), deterministic, shuffle (default wor)")
        a("--bottom-level", choices=st.BOTTOM_LEVELS, default="wr",
          help="window sampling: wr (with replacement) or poisson (default wr)")
        a("--relation", choices=st.RELATIONS, default="event", help="w-event or w-user")
        a("--w", type=int, default=1, metavar="W", help="relation size w (default 1)")
        a("--bound", choices=st.BOUNDS, default="tight",
          help="tight (default), upper, or lower (optimistic, NOT a guarantee)")
        a("--context-noise", type=float, default=0.0, metavar="SC",
          help="context augmentation multiplier sigma_C (std sigma_C*v), default 0")
        a("--forecast-noise", type=float, default=0.0, metavar="SF",
          help="forecast augmentation multiplier sigma_F (std sigma_F*v), default 0")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "StructuredScheme":
        return cls(num_series=args.num_series, series_length=args.series_length,
                   context_length=args.context_length, forecast_length=args.forecast_length,
                   batch_size=args.batch_size, instances_per_series=args.instances_per_series,
                   top_level=args.top_level, bottom_level=args.bottom_level,
                   relation=args.relation, w=args.w, bound=args.bound,
                   context_noise=args.context_noise, forecast_noise=args.forecast_noise)

    def describe(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        s = self.setting()
        out.update(theorem=self.theorem, unit=self.unit, rho=s.rho(),
                   windows_per_element=s.windows(), hit_probability=s.r(),
                   steps_per_epoch=self.steps_per_epoch(), padding=self.padding())
        return out

    def padding(self) -> dict[str, Any]:
        """What the :math:`L_C` prepended zeros do to the windows and to the guarantee
        (:func:`~opacus_structured.accounting.structured.padding_summary`): padding is public
        and never weakens the bound; when the window covers every start of the shortest series
        (``every_start_covers_element``) ε is priced with ``k = T`` and, for the ``"wr"``
        bottom level, ``r = 1`` (no amplification from window sampling)."""
        return st.padding_summary(self.setting())

    def notes(self) -> list[str]:
        """Sentences the CLI prints beside an ε (the short-series regime of :meth:`padding`)."""
        note = self.padding()["note"]
        return [] if note is None else [note]

