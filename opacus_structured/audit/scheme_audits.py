"""How each scheme is audited: its default flags, the scheme priced, one run's sampler, the
canary's participation law and, for matrix mechanisms, the strategy; the registry of audited
schemes (split from :mod:`~opacus_structured.audit.pipelines`, which re-exports every name)."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np
import torch

from .._validation import check_int, check_open_unit, check_positive, check_probability
from ..accountants.base import SchemeAccountant
from ..accounting.monte_carlo import MonteCarloSettings
from ..accounting.strategies import strategy_coefficients
from ..schemes.balls_in_bins import BallsInBinsScheme
from ..schemes.bandmf_cyclic_poisson import BandMFCyclicPoissonScheme
from ..schemes.bminsep_mc import BMinSepMonteCarloScheme
from ..schemes.gdp import GDPScheme
from ..schemes.poisson import PoissonScheme
from ..schemes.structured import StructuredScheme
from ..schemes.truncated_poisson import TruncatedPoissonScheme
from .canaries import EventCanary
from .runs import (
    FORECASTER_PATHS,
    MAX_PATTERNS,
    MUTATIONS,
    SCHEME_PATHS,
    _Chunk,
    _clipping,
    _Plan,
)
from .scoring import bernoulli_patterns

# ---- per-scheme audit specs -------------------------------------------------------------------
#: Memo of reported ε (see :meth:`_SchemeAudit.reported`).
_REPORTED: dict = {}

class _SchemeAudit:
    """How to audit one scheme: its default flags, the scheme priced, the sampler of one run,
    the canary's participation law and (for matrix mechanisms) the strategy."""

    name = ""
    summary = ""
    defaults: dict = {}
    #: The other examples' gradient in the canary's coordinate (units of C); None: they use a
    #: coordinate of their own.
    others: Optional[float] = None
    #: "Without" runs remove the canary (their sampler draws from n - 1 examples) instead of
    #: zeroing it (the same mechanism for samplers drawing every example independently).
    removal = False
    #: Substitution relation: "without" runs hold ``others`` in the canary's rows.
    substitution = False
    #: Paths this scheme's pipeline supports.
    paths = SCHEME_PATHS
    #: Mutation -> flags (over the defaults) at which that mutation is audited, where the
    #: defaults cannot show it.
    mutation_flags: dict = {}
    #: Path -> flags (over the defaults) that path needs (the tools' sweeps use them).
    path_flags: dict = {}

    def others_value(self, plan: _Plan) -> Optional[float]:
        """:attr:`others` of this audit (a design flag may change it)."""
        return self.others

    def row(self, plan: _Plan, item) -> int:
        """The dataset row (within its run) of an item the sampler draws."""
        return int(item)

    def examples(self, f: dict) -> int:
        """Dataset rows per run."""
        return f["examples"]

    # -- the accountant, fed by the training loop -------------------------------------------
    def new_accountant(self, chunk: "_Chunk"):
        """A fresh accountant of the priced scheme (its registered class)."""
        return SchemeAccountant(chunk.plan.scheme)

    def record(self, chunk: "_Chunk") -> None:
        """After each optimizer step: the accountant is told the *claimed* σ and the scheme's
        rate (a mutation does not tell it)."""
        rate = chunk.plan.scheme.expected_sample_rate()
        chunk.accountant.step(noise_multiplier=chunk.plan.noise_multiplier,
                              sample_rate=rate if rate is not None else 1.0)

    def reported(self, chunk: "_Chunk") -> float:
        """The ε the pipeline's accountant reports at the plan's δ (memoised on the scheme, the
        accountant's recorded history, its Monte Carlo settings (seed included) and δ: the same
        record prices the same)."""
        acc = chunk.accountant
        key = (type(acc), acc.scheme, tuple(acc.history), acc.discretization,
               getattr(acc, "settings", None), chunk.plan.delta)
        if key not in _REPORTED:
            _REPORTED[key] = float(acc.get_epsilon(chunk.plan.delta))
        return _REPORTED[key]

    def attach(self, chunk: "_Chunk") -> None:
        """After the optimizer is built (hook for per-example machinery)."""

    def before_backward(self, chunk: "_Chunk") -> None:
        """Before each backward."""

    def before_step(self, chunk: "_Chunk") -> None:
        """Between backward and the optimizer step."""

    def canary_rows(self, plan: _Plan) -> list[int]:
        """Rows (within a run) that carry the canary."""
        return [0]

    def scheme(self, f: dict):
        raise NotImplementedError

    def doubled(self, scheme, f: dict):
        """The scheme the samplers draw under ``mutation="rate-doubled"``."""
        raise NotImplementedError

    def sampler(self, plan: _Plan, generator: torch.Generator, *, removed: bool = False):
        return plan.drawn.sampler(plan.examples, generator=generator)

    def patterns(self, plan: _Plan, sampler) -> tuple[tuple, np.ndarray, np.ndarray]:
        """``(key, patterns, log_probs)`` of the canary (row 0) of a run drawn by ``sampler``;
        runs with equal ``key`` share the law."""
        raise NotImplementedError

    def patterns_without(self, plan: _Plan):
        """``(patterns, log_probs)`` of the canary coordinate without the canary (``None``:
        always 0)."""
        return None

    def coefficients(self, scheme, f: dict) -> Optional[list]:
        return None

    def wrong_band(self, scheme, f: dict) -> list:
        raise ValueError(f"mutation 'wrong-band' applies to matrix-mechanism schemes; scheme "
                         f"{self.name!r} adds independent noise")


