r"""``PerSampleEpsilonTracker``: per-example privacy state on the training device.

Keeps, in tensors indexed by dataset index (see
:class:`~opacus_structured.accountants.individual_gdp.IndividualGDPAccountant`):

* the individual GDP state, :math:`(\mu^{(i)})^2 = \sum_j (\mu_j^{(i)})^2` with
  :math:`\mu_j^{(i)} = \min(\lVert g_{ij}\rVert,C)/(\sigma C)` when :math:`i` is in the batch and
  the worst case :math:`1/\sigma` when it is not (Koskela et al. 2023, eq. (4.2), Thm 2). For
  full-batch DP-GD this is the paper's individual GDP value (:meth:`gdp_epsilons`);
* for a run whose scheme it knows (``GDPScheme``, or ``PoissonScheme(q)``: read from
  ``DPCallback`` / the train batch sampler, or passed as ``scheme=``), the **population** ε of
  the same steps (:meth:`population_epsilon`: the Poisson-subsampled Gaussian PLD composition,
  as ``DPCallback`` prices it), a guarantee for every example;
* optionally, for Poisson-subsampled DP-SGD, the integer σ-grid histogram ``K[i, b]`` of the
  **APPROXIMATE** App. D individual PLD accountant
  (:class:`~opacus_structured.accounting.individual_gdp.ApproximateIndividualPLDAccountant`).
  Steps where :math:`i` was not sampled are charged the worst bucket (σ̃ = σ), because its norm
  is unknown there (the App. D accountant needs every example's norm at every step). Its ε values
  are estimates, **not certified bounds**.

**Per-example ε** (:meth:`epsilons`) is the smaller of the individual GDP ε and the population
ε. Both bound example :math:`i`'s privacy loss, so the minimum does too.

*Why the individual GDP ε alone is far above the population ε under Poisson sampling* (e.g.
q = 1/8, σ = 1, 16 steps, δ = 1e-5: 24.38 for an example whose gradient norm is always ≥ C,
against a population ε of 4.02). The individual GDP value composes one μ per step by
Theorem 2, which is valid for fully adaptive, data-dependent μ; but no per-step μ can capture
subsampling amplification: one Poisson-subsampled Gaussian step with sensitivity C is μ-GDP only
for μ ≥ 1/σ. Its privacy curve has the same Gaussian tail as the unsampled step: the μ
matching its δ(ε) at q = 1/8, σ = 1 is 0.36 at ε = 1, 0.65 at ε = 4, 0.79 at ε = 8, and tends
to 1. Amplification appears only in the PLD of the whole composition. So the tracker charges an
unsampled step the worst case 1/σ and a sampled one min(‖g‖, C)/(σC). This is sound but
ignores amplification. The population PLD bound uses amplification, and it applies to every
example because each example's contribution is clipped to C at every step. Hence
``epsilons()`` reports min(24.38, 4.02) = 4.02 for such an example: exactly the population ε.

An amplified *individual* value below the population ε would need two things the tracker does
not have:

* each example's gradient norm at every step, including the steps where it was not sampled
  (an extra pass over the whole dataset per step; Koskela et al. 2023, App. D). The tracker
  sees only the batch, so an unsampled step must be charged the worst case, and with q = 1/8
  that is 7/8 of the steps;
* a composition theorem for PLDs chosen adaptively, since the norms depend on the released
  model. The paper leaves this open; its App. D accountant (``approximate_pld=``) is an
  estimate.

With a full batch every example is in every step, and the individual GDP value is the paper's
(and is never above the population value).

**Where the norms come from.** In hooks mode the tracker observes the optimizer's own
clipping (:mod:`opacus_structured.accountants.clip_factors`): the per-sample norms Opacus
computes anyway, after every mask, so the norms of examples that an
:class:`~lightning_callbacks.gdp_filter.IndividualGDPFilter` excluded in that step count as zero
whatever the callbacks' order in ``Trainer(callbacks=[...])``. A step touches only the
batch's rows (``index_add_`` / ``index_put_(accumulate=True)`` of :math:`\mu^2`, and of the
approximate-PLD state), on the training device: no pass over the per-sample gradients, no
Python loop over examples, no host synchronisation (the batch's indices are copied through
pinned memory); its cost does not grow with ``num_examples``. ε values are computed only when
asked (:meth:`epsilons`, logging). With book-keeping / ghost clipping or per-layer clipping the
norms are read in ``on_before_optimizer_step`` and recorded in ``on_train_batch_end``, after
every filter has decided (its ``last_active`` mask). The dataset indices of a batch
come from its batch sampler (:mod:`lightning_callbacks.batch_indices`), so the LightningModule
is unmodified. Export with :meth:`mu`, :meth:`epsilons`, :meth:`histogram`, :meth:`to_csv`,
:meth:`plot_histogram`. The state is saved in Lightning checkpoints
(``state_dict`` / ``load_state_dict``).

Reported individual ε values are data-dependent and are not themselves protected (Redberg & Wang,
*Privately Publishable Per-instance Privacy*, NeurIPS 2021).

Under DDP (``torch.distributed`` initialised, batches split by
:class:`~opacus_structured.samplers.distributed.DistributedBatchSampler`) each rank records only
the examples of its own shard, with no communication per step. A rank's local view charges the
worst case :math:`1/\sigma^2` for the steps in which an example was processed elsewhere, so it is
an upper bound; :meth:`PerSampleEpsilonTracker.gather` sums the rank states (exact: every example
of a step is in exactly one shard) and returns the full vector, identical on every rank.
"""

