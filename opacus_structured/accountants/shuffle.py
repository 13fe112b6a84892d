"""Opacus accountant for shuffled fixed-size batches (``"shuffle"``), the :class:`ShuffleScheme`.

What ``make_private(..., poisson_sampling=False)`` with ``DataLoader(shuffle=True)`` trains:
no subsampling amplification, so E epochs are μ-GDP with μ = Δ√(Σ_e σ_e⁻²) (Δ = 1 zero-out,
2 replace-one; each epoch at the smallest σ used in it), and ε(δ) is its exact closed form
(:mod:`opacus_structured.accounting.shuffle`).

**Epochs are counted, not assumed.** A loop that leaves an epoch early and iterates the loader
again starts a new permutation, in which an example can be drawn again. The accountant therefore
prices, as one full epoch each, every permutation its steps drew from: at every hooked step it
reads the sampler's ``permutations_drawn`` (our :class:`~opacus_structured.samplers.shuffle.
ShuffleBatchSampler`, or the counter it installs in a stock ``BatchSampler`` over a
``RandomSampler`` / ``SequentialSampler``), and a new count opens a new epoch. Steps recorded
without a sampler (``step()`` by hand, Opacus' ``get_noise_multiplier``) open a new epoch every
``K`` steps (``K`` = steps per epoch). The epoch starts are part of :meth:`state_dict`.

``PrivacyEngine(accountant="shuffle")`` builds it by name with the template
``ShuffleScheme()`` (no dataset size): attached to a DataLoader (inside Opacus' stock
``make_private(..., poisson_sampling=False)``) it binds the concrete scheme the loader draws
(n, B, ``drop_last``); offline it takes ``K = 1/sample_rate`` from the history. A lower-bound
scheme (``bound="lower"``) is refused: an accountant reports guarantees.
"""

from __future__ import annotations

import math
from typing import Optional

from .._validation import check_nonnegative, check_open_unit, check_positive
from ..accounting import pld as pld_lib
from ..accounting.gaussian import gdp_delta, gdp_epsilon
from ..accounting.shuffle import shuffle_mu
from ..samplers import verification
from ..schemes.shuffle import ShuffleScheme
from .base import SchemeAccountant

__all__ = ["ShuffleAccountant"]