class _PoissonAudit(_SchemeAudit):
    """Poisson sampling (add/remove; a zeroed canary = a removed one, the sampler drawing every
    example independently). Also the ``lightning`` path: Poisson sampling of ``R`` runs of
    ``n`` examples each *is* Poisson sampling of their ``R·n`` examples, so ``DPCallback``
    installs the scheme's sampler over the union itself."""

    name = "poisson"
    paths = SCHEME_PATHS
    summary = "Poisson sampling, DP-SGD (add/remove; a zero canary = removed)"
    defaults = dict(sample_rate=0.5, noise_multiplier=0.7, steps=3, delta=0.05, examples=4)

    def scheme(self, f):
        return PoissonScheme(sample_rate=f["sample_rate"])

    def doubled(self, scheme, f):
        return dataclasses.replace(scheme, sample_rate=min(1.0, 2 * scheme.sample_rate))

    def sampler(self, plan, generator, *, removed=False):
        return plan.drawn.sampler(plan.examples, generator=generator, steps=plan.steps)

    def patterns(self, plan, sampler):
        return (), *bernoulli_patterns(plan.steps, range(plan.steps), plan.scheme.sample_rate)


class _TruncatedPoissonAudit(_SchemeAudit):
    r"""Truncated Poisson, add/remove (Theorem 3.1 of Ganesh 2025), two canary designs
    (flag ``design``).

    ``"displace"`` (default): the worst case of its :math:`r = 2` branch is an included canary
    **displacing** another example whose gradient points the other way: the other examples here
    have gradient :math:`-C e_k` in the canary's coordinate, and the rate is high enough that at
    least ``B`` others are drawn almost always, so every batch sums to :math:`-B` without the
    canary and to :math:`-B + 2` when the canary is kept (probability ``q``, the scheme's
    conditional sampling probability): the pair :math:`(1-q)N(0) + qN(2)` vs :math:`N(0)` the
    accountant prices.

    ``"add"``: the other examples use a coordinate of their own, so the canary's coordinate
    releases :math:`1[\text{canary kept}]` (probability :math:`\pi` =
    ``scheme.inclusion_probability``, independently at every step): where truncation is rare
    (``B`` near ``n``) this is the :math:`r = 1` branch :math:`(1-p)N(0) + pN(1)` vs
    :math:`N(0)` that dominates the price. This is the design that sees a **doubled rate**: in
    the displacement regime (:math:`pn \gg B`) a kept canary has probability
    :math:`q \approx B/n` whatever the rate, so doubling ``p`` changes the release by almost
    nothing (the truncation caps it); with ``B`` near ``n`` it nearly doubles :math:`\pi`.

    "Without" runs draw from the ``n - 1`` other examples (removal)."""

    name = "truncated-poisson"
    summary = ("Poisson sampling truncated to B examples (add/remove; design=displace: the "
               "canary displaces an opposite example; design=add: it is only added)")
    defaults = dict(sample_rate=0.9, max_batch_size=3, noise_multiplier=1.4, steps=2,
                    delta=0.05, examples=6, design="displace")
    #: Settings where a doubled rate changes the release (``design="add"``, truncation rare
    #: unbroken, 38 % of the doubled sampler's batches truncated): the rate-doubled mutation's.
    RATE_DOUBLED = dict(design="add", sample_rate=0.4, max_batch_size=8, examples=10,
                        noise_multiplier=0.8, steps=3)
    DESIGNS = ("displace", "add")
    mutation_flags = {"rate-doubled": RATE_DOUBLED}
    others = -1.0
    removal = True

    def others_value(self, plan):
        return self.others if self._design(plan.flags) == "displace" else None

    def _design(self, f) -> str:
        design = f.get("design", "displace")
        if design not in self.DESIGNS:
            raise ValueError(f"design must be one of {list(self.DESIGNS)}, got {design!r}")
        return design

    def scheme(self, f):
        self._design(f)
        return TruncatedPoissonScheme(dataset_size=f["examples"], sample_rate=f["sample_rate"],
                                      max_batch_size=f["max_batch_size"])

    def doubled(self, scheme, f):
        return dataclasses.replace(scheme, sample_rate=min(1.0, 2 * scheme.sample_rate),
                                   epoch_steps=scheme.steps_per_epoch())

    def sampler(self, plan, generator, *, removed=False):
        scheme = plan.drawn
        if removed:
            scheme = dataclasses.replace(scheme, dataset_size=scheme.dataset_size - 1,
                                         epoch_steps=scheme.steps_per_epoch())
        return scheme.sampler(scheme.dataset_size, generator=generator, pad=False)

    def patterns(self, plan, sampler):
        if self._design(plan.flags) == "add":
            return (), *bernoulli_patterns(plan.steps, range(plan.steps),
                                           plan.scheme.inclusion_probability)
        B = plan.scheme.max_batch_size
        rows, lps = bernoulli_patterns(plan.steps, range(plan.steps),
                                       plan.scheme.conditional_sampling_probability)
        return (), 2.0 * rows - B, lps

    def patterns_without(self, plan):
        if self._design(plan.flags) == "add":
            return None
        return np.full((1, plan.steps), -float(plan.scheme.max_batch_size)), np.zeros(1)


