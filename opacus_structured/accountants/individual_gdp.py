r"""Opacus accountant with per-example (individual) GDP state: ``"individual-gdp"``.

Koskela, Tobaben & Honkela, "Individual Privacy Accounting with Gaussian Differential Privacy"
(arXiv:2209.15596, ICLR 2023). Per example :math:`i` it keeps, as torch tensors on the
training device and indexed by dataset index,

* ``observed_mu_sq[i]`` :math:`=\sum_{j \ni i} (\mu_j^{(i)})^2` over the steps whose batch
  contained :math:`i`, with :math:`\mu_j^{(i)} = \min(\lVert g_{ij}\rVert, C)/(\sigma_j C)`
  (eq. (4.2); the global L2 norm over all parameters of the gradient actually summed);
* ``observed_worst_sq[i]`` :math:`=\sum_{j \ni i} 1/\sigma_j^2`,

plus the scalar :math:`W = \sum_j 1/\sigma_j^2` over all recorded steps. The individual GDP
parameter is :math:`\mu^{(i)} = (\text{observed\_mu\_sq}[i] + W - \text{observed\_worst\_sq}[i])^{1/2}`:
steps in which :math:`i` was not in the batch are charged the worst case :math:`1/\sigma_j`
(no subsampling amplification; a subsampled Gaussian with sensitivity c is still c/σ-GDP). In
full-batch DP-GD every example is in every step and :math:`\mu^{(i)}` is exactly the paper's
individual GDP value (Theorem 2 / odometer, App. C.5); its ε comes from Cor. C.2.

:meth:`IndividualGDPAccountant.get_epsilon` returns the **dataset-level worst case**
:math:`\mu = (\sum_j 1/\sigma_j^2)^{1/2}` (a guarantee for any sampling); individual values
come from :meth:`~IndividualGDPAccountant.individual_epsilons`. Registered with Opacus'
registry at import, so ``PrivacyEngine(accountant="individual-gdp")`` works (per-example state
then needs :meth:`~IndividualGDPAccountant.allocate` and :meth:`~IndividualGDPAccountant.record`,
which the Lightning callbacks call).

**No subsampling amplification.** Every step is charged :math:`1/\sigma_j` whatever the
sampling, so under Poisson subsampling (Opacus' hook reports ``sample_rate < 1``) the ε is the
full-batch worst case, far above what the Poisson-subsampled Gaussian accountant proves for the
same run. The first such step emits a ``UserWarning`` (once per accountant) saying so, and
:attr:`IndividualGDPAccountant.amplification` records it (e.g. ``"not used (sample_rate=0.125 <
1)"``, ``None`` while every step was full-batch), in :meth:`~IndividualGDPAccountant.state_dict`
too; ``"poisson"`` gives the population ε of such a run.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import numpy as np
import torch
from opacus.accountants.accountant import IAccountant
from opacus.accountants.registry import register_accountant

from .._validation import check_int, check_open_unit, check_positive
from .._warnings import warn
from ..accounting.gaussian import gdp_epsilon
from ..accounting.individual_gdp import individual_epsilons

__all__ = ["IndividualGDPAccountant", "per_sample_norms"]


def per_sample_norms(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """Global per-sample L2 norms over all parameters from ``p.grad_sample`` (as Opacus'
    ``clip_and_accumulate`` computes them). Parameters without ``grad_sample`` are skipped."""
    parts = []
    for p in params:
        gs = getattr(p, "grad_sample", None)
        if gs is None:
            continue
        if isinstance(gs, list):
            raise ValueError("p.grad_sample is a list (gradient accumulation); individual GDP "
                             "accounting needs one backward pass per optimizer step")
        parts.append(gs.reshape(gs.shape[0], -1).norm(2, dim=1))
    if not parts:
        raise ValueError("no parameter has per-sample gradients (p.grad_sample); is the model "
                         "wrapped by Opacus (GradSampleModule / GradSampleHooks)?")
    return torch.stack(parts, dim=1).norm(2, dim=1)


class IndividualGDPAccountant(IAccountant):
    """Per-example GDP accountant (see the module docstring for the math).

    Args:
        num_examples: dataset size N (rows of the per-example state). ``None`` (what Opacus'
            registry does) gives an accountant with worst-case history only until
            :meth:`allocate` is called.
        device: device of the per-example tensors.

    Attributes:
        amplification: ``None`` while every recorded step was full-batch (``sample_rate = 1``);
            after a subsampled step, ``"not used (sample_rate=q < 1)"`` (its first rate): the
            ε is the full-batch worst case, no subsampling amplification is applied.
    """

    def __init__(self, num_examples: Optional[int] = None, *, device=None):
        super().__init__()
        self.history: list[tuple[float, float, int]] = []
        self.worst_sq = 0.0
        self.recorded_steps = 0
        self.num_examples = None
        self.observed_mu_sq = None
        self.observed_worst_sq = None
        self.amplification: Optional[str] = None
        self._warned = False
        if num_examples is not None:
            self.allocate(num_examples, device=device)

    @classmethod
    def mechanism(cls) -> str:
        return "individual-gdp"

    def allocate(self, num_examples: int, *, device=None) -> None:
        """Create zeroed per-example state for ``num_examples`` examples on ``device``."""
        self.num_examples = check_int("num_examples", num_examples, minimum=1)
        self.observed_mu_sq = torch.zeros(self.num_examples, dtype=torch.float64, device=device)
        self.observed_worst_sq = torch.zeros_like(self.observed_mu_sq)

    def to(self, device) -> "IndividualGDPAccountant":
        if self.observed_mu_sq is not None:
            self.observed_mu_sq = self.observed_mu_sq.to(device)
            self.observed_worst_sq = self.observed_worst_sq.to(device)
        return self

    # ---- recording -----------------------------------------------------------------------
    def step(self, *, noise_multiplier: float, sample_rate: float, num_steps: int = 1):
        """Opacus hook: record ``num_steps`` steps (worst-case history)."""
        noise_multiplier = check_positive("noise_multiplier", noise_multiplier)
        sample_rate = check_positive("sample_rate", sample_rate)
        if sample_rate < 1.0:
            self._note_subsampling(sample_rate)
        if self.history and self.history[-1][:2] == (noise_multiplier, sample_rate):
            s, q, n = self.history[-1]
            self.history[-1] = (s, q, n + num_steps)
        else:
            self.history.append((noise_multiplier, sample_rate, num_steps))

    def _note_subsampling(self, sample_rate: float) -> None:
        if self.amplification is None:
            self.amplification = f"not used (sample_rate={sample_rate:.6g} < 1)"
        if not self._warned:
            self._warned = True
            warn(
                f"individual-gdp does not use subsampling amplification: ε is the full-batch "
                f"worst case (every step charged 1/σ) although the steps are subsampled "
                f"(sample_rate={sample_rate:.6g} < 1); use 'poisson' for the population ε",
                UserWarning)

    def record(self, indices: torch.Tensor, mu: torch.Tensor, noise_multiplier: float) -> None:
        r"""Record one step: ``mu[k]`` is :math:`\mu_j` of example ``indices[k]`` (0 for an
        example the filter excluded). Vectorised ``index_add_``; no host synchronisation."""
        if self.observed_mu_sq is None:
            raise ValueError("call allocate(num_examples) before record()")
        sigma = check_positive("noise_multiplier", noise_multiplier)
        if indices.ndim != 1 or mu.shape != indices.shape:
            raise ValueError(f"indices and mu must be 1-d of equal length, got "
                             f"{tuple(indices.shape)} and {tuple(mu.shape)}")
        dev = self.observed_mu_sq.device
        idx = indices.to(dev)
        m = mu.to(device=dev, dtype=torch.float64)
        self.observed_mu_sq.index_add_(0, idx, m * m)
        self.observed_worst_sq.index_add_(
            0, idx, torch.full_like(m, 1.0 / (sigma * sigma)))
        self.worst_sq += 1.0 / (sigma * sigma)
        self.recorded_steps += 1

    def record_norms(self, indices: torch.Tensor, norms: torch.Tensor, noise_multiplier: float,
                     max_grad_norm: float) -> torch.Tensor:
        r"""Record per-sample norms; returns :math:`\mu = \min(\lVert g\rVert, C)/(\sigma C)`."""
        clip = check_positive("max_grad_norm", max_grad_norm)
        sigma = check_positive("noise_multiplier", noise_multiplier)
        mu = norms.to(torch.float64).clamp(max=clip) / (sigma * clip)
        self.record(indices, mu, sigma)
        return mu

    def __len__(self) -> int:
        return sum(n for _, _, n in self.history)

    # ---- read-out ------------------------------------------------------------------------
    def _history_worst_sq(self) -> float:
        return sum(n / (s * s) for s, _, n in self.history)

    def worst_case_mu(self) -> float:
        r"""Dataset-level :math:`\mu = (\sum_j 1/\sigma_j^2)^{1/2}` (max of history and records)."""
        return math.sqrt(max(self._history_worst_sq(), self.worst_sq))

    def get_epsilon(self, delta: float, *args, **kwargs) -> float:
        """Worst-case (dataset-level) ε(δ): a guarantee for every example."""
        return gdp_epsilon(check_open_unit("delta", delta), self.worst_case_mu())

    def individual_mu_squared(self) -> torch.Tensor:
        r"""Tensor [N] of :math:`(\mu^{(i)})^2` (on the state's device)."""
        if self.observed_mu_sq is None:
            raise ValueError("no per-example state: call allocate(num_examples) first")
        unseen = (self.worst_sq - self.observed_worst_sq).clamp(min=0.0)
        return self.observed_mu_sq + unseen

    def individual_epsilons(self, delta: float) -> np.ndarray:
        """numpy [N] of individual ε(δ) (Cor. C.2 at μ^(i); one host transfer)."""
        sq = self.individual_mu_squared().detach().cpu().numpy()
        return individual_epsilons(np.sqrt(sq), delta)

    # ---- state ---------------------------------------------------------------------------
    def state_dict(self, destination=None):
        """Opacus' state (history, mechanism) plus the per-example tensors (CPU copies)."""
        destination = super().state_dict(destination)
        destination["worst_sq"] = self.worst_sq
        destination["recorded_steps"] = self.recorded_steps
        destination["num_examples"] = self.num_examples
        destination["amplification"] = self.amplification
        if self.observed_mu_sq is not None:
            destination["observed_mu_sq"] = self.observed_mu_sq.detach().cpu().clone()
            destination["observed_worst_sq"] = self.observed_worst_sq.detach().cpu().clone()
        return destination

    def load_state_dict(self, state_dict):
        """Restore a :meth:`state_dict` (tensors go to the current state's device)."""
        super().load_state_dict(state_dict)
        self.history = [tuple(h) for h in self.history]
        self.worst_sq = float(state_dict.get("worst_sq", 0.0))
        self.recorded_steps = int(state_dict.get("recorded_steps", 0))
        self.amplification = state_dict.get("amplification")
        n = state_dict.get("num_examples")
        if n is None:
            self.num_examples = self.observed_mu_sq = self.observed_worst_sq = None
            return
        dev = self.observed_mu_sq.device if self.observed_mu_sq is not None else None
        self.allocate(n, device=dev)
        for key in ("observed_mu_sq", "observed_worst_sq"):
            t = torch.as_tensor(state_dict[key], dtype=torch.float64)
            if t.shape != (n,):
                raise ValueError(f"state {key} has shape {tuple(t.shape)}, expected ({n},)")
            getattr(self, key).copy_(t)


register_accountant("individual-gdp", IndividualGDPAccountant, force=True)
