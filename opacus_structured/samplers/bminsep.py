"""b-min-sep batch samplers (Dong & Ganesh, "Privacy amplification for BandMF via b-min-sep
subsampling", Algorithms 1 and 2 and Appendix D; digest ``seed1-bandmf-bminsep.md`` §3.4–3.6).

Exact semantics (per example, independently across examples; steps are 0-indexed and counted
across epochs; ``b`` = ``min_sep``, ``p`` = conditional sampling probability):

* **Alg. 1, cold start** (:class:`BMinSepBatchSampler`): at step ``i`` every example that did
  *not* participate in steps ``i−b+1 … i−1`` joins independently with probability ``p``;
  examples that did are excluded. No example is in two batches fewer than ``b`` steps apart.
  Per example this is the Markov chain 0→0 (1−p), 0→b−1 (p, participates), k→k−1.
  Batch sizes vary and are large early (E|B_0| = N·p).
* **Alg. 2, warm start** (:class:`WarmStartBMinSepBatchSampler`): each example starts in the
  stationary law: available w.p. ``1/(1+(b−1)p)``, otherwise in one of ``b−1`` virtual past
  batches uniformly (first available at step ``b−s`` for virtual batch ``s ∈ {1..b−1}``).
  E|B_i| = N·p0 at every step with ``p0 = p/(1+(b−1)p)``; construct it from the expected batch
  size with :func:`warm_start_probability` (``p = B̄/(N − (b−1)B̄)``, needs ``b ≤ N/B̄``).
  ``b = 1`` is Poisson; ``p = 1, b = T`` is balls-in-bins with ``T`` bins.
* **App. D, truncated + padded** (``truncated_batch_size=B_max``): after the b-min-sep draw, a
  batch larger than ``B_max`` is cut to a uniformly random subset of size ``B_max``; the
  exclusion history uses the **pre-truncation** sample (a truncated-away example is still
  barred). With ``pad_index`` set, shorter batches are padded with that index up to ``B_max``
  (it must point at a zero-gradient ⊥ example, e.g. a dummy row the loss masks out).

Valid accountants: the b-min-sep Monte Carlo accountant (Theorem 5.1 recursion; cold start for
Alg. 1, warm average for Alg. 2, the App. D ratio recursion with the released ``r_i`` for the
truncated variant; zero-out adjacency, public N) — an estimate that needs the EVR protocol
(Alg. 5) to become a guarantee — and the deterministic unamplified BandMF bound (Gaussian with
sensitivity ``√ceil(n/b)·max‖c_i‖``). Requires ``bands(C) ≤ b``. The ``scheme`` attribute is a
:class:`BMinSepSampling` record of these parameters (not a PLD-priced scheme).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .._validation import check_int, check_positive, check_probability
from ._mf_base import MFBatchSampler

__all__ = ["BMinSepSampling", "BMinSepBatchSampler", "WarmStartBMinSepBatchSampler",
           "warm_start_probability", "stationary_rate"]


def warm_start_probability(dataset_size: int, expected_batch_size: float, min_sep: int) -> float:
    """Conditional probability ``p = B̄ / (N − (b−1)B̄)`` giving stationary E|B| = ``B̄``."""
    n = check_int("dataset_size", dataset_size, minimum=1)
    B = check_positive("expected_batch_size", expected_batch_size)
    b = check_int("min_sep", min_sep, minimum=1)
    if b * B > n * (1 + 1e-12):
        raise ValueError(f"b-min-sep needs min_sep * expected_batch_size <= dataset_size (p <= 1),"
                         f" got {b} * {B} > {n}")
    return min(1.0, B / (n - (b - 1) * B))


def stationary_rate(p: float, min_sep: int) -> float:
    """Average participation rate ``p0 = p / (1 + (b−1)p)``."""
    p = check_probability("p", p)
    b = check_int("min_sep", min_sep, minimum=1)
    return p / (1 + (b - 1) * p)


@dataclasses.dataclass(frozen=True)
class BMinSepSampling:
    """Public parameters of a b-min-sep sampler (what its accountant must be given)."""

    name = "b-min-sep"
    dataset_size: int
    p: float
    min_sep: int
    warm_start: bool
    truncated_batch_size: Optional[int] = None

    def to_dict(self) -> dict:
        return {"scheme": self.name, **dataclasses.asdict(self)}


class BMinSepBatchSampler(MFBatchSampler):
    """b-min-sep subsampling (Alg. 1 cold start; ``warm_start=True`` for Alg. 2).

    Args:
        num_samples: dataset size N.
        p: conditional sampling probability of an available example, in (0, 1].
        min_sep: ``b ≥ 1``.
        steps: batches per epoch (``len``); default ``round(N/(N·p0))``.
        warm_start: Alg. 2 initial state.
        truncated_batch_size: ``B_max`` (App. D truncation), or ``None``.
        pad_index: with ``truncated_batch_size``, pad shorter batches with this index.
        generator / seed: randomness source (dedicated).
    """

    _params = ("num_samples", "p", "min_sep", "warm_start", "truncated_batch_size",
               "pad_index", "steps")
    _state_tensors = ("next_available",)

    def __init__(self, num_samples: int, p: float, min_sep: int, *,
                 steps: Optional[int] = None, warm_start: bool = False,
                 truncated_batch_size: Optional[int] = None, pad_index: Optional[int] = None,
                 generator: Optional[torch.Generator] = None, seed: Optional[int] = None):
        self.p = check_probability("p", p)
        self.min_sep = check_int("min_sep", min_sep, minimum=1)
        self.warm_start = bool(warm_start)
        self.truncated_batch_size = None if truncated_batch_size is None else check_int(
            "truncated_batch_size", truncated_batch_size, minimum=1)
        if pad_index is not None and self.truncated_batch_size is None:
            raise ValueError("pad_index needs truncated_batch_size (padding to B_max)")
        self.pad_index = None if pad_index is None else check_int("pad_index", pad_index)
        n = check_int("num_samples", num_samples, minimum=1)
        if steps is None:
            steps = max(1, round(1.0 / stationary_rate(self.p, self.min_sep)))
        super().__init__(n, steps=steps, generator=generator, seed=seed)
        self.scheme = BMinSepSampling(n, self.p, self.min_sep, self.warm_start,
                                      self.truncated_batch_size)
        # next_available[e] = first global step at which e may be sampled.
        self.next_available = torch.zeros(n, dtype=torch.int64)
        if self.warm_start and self.min_sep > 1:
            b = self.min_sep
            in_history = self._bernoulli(n, (b - 1) * self.p / (1 + (b - 1) * self.p))
            s = torch.randint(1, b, (n,), generator=self.generator)  # virtual batch -s
            self.next_available = torch.where(in_history, b - s, torch.zeros_like(s))

    @classmethod
    def from_expected_batch_size(cls, num_samples: int, expected_batch_size: float,
                                 min_sep: int, **kwargs) -> "WarmStartBMinSepBatchSampler":
        """Warm-start sampler with stationary E|B| = ``expected_batch_size`` (rate conversion)."""
        p = warm_start_probability(num_samples, expected_batch_size, min_sep)
        return WarmStartBMinSepBatchSampler(num_samples, p, min_sep, **kwargs)

    def _draw(self) -> list[int]:
        available = self.next_available <= self.step
        chosen = available & self._bernoulli(self.num_samples, self.p)
        self.next_available[chosen] = self.step + self.min_sep  # pre-truncation history
        batch = chosen.nonzero().reshape(-1)
        B_max = self.truncated_batch_size
        if B_max is not None and batch.numel() > B_max:
            keep = torch.randperm(batch.numel(), generator=self.generator)[:B_max]
            batch = batch[keep.sort().values]
        out = batch.tolist()
        if self.pad_index is not None and len(out) < B_max:
            out.extend([self.pad_index] * (B_max - len(out)))
        return out


class WarmStartBMinSepBatchSampler(BMinSepBatchSampler):
    """Algorithm 2: :class:`BMinSepBatchSampler` with ``warm_start=True``."""

    def __init__(self, num_samples: int, p: float, min_sep: int, **kwargs):
        kwargs["warm_start"] = True
        super().__init__(num_samples, p, min_sep, **kwargs)