class _BallsInBinsAudit(_SchemeAudit):
    name = "balls-in-bins"
    summary = "balls-in-bins (each example in one uniform bin, bins reused every epoch)"
    defaults = dict(num_bins=2, epochs=1, noise_multiplier=0.8, delta=0.05, examples=4)

    def scheme(self, f):
        return BallsInBinsScheme(num_bins=f["num_bins"], epochs=f["epochs"])

    def doubled(self, scheme, f):
        if scheme.num_bins % 2:
            raise ValueError(f"num_bins: 'rate-doubled' halves the bins, needs an even "
                             f"num_bins, got {scheme.num_bins}")
        return dataclasses.replace(scheme, num_bins=scheme.num_bins // 2,
                                   epochs=2 * scheme.epochs)

    def patterns(self, plan, sampler):
        k, T = plan.scheme.num_bins, plan.steps
        rows = np.zeros((k, T))
        for b in range(k):
            rows[b, b::k] = 1.0
        return (), rows, np.full(k, -math.log(k))


class _BandMFAudit(_SchemeAudit):
    name = "bandmf-cyclic-poisson"
    summary = "BandMF correlated noise with cyclic Poisson sampling (b-banded strategy)"
    defaults = dict(bands=2, batch_size=2.0, noise_multiplier=1.3, steps=12, delta=0.05,
                    examples=8)

    def scheme(self, f):
        return BandMFCyclicPoissonScheme(dataset_size=f["examples"], batch_size=f["batch_size"],
                                         bands=f["bands"])

    def doubled(self, scheme, f):
        return dataclasses.replace(scheme, batch_size=2 * scheme.batch_size)

    def coefficients(self, scheme, f):
        """The scheme's strategy over the run (``scheme.noise_correlation(steps)``)."""
        return [float(v) for v in scheme.noise_correlation(f["steps"])]

    def wrong_band(self, scheme, f):
        # banded over the whole run: the canary's participations (bands steps apart) overlap
        return [float(v) for v in strategy_coefficients(scheme.strategy, f["steps"],
                                                         f["steps"])]

    def sampler(self, plan, generator, *, removed=False):
        return plan.drawn.sampler(plan.examples, generator=generator, steps=plan.steps)

    def patterns(self, plan, sampler):
        b = plan.scheme.bands
        group = int(sampler.groups[0])
        eligible = [t for t in range(plan.steps) if t % b == group]
        return (group,), *bernoulli_patterns(plan.steps, eligible, plan.scheme.sample_rate)