from __future__ import annotations

import csv
import math
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from opacus_structured._validation import check_int, check_open_unit, check_positive
from opacus_structured.accountants.base import SchemeAccountant
from opacus_structured.accountants.clip_factors import (
    add_norm_observer,
    install_clip_factors,
)
from opacus_structured.accountants.individual_gdp import IndividualGDPAccountant
from opacus_structured.accounting import pld as pld_lib
from opacus_structured.accounting.individual_gdp import (
    ApproximateIndividualEpsilons,
    ApproximateIndividualPLDAccountant,
)
from opacus_structured.distributed import all_reduce_sum
from opacus_structured.schemes.base import Scheme
from opacus_structured.schemes.gdp import GDPScheme
from opacus_structured.schemes.poisson import PoissonScheme

from .batch_indices import IndexSource, train_scheme
from .dp_callback import DPCallback
from .gdp_filter import (
    ClipAttachedCallback,
    IndividualGDPFilter,
    clip_step_inputs,
    dp_settings,
    step_inputs,
)

__all__ = ["PerSampleEpsilonTracker"]


class PerSampleEpsilonTracker(ClipAttachedCallback):
    """Per-example Σμ², per-example ε (with the population bound) and optional APPROXIMATE
    App. D PLD histogram.

    Args:
        num_examples: dataset size N (10⁶ is fine: 16 bytes per example, plus
            ``4·num_sigmas`` bytes with the approximate PLD).
        approximate_pld: an :class:`ApproximateIndividualPLDAccountant` whose
            ``noise_multiplier`` and ``sample_rate`` match the run; enables the approximate
            per-example PLD state (labelled approximate everywhere).
        index_fn: ``batch -> LongTensor`` of dataset indices read from the batch (e.g.
            :func:`~opacus_structured.indexed_dataset.batch_indices` for an
            ``IndexedDataset``). Default: the indices the train batch sampler recorded (the
            batch is not touched; see :mod:`lightning_callbacks.batch_indices`).
        scheme: the run's batching scheme. Default: read at fit start from ``DPCallback`` or
            the train batch sampler. With :class:`~opacus_structured.schemes.gdp.GDPScheme` or
            a :class:`~opacus_structured.schemes.poisson.PoissonScheme` with a rate, the tracker
            also prices the population (every-example) ε of the steps it saw, and
            :meth:`epsilons` reports the smaller of the two bounds; pass it when calling
            :meth:`update` by hand.
        discretization: PLD discretisation of that population accountant (pessimistic);
            default: ``DPCallback``'s when one is attached (so both report the same population
            ε), else the package default.
    """

    def __init__(self, num_examples: int, *,
                 approximate_pld: Optional[ApproximateIndividualPLDAccountant] = None,
                 index_fn: Optional[Callable] = None, scheme: Optional[Scheme] = None,
                 discretization: Optional[float] = None):
        super().__init__()
        self.num_examples = check_int("num_examples", num_examples, minimum=1)
        self.accountant = IndividualGDPAccountant(self.num_examples)
        if approximate_pld is not None and not isinstance(
                approximate_pld, ApproximateIndividualPLDAccountant):
            raise ValueError(f"approximate_pld must be an ApproximateIndividualPLDAccountant, "
                             f"got {type(approximate_pld).__name__}")
        self.approximate_pld = approximate_pld
        self._discretization_given = discretization is not None
        self.discretization = (pld_lib.DEFAULT_DISCRETIZATION if discretization is None
                               else check_positive("discretization", discretization))
        self._source = IndexSource("PerSampleEpsilonTracker", index_fn)
        self.index_fn = index_fn
        self.pld_counts = None
        if approximate_pld is not None:
            # buckets 1.. only; bucket 0 (the worst case) = steps - sum(others)
            self.pld_counts = torch.zeros(self.num_examples, approximate_pld.num_sigmas,
                                          dtype=torch.int32)
        self.scheme: Optional[Scheme] = None
        #: Accountant of the population ε (every example) of the steps recorded, or ``None``.
        self.population = None
        if scheme is not None:
            self._set_scheme(scheme)
        self._indices: Optional[torch.Tensor] = None
        self._pending: Optional[tuple] = None   # this step's (indices, norms, sigma, clip)
        self._filters: list = []                # the Trainer's IndividualGDPFilters

    @property
    def steps(self) -> int:
        return self.accountant.recorded_steps

    # ---- the run's scheme ----------------------------------------------------------------
    def _set_scheme(self, scheme: Scheme) -> None:
        if not isinstance(scheme, Scheme):
            raise ValueError(f"scheme must be a Scheme (e.g. PoissonScheme(sample_rate=q) or "
                             f"GDPScheme()), got {type(scheme).__name__}")
        if isinstance(scheme, PoissonScheme) and scheme.sample_rate is None:
            raise ValueError("scheme=PoissonScheme() needs its sample_rate to price the "
                             "population epsilon: pass PoissonScheme(sample_rate=q)")
        if self.scheme is not None:
            if scheme != self.scheme:
                raise ValueError(f"PerSampleEpsilonTracker prices {self.scheme!r} (given or "
                                 f"restored) but the run draws batches with {scheme!r}")
            return
        self.scheme = scheme
        if isinstance(scheme, (GDPScheme, PoissonScheme)):
            self.population = SchemeAccountant(scheme, discretization=self.discretization)
        rate = scheme.expected_sample_rate()
        acc = self.approximate_pld
        if acc is not None and rate is not None and not math.isclose(acc.sample_rate, rate):
            raise ValueError(f"approximate_pld has sample_rate={acc.sample_rate} but the run "
                             f"samples at {rate} ({scheme!r})")

    def _sample_rate(self) -> Optional[float]:
        return None if self.scheme is None else self.scheme.expected_sample_rate()

    # ---- hooks ---------------------------------------------------------------------------
    def on_fit_start(self, trainer, pl_module):
        self._source.on_fit_start(trainer)

    def on_train_start(self, trainer, pl_module):
        self._source.on_train_start(trainer)
        self._filters = [cb for cb in trainer.callbacks if isinstance(cb, IndividualGDPFilter)]
        scheme = train_scheme(trainer)
        dps = [cb for cb in trainer.callbacks if isinstance(cb, DPCallback)]
        if dps and not self._discretization_given:
            self.discretization = dps[0].discretization
            if self.population is not None:
                self.population.discretization = self.discretization
        if isinstance(scheme, PoissonScheme) and scheme.sample_rate is None:
            rate = dps[0].sample_rate if dps else None
            # the rate Opacus' hook reports (1/len(loader) >= q): pricing at it never
            # under-reports
            scheme = PoissonScheme(sample_rate=rate) if rate is not None else None
        if scheme is not None:
            self._set_scheme(scheme)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._indices = self._source.indices(trainer, batch)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self._indices is None:
            raise ValueError("no batch indices recorded for this step")
        if getattr(optimizer, "bookkeeper", None) is None and self.attach(optimizer):
            return  # hooks: recorded inside optimizer.step from Opacus' own norms (_observe)
        indices, norms, _, sigma, clip = step_inputs(self._indices, optimizer,
                                                     "PerSampleEpsilonTracker")
        # recorded at batch end, once every filter of the Trainer has decided (module doc)
        self._pending = (indices, norms.detach().clone(), sigma, clip)
        self._indices = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._record_pending()

    def attach(self, optimizer) -> bool:
        """Record from ``optimizer``'s own per-sample clipping norms (hooks mode).

        From then on every ``optimizer.step()`` records the batch whose dataset indices
        :meth:`set_batch_indices` gave (Lightning gives them itself) with the norms Opacus
        computes for clipping, after every mask (an
        :class:`~lightning_callbacks.gdp_filter.IndividualGDPFilter`'s inactive examples count
        0): :mod:`opacus_structured.accountants.clip_factors`. The step does ``O(batch)`` work
        on the training device: no pass over ``grad_sample``, no host synchronisation. Returns
        ``False`` (attaching nothing) for an optimizer that does not clip as Opacus'
        ``DPOptimizer`` (per-layer clipping; ghost / book-keeping: the norms are read in
        ``on_before_optimizer_step``)."""
        dp_settings(optimizer)
        if not install_clip_factors(optimizer):
            return False
        add_norm_observer(optimizer, self, self._observe)
        return True

    def set_batch_indices(self, indices) -> None:
        """Dataset indices of the next batch (plain Opacus loops after :meth:`attach`)."""
        self._indices = torch.as_tensor(indices)

    def _observe(self, optimizer, norms: torch.Tensor) -> None:
        indices, self._indices = self._indices, None
        indices, sigma, clip = clip_step_inputs(indices, optimizer, norms,
                                                "PerSampleEpsilonTracker")
        self.update(indices, norms, sigma, clip)

    def _record_pending(self) -> None:
        if self._pending is None:
            return
        indices, norms, sigma, clip = self._pending
        self._pending = None
        for filt in self._filters:
            active = filt.last_active
            if active is None or active.shape[0] != norms.shape[0]:
                raise ValueError("PerSampleEpsilonTracker: the IndividualGDPFilter of this "
                                 "Trainer took no decision on this step's batch")
            norms = norms * active.to(device=norms.device, dtype=norms.dtype)
        self.update(indices, norms, sigma, clip)

    def update(self, indices: torch.Tensor, norms: torch.Tensor, noise_multiplier: float,
               max_grad_norm: float) -> None:
        """Record one optimizer step for the examples ``indices`` with per-sample ``norms``
        (and one step of the population accountant, if the scheme is known)."""
        dev = norms.device
        if self.accountant.observed_mu_sq.device != dev:
            self.accountant.to(dev)
        self.accountant.record_norms(indices, norms, noise_multiplier, max_grad_norm)
        if self.population is not None:
            self.population.step(noise_multiplier=noise_multiplier,
                                 sample_rate=self._sample_rate())
        if self.pld_counts is not None:
            acc = self.approximate_pld
            if noise_multiplier != acc.noise_multiplier:
                raise ValueError(f"noise_multiplier {noise_multiplier} differs from the "
                                 f"approximate PLD accountant's {acc.noise_multiplier}")
            if self.pld_counts.device != dev:
                self.pld_counts = self.pld_counts.to(dev)
            ratio = norms.to(torch.float64).clamp(max=max_grad_norm) / max_grad_norm
            sig_eff = torch.where(ratio > 0, acc.noise_multiplier / ratio.clamp(min=1e-300),
                                  torch.full_like(ratio, float("inf")))
            step = (acc.sigma_max - acc.noise_multiplier) / (acc.num_sigmas - 1)
            b = torch.floor((sig_eff.clamp(max=acc.sigma_max) - acc.noise_multiplier) / step
                            * (1 + 1e-12)).clamp(0, acc.num_sigmas - 1).long()
            keep = b > 0  # bucket 0 is implicit
            self.pld_counts.index_put_(
                (indices, b), keep.to(torch.int32), accumulate=True)

    # ---- DDP -----------------------------------------------------------------------------
    def gather(self) -> torch.Tensor:
        """Tensor [N] of (μ^(i))² over **all** ranks' shards (a collective: call it on every
        rank). Without a process group this is :meth:`mu_squared`."""
        acc = self.accountant
        observed = all_reduce_sum(acc.observed_mu_sq)
        seen_worst = all_reduce_sum(acc.observed_worst_sq)
        return observed + (acc.worst_sq - seen_worst).clamp(min=0.0)

    # ---- export --------------------------------------------------------------------------
    def mu_squared(self) -> torch.Tensor:
        """Tensor [N] of individual (μ^(i))² (device tensor)."""
        return self.accountant.individual_mu_squared()

    def mu(self) -> torch.Tensor:
        """Tensor [N] of individual GDP μ^(i)."""
        return self.mu_squared().sqrt()

    def gdp_epsilons(self, delta: float) -> np.ndarray:
        """numpy [N] of the individual GDP ε(δ) (Cor. C.2 at μ^(i); no amplification)."""
        return self.accountant.individual_epsilons(delta)

    def population_epsilon(self, delta: float) -> Optional[float]:
        """ε(δ) of the steps recorded for *every* example, priced by the run's scheme
        (Poisson-subsampled Gaussian PLD, or the full-batch Gaussian); ``None`` when the
        scheme is not known to the tracker (see ``scheme``)."""
        if self.population is None:
            return None
        delta = check_open_unit("delta", delta)
        if len(self.population) == 0:
            return 0.0
        return float(self.population.get_epsilon(delta))

    def epsilons(self, delta: float) -> np.ndarray:
        """numpy [N] of per-example ε(δ): the smaller of the individual GDP ε
        (:meth:`gdp_epsilons`) and the population ε (:meth:`population_epsilon`), both upper
        bounds for the example (module doc). Under Poisson sampling an example whose gradient
        norm is always ≥ C gets exactly the population ε."""
        eps = self.gdp_epsilons(delta)
        pop = self.population_epsilon(delta)
        return eps if pop is None else np.minimum(eps, pop)

    def histogram(self, delta: float, bins: int | Sequence[float] = 50):
        """``(counts, edges)`` of the per-example ε(δ) (:meth:`epsilons`, numpy)."""
        return np.histogram(self.epsilons(delta), bins=bins)

    def approximate_pld_counts(self) -> torch.Tensor:
        """APPROXIMATE accountant's bucket counts ``K[N, num_sigmas]`` (int64, CPU)."""
        if self.pld_counts is None:
            raise ValueError("construct the tracker with approximate_pld=... to use this")
        k = self.pld_counts.to(torch.int64).cpu()
        k[:, 0] = self.steps - k[:, 1:].sum(dim=1)
        return k

    def approximate_epsilons(self, delta: float, indices=None,
                             **kwargs) -> ApproximateIndividualEpsilons:
        """APPROXIMATE individual PLD ε (App. D); NOT a certified bound. ``indices`` selects
        a subset (the FFT work is per example)."""
        k = self.approximate_pld_counts()
        if indices is not None:
            k = k[torch.as_tensor(indices, dtype=torch.int64)]
        return self.approximate_pld.approximate_epsilons(k.numpy(), delta, **kwargs)

    def to_csv(self, path, delta: float) -> None:
        """Write ``index, mu, epsilon, epsilon_gdp`` for every example (``epsilon`` is
        :meth:`epsilons`, ``epsilon_gdp`` the individual GDP value without amplification)."""
        mu = self.mu().cpu().numpy()
        gdp = self.gdp_epsilons(delta)
        pop = self.population_epsilon(delta)
        eps = gdp if pop is None else np.minimum(gdp, pop)
        with open(path, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["index", "mu", f"epsilon_delta_{delta:g}",
                        f"epsilon_gdp_delta_{delta:g}"])
            for i in range(self.num_examples):
                w.writerow([i, repr(float(mu[i])), repr(float(eps[i])), repr(float(gdp[i]))])

    def plot_histogram(self, path, delta: float, bins: int = 50, worst_case: bool = True):
        """Save a histogram of the per-example ε(δ) (matplotlib, Agg backend); the dashed line
        is the population ε (or, with no known scheme, the worst case √T/σ)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.hist(self.epsilons(delta), bins=bins)
        if worst_case:
            e = self.population_epsilon(delta)
            label = "population"
            if e is None:
                e, label = self.accountant.get_epsilon(delta), "worst case"
            ax.axvline(e, color="k", ls="--", label=f"{label} ε = {e:.3g}")
            ax.legend()
        ax.set_xlabel(f"individual ε (δ = {delta:g})")
        ax.set_ylabel("examples")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)

    # ---- checkpointing -------------------------------------------------------------------
    def state_dict(self):
        state = {"accountant": self.accountant.state_dict()}
        if self.pld_counts is not None:
            state["pld_counts"] = self.pld_counts.cpu().clone()
        if self.scheme is not None:
            state["scheme"] = self.scheme.to_dict()
        if self.population is not None:
            state["population"] = self.population.state_dict()
        return state

    def load_state_dict(self, state_dict):
        if "scheme" in state_dict:
            self._set_scheme(Scheme.from_dict(state_dict["scheme"]))
        self.accountant.load_state_dict(state_dict["accountant"])
        if self.population is not None:
            if "population" not in state_dict:
                raise ValueError("checkpoint has no population accountant state")
            self.population.load_state_dict(state_dict["population"])
        if self.pld_counts is not None:
            if "pld_counts" not in state_dict:
                raise ValueError("checkpoint has no approximate PLD counts")
            k = torch.as_tensor(state_dict["pld_counts"], dtype=torch.int32)
            if k.shape != self.pld_counts.shape:
                raise ValueError(f"pld_counts shape {tuple(k.shape)} != "
                                 f"{tuple(self.pld_counts.shape)}")
            self.pld_counts = k.clone()