class ShuffleAccountant(SchemeAccountant):
    """Shuffled fixed-size batches: E epochs of the Gaussian mechanism, μ = Δ√E/σ."""

    default_scheme = ShuffleScheme()
    mechanism_name = "shuffle"
    scheme_class = ShuffleScheme

    def __init__(self, scheme: Optional[ShuffleScheme] = None, *,
                 discretization: float = pld_lib.DEFAULT_DISCRETIZATION):
        super().__init__(scheme, discretization=discretization)
        if not self.scheme.bound.is_guarantee:
            raise ValueError(f"{self.scheme!r} is Chua et al.'s lower bound, not a guarantee; "
                             f"an accountant reports guarantees: use bound='upper' here and "
                             f"scheme.compare(...) or scheme.epsilon(...) to see the lower bound")
        self.epoch_starts: list[int] = []  # step indices at which a new permutation began
        self._permutations_seen: Optional[int] = None

    # ---- attachment -----------------------------------------------------------------------
    def attach(self, data_loader=None) -> None:
        """Bind a template to the scheme the loader draws, count its permutations, then check
        it as every scheme accountant does."""
        if data_loader is not None:
            batch_sampler = getattr(data_loader, "batch_sampler", None)
            verification.instrument_batch_sampler(batch_sampler)   # a stock BatchSampler: count its passes
            found = verification.scheme_of_batch_sampler(batch_sampler)
            if found is None and batch_sampler is not None:
                found = verification.stock_shuffle_scheme(batch_sampler)
            if self.scheme.is_template() and isinstance(found, ShuffleScheme) \
                    and not found.is_template():
                concrete = found.__class__(dataset_size=found.dataset_size,
                                           batch_size=found.batch_size,
                                           drop_last=found.drop_last,
                                           **self.scheme.template_options())
                for _, rate, n in self.history:
                    if n:
                        concrete.check_sample_rate(rate)
                self.scheme = concrete
                self._cache.clear()
        super().attach(data_loader)
        self._permutations_seen = None

    def check_draws(self) -> None:
        """The base checks, then: a step drawn from a permutation not seen before opens an
        epoch (the first hooked step after attaching always does)."""
        super().check_draws()
        source = self._draw_source() if self._draw_source is not None else None
        count = getattr(source, "permutations_drawn", None)
        if count is None:
            return
        if self._permutations_seen is None or count != self._permutations_seen:
            step = len(self)
            if not self.epoch_starts or self.epoch_starts[-1] != step:
                self.epoch_starts.append(step)
            self._permutations_seen = count

    # ---- recording ------------------------------------------------------------------------
    def step(self, *, noise_multiplier: float, sample_rate: float, num_steps: int = 1):
        """Record steps; the rate must give a whole number of steps per epoch (a template's
        epoch length is ``1/sample_rate``)."""
        self._require_bound("record a step")
        self.scheme.steps_per_epoch_at(check_positive("sample_rate", sample_rate))
        if check_nonnegative("noise_multiplier", noise_multiplier) == 0.0:
            # no noise (Opacus' non-private debugging runs): recorded, and ε is infinite
            self._note_no_noise()
            if self.history and tuple(self.history[-1][:2]) == (0.0, sample_rate):
                self.history[-1] = (0.0, sample_rate, self.history[-1][2] + num_steps)
            else:
                self.history.append((0.0, sample_rate, num_steps))
            return
        super().step(noise_multiplier=noise_multiplier, sample_rate=sample_rate,
                     num_steps=num_steps)

    def _check_run_length(self, steps: int) -> None:
        """No planned run: every epoch is priced on its own, however many there are."""

    # ---- pricing --------------------------------------------------------------------------
    def epoch_noise_multipliers(self) -> list[float]:
        """One entry per epoch priced: the smallest σ among its steps. A new epoch opens at a
        recorded permutation start, or when the current one has ``K`` steps already."""
        starts = sorted(set(self.epoch_starts))
        out: list[float] = []
        filled = None   # steps in the open epoch
        t = 0
        j = 0           # next start in ``starts``
        for sigma, rate, n in self.history:
            n = int(n)
            if not n:
                continue
            k = self.scheme.steps_per_epoch_at(rate)
            end = t + n
            while t < end:
                while j < len(starts) and starts[j] < t:
                    j += 1
                if (j < len(starts) and starts[j] == t) or filled is None or filled >= k:
                    out.append(float(sigma))
                    filled = 0
                else:
                    out[-1] = min(out[-1], float(sigma))
                later = [s for s in starts[j:j + 2] if s > t]   # the next start after t
                nxt = later[0] if later else math.inf
                segment = int(min(end, nxt) - t)
                take = min(segment, k - filled)
                filled += take
                rest = segment - take
                if rest:
                    full, part = divmod(rest, k)
                    out.extend([float(sigma)] * (full + (1 if part else 0)))
                    filled = part if part else k
                t += segment
        return out

    def mu(self) -> float:
        """μ = Δ√(Σ_e σ_e⁻²) of the epochs recorded."""
        sigmas = self.epoch_noise_multipliers()
        if any(s == 0.0 for s in sigmas):
            return math.inf  # an epoch without noise: no privacy
        return shuffle_mu(sigmas, self.scheme.relation) if sigmas else 0.0

    def phase_pld(self, discretization: float):
        """This run as one phase of a composed run: the Gaussian PLD of its μ."""
        return self._gaussian_phase_pld(self.mu(), discretization)

    def get_epsilon(self, delta: float, *, discretization: Optional[float] = None,
                    **kwargs) -> float:
        """Exact ε(δ) of μ-GDP (``discretization`` accepted and unused: no PLD), or of the
        composed phases (a PLD) after a resume under another scheme."""
        self._require_observed()
        delta, mu = check_open_unit("delta", delta), self.mu()
        if math.isinf(mu):
            return math.inf
        if self.phases:
            return self._phases_epsilon(delta, discretization)
        return gdp_epsilon(delta, mu)

    def get_delta(self, epsilon: float, *, discretization: Optional[float] = None) -> float:
        """Exact δ(ε) of μ-GDP."""
        self._require_observed()
        if math.isnan(epsilon):
            raise ValueError("epsilon must not be NaN")
        mu = self.mu()
        if math.isinf(mu):
            return 1.0
        if self.phases:
            return float(self._phases_delta(epsilon, discretization))
        return float(gdp_delta(float(epsilon), mu))

    # ---- state ----------------------------------------------------------------------------
    def state_dict(self, destination=None):
        destination = super().state_dict(destination)
        destination["epoch_starts"] = list(self.epoch_starts)
        return destination

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self.epoch_starts = [int(s) for s in state_dict.get("epoch_starts", [])]
        self._permutations_seen = None