def min_sep_patterns(steps: int, min_sep: int, rate: float) -> tuple[np.ndarray, np.ndarray]:
    r"""Every participation pattern of one example under cold-start b-min-sep sampling
    (Algorithm 1 of Dong & Ganesh): at each step an *available* example joins with probability
    ``p`` and is then barred for the next ``b - 1`` steps, so
    :math:`P(S) = p^{|S|}(1-p)^{\#\text{available steps not taken}}`."""
    b, p = check_int("min_sep", min_sep, minimum=1), check_probability("rate", rate)
    rows, lps = [], []

    def walk(t: int, row: list, lp: float):
        if t >= steps:
            rows.append(row), lps.append(lp)
            return
        if p < 1:  # available, not taken
            walk(t + 1, row + [0.0], lp + math.log1p(-p))
        if p > 0:  # taken: barred for b - 1 steps
            barred = min(b - 1, steps - t - 1)
            walk(t + 1 + barred, row + [1.0] + [0.0] * barred, lp + math.log(p))

    walk(0, [], 0.0)
    if len(rows) > MAX_PATTERNS:
        raise ValueError(f"steps: {len(rows)} participation patterns (max {MAX_PATTERNS}); "
                         f"audit fewer steps")
    return np.array(rows), np.array(lps)


class _BMinSepAudit(_BandMFAudit):
    """BandMF with cold-start b-min-sep sampling (Dong & Ganesh), priced by its Monte Carlo
    accountant (an estimate that holds with probability 1 - q, not a bound; Algorithm 5
    certifies it). The canary's participations are at least ``min_sep`` steps apart, so with a
    strategy of at most ``min_sep`` bands they never overlap through ``C``."""

    name = "bminsep-mc"
    summary = "BandMF with b-min-sep sampling (Monte Carlo accountant: an estimate)"
    defaults = dict(bands=2, batch_size=8 / 3, noise_multiplier=1.3, steps=12, delta=0.05,
                    examples=8, mc_samples=100_000)

    def scheme(self, f):
        # horizon: the strategy the optimizer streams is optimised for the audited run
        return BMinSepMonteCarloScheme(bands=f["bands"], dataset_size=f["examples"],
                                       batch_size=f["batch_size"], min_sep=f["bands"],
                                       horizon=f["steps"])

    def new_accountant(self, chunk):
        seed = None if chunk.plan.seed is None else int(chunk.plan.seed)
        return SchemeAccountant(chunk.plan.scheme, settings=MonteCarloSettings(
            samples=check_int("mc_samples", chunk.plan.flags["mc_samples"], minimum=1000),
            seed=seed))

    def patterns(self, plan, sampler):
        scheme = plan.scheme
        return (), *min_sep_patterns(plan.steps, scheme.min_sep, scheme.sampling_prob)


