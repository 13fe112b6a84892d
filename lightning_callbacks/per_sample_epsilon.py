r"""``PerSampleEpsilonTracker``: per-example privacy state on the training device.

Keeps, in tensors indexed by dataset index (see
:class:`~opacus_structured.accountants.individual_gdp.IndividualGDPAccountant`):

* the individual GDP state, :math:`(\mu^{(i)})^2 = \sum_j (\mu_j^{(i)})^2` with
  :math:`\mu_j^{(i)} = \min(\lVert g_{ij}\rVert,C)/(\sigma C)` when :math:`i` is in the batch and
  the worst case :math:`1/\sigma` when it is not (Koskela et al. 2023, eq. (4.2), Thm 2). For
  full-batch DP-GD this is the paper's individual GDP value; with Poisson subsampling it
  ignores amplification (valid but loose);
* optionally, for Poisson-subsampled DP-SGD, the integer σ-grid histogram ``K[i, b]`` of the
  **APPROXIMATE** App. D individual PLD accountant
  (:class:`~opacus_structured.accounting.individual_gdp.ApproximateIndividualPLDAccountant`).
  Steps where :math:`i` was not sampled are charged the worst bucket (σ̃ = σ), because its norm
  is unknown there (digest pitfall 8). Its ε values are estimates, **not certified bounds**.

Updates happen in ``on_before_optimizer_step`` (per-sample gradients are populated; put this
callback *after* an :class:`~lightning_callbacks.gdp_filter.IndividualGDPFilter` so excluded
examples are seen with zero gradient) with ``index_add_`` / ``index_put_(accumulate=True)``: no
Python loop over examples and no host synchronisation per step. Export with :meth:`mu`,
:meth:`epsilons`, :meth:`histogram`, :meth:`to_csv`, :meth:`plot_histogram`; the state is saved in
Lightning checkpoints (``state_dict`` / ``load_state_dict``).

Reported individual ε values are data-dependent and are not themselves protected (digest §6).

Under DDP (``torch.distributed`` initialised, batches split by
:class:`~opacus_structured.samplers.distributed.DistributedBatchSampler`) each rank records only
the examples of its own shard, with no communication per step. A rank's local view charges the
worst case :math:`1/\sigma^2` for the steps in which an example was processed elsewhere, so it is
an upper bound; :meth:`PerSampleEpsilonTracker.gather` sums the rank states (exact: every example
of a step is in exactly one shard) and returns the full vector, identical on every rank.
"""

from __future__ import annotations

import csv
from typing import Callable, Optional, Sequence

import numpy as np
import torch

try:
    from lightning.pytorch import Callback
except ImportError:  # pragma: no cover
    from pytorch_lightning import Callback

from opacus_structured._validation import check_int
from opacus_structured.accountants.individual_gdp import IndividualGDPAccountant
from opacus_structured.accounting.individual_gdp import (
    ApproximateIndividualEpsilons,
    ApproximateIndividualPLDAccountant,
)
from opacus_structured.indexed_dataset import batch_indices

from .gdp_filter import _dp_settings, step_norms

__all__ = ["PerSampleEpsilonTracker"]


class PerSampleEpsilonTracker(Callback):
    """Per-example Σμ² (and optional APPROXIMATE App. D PLD histogram) tracker.

    Args:
        num_examples: dataset size N (10⁶ is fine: 16 bytes per example, plus
            ``4·num_sigmas`` bytes with the approximate PLD).
        approximate_pld: an :class:`ApproximateIndividualPLDAccountant` whose
            ``noise_multiplier`` and ``sample_rate`` match the run; enables the approximate
            per-example PLD state (labelled approximate everywhere).
        index_fn: ``batch -> LongTensor`` of dataset indices (default: last batch element).
    """

    def __init__(self, num_examples: int, *,
                 approximate_pld: Optional[ApproximateIndividualPLDAccountant] = None,
                 index_fn: Optional[Callable] = None):
        super().__init__()
        self.num_examples = check_int("num_examples", num_examples, minimum=1)
        self.accountant = IndividualGDPAccountant(self.num_examples)
        self.approximate_pld = approximate_pld
        self.index_fn = index_fn or batch_indices
        self.pld_counts = None
        if approximate_pld is not None:
            # buckets 1.. only; bucket 0 (the worst case) = steps - sum(others)
            self.pld_counts = torch.zeros(self.num_examples, approximate_pld.num_sigmas,
                                          dtype=torch.int32)
        self._indices: Optional[torch.Tensor] = None

    @property
    def steps(self) -> int:
        return self.accountant.recorded_steps

    # ---- hooks ---------------------------------------------------------------------------
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._indices = self.index_fn(batch)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self._indices is None:
            raise ValueError("no batch indices recorded for this step")
        sigma, clip = _dp_settings(optimizer)
        norms, _ = step_norms(optimizer)
        self.update(self._indices.to(norms.device), norms, sigma, clip)
        self._indices = None

    def update(self, indices: torch.Tensor, norms: torch.Tensor, noise_multiplier: float,
               max_grad_norm: float) -> None:
        """Record one optimizer step for the examples ``indices`` with per-sample ``norms``."""
        dev = norms.device
        if self.accountant.observed_mu_sq.device != dev:
            self.accountant.to(dev)
        self.accountant.record_norms(indices, norms, noise_multiplier, max_grad_norm)
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
        from opacus_structured.distributed import all_reduce_sum

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

    def epsilons(self, delta: float) -> np.ndarray:
        """numpy [N] of individual GDP ε(δ) (Cor. C.2)."""
        return self.accountant.individual_epsilons(delta)

    def histogram(self, delta: float, bins: int | Sequence[float] = 50):
        """``(counts, edges)`` of the individual GDP ε(δ) (numpy)."""
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
        """Write ``index, mu, epsilon_gdp`` for every example."""
        mu = self.mu().cpu().numpy()
        eps = self.epsilons(delta)
        with open(path, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["index", "mu", f"epsilon_gdp_delta_{delta:g}"])
            for i in range(self.num_examples):
                w.writerow([i, repr(float(mu[i])), repr(float(eps[i]))])

    def plot_histogram(self, path, delta: float, bins: int = 50, worst_case: bool = True):
        """Save a histogram of the individual GDP ε(δ) (matplotlib, Agg backend)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.hist(self.epsilons(delta), bins=bins)
        if worst_case:
            e = self.accountant.get_epsilon(delta)
            ax.axvline(e, color="k", ls="--", label=f"worst case ε = {e:.3g}")
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
        return state

    def load_state_dict(self, state_dict):
        self.accountant.load_state_dict(state_dict["accountant"])
        if self.pld_counts is not None:
            if "pld_counts" not in state_dict:
                raise ValueError("checkpoint has no approximate PLD counts")
            k = torch.as_tensor(state_dict["pld_counts"], dtype=torch.int32)
            if k.shape != self.pld_counts.shape:
                raise ValueError(f"pld_counts shape {tuple(k.shape)} != "
                                 f"{tuple(self.pld_counts.shape)}")
            self.pld_counts = k.clone()
