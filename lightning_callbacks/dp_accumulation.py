r"""``DPCallback``'s accumulation part: ``Trainer(accumulate_grad_batches=K)`` is priced.

Lightning's automatic optimisation with ``accumulate_grad_batches=K`` runs ``training_step``
and ``backward`` on every batch, calls ``zero_grad`` only during the first batch of each group
of ``K`` (after its ``training_step``, before its ``backward``) and steps the optimizer on the
``K``-th batch, or on the last batch of the epoch when fewer than ``K`` are left (Lightning
2.x, ``_AutomaticOptimization`` and ``_TrainingEpochLoop._should_accumulate``). It divides
each loss by ``K`` first.

Under DP one noisy step then releases ``Σ_{draws d} Σ_{rows b of d} clip_C(g_b) + N(0, σ²C²)``
with ``n ≤ K`` draws: per-sample gradients of several backward passes accumulate (Opacus'
hooks keep one ``grad_sample`` per pass and its clipping concatenates them; book-keeping
appends the rows of each pass, :mod:`opacus_structured.optim.bookkeeping`), and every row is
clipped on its own. This part makes that step the DP-SGD step of a batch of ``n`` draws:

* **the price.** The tracked sampler knows the ``n`` draws the sum holds
  (:meth:`~lightning_callbacks.dp_loader.TrackedBatchSampler.step_draws`; emptied by
  ``zero_grad``, :meth:`GradientAccumulation.on_zero_grad`, and by each release), and the
  accountant prices them by noise splitting: each draw is the scheme's step at ``σ/√n``
  (:mod:`opacus_structured.accountants.observed_release`), which is sound for every release
  policy that prices independent noise; under Poisson the exact mechanism (an example is in
  ``Binomial(n, q)`` of the draws) is the mixture that tests compare against. An accountant
  that prices one noise multiplier per run (random allocation) gets every release split into
  ``K`` parts, a shorter last group included (its missing parts are empty).
  Correlated noise (release policy ``"exact"``: BandMF, random allocation with a matrix
  strategy) ties each noise position to one draw: refused at fit start, naming the fix;
* **the clipping.** Lightning's ``loss / K`` would make each per-sample gradient ``g_b / K``
  and the clip norm ``K·C`` in the loss' own units; the per-sample hooks scale the backprops
  by ``K`` (:meth:`GradientAccumulation.unscale_per_sample_gradients`), so each row is
  ``clip_C(g_b)`` of its own loss, as in a single batch;
* **the normaliser.** With ``loss_reduction="mean"`` the noisy sum is divided by
  ``n × expected_batch_size`` (:meth:`GradientAccumulation.normalise`), the expected size of
  the ``n`` draws: public, since ``n`` follows from ``K`` and the epoch's number of batches.

The update is then ``(Σ clip_C(g_b) + N(0, σ²C²)) / (n·E)``, the DP-SGD step on the union of
the ``n`` draws; with ``K = 1`` nothing changes.
"""

from __future__ import annotations

import warnings
from typing import Callable

from opacus_structured.accountants.observed_release import split_sigma  # noqa: F401 (re-export)

__all__ = ["GradientAccumulation", "AccumulationWarning", "split_sigma"]


class AccumulationWarning(UserWarning):
    """The per-sample gradients under ``accumulate_grad_batches`` are those of Lightning's
    ``loss / K`` (the module carried its own Opacus hooks): privacy is unchanged, the clip
    norm acts as ``K·C`` in the loss' units."""