class _StructuredAudit(_SchemeAudit):
    r"""Structured window subsampling (Schuchardt et al., ICML 2025), 1-event relation, WR
    bottom level, one window per drawn series. The canary is an **event**: one time step
    ``time`` of series 0 (:class:`~opacus_structured.audit.canaries.EventCanary`). Every window
    of every series has gradient :math:`-C e_k`; with the event, the
    :math:`k = L_C + L_F` windows covering it have :math:`+mC e_k` instead (clipped to
    :math:`+C e_k`: the substitution changes each of them by :math:`2C`). With ``batch_size``
    = 1 window per step, every step releases :math:`-1` without the event and :math:`+1` when a
    covering window was drawn (probability :math:`\rho r` for WOR, :math:`r = k/T` at the
    canary series' step of the epoch for the deterministic top level): exactly the pair
    :math:`(1-q)N(0) + qN(2)` vs :math:`N(0)` of Theorems 4.4 / 4.2 — the tight results."""

    name = "structured"
    summary = ("structured time-series windows, 1-event relation (the canary is one time step "
               "of one series), WOR or deterministic top level")
    defaults = dict(top_level="wor", num_series=2, series_length=3, context_length=2,
                    forecast_length=1, noise_multiplier=1.4, steps=3, delta=0.05)
    others = -1.0
    substitution = True
    #: Every path, and the forecasting trainer end to end (deterministic top level).
    paths = SCHEME_PATHS + FORECASTER_PATHS
    #: The trainer's paths audit the deterministic top level (2 series per run, one window per
    #: step: the canary series is drawn at the first step of every 2-step epoch; r = 2 of 4
    #: windows cover the event; 3 epochs).
    path_flags = {p: dict(top_level="deterministic", series_length=4, context_length=1, steps=6)
                  for p in FORECASTER_PATHS}

    def scheme(self, f):
        return StructuredScheme(num_series=f["num_series"], series_length=f["series_length"],
                                context_length=f["context_length"],
                                forecast_length=f["forecast_length"], batch_size=1,
                                top_level=f["top_level"], bottom_level="wr", relation="event",
                                w=1)

    def doubled(self, scheme, f):
        raise ValueError("mutation 'rate-doubled' is audited on the poisson scheme; the "
                         "structured sampler's rate is fixed by its geometry")

    def sampler(self, plan, generator, *, removed=False):
        return plan.drawn.sampler(generator=generator)

    @staticmethod
    def _starts(scheme) -> int:
        return scheme.series_length - scheme.forecast_length + 1

    def examples(self, f):
        return f["num_series"] * (f["series_length"] - f["forecast_length"] + 1)

    def row(self, plan, item) -> int:  # (series, start) -> series * T + start
        series, start = item
        return int(series) * self._starts(plan.scheme) + int(start)

    def event(self, plan):
        """The event: time ``L_F - 1`` of series 0, so that all ``min(L_C + L_F, T)`` windows
        that can cover an event cover it."""
        return EventCanary(series=0, time=plan.scheme.forecast_length - 1)

    def canary_rows(self, plan):
        # the window at (padded) start s reads x[s - L_C .. s + L_F - 1]
        scheme = plan.scheme
        return self.event(plan).covering_windows(
            [s - scheme.context_length for s in range(self._starts(scheme))],
            scheme.context_length + scheme.forecast_length)

    def patterns(self, plan, sampler):
        scheme = plan.scheme
        r = len(self.canary_rows(plan)) / self._starts(scheme)
        if scheme.top_level == "wor":  # one of num_series series per step, uniformly
            eligible, rate = range(plan.steps), r / scheme.num_series
        else:  # series 0 is in block 0: the first step of every epoch
            per_epoch = scheme.steps_per_epoch()
            eligible, rate = [t for t in range(plan.steps) if t % per_epoch == 0], r
        rows, lps = bernoulli_patterns(plan.steps, eligible, rate)
        return (), 2.0 * rows - 1.0, lps

    def patterns_without(self, plan):
        return np.full((1, plan.steps), -1.0), np.zeros(1)


