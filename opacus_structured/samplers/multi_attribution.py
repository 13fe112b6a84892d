"""Multi-attribution b-min-sep sampler — Algorithm 3 of Dong & Ganesh, "Privacy Amplification
for BandMF via b-Min-Sep Subsampling" (arXiv:2602.09338, §6.1), for user-level DP when an
example can belong to several users.

Exact semantics of :class:`MultiAttributionBMinSepBatchSampler` (steps 0-indexed, counted across
epochs; ``U(e)`` = the public set of users of example ``e``; ``N(e)`` = examples sharing a user
with ``e``, including ``e``):

* step ``i``: draw an *interim* sample ``S_i`` — every example independently w.p. ``p``,
  regardless of past exclusions; then ``B_i = S_i \\ ∪_{j=i−b+1}^{i−1} ∪_{e∈S_j} N(e)``:
  exclusion uses the interim samples ``S_j`` (not the realised batches: that is Alg. 4,
  whose analysis is only conjectured and which is not implemented);
* hence every user's examples appear in at most one step of any ``b`` consecutive steps (possibly
  several of them in that step); batch sizes vary;
* ``burn_in`` steps are drawn and discarded at construction (warm start by simulation); the
  accountant must then use **cold-start** accounting over the training steps (valid: the burn-in
  is post-processing of a cold start).

Preconditions: contribution bounding so that each user has at most ``k_u`` examples
(``max_user_examples`` is checked). Valid accountant: Theorem 6.1's recursion with ``k_u`` (fixed
-graph, zero-out adjacency of one user), a Monte Carlo estimate that needs Algorithm 5 to become
a guarantee: the ``bminsep-mc`` scheme with ``max_user_examples = k_u`` and
``sampling_probability = p``, which the ``scheme`` attribute holds (the scheme it was built from
by ``scheme.sampler(user_sets)``, else the scheme of its parameters with one band, see
:meth:`~opacus_structured.schemes.bminsep_mc.BMinSepMonteCarloScheme.from_sampling_probability`).
With ``max_user_examples = 1`` that scheme is the cold-start one: Theorem 6.1 at ``k_u = 1`` is
the recursion of Algorithm 1 (the extra exclusions by interim samples only lower an example's
participation).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from .._validation import check_int, check_probability
from ..schemes.bminsep_mc import BMinSepMonteCarloScheme
from ._mf_base import MFBatchSampler
from .verification import adopt_scheme

__all__ = ["MultiAttributionBMinSepBatchSampler"]


class MultiAttributionBMinSepBatchSampler(MFBatchSampler):
    """Algorithm 3 (see module docstring).

    Args:
        user_sets: for each example, an iterable of hashable user ids (non-empty).
        p: interim sampling probability in (0, 1].
        min_sep: ``b ≥ 1``.
        max_user_examples: ``k_u``; raises if some user has more examples.
        burn_in: steps simulated and discarded at construction.
        steps: batches per epoch (default ``round(1/p)``).
        generator / seed: randomness source (dedicated).
        scheme: the :class:`BMinSepMonteCarloScheme` to carry (its batches must be these);
            default: the scheme of these parameters with one band.
    """

    _params = ("num_samples", "p", "min_sep", "max_user_examples", "burn_in", "steps")
    _state_tensors = ("next_available",)

    def __init__(self, user_sets: Sequence, p: float, min_sep: int, *, max_user_examples: int,
                 burn_in: int = 0, steps: Optional[int] = None,
                 generator: Optional[torch.Generator] = None, seed: Optional[int] = None,
                 scheme: Optional[BMinSepMonteCarloScheme] = None):
        self.p = check_probability("p", p)
        self.min_sep = check_int("min_sep", min_sep, minimum=1)
        self.max_user_examples = check_int("max_user_examples", max_user_examples, minimum=1)
        self.burn_in = check_int("burn_in", burn_in, minimum=0)
        user_ids: dict = {}
        ex_idx, us_idx = [], []
        for e, users in enumerate(user_sets):
            users = list(users)
            if not users:
                raise ValueError(f"user_sets[{e}] is empty: every example needs >= 1 user")
            for u in users:
                ex_idx.append(e)
                us_idx.append(user_ids.setdefault(u, len(user_ids)))
        n = len(user_sets)
        super().__init__(n, steps=max(1, round(1 / self.p)) if steps is None else steps,
                         generator=generator, seed=seed)
        self.scheme = adopt_scheme(
            scheme, BMinSepMonteCarloScheme.from_sampling_probability(
                n, self.p, self.min_sep, max_user_examples=self.max_user_examples),
            type(self).__name__)
        self._ex = np.asarray(ex_idx, dtype=np.int64)
        self._us = np.asarray(us_idx, dtype=np.int64)
        counts = np.bincount(np.unique(np.stack([self._us, self._ex]), axis=1)[0],
                             minlength=len(user_ids))
        if counts.max() > self.max_user_examples:
            raise ValueError(f"a user has {int(counts.max())} examples but max_user_examples="
                             f"{self.max_user_examples}: bound contributions first")
        self.num_users = len(user_ids)
        self.next_available = torch.zeros(n, dtype=torch.int64)
        for _ in range(self.burn_in):
            self._draw()
            self.step += 1
        self.step = 0
        if self.burn_in:
            # re-base the exclusion horizon so step 0 follows the burn-in
            self.next_available = torch.clamp(self.next_available - self.burn_in, min=0)
        self._freeze_law()

    def _draw(self) -> list[int]:
        interim = self._bernoulli(self.num_samples, self.p)
        batch = interim & (self.next_available <= self.step)
        if self.min_sep > 1 and bool(interim.any()):
            hit = interim.numpy()[self._ex]
            users = np.unique(self._us[hit])
            barred = np.unique(self._ex[np.isin(self._us, users)])
            idx = torch.from_numpy(barred)
            self.next_available[idx] = torch.clamp(self.next_available[idx],
                                                   min=self.step + self.min_sep)
        return batch.nonzero().reshape(-1).tolist()
