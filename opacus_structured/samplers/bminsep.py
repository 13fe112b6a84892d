"""b-min-sep batch samplers (Dong & Ganesh, "Privacy Amplification for BandMF via b-Min-Sep
Subsampling", arXiv:2602.09338, Algorithms 1 and 2 and Appendix D).

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
  E|B_i| = N·p0 at every step with ``p0 = p/(1+(b−1)p)``
  (:func:`~opacus_structured.accounting.bminsep_mc.bminsep_stationary_rate`); construct it from
  the expected batch size with :meth:`BMinSepBatchSampler.from_expected_batch_size`
  (``p = B̄/(N − (b−1)B̄)``, :func:`~opacus_structured.accounting.bminsep_mc.
  bminsep_sampling_prob`; needs ``b ≤ N/B̄``). ``b = 1`` is Poisson; ``p = 1, b = T`` is
  balls-in-bins with ``T`` bins.
* **App. D, truncated + padded** (``truncated_batch_size=B_max``): after the b-min-sep draw, a
  batch larger than ``B_max`` is cut to a uniformly random subset of size ``B_max``; the
  exclusion history uses the **pre-truncation** sample (a truncated-away example is still
  barred). With ``pad_index`` set, shorter batches are padded with that index up to ``B_max``
  (it must point at a zero-gradient ⊥ example, e.g. a dummy row the loss masks out).

Valid accountants: the b-min-sep Monte Carlo accountant (Theorem 5.1 recursion; cold start for
Alg. 1, warm average for Alg. 2, the App. D ratio recursion with the released ``r_i`` for the
truncated variant; zero-out adjacency, public N) — an estimate that needs Algorithm 5 to become
a guarantee — and the deterministic unamplified BandMF bound (Gaussian with sensitivity
``√ceil(n/b)·max‖c_i‖``). Requires ``bands(C) ≤ b``.

The ``scheme`` attribute is the :class:`~opacus_structured.schemes.bminsep_mc.
BMinSepMonteCarloScheme` whose batches the sampler draws: the one it was built from
(``scheme.sampler(dataset_size)``, the factory :func:`bminsep_sampler` registered here, which
also builds the multi-attribution sampler of :mod:`.multi_attribution` for
``max_user_examples > 1``), else the scheme of its parameters with one band
(:meth:`~opacus_structured.schemes.bminsep_mc.BMinSepMonteCarloScheme.
from_sampling_probability`). An accountant of any ``bands`` / ``strategy`` accepts it when the
batches match (:meth:`~opacus_structured.schemes.bminsep_mc.BMinSepMonteCarloScheme.
implemented_by`).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from .._validation import check_int, check_probability
from ..accounting.bminsep_mc import bminsep_sampling_prob, bminsep_stationary_rate
from ..schemes.bminsep_mc import BMinSepMonteCarloScheme
from ..schemes.registry import register_sampler
from ._mf_base import MFBatchSampler
from .multi_attribution import MultiAttributionBMinSepBatchSampler
from .verification import adopt_scheme, check_dataset_size

__all__ = ["BMinSepBatchSampler", "WarmStartBMinSepBatchSampler", "bminsep_sampler"]


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
        scheme: the :class:`BMinSepMonteCarloScheme` to carry (its batches must be these);
            default: the scheme of these parameters with one band.
    """

    _params = ("num_samples", "p", "min_sep", "warm_start", "truncated_batch_size",
               "pad_index", "steps")
    _state_tensors = ("next_available",)

    def __init__(self, num_samples: int, p: float, min_sep: int, *,
                 steps: Optional[int] = None, warm_start: bool = False,
                 truncated_batch_size: Optional[int] = None, pad_index: Optional[int] = None,
                 generator: Optional[torch.Generator] = None, seed: Optional[int] = None,
                 scheme: Optional[BMinSepMonteCarloScheme] = None):
        self.p = check_probability("p", p)
        self.min_sep = check_int("min_sep", min_sep, minimum=1)
        self.warm_start = bool(warm_start)
        self.truncated_batch_size = None if truncated_batch_size is None else check_int(
            "truncated_batch_size", truncated_batch_size, minimum=1)
        if pad_index is not None and self.truncated_batch_size is None:
            raise ValueError("pad_index needs truncated_batch_size (padding to B_max)")
        self.pad_index = None if pad_index is None else check_int("pad_index", pad_index)
        n = check_int("num_samples", num_samples, minimum=1)
        self.scheme = adopt_scheme(
            scheme, BMinSepMonteCarloScheme.from_sampling_probability(
                n, self.p, self.min_sep, warm_start=self.warm_start,
                truncate=self.truncated_batch_size), type(self).__name__)
        if steps is None:
            steps = max(1, round(1.0 / bminsep_stationary_rate(self.p, self.min_sep)))
        super().__init__(n, steps=steps, generator=generator, seed=seed)
        # next_available[e] = first global step at which e may be sampled.
        self.next_available = torch.zeros(n, dtype=torch.int64)
        if self.warm_start and self.min_sep > 1:
            b = self.min_sep
            in_history = self._bernoulli(n, (b - 1) * self.p / (1 + (b - 1) * self.p))
            s = torch.randint(1, b, (n,), generator=self.generator)  # virtual batch -s
            self.next_available = torch.where(in_history, b - s, torch.zeros_like(s))
        self._freeze_law()

    @classmethod
    def from_expected_batch_size(cls, num_samples: int, expected_batch_size: float,
                                 min_sep: int, **kwargs) -> "WarmStartBMinSepBatchSampler":
        """Warm-start sampler with stationary E|B| = ``expected_batch_size``: ``p =
        bminsep_sampling_prob(num_samples, expected_batch_size, min_sep)``."""
        p = bminsep_sampling_prob(num_samples, expected_batch_size, min_sep)
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