class _GDPFilterAudit(_SchemeAudit):
    r"""Full-batch DP-GD with the individual GDP filter (Koskela, Tobaben & Honkela 2023,
    :class:`lightning_callbacks.gdp_filter.IndividualGDPFilter`, driven as in a plain Opacus
    loop). The canary's gradient has norm ``C``, so it spends :math:`\mu_t = 1/\sigma` per step
    and the filter keeps it for the first :math:`k = \lfloor B^2\sigma^2 \rfloor` steps only;
    the other examples (norms < C) stay active. The released canary coordinate is
    :math:`N(1, \sigma^2)` for ``k`` steps then :math:`N(0, \sigma^2)`: :math:`\sqrt{k}/\sigma`-GDP,
    equal to the budget ``B`` the filter certifies when :math:`B^2\sigma^2` is an integer
    (the defaults: σ = √2/1.5, B = 1.5, k = 2 of 4 steps). The reported ε is the filter's
    (:meth:`~lightning_callbacks.gdp_filter.IndividualGDPFilter.epsilon`). Paths: hooks
    (inactive ``grad_sample`` rows zeroed before the optimizer clips), ghost (the mask
    enters the clipping coefficients inside Opacus' backward), book-keeping (the mask enters
    the book-keeping coefficients), each under DDP too (the filter decides on the
    all-gathered global batch, every rank masks its shard), and lightning (the filter as a
    callback beside ``DPCallback``)."""

    name = "gdp-filter"
    summary = "full-batch DP-GD with the individual GDP filter (per-example budget B)"
    defaults = dict(budget=1.5, noise_multiplier=math.sqrt(2) / 1.5, steps=4, delta=0.05,
                    examples=4)
    paths = ("hooks", "ghost", "bookkeeping", "ddp", "ddp-ghost", "ddp-bookkeeping",
             "lightning")

    def scheme(self, f):
        check_positive("budget", f["budget"])
        return GDPScheme()

    def doubled(self, scheme, f):
        raise ValueError("mutation 'rate-doubled' needs a subsampled scheme; full-batch DP-GD "
                         "already uses every example")

    def new_accountant(self, chunk):
        from lightning_callbacks.gdp_filter import IndividualGDPFilter  # optional: lightning

        return IndividualGDPFilter(chunk.present.size * chunk.plan.examples,
                                   chunk.plan.flags["budget"])

    def record(self, chunk):
        """The filter recorded the step itself (its μ use the optimizer's σ)."""

    def reported(self, chunk):
        return float(chunk.accountant.epsilon(chunk.plan.delta))

    def attach(self, chunk):
        if _clipping(chunk.plan.path) == "ghost":
            chunk.accountant.attach_ghost(chunk.module, chunk.optimizer)
        elif _clipping(chunk.plan.path) == "hooks":
            # folded into Opacus' clipping factors (the path DPCallback takes in hooks mode)
            if not chunk.accountant.attach(chunk.optimizer):
                raise ValueError(f"{type(chunk.optimizer).__name__} does not clip as Opacus' "
                                 f"DPOptimizer: the filter cannot be folded into its factors")

    def before_backward(self, chunk):
        if _clipping(chunk.plan.path) in ("ghost", "hooks"):
            chunk.accountant.set_batch_indices(chunk.local_batch())

    def before_step(self, chunk):
        if _clipping(chunk.plan.path) in ("ghost", "hooks"):
            return  # the filter decides inside the ghost backward / the optimizer's clipping
        from lightning_callbacks.gdp_filter import step_norms  # optional: lightning

        # book-keeping: mask the coefficients
        norms, bookkeeper = step_norms(chunk.optimizer)
        params = [] if bookkeeper is not None else [
            p for p in chunk.module.parameters() if p.requires_grad]
        active = chunk.accountant.mask_and_record(
            params, torch.as_tensor(chunk.local_batch(), dtype=torch.int64), norms,
            chunk.optimizer.noise_multiplier, chunk.optimizer.max_grad_norm)
        if bookkeeper is not None:
            bookkeeper.set_mask(active.to(norms.dtype))

    def patterns(self, plan, sampler):
        mu2 = (1.0 / plan.noise_multiplier) ** 2
        k = min(plan.steps, int(math.floor(plan.flags["budget"] ** 2 / mu2 * (1 + 1e-9))))
        row = np.zeros((1, plan.steps))
        row[0, :k] = 1.0
        return (), row, np.zeros(1)