class GradientAccumulation:
    """``Trainer(accumulate_grad_batches=K)`` under ``DPCallback`` (module docstring).

    ``trainer`` is read at every use (a ``GradientAccumulationScheduler`` changes ``K`` per
    epoch)."""

    def __init__(self):
        self._trainer = None
        self._sampler = None
        self._one_sigma = False

    @property
    def k(self) -> int:
        """Lightning's current ``accumulate_grad_batches`` (1 before fit start)."""
        return max(1, int(getattr(self._trainer, "accumulate_grad_batches", 1) or 1))

    def attach(self, trainer, scheme, sampler, accountant=None) -> None:
        """At fit start: refuse correlated noise with ``K > 1``; remember the trainer and the
        tracked sampler whose draws each step sums. An ``accountant`` that prices one noise
        multiplier per run (``mixed_sigma == "raise"``: random allocation) gets every release
        split into ``K`` parts, the last shorter group of an epoch included (its missing
        parts are empty: sound, and the run keeps one multiplier, ``σ/√K``)."""
        self._trainer, self._sampler = trainer, sampler
        self._one_sigma = getattr(accountant, "mixed_sigma", None) == "raise"
        self.check(scheme)

    def check(self, scheme) -> None:
        """Raise ``ValueError`` for ``K > 1`` under a scheme that ties each noise position to
        one draw (release policy ``"exact"``)."""
        if self.k > 1 and scheme.release_policy == "exact":
            raise ValueError(
                f"Trainer(accumulate_grad_batches={self.k}) sums {self.k} batches under one "
                f"noise position, but scheme {scheme.name!r} adds correlated noise priced for "
                f"one draw per position (step i's noise is correlated with the draws before "
                f"it). Fix: accumulate_grad_batches=1 with a larger batch, i.e. a scheme with "
                f"{self.k}x the batch size; or a scheme with independent noise (e.g. "
                f"PoissonScheme, ShuffleScheme), where accumulated batches are priced")

    # ---- per release ------------------------------------------------------------------
    def draws_in_sum(self) -> int:
        """Draws the clipped sum being released holds (``n``; 1 outside a fit)."""
        report = self._sampler.step_draws() if self._sampler is not None else None
        return 1 if report is None else max(1, len(report.draws))

    def parts_of_next_release(self) -> int:
        """Parts the noise of the release being prepared is split into (``n``, or ``K`` for
        an accountant that prices one noise multiplier per run)."""
        report = self._sampler.step_draws() if self._sampler is not None else None
        return 1 if report is None else max(1, report.parts)

    def on_zero_grad(self) -> None:
        """Lightning's ``zero_grad`` (first batch of a group): the sum starts anew."""
        if self._sampler is not None:
            self._sampler.sum_emptied()
            self._sampler.min_parts = self.k if self._one_sigma else 1

    def on_release(self) -> None:
        """The step released the sum (called after the accountant priced it)."""
        if self._sampler is not None:
            self._sampler.released()

    # ---- the optimizer and the hooks --------------------------------------------------
    def normalise(self, optimizer) -> None:
        """Divide a mean-reduced noisy sum of ``n`` draws by ``n × expected_batch_size``
        (Opacus divides by ``expected_batch_size × accumulated_iterations``, the number of
        backward passes that reached the hooks, which an empty or skipped batch lowers)."""
        if getattr(optimizer, "_accumulation_normaliser", False):
            return
        plain = optimizer.scale_grad

        def scale_grad():
            n = self.draws_in_sum()
            if n <= 1 or optimizer.loss_reduction != "mean":
                return plain()
            for p in optimizer.params:
                p.grad /= optimizer.expected_batch_size * n
            return None

        optimizer.scale_grad = scale_grad
        optimizer._accumulation_normaliser = True

    def unscale_per_sample_gradients(self, hooks) -> None:
        """Scale the backprops the per-sample hooks see by ``K``, undoing Lightning's
        ``loss / K``: each row's gradient is that of its own loss before clipping. ``hooks``
        ``None`` (the module carried its own Opacus hooks): warned once when ``K > 1``."""
        if hooks is None:
            if self.k > 1:
                warnings.warn(
                    f"DPCallback: with accumulate_grad_batches={self.k} Lightning divides the "
                    f"loss by {self.k}, and the module's own Opacus hooks clip the per-sample "
                    f"gradients of that loss: epsilon is unchanged, but the clip norm acts as "
                    f"{self.k} x max_grad_norm in the loss' units. Let DPCallback hook the "
                    f"module (no PrivacyEngine.make_private(module=self)) to clip the "
                    f"per-sample gradients of the loss itself", AccumulationWarning,
                    stacklevel=2)
            return
        plain: Callable = hooks.rearrange_grad_samples

        def rearrange_grad_samples(*args, **kwargs):
            activations, backprops = plain(*args, **kwargs)
            k = self.k
            return activations, (backprops if k == 1 else backprops * k)

        hooks.rearrange_grad_samples = rearrange_grad_samples

    # ---- the budget ------------------------------------------------------------------
    def next_release(self, *, exact: bool) -> int:
        """Parts of the next release: those of the sum being released (``exact``, before the
        noisy step), else the most a group holds (``K``)."""
        return self.parts_of_next_release() if exact else self.k
