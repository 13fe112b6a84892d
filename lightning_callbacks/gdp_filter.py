r"""``IndividualGDPFilter``: the individual GDP filter (Algorithm 1) as a Lightning callback.

Koskela, Tobaben & Honkela (2023), Theorem 1. With budget :math:`B`, at step :math:`j` example
:math:`i` stays active only if

.. math:: s_i + (\mu_j^{(i)})^2 \le B^2, \qquad
          \mu_j^{(i)} = \frac{\min(\lVert g_{ij}\rVert_2, C)}{\sigma C},

where :math:`s_i` is the sum of its :math:`\mu^2` over the steps in which it was active (the test
includes the current step). Inactive examples are removed from the clipped sum through their clipping
factors: the filter is folded into the optimizer's clipping
(:mod:`opacus_structured.accountants.clip_factors`), where Opacus computes the per-sample norms
:math:`\lVert g_{ij}\rVert` anyway, takes its decision from them and multiplies the clip
factor of each inactive example by 0 — no extra pass over the per-sample gradients, and the
released sum is bit-identical to zeroing the inactive rows first (Opacus' own step hook fires
after the noise: too late). Optimizers that clip otherwise (per layer) get their inactive rows
of every ``p.grad_sample`` zeroed in ``on_before_optimizer_step`` instead. The noise is unchanged and Opacus divides by its fixed public
``expected_batch_size``, never by the number of active examples. Then the released trajectory
is :math:`B`-GDP for every example under add/remove (Thm 1; ε(δ) by Cor. C.2, see
:meth:`IndividualGDPFilter.epsilon`).

**Which examples are in a batch** is found without touching the batch: the batch sampler records
the index list of every batch it draws (:mod:`lightning_callbacks.batch_indices`), so the
LightningModule's ``training_step`` receives exactly what it would without the filter. With
:class:`~lightning_callbacks.dp_callback.DPCallback` its sampler records (for
``GDPScheme()`` it installs a :class:`~opacus_structured.samplers.full_batch.FullBatchSampler`);
without it (a module whose ``configure_optimizers`` returns an Opacus ``DPOptimizer``) the
filter wraps the train DataLoader's batch sampler in a recorder at fit start. The older
convention, an :class:`~opacus_structured.indexed_dataset.IndexedDataset` whose batches end with
the index tensor, still works with ``index_fn=batch_indices``.

**Batches the certificate covers.** Theorem 1 is stated for full-batch DP-GD (every example in
every step). It also holds under **Poisson subsampling** with the filter charging an example
only in the steps it was sampled (what this filter does): conditioned on all the sampling coins,
the run is Algorithm 1 on fixed, data-independent batches (an example not in batch :math:`j`
has :math:`\mu_j^{(i)} = 0`), which is :math:`B`-GDP for every coin pattern by Theorem 1; the
real output is the mixture over the coins, against the same mixture for :math:`X^{-i}` (the
coins of the other examples are unchanged by removing :math:`x_i`), and the hockey-stick
divergence is jointly convex, so the mixture is :math:`B`-GDP as well (both directions). The
certificate then uses no subsampling amplification (the run's population ε from ``DPCallback``
still holds, and the smaller of the two applies). Shuffled fixed-size batches are **not**
covered (removing an example moves others between batches). With the default
``require_full_batch=None`` the filter accepts full batches, and any batch when the train batch
sampler implements :class:`~opacus_structured.schemes.poisson.PoissonScheme`, and raises
otherwise; ``require_full_batch=False`` lets other samplers run, and then
:meth:`IndividualGDPFilter.epsilon` refuses to certify.

Other requirements (checked where possible): independent Gaussian noise per step (a
correlated-noise optimizer is refused), one backward pass per optimizer step, deterministic
per-sample gradients between the norm and the sum (one pass, as here), a maximum number of steps
fixed in advance, a fixed public normaliser (Opacus' ``expected_batch_size``), and no
data-dependent layers such as BatchNorm. The logged active counts and individual ε are *not*
covered by the guarantee.

Works with ``DPCallback`` (an unmodified LightningModule), or with Opacus ``GradSampleModule`` /
``GradSampleHooks`` + ``DPOptimizer`` returned by ``configure_optimizers``.

**Ghost clipping** (``make_private(grad_sample_mode="ghost")``, no per-sample gradients are
materialised): in a plain Opacus loop call :meth:`IndividualGDPFilter.attach_ghost` once and
:meth:`IndividualGDPFilter.set_batch_indices` before each backward. The filter then decides
between Opacus' two backward passes, from the first pass's per-sample norms, and multiplies
the clipping coefficients by the active mask
(:func:`opacus_structured.optim.ghost_clipping.set_clipping_mask`): an inactive example gets
weight 0 in the second backward, exactly as a zeroed ``grad_sample`` row in hooks mode. Under
Lightning with ``DPCallback(grad_sample_mode="ghost")`` (one backward, book-keeping) nothing
is needed: the filter reads the norms from the optimizer's ``bookkeeper`` and sets its mask.

Under DDP (``torch.distributed`` initialised with several processes, each holding a shard of the
global batch) every step all-gathers the shards' indices and μ values, so every rank takes the
decisions of the single-process filter on the global batch and keeps the same, complete state
(:math:`s_i` must include every step an example was active, whichever rank processed it); each
rank then zeroes its own inactive rows. The full-batch check counts the global batch.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

try:
    from lightning.pytorch import Callback
except ImportError:  # pragma: no cover
    from pytorch_lightning import Callback

from opacus_structured._validation import check_int, check_nonnegative, check_positive
from opacus_structured.accountants.clip_factors import (
    add_clip_mask,
    install_clip_factors,
    remove_clip_hooks,
)
from opacus_structured.accountants.individual_gdp import IndividualGDPAccountant, per_sample_norms
from opacus_structured.accounting.individual_gdp import filter_epsilon
from opacus_structured.distributed import all_gather_cat as _all_gather_cat
from opacus_structured.distributed import all_reduce_sum as _all_reduce_sum
from opacus_structured.distributed import is_distributed as _is_distributed
from opacus_structured.optim.ghost_clipping import set_clipping_mask
from opacus_structured.schemes.base import noise_bands
from opacus_structured.schemes.poisson import PoissonScheme

from .batch_indices import IndexSource, to_device, train_scheme

__all__ = ["IndividualGDPFilter", "dp_params", "dp_settings", "step_norms", "step_inputs",
           "check_batch_rows", "clip_step_inputs", "ClipAttachedCallback"]


def _dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def dp_params(optimizer) -> list:
    """Parameters whose per-sample gradients the (DP)optimizer sums."""
    params = getattr(optimizer, "params", None)
    if params is None:
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    return list(params)


def step_norms(optimizer) -> tuple[torch.Tensor, object]:
    """Per-sample gradient norms of this step and the optimizer's book-keeping hooks (``None``
    in hooks mode, where the norms come from ``p.grad_sample``). Examples a filter already
    removed this step count with norm 0 in both modes."""
    bookkeeper = getattr(optimizer, "bookkeeper", None)
    if bookkeeper is not None:
        return bookkeeper.released_norms(), bookkeeper
    return per_sample_norms(dp_params(optimizer)), None


def dp_settings(optimizer) -> tuple[float, float]:
    """``(noise_multiplier, max_grad_norm)`` of an independent-noise Opacus DP optimizer;
    raises ``ValueError`` for anything else (no DP optimizer, correlated noise)."""
    sigma = getattr(optimizer, "noise_multiplier", None)
    clip = getattr(optimizer, "max_grad_norm", None)
    if sigma is None or clip is None:
        raise ValueError("the optimizer is not an Opacus DPOptimizer (no noise_multiplier / "
                         "max_grad_norm); return the DPOptimizer from configure_optimizers or "
                         "add DPCallback")
    coefficients = getattr(optimizer, "noise_coefficients", None)
    if coefficients is not None and noise_bands(coefficients) > 1:
        raise ValueError(f"{type(optimizer).__name__} adds correlated noise across steps; "
                         f"individual GDP accounting prices each step as a Gaussian mechanism "
                         f"with independent noise (mu = min(||g||, C) / (sigma C)), which "
                         f"correlated noise is not: use a plain DPOptimizer")
    return float(sigma), float(clip)


def check_batch_rows(indices: torch.Tensor, norms: torch.Tensor, owner: str) -> None:
    """The per-sample gradients must have one row per index drawn."""
    if norms.shape[0] != indices.shape[0]:
        raise ValueError(
            f"{owner}: the per-sample gradients have {norms.shape[0]} rows but the batch drawn "
            f"holds {indices.shape[0]} examples; the training step must use every example of "
            f"the batch once, in the order drawn (a collate function that drops, reorders or "
            f"repeats rows breaks the mapping to dataset indices)")


def step_inputs(indices: Optional[torch.Tensor], optimizer, owner: str):
    """What an individual-accounting callback needs at ``on_before_optimizer_step``:
    ``(indices, norms, bookkeeper, sigma, clip)``, the batch's dataset indices on the norms'
    device, the per-sample norms and book-keeping hooks (:func:`step_norms`) and the
    optimizer's noise multiplier and clipping norm. Raises ``ValueError`` when no indices were
    recorded for the step, the optimizer is no independent-noise DP optimizer, or the rows do
    not match the indices (:func:`check_batch_rows`)."""
    if indices is None:
        raise ValueError("no batch indices recorded for this step")
    sigma, clip = dp_settings(optimizer)
    norms, bookkeeper = step_norms(optimizer)
    check_batch_rows(indices, norms, owner)
    return to_device(indices, norms.device), norms, bookkeeper, sigma, clip


def clip_step_inputs(indices: Optional[torch.Tensor], optimizer, norms: torch.Tensor,
                     owner: str):
    """What a callback attached to the clipping (:mod:`~opacus_structured.accountants.clip_factors`)
    needs: ``(indices, sigma, clip)``, the batch's dataset indices on the norms' device and the
    optimizer's noise multiplier and clipping norm. Raises ``ValueError`` when no indices were
    given for the step or the rows do not match them."""
    if indices is None:
        raise ValueError(f"{owner} is attached to this optimizer but no batch indices were "
                         f"given for this step: call set_batch_indices(indices) before each "
                         f"optimizer.step() (under Lightning the callback records them itself)")
    check_batch_rows(indices, norms, owner)
    sigma, clip = dp_settings(optimizer)
    return to_device(indices, norms.device), sigma, clip


class ClipAttachedCallback(Callback):
    """A callback that may attach to the optimizer's clipping
    (:mod:`opacus_structured.accountants.clip_factors`): it detaches when the fit ends, also
    after an exception, so the optimizer never calls back into a finished fit. Its per-example
    accounting reads one batch per noisy step: ``Trainer(accumulate_grad_batches > 1)`` is
    refused at setup, naming the cause (``DPCallback``'s population ε prices it)."""

    def setup(self, trainer, pl_module, stage):
        k = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
        if stage == "fit" and k > 1:
            name = type(self).__name__
            raise ValueError(
                f"{name} accounts each example in the one batch a noisy step trains on, but "
                f"Trainer(accumulate_grad_batches={k}) sums {k} batches under one noise (an "
                f"example may be in several of them), which {name}'s per-example accounting "
                f"does not price. Fix: accumulate_grad_batches=1 with a {k}x larger batch, or "
                f"train without {name} (DPCallback's population epsilon prices accumulated "
                f"batches)")

    def teardown(self, trainer, pl_module, stage):
        for optimizer in trainer.optimizers:
            remove_clip_hooks(optimizer, self)

    def on_exception(self, trainer, pl_module, exception):
        self.teardown(trainer, pl_module, "fit")


class IndividualGDPFilter(ClipAttachedCallback):
    """Algorithm 1 (individual GDP filter) for full-batch DP-GD or Poisson-subsampled DP-SGD
    with Opacus + Lightning (see the module doc for what the certificate covers).

    Args:
        num_examples: dataset size N.
        budget: GDP budget B (a μ value), e.g. ``budget_from_epsilon(eps, delta)`` or
            ``budget_from_steps(T0, sigma)``.
        permanent_drop: once refused, never re-admit (the released code's policy); the default
            is the literal Algorithm 1 (re-entry when a later μ fits). Both satisfy Thm 1.
        require_full_batch: ``None`` (default): accept full batches (all N examples), and any
            batch when the train batch sampler implements Poisson sampling (certified too, see
            the module doc); raise for other samplers. ``True``: every batch must hold all N
            examples (the paper's DP-GD setting, even under Poisson). ``False``: no check;
            steps from other samplers are counted in :attr:`uncertified_steps` and
            :meth:`epsilon` then refuses.
        tolerance: relative slack on B² for float round-off at equality (certified budget is
            :attr:`effective_budget`).
        index_fn: ``batch -> LongTensor`` of dataset indices, read from the batch (e.g.
            :func:`~opacus_structured.indexed_dataset.batch_indices` for an
            :class:`~opacus_structured.indexed_dataset.IndexedDataset`). Default: the indices
            the train batch sampler recorded (the batch is not touched).
    """

    def __init__(self, num_examples: int, budget: float, *, permanent_drop: bool = False,
                 require_full_batch: Optional[bool] = None, tolerance: float = 1e-12,
                 index_fn: Optional[Callable] = None):
        super().__init__()
        self.num_examples = check_int("num_examples", num_examples, minimum=1)
        self.budget = check_positive("budget", budget)
        self.tolerance = check_nonnegative("tolerance", tolerance)
        self.permanent_drop = bool(permanent_drop)
        if require_full_batch not in (None, True, False):
            raise ValueError(f"require_full_batch must be None, True or False, got "
                             f"{require_full_batch!r}")
        self.require_full_batch = require_full_batch
        self._source = IndexSource("IndividualGDPFilter", index_fn)
        self.index_fn = index_fn
        self.accountant = IndividualGDPAccountant(self.num_examples)
        self.dropped = torch.zeros(self.num_examples, dtype=torch.bool)
        self.active_history: list[torch.Tensor] = []  # per-step active counts (device scalars)
        #: Filtered steps whose batches the certificate does not cover (see module doc).
        self.uncertified_steps = 0
        self._poisson = False
        self._covered = True
        self._indices: Optional[torch.Tensor] = None
        self.last_active: Optional[torch.Tensor] = None

    @property
    def effective_budget(self) -> float:
        return (self.budget ** 2 * (1.0 + self.tolerance)) ** 0.5

    def epsilon(self, delta: float) -> float:
        """ε(δ) certified for every example by Theorem 1 (Cor. C.2 at the budget).

        Raises ``ValueError`` if some filtered step drew a batch the certificate does not cover
        (neither all N examples nor Poisson sampling; only possible with
        ``require_full_batch=False``).
        """
        if self.uncertified_steps:
            raise ValueError(
                f"IndividualGDPFilter ran {self.uncertified_steps} step(s) on batches that are "
                f"neither full (all {self.num_examples} examples) nor Poisson-sampled "
                f"(require_full_batch=False): Theorem 1 does not cover them, so the filter "
                f"certifies no epsilon for this run (use DPCallback's population epsilon)")
        return filter_epsilon(self.effective_budget, delta)

    # ---- hooks ---------------------------------------------------------------------------
    def on_fit_start(self, trainer, pl_module):
        self._source.on_fit_start(trainer)

    def on_train_start(self, trainer, pl_module):
        self._source.on_train_start(trainer)
        self._poisson = isinstance(train_scheme(trainer), PoissonScheme)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.last_active = None  # this step's decision is taken in on_before_optimizer_step
        idx = self._source.indices(trainer, batch)
        poisson_ok = self._poisson and self.require_full_batch is not True
        full = True
        if not poisson_ok:
            size = idx.shape[0]
            if _is_distributed():
                size = int(_all_reduce_sum(torch.tensor([size], dtype=torch.int64)).item())
            full = size == self.num_examples
            if not full and self.require_full_batch is not False:
                why = ("require_full_batch=True" if self.require_full_batch else
                       "the train batch sampler does not implement Poisson sampling")
                raise ValueError(
                    f"IndividualGDPFilter needs full-batch DP-GD or Poisson sampling: got a "
                    f"batch of {size} examples, num_examples={self.num_examples} ({why}). Use "
                    f"DPCallback(scheme=GDPScheme()) or a batch of all N examples, or Poisson "
                    f"sampling (DPCallback(scheme=PoissonScheme(q))); require_full_batch=False "
                    f"trains anyway but certifies nothing")
        self._covered = full or poisson_ok
        self._indices = idx

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self._indices is None:
            raise ValueError("no batch indices recorded for this step")
        if getattr(optimizer, "bookkeeper", None) is None and self.attach(optimizer):
            return  # hooks: decided inside optimizer.step, from Opacus' own norms (_clip_mask)
        indices, norms, bookkeeper, sigma, clip = step_inputs(self._indices, optimizer,
                                                              "IndividualGDPFilter")
        params = dp_params(optimizer) if bookkeeper is None else []
        active = self.mask_and_record(params, indices, norms, sigma, clip)
        if bookkeeper is not None:  # ghost mode: inactive examples get coefficient 0
            bookkeeper.set_mask(active.to(norms.dtype))
        if not self._covered:
            self.uncertified_steps += 1
        self._indices = None

    def attach(self, optimizer) -> bool:
        """Fold the filter into ``optimizer``'s per-sample clipping factors (hooks mode).

        From then on every ``optimizer.step()`` takes the filter's decision on the batch whose
        dataset indices :meth:`set_batch_indices` gave (Lightning gives them itself), from the
        per-sample norms Opacus computes for clipping, and multiplies each example's clip
        factor by its active mask (:mod:`opacus_structured.accountants.clip_factors`): no
        ``grad_sample`` tensor is read or written beyond the stock step. Returns ``False``
        (attaching nothing) for an optimizer that does not clip as Opacus' ``DPOptimizer``
        (per-layer clipping: the filter then zeroes inactive rows itself; ghost clipping: use
        :meth:`attach_ghost`). Raises ``ValueError`` for a correlated-noise optimizer."""
        dp_settings(optimizer)
        if not install_clip_factors(optimizer):
            return False
        add_clip_mask(optimizer, self, self._clip_mask)
        return True

    def _clip_mask(self, optimizer, norms: torch.Tensor) -> torch.Tensor:
        indices, self._indices = self._indices, None
        indices, sigma, clip = clip_step_inputs(indices, optimizer, norms, "IndividualGDPFilter")
        active = self.mask_and_record([], indices, norms, sigma, clip)
        if not self._covered:
            self.uncertified_steps += 1
        return active

    def set_batch_indices(self, indices) -> None:
        """Dataset indices of the next batch (plain Opacus loops; Lightning sets them itself)."""
        self._indices = torch.as_tensor(indices)

    def attach_ghost(self, module, optimizer) -> None:
        """Filter inside Opacus' ghost-clipping backward (see module docstring).

        ``module``/``optimizer`` are what ``make_private(grad_sample_mode="ghost")`` returned.
        Each backward consumes the indices given by :meth:`set_batch_indices`.
        """
        def mask(norms: torch.Tensor) -> torch.Tensor:
            if self._indices is None:
                raise ValueError("call IndividualGDPFilter.set_batch_indices(indices) before "
                                 "each backward")
            sigma, clip = dp_settings(optimizer)
            active = self.mask_and_record([], to_device(self._indices, norms.device), norms, sigma,
                                          clip)
            self._indices = None
            return active.to(norms.dtype)

        set_clipping_mask(module, mask)

    def mask_and_record(self, params, indices: torch.Tensor, norms: torch.Tensor, sigma: float,
                        clip: float) -> torch.Tensor:
        """One filter step on tensors (used by the hooks; callable without Lightning).

        Returns the boolean active mask of the batch rows; zeroes the inactive rows of every
        ``p.grad_sample`` of ``params`` in place (pass ``[]`` in ghost mode, where the mask goes
        into the clipping coefficients instead) and records the active examples' μ².
        """
        dev = norms.device
        if self.accountant.observed_mu_sq.device != dev:
            self.accountant.to(dev)
            self.dropped = self.dropped.to(dev)
        mu = norms.to(torch.float64).clamp(max=clip) / (sigma * clip)
        if _is_distributed():  # decide on the global batch, identically on every rank
            local_idx = indices
            indices, lengths = _all_gather_cat(indices.to(torch.int64), return_lengths=True)
            mu = _all_gather_cat(mu)
            start = sum(lengths[:_dist_rank()])
            local = slice(start, start + local_idx.shape[0])
        else:
            local = slice(None)
        spent = self.accountant.observed_mu_sq[indices]
        active = spent + mu * mu <= self.budget ** 2 * (1.0 + self.tolerance)
        if self.permanent_drop:
            active &= ~self.dropped[indices]
            self.dropped[indices] |= ~active
        mine = active[local]
        for p in params:
            gs = getattr(p, "grad_sample", None)
            if gs is not None:
                gs.mul_(mine.to(gs.dtype).view(-1, *([1] * (gs.ndim - 1))))
        self.accountant.record(indices, mu * active, sigma)
        self.active_history.append(active.sum())
        self.last_active = mine
        return mine

    def active_counts(self) -> list[int]:
        """Number of active examples at each step (one host transfer)."""
        if not self.active_history:
            return []
        return torch.stack(self.active_history).cpu().tolist()

    # ---- checkpointing -------------------------------------------------------------------
    def state_dict(self):
        return {"accountant": self.accountant.state_dict(), "dropped": self.dropped.cpu(),
                "budget": self.budget, "tolerance": self.tolerance,
                "active_counts": self.active_counts(),
                "uncertified_steps": self.uncertified_steps}

    def load_state_dict(self, state_dict):
        if abs(float(state_dict["budget"]) - self.budget) > 0:
            raise ValueError(f"checkpoint has budget {state_dict['budget']}, this filter "
                             f"{self.budget}")
        self.accountant.load_state_dict(state_dict["accountant"])
        self.dropped = torch.as_tensor(state_dict["dropped"], dtype=torch.bool).clone()
        self.active_history = [torch.tensor(c) for c in state_dict.get("active_counts", [])]
        self.uncertified_steps = int(state_dict.get("uncertified_steps", 0))