_SPECS: dict[str, _SchemeAudit] = {s.name: s for s in (
    _PoissonAudit(), _TruncatedPoissonAudit(), _BallsInBinsAudit(), _BandMFAudit(),
    _StructuredAudit(), _GDPFilterAudit(), _BMinSepAudit())}


def audit_registry() -> dict[str, dict]:
    """Scheme name -> ``{"summary", "paths", "mutations", "defaults", "mutation_flags",
    "path_flags"}`` of every auditable scheme (what ``opacus-structured audit <scheme>``
    accepts; ``mutation_flags[m]``: the flags, over the defaults, at which mutation ``m``
    changes the release, where the defaults cannot show it; ``path_flags[p]``: the flags, over
    the defaults, that path ``p`` needs)."""
    out = {}
    for name, spec in _SPECS.items():
        mutations = [m for m in MUTATIONS
                     if m != "wrong-band" or type(spec).wrong_band is not _SchemeAudit.wrong_band]
        out[name] = {"summary": spec.summary, "paths": list(spec.paths),
                     "mutations": mutations, "defaults": dict(spec.defaults),
                     "mutation_flags": {m: dict(v) for m, v in spec.mutation_flags.items()},
                     "path_flags": {p: dict(v) for p, v in spec.path_flags.items()}}
    return out


#: Auditable scheme names.
AUDIT_SCHEMES = tuple(_SPECS)


def audited_scheme(scheme_name: str, flags: dict):
    """The scheme object whose accountant prices an audit of ``scheme_name`` run with
    ``flags`` (an audit's ``AuditScores.meta["flags"]``): what the predicted trade-off curve of
    :mod:`~opacus_structured.audit.report` is drawn from."""
    spec = _SPECS.get(scheme_name)
    if spec is None:
        raise ValueError(f"scheme must be one of {list(AUDIT_SCHEMES)}, got {scheme_name!r}")
    return spec.scheme(flags)


def _flags(spec: _SchemeAudit, scheme_flags: dict) -> dict:
    unknown = sorted(set(scheme_flags) - set(spec.defaults))
    if unknown:
        raise ValueError(f"scheme {spec.name!r} takes no flag {unknown[0]!r}; its flags are "
                         f"{sorted(spec.defaults)}")
    f = {**spec.defaults, **scheme_flags}
    for key in ("steps", "examples", "num_bins", "epochs", "bands", "max_batch_size",
                "num_series", "series_length", "context_length", "forecast_length"):
        if key in f:
            f[key] = check_int(key, f[key], minimum=0 if key == "context_length" else 1)
    f["noise_multiplier"] = check_positive("noise_multiplier", f["noise_multiplier"])
    f["delta"] = check_open_unit("delta", f["delta"])
    if "num_bins" in f:
        f["steps"] = f["num_bins"] * f["epochs"]
    return f