@register_sampler(BMinSepMonteCarloScheme)
def bminsep_sampler(scheme: BMinSepMonteCarloScheme, data: Union[int, Sequence, None] = None, *,
                    generator=None, seed=None, steps: Optional[int] = None,
                    pad_index: Optional[int] = None, burn_in: int = 0):
    """``scheme.sampler(data, ...)``: the sampler the scheme describes, carrying ``scheme``.

    With one example per user, ``data`` is the number of examples (optional; it must be the
    scheme's ``dataset_size``) and the sampler is Algorithm 1 or 2 (``warm_start``), truncated
    to ``truncate`` examples per batch (padded with ``pad_index`` when given). With
    ``max_user_examples > 1``, ``data`` is every example's users (``user_sets``, one entry per
    example) and the sampler is Algorithm 3 (:class:`~.multi_attribution.
    MultiAttributionBMinSepBatchSampler`; ``burn_in`` steps are discarded, which the cold-start
    accounting covers).
    """
    if scheme.max_user_examples > 1:
        if data is None or isinstance(data, int):
            raise ValueError(f"scheme {scheme.name!r} with max_user_examples > 1 needs each "
                             f"example's users: scheme.sampler(user_sets, ...), got {data!r}")
        if pad_index is not None:
            raise ValueError("pad_index needs truncation, which multi-attribution does not "
                             "support")
        check_dataset_size(len(data), scheme.dataset_size, scheme.name)
        return MultiAttributionBMinSepBatchSampler(
            data, scheme.sampling_prob, scheme.min_sep,
            max_user_examples=scheme.max_user_examples, burn_in=burn_in, steps=steps,
            generator=generator, seed=seed, scheme=scheme)
    if burn_in:
        raise ValueError("burn_in is for the multi-attribution sampler (max_user_examples > 1); "
                         "use warm_start=True for a stationary start")
    check_dataset_size(data, scheme.dataset_size, scheme.name)
    return BMinSepBatchSampler(scheme.dataset_size, scheme.sampling_prob, scheme.min_sep,
                               steps=steps, warm_start=scheme.warm_start,
                               truncated_batch_size=scheme.truncate, pad_index=pad_index,
                               generator=generator, seed=seed, scheme=scheme)
