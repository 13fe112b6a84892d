"""``DPCallback``: make an unmodified ``lightning.pytorch`` LightningModule differentially private.

Attaching :class:`DPCallback` to a :class:`lightning.pytorch.Trainer`

1. **verifies** at fit start that the training can be private and refuses otherwise, with a
   message saying what to change: no layer incompatible with per-sample gradients (BatchNorm
   etc., via Opacus' ``ModuleValidator``); exactly one optimizer, which is (or is wrapped into)
   an Opacus ``DPOptimizer``; no gradient accumulation; a train DataLoader that draws batches
   with the sampler the accountant prices (checked through the sampler's ``scheme``);
2. **wraps** the module for per-sample gradients (Opacus ``GradSampleHooks``: hooks on the
   sub-modules, the LightningModule itself is not replaced; with ``grad_sample_mode="ghost"``
   book-keeping hooks that clip without materialising per-sample gradients, see
   :mod:`opacus_structured.optim.bookkeeping`) and the optimizer (``DPOptimizer`` or a
   supplied subclass such as a correlated-noise optimizer);
3. **installs** the scheme's sampler in the train DataLoader (``scheme.sampler(...)``, or a
   sampler / factory you pass), with Opacus' empty-batch collate wrapper;
4. **prices** every optimizer step with the scheme's accountant (``SchemeAccountant(scheme)``
   or the one you pass) through the optimizer's step hook, which runs after clipping and
   noising and before the parameter update (Opacus order: clip, noise, scale, hook, step);
5. **logs** ``dp/epsilon`` and ``dp/delta`` to the Lightning logger every step (and
   ``dp/epsilon_epoch`` every epoch), and **stops** training before the step that would take
   ε above ``target_epsilon`` (a hard check before each noisy release raises if something,
   e.g. ``min_steps``, keeps training going);
6. **checkpoints** the accountant, the sampler position and the noise generator (and an
   optimizer's extra noise state if it defines ``noise_state_dict`` /
   ``load_noise_state_dict``) in the Lightning checkpoint, so a run resumed with
   ``trainer.fit(..., ckpt_path=...)`` draws the same batches and noise and neither loses nor
   double-counts a step.

Lightning hook order used (automatic optimisation, ``docs/architecture.md`` /
ecosystem notes §4.2): ``training_step`` → ``zero_grad`` → ``backward`` →
``on_after_backward`` → ``on_before_optimizer_step`` (our budget guard) → DP clip / noise /
accountant hook → inner step → ``on_train_batch_end`` (our logging and stopping).

**Multi-process (DDP)**: under ``Trainer(strategy="ddp", use_distributed_sampler=False)`` the
callback wraps the sampler in
:class:`~opacus_structured.samplers.distributed.DistributedBatchSampler` (every rank draws the
same global batch, rank 0's sampler state is broadcast, each rank trains on its shard) and the
optimizer in the distributed variant (``DPOptimizer`` -> Opacus ``DistributedDPOptimizer``,
``CorrelatedNoiseDPOptimizer`` -> ``DistributedCorrelatedNoiseDPOptimizer``: noise on rank 0,
then all-reduce) with the per-rank ``expected_batch_size / world_size``. The accountant then
prices exactly the single-process mechanism; every rank keeps an identical accountant.

The ε reported is what the scheme's accountant proves: an upper bound (``accountant.bound``);
a scheme whose bound kind is "lower" is refused, since a lower bound is no guarantee.

**Estimates are labelled, never logged as ``dp/epsilon``.** An accountant whose bound kind is
not a guarantee (``BoundKind.MONTE_CARLO``, e.g. ``bminsep-mc``: a high-confidence estimate
that holds with probability ≥ 1 − q) is refused unless ``allow_estimate=True``. Then
:meth:`DPCallback.epsilon` returns the accountant's labelled value (a
:class:`~opacus_structured.accounting.monte_carlo.MonteCarloEpsilon`, which prints its label),
the value is logged as ``dp/epsilon_mc_estimate`` (``dp/epsilon_estimate`` for another
non-guarantee kind; :attr:`DPCallback.epsilon_metric`) and never as ``dp/epsilon``, and
``target_epsilon`` is refused unless ``stop_on_estimate=True`` (stopping on an estimate stops
within the budget only with the estimate's confidence).

**No ε from a callback that priced nothing.** :meth:`DPCallback.epsilon` and
:meth:`DPCallback.prospective_epsilon` raise
:class:`~opacus_structured.accountants.base.AccountantNotAttachedError` on a callback that was
never attached to a fit (``on_fit_start`` never ran) and holds no restored steps: its 0 would
describe no training. After fit start and before the first step, 0 is the honest value.
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any, Callable, Optional, Union

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

try:  # the namespace gluonts uses (ecosystem notes §0); fall back for old installs
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover
    import pytorch_lightning as pl

from opacus.data_loader import wrap_collate_with_empty
from opacus.grad_sample import GradSampleHooks
from opacus.optimizers import (
    DistributedDPOptimizer,
    DPOptimizer,
    DPOptimizerFastGradientClipping,
)
from opacus.optimizers.ddpoptimizer_fast_gradient_clipping import (
    DistributedDPOptimizerFastGradientClipping,
)
from opacus.utils.uniform_sampler import UniformWithReplacementSampler
from opacus.validators import ModuleValidator

from opacus_structured._validation import check_open_unit, check_positive
from opacus_structured.accountants.base import AccountantNotAttachedError, SchemeAccountant
from opacus_structured.accounting import pld as pld_lib
from opacus_structured.optim import distributed as dist_opt
from opacus_structured.optim.bookkeeping import BookKeepingHooks, bookkeeping_optimizer_class
from opacus_structured.optim.correlated_noise import CorrelatedNoiseDPOptimizer
from opacus_structured.optim.ghost_clipping import CorrelatedNoiseDPOptimizerFastGradientClipping
from opacus_structured.samplers.distributed import DistributedBatchSampler
from opacus_structured.samplers.poisson import PoissonBatchSampler, _fresh_seed
from opacus_structured.schemes.base import BoundKind, Scheme
from opacus_structured.schemes.gdp import GDPScheme
from opacus_structured.schemes.poisson import PoissonScheme

from .batch_indices import BatchIndexRecorder, FullBatchSampler

__all__ = ["DPCallback", "scheme_of_batch_sampler", "build_sampler",
           "loader_with_batch_sampler"]

log = logging.getLogger(__name__)

SamplerFactory = Callable[[Any, torch.Generator], Sampler]


# ---- samplers and loaders (generic over the sampler protocol) ----------------------------
def scheme_of_batch_sampler(batch_sampler) -> Optional[Scheme]:
    """The scheme a DataLoader's batch sampler implements, or ``None`` if it implements none.

    Our samplers carry a ``scheme`` attribute; Opacus' ``UniformWithReplacementSampler``
    (``DPDataLoader``) is Poisson sampling at its ``sample_rate``. Anything else (e.g.
    ``BatchSampler(RandomSampler)``: shuffling with a fixed batch size) has no scheme.
    """
    if batch_sampler is None:
        return None
    scheme = getattr(batch_sampler, "scheme", None)
    if isinstance(scheme, Scheme):
        return scheme
    if type(batch_sampler) is UniformWithReplacementSampler:
        return PoissonScheme(sample_rate=batch_sampler.sample_rate)
    return None


def _describe_loader(loader: DataLoader) -> str:
    bs = loader.batch_sampler
    if bs is None:
        return "no batch sampler (automatic batching disabled)"
    inner = getattr(bs, "sampler", None)
    if inner is not None:
        shuffled = " (shuffling)" if type(inner).__name__ == "RandomSampler" else ""
        return (f"{type(bs).__name__}({type(inner).__name__}){shuffled} with batch_size="
                f"{getattr(bs, 'batch_size', '?')}")
    return type(bs).__name__


def build_sampler(scheme: Scheme, dataset, generator: torch.Generator):
    """``scheme.sampler_for_dataset(len(dataset), generator=generator)``; for a
    :class:`PoissonScheme` without a rate of its own, a :class:`PoissonBatchSampler`; for
    :class:`~opacus_structured.schemes.gdp.GDPScheme` (full-batch DP-GD) a
    :class:`~lightning_callbacks.batch_indices.FullBatchSampler` (every example every step).

    Schemes whose sampler needs more than the dataset size (structured time-series windows, the
    padded truncated-Poisson dataset) raise: pass ``sampler=`` (an instance or a
    ``(dataset, generator)`` factory).
    """
    try:
        return scheme.sampler_for_dataset(len(dataset), generator=generator)
    except NotImplementedError:
        if isinstance(scheme, GDPScheme):
            return FullBatchSampler(len(dataset))
        if isinstance(scheme, PoissonScheme) and scheme.sample_rate is not None:
            return PoissonBatchSampler(len(dataset), scheme.sample_rate, generator=generator)
        raise ValueError(f"scheme {scheme.name!r} has no sampler; pass DPCallback(sampler=...)"
                         ) from None


def loader_with_batch_sampler(loader: DataLoader, batch_sampler) -> DataLoader:
    """A copy of ``loader`` drawing batches with ``batch_sampler``.

    Keeps the dataset, workers and collate function (wrapped with Opacus'
    ``wrap_collate_with_empty`` so empty batches keep their structure, as in ``DPDataLoader``).
    """
    if isinstance(loader.dataset, IterableDataset):
        raise ValueError("the train DataLoader wraps an IterableDataset; DP sampling needs a "
                         "map-style dataset (indexable, with len())")
    kwargs = dict(num_workers=loader.num_workers, pin_memory=loader.pin_memory,
                  timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
                  multiprocessing_context=loader.multiprocessing_context,
                  persistent_workers=loader.persistent_workers)
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    collate = loader.collate_fn
    if not hasattr(collate, "wrapped_collator_fn"):  # not yet an Opacus empty-batch wrapper
        collate = wrap_collate_with_empty(collate_fn=collate)
    return DataLoader(loader.dataset, batch_sampler=batch_sampler, collate_fn=collate, **kwargs)


class _TrackedBatchSampler(BatchIndexRecorder, Sampler):
    """Wraps a protocol sampler and snapshots its ``state_dict()`` before every draw.

    Lightning prefetches a batch (and workers prefetch more), so the sampler's own state at
    checkpoint time is ahead of training; the snapshot taken before drawing batch ``k`` is the
    state to resume from once ``k`` batches of the epoch have been trained on. It also records
    the index list of every batch drawn (:class:`~.batch_indices.BatchIndexRecorder`), which
    is how the individual-accounting callbacks know which examples each batch holds.
    """

    def __init__(self, inner):
        self.inner = inner
        self.scheme = scheme_of_batch_sampler(inner)
        self.consumed = 0         # batches of the current epoch trained on (set by DPCallback)
        self._offset = 0          # batches already consumed when iteration resumes mid-epoch
        self._snapshots: dict[int, Any] = {}

    def __len__(self):
        return len(self.inner)

    def __iter__(self):
        k, self._offset = self._offset, 0
        self.consumed = k
        self._snapshots = {}
        self._start_recording()
        it = iter(self.inner)
        while True:
            self._snapshots[k] = self.inner.state_dict()
            try:
                batch = next(it)
            except StopIteration:
                return
            k += 1
            self._record(batch)
            yield batch

    def state_for_consumed(self):
        snap = self._snapshots.get(self.consumed)
        return snap if snap is not None else self.inner.state_dict()

    def prune(self):
        for k in [k for k in self._snapshots if k < self.consumed]:
            del self._snapshots[k]

    def restore(self, state, consumed: int):
        self.inner.load_state_dict(state)
        self._offset = consumed if 0 < consumed < len(self.inner) else 0
        self.consumed = self._offset


def _float32_up(x: float) -> float:
    """``x`` as a float32 rounded *up*: loggers store float32, and ε must not be rounded down."""
    import numpy as np

    y = np.float32(x)
    if float(y) < x:
        y = np.nextafter(y, np.float32(np.inf))
    return float(y)


def _optimizer_variants() -> dict:
    """``{base: {(ghost, distributed): class}}`` for the two optimizers DPCallback maps."""
    return {
        DPOptimizer: {(False, False): DPOptimizer, (False, True): DistributedDPOptimizer,
                      (True, False): DPOptimizerFastGradientClipping,
                      (True, True): DistributedDPOptimizerFastGradientClipping},
        CorrelatedNoiseDPOptimizer: {
            (False, False): CorrelatedNoiseDPOptimizer,
            (False, True): dist_opt.DistributedCorrelatedNoiseDPOptimizer,
            (True, False): CorrelatedNoiseDPOptimizerFastGradientClipping,
            (True, True): dist_opt.DistributedCorrelatedNoiseDPOptimizerFastGradientClipping},
    }


# ---- the callback -----------------------------------------------------------------------
class DPCallback(pl.Callback):
    """Differentially private training of an unmodified LightningModule (see module doc).

    Args:
        delta: target δ in (0, 1) for the reported ε.
        noise_multiplier: σ (noise std / clipping norm); required when the callback wraps the
            optimizer.
        max_grad_norm: per-sample clipping norm C; required when wrapping.
        scheme: the batching scheme (e.g. ``PoissonScheme(sample_rate=1/64)``); default: the
            ``scheme`` of ``sampler`` or of ``accountant``.
        sampler: a batch sampler following the protocol (``scheme`` attribute, ``__len__`` =
            steps per epoch, ``state_dict``/``load_state_dict``), or a factory
            ``(dataset, generator) -> sampler``; default ``build_sampler(scheme, ...)``.
        accountant: an Opacus accountant with a ``scheme``; default
            ``SchemeAccountant(scheme, discretization=discretization)``.
        target_epsilon: stop before the step that would take ε(δ) above this.
        optimizer_class: DPOptimizer subclass used to wrap the module's optimizer (e.g. a
            correlated-noise optimizer); ``optimizer_kwargs`` are passed to it.
        wrap_optimizer: if False, ``configure_optimizers`` must already return a DPOptimizer
            (e.g. from ``PrivacyEngine.make_private``); the callback then only verifies and
            accounts.
        install_sampler: if False, the train DataLoader must already use the scheme's sampler
            (verified); if True a plain loader is rebuilt around the scheme's sampler.
        seed: seeds the sampler and noise generators (fresh OS randomness by default).
        discretization: PLD discretisation of the default accountant (pessimistic).
        loss_reduction: "mean" or "sum", how the training loss aggregates the batch.
        log_prefix: prefix of the logged metric names.
        grad_sample_mode: ``"hooks"`` (default: Opacus materialises per-sample gradients) or
            ``"ghost"``: per-sample norms by the ghost (Gram) trick and the clipped sum by
            book-keeping in the same single backward
            (:mod:`opacus_structured.optim.bookkeeping`), no per-sample gradients for
            ``nn.Linear`` layers and no second backward, so the LightningModule stays
            unmodified. Same clipped sum, same noise, same ε. Needs the callback to wrap the
            optimizer and every module run once per step; works under DDP too.
        allow_estimate: accept an accountant whose ε is an estimate, not a guarantee (bound
            kind ``"monte-carlo"``). Its value is logged as ``<log_prefix>epsilon_mc_estimate``
            (never as ``<log_prefix>epsilon``) and :meth:`epsilon` returns it labelled. Default
            False: such an accountant is refused.
        stop_on_estimate: with ``allow_estimate``, allow ``target_epsilon`` to stop training on
            the estimate (default False: ``target_epsilon`` with an estimate is refused).
    """

    #: Its batch sampler records each batch's dataset indices (``batch_indices``).
    installs_recording_sampler = True

    def __init__(self, *, delta: float, noise_multiplier: Optional[float] = None,
                 max_grad_norm: Optional[float] = None, scheme: Optional[Scheme] = None,
                 sampler: Union[Sampler, SamplerFactory, None] = None,
                 accountant: Optional[SchemeAccountant] = None,
                 target_epsilon: Optional[float] = None,
                 optimizer_class: type = DPOptimizer,
                 optimizer_kwargs: Optional[dict] = None, wrap_optimizer: bool = True,
                 install_sampler: bool = True, seed: Optional[int] = None,
                 discretization: float = pld_lib.DEFAULT_DISCRETIZATION,
                 loss_reduction: str = "mean", log_prefix: str = "dp/",
                 grad_sample_mode: str = "hooks", allow_estimate: bool = False,
                 stop_on_estimate: bool = False):
        super().__init__()
        if grad_sample_mode not in ("hooks", "ghost"):
            raise ValueError(f"grad_sample_mode must be 'hooks' or 'ghost', got "
                             f"{grad_sample_mode!r}")
        if grad_sample_mode == "ghost" and not wrap_optimizer:
            raise ValueError("grad_sample_mode='ghost' needs DPCallback to wrap the optimizer "
                             "(wrap_optimizer=True): the clipped sum is written by its step")
        self.grad_sample_mode = grad_sample_mode
        self.delta = check_open_unit("delta", delta)
        self.target_epsilon = (None if target_epsilon is None
                               else check_positive("target_epsilon", target_epsilon))
        if wrap_optimizer:
            if noise_multiplier is None or max_grad_norm is None:
                raise ValueError("noise_multiplier and max_grad_norm are required when "
                                 "DPCallback wraps the optimizer (wrap_optimizer=True)")
        self.noise_multiplier = (None if noise_multiplier is None
                                 else check_positive("noise_multiplier", noise_multiplier))
        self.max_grad_norm = (None if max_grad_norm is None
                              else check_positive("max_grad_norm", max_grad_norm))
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, DPOptimizer)):
            raise ValueError(f"optimizer_class must be a subclass of opacus DPOptimizer, got "
                             f"{optimizer_class!r}")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        self.optimizer_class = optimizer_class
        self.optimizer_kwargs = dict(optimizer_kwargs or {})
        self.wrap_optimizer = bool(wrap_optimizer)
        self.install_sampler = bool(install_sampler)
        self.loss_reduction = loss_reduction
        self.log_prefix = log_prefix
        self.discretization = check_positive("discretization", discretization)

        # scheme <- sampler / accountant; all given ones must agree
        sampler_scheme = None
        if sampler is None:
            pass
        elif hasattr(sampler, "__iter__"):
            sampler_scheme = scheme_of_batch_sampler(sampler)
            if sampler_scheme is None:
                raise ValueError(f"sampler {sampler!r} has no `scheme` attribute: the callback "
                                 f"cannot tell which accountant prices it")
        elif not callable(sampler):
            raise ValueError("sampler must be a batch sampler or a (dataset, generator) factory")
        candidates = [("scheme", scheme), ("sampler.scheme", sampler_scheme),
                      ("accountant.scheme", getattr(accountant, "scheme", None))]
        given = [(k, s) for k, s in candidates if s is not None]
        if not given:
            raise ValueError("DPCallback needs a scheme (e.g. PoissonScheme(sample_rate=q)), a "
                             "sampler with a `scheme`, or an accountant with a `scheme`")
        for k, s in given[1:]:
            if s != given[0][1]:
                raise ValueError(f"{given[0][0]}={given[0][1]!r} and {k}={s!r} disagree: the "
                                 f"accountant must price the sampler the DataLoader uses")
        self.scheme: Scheme = given[0][1]
        if self.scheme.bound == BoundKind.LOWER:
            raise ValueError(f"scheme {self.scheme.name!r} only yields a lower bound on ε, "
                             f"which is no privacy guarantee; pick a scheme with an upper bound")
        self.accountant = accountant if accountant is not None else SchemeAccountant(
            self.scheme, discretization=self.discretization)
        self.allow_estimate = bool(allow_estimate)
        self.stop_on_estimate = bool(stop_on_estimate)
        kind = self.bound_kind
        if kind == BoundKind.LOWER:
            raise ValueError(f"the accountant ({type(self.accountant).__name__}) only yields a "
                             f"lower bound on ε, which is no privacy guarantee")
        if not self.is_guarantee:
            if not self.allow_estimate:
                raise ValueError(
                    f"the accountant's ε is a {kind} estimate (bound kind {str(kind)!r}), not a "
                    f"guarantee: DPCallback would log it as {log_prefix}epsilon and stop on it "
                    f"as if it bounded ε. Pass allow_estimate=True to log it, labelled, as "
                    f"{log_prefix}{self._estimate_metric(kind)} (certify the noise multiplier "
                    f"first, e.g. scheme.certify(...)), or use a scheme with an upper bound")
            if self.target_epsilon is not None and not self.stop_on_estimate:
                raise ValueError(
                    f"target_epsilon={self.target_epsilon} with a {kind} estimate of ε: "
                    f"stopping on an estimate keeps ε below the target only with the "
                    f"estimate's confidence; pass stop_on_estimate=True to stop on it anyway, "
                    f"or drop target_epsilon")
        elif stop_on_estimate:
            raise ValueError("stop_on_estimate=True needs an accountant whose ε is an estimate "
                             "(and allow_estimate=True); this accountant gives a guarantee")
        self.epsilon_metric = (f"{log_prefix}epsilon" if self.is_guarantee
                               else f"{log_prefix}{self._estimate_metric(kind)}")
        self._sampler_arg = sampler
        seed = _fresh_seed() if seed is None else int(seed)
        self.sampler_generator = torch.Generator().manual_seed(seed)
        self.noise_generator = torch.Generator().manual_seed(seed + 1)

        self.sampler: Optional[_TrackedBatchSampler] = None
        self.optimizer: Optional[DPOptimizer] = None
        self.sample_rate: Optional[float] = None
        self.epsilon_history: list[tuple[int, float]] = []  # (optimizer steps, ε)
        self._hooks = None
        self._pending: Optional[dict] = None
        self._ready = False
        self._memo: dict = {}

    # ---- what kind of ε -------------------------------------------------------------------
    @property
    def bound_kind(self):
        """The accountant's bound kind (its ``bound``, else the scheme's): a
        :class:`~opacus_structured.accounting.bounds.BoundKind` when it is a known one."""
        kind = getattr(self.accountant, "bound", None)
        if kind is None:
            kind = self.scheme.bound
        try:
            return BoundKind(kind)
        except ValueError:
            return kind

    @property
    def is_guarantee(self) -> bool:
        """Whether the reported ε is a certain upper bound (bound kind tight or upper)."""
        kind = self.bound_kind
        return isinstance(kind, BoundKind) and kind.is_guarantee

    @staticmethod
    def _estimate_metric(kind) -> str:
        return "epsilon_mc_estimate" if kind == BoundKind.MONTE_CARLO else "epsilon_estimate"

    # ---- verification + wrapping at fit start -------------------------------------------
    def on_fit_start(self, trainer, pl_module) -> None:
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) merges "
                f"batches into one noisy step, which changes the sampling scheme the accountant "
                f"prices; use accumulate_grad_batches=1 and a larger sample rate instead")
        self._check_layers(pl_module)
        loader = self._install_sampler(trainer)
        self._wrap_optimizer(trainer, loader)
        self._attach_grad_sampler(pl_module)
        if self.grad_sample_mode == "ghost":
            self.optimizer.attach_bookkeeper(self._hooks)
        self._ready = True
        if self._pending is not None:
            state, self._pending = self._pending, None
            self._apply_state(state)

    def _check_layers(self, pl_module) -> None:
        problems = []
        for name, sub in pl_module.named_modules():
            validator = ModuleValidator.VALIDATORS.get(type(sub))
            if validator is None:
                continue
            if not any(p.requires_grad for p in sub.parameters(recurse=False)):
                continue
            for err in validator(sub):
                problems.append(f"{name or '<root>'} ({type(sub).__name__}): {err}")
        if problems:
            raise ValueError(
                "the LightningModule has layers incompatible with DP-SGD per-sample gradients:\n  "
                + "\n  ".join(problems)
                + "\nreplace them before training, e.g. `model = "
                  "opacus.validators.ModuleValidator.fix(model)` (BatchNorm -> GroupNorm, "
                  "LSTM -> DPLSTM) and build the optimizer on the fixed model's parameters")

    def _install_sampler(self, trainer) -> DataLoader:
        fit_loop = trainer.fit_loop
        if getattr(fit_loop, "_combined_loader", None) is not None:
            raise RuntimeError("the train DataLoader was set up before DPCallback.on_fit_start; "
                               "DPCallback cannot install or verify its sampler")
        source = fit_loop._data_source
        loader = source.dataloader()
        if not isinstance(loader, DataLoader):
            raise ValueError(f"DPCallback needs a single torch DataLoader for training, got "
                             f"{type(loader).__name__}")
        current = scheme_of_batch_sampler(loader.batch_sampler)
        if current is not None and current != self.scheme:
            raise ValueError(
                f"the train DataLoader's batch sampler implements {current!r} but the accountant "
                f"prices {self.scheme!r}: build both from the same scheme")
        if current is None and not self.install_sampler:
            raise ValueError(
                f"the train DataLoader draws batches with {_describe_loader(loader)}, but the "
                f"accountant prices {self.scheme!r}, whose ε is only valid for that scheme's "
                f"sampler: pass batch_sampler=scheme.sampler(...) (e.g. PoissonBatchSampler) to "
                f"the DataLoader, or let DPCallback install it (install_sampler=True)")
        if current is not None:
            inner = loader.batch_sampler
            if isinstance(inner, _TrackedBatchSampler):
                inner = inner.inner
        elif self._sampler_arg is not None and hasattr(self._sampler_arg, "__iter__"):
            inner = self._sampler_arg
        elif self._sampler_arg is not None:
            inner = self._sampler_arg(loader.dataset, self.sampler_generator)
            if scheme_of_batch_sampler(inner) != self.scheme:
                raise ValueError(f"the sampler factory built a sampler for "
                                 f"{scheme_of_batch_sampler(inner)!r}, not {self.scheme!r}")
        else:
            inner = build_sampler(self.scheme, loader.dataset, self.sampler_generator)
        for method in ("state_dict", "load_state_dict"):
            if not callable(getattr(inner, method, None)):
                raise ValueError(f"sampler {inner!r} has no {method}(): a resumed run could not "
                                 f"continue its batches")
        inner = self._distribute(trainer, inner, loader.dataset)
        self.sampler = _TrackedBatchSampler(inner)
        new_loader = loader_with_batch_sampler(loader, self.sampler)
        if trainer.world_size > 1 and getattr(new_loader.collate_fn, "first_batch", 1) is None:
            new_loader.collate_fn([loader.dataset[0]])  # a rank's first shard may be empty
        source.instance = new_loader  # fit_loop.setup_data() will now use it
        expected = self.scheme.expected_sample_rate()
        self.sample_rate = expected if expected is not None else 1.0 / len(self.sampler)
        return new_loader

    @staticmethod
    def _distribute(trainer, inner, dataset):
        """Under DDP: the rank's shard of the global batches (see module doc)."""
        if trainer.world_size <= 1:
            return inner
        if getattr(trainer._accelerator_connector, "use_distributed_sampler", False):
            raise ValueError("DPCallback under DDP needs Trainer(use_distributed_sampler=False): "
                             "Lightning's DistributedSampler would re-partition the DP batches; "
                             "the callback shards the scheme's global batches itself")
        if isinstance(inner, DistributedBatchSampler):
            if (inner.num_replicas, inner.rank) != (trainer.world_size, trainer.global_rank):
                raise ValueError(f"the DistributedBatchSampler has num_replicas="
                                 f"{inner.num_replicas}, rank={inner.rank} but the trainer has "
                                 f"world_size={trainer.world_size}, rank={trainer.global_rank}")
            return inner
        return DistributedBatchSampler(inner, num_replicas=trainer.world_size,
                                       rank=trainer.global_rank)

    def _optimizer_class_for(self, world_size: int) -> type:
        """The optimizer class for this mode: ``(ghost, distributed)`` picks the variant of
        DPOptimizer / CorrelatedNoiseDPOptimizer; any other class must already be it."""
        ghost, distributed = self.grad_sample_mode == "ghost", world_size > 1
        cls = self.optimizer_class
        variants = _optimizer_variants()
        if cls in variants:
            cls = variants[cls][(ghost, distributed)]
        elif distributed and "Distributed" not in cls.__name__:
            raise ValueError(f"optimizer_class={cls.__name__} adds noise on every rank; under "
                             f"DDP pass a distributed optimizer class (noise on rank 0 only), "
                             f"e.g. opacus DistributedDPOptimizer")
        if not ghost:
            return cls
        if not issubclass(cls, DPOptimizerFastGradientClipping):
            raise ValueError(f"grad_sample_mode='ghost' needs optimizer_class DPOptimizer, "
                             f"CorrelatedNoiseDPOptimizer or a DPOptimizerFastGradientClipping "
                             f"subclass (a distributed one under DDP), got {cls.__name__}")
        return bookkeeping_optimizer_class(cls)

    def _wrap_optimizer(self, trainer, loader: DataLoader) -> None:
        optimizers = list(trainer.optimizers)
        if len(optimizers) != 1:
            raise ValueError(
                f"DPCallback supports exactly one optimizer, got {len(optimizers)}: several "
                f"noisy releases on the same batch are not priced by the scheme's accountant")
        opt = optimizers[0]
        if isinstance(opt, DPOptimizer):
            if trainer.world_size > 1 and "Distributed" not in type(opt).__name__:
                raise ValueError(f"configure_optimizers returned {type(opt).__name__}, which adds "
                                 f"noise on every rank under DDP; return a distributed DP "
                                 f"optimizer or let DPCallback wrap the optimizer")
            if self.noise_multiplier is not None and not math.isclose(
                    opt.noise_multiplier, self.noise_multiplier):
                raise ValueError(f"configure_optimizers returned a DPOptimizer with "
                                 f"noise_multiplier={opt.noise_multiplier} but DPCallback was "
                                 f"given {self.noise_multiplier}")
            if opt.generator is None:  # give it a seeded generator so resumption is exact
                opt.generator = self.noise_generator
            else:
                self.noise_generator = opt.generator
        elif not self.wrap_optimizer:
            raise ValueError(
                f"configure_optimizers returned {type(opt).__module__}.{type(opt).__name__}, "
                f"which neither clips per-sample gradients nor adds noise: return an Opacus "
                f"DPOptimizer (e.g. from PrivacyEngine.make_private) or let DPCallback wrap it "
                f"(wrap_optimizer=True, the default)")
        else:
            batch = getattr(self.sampler.inner, "expected_batch_size", None)
            if batch is None:
                batch = len(loader.dataset) * self.sample_rate
            world = max(1, trainer.world_size)
            opt = self._optimizer_class_for(world)(
                opt, noise_multiplier=self.noise_multiplier, max_grad_norm=self.max_grad_norm,
                expected_batch_size=max(1, int(batch)) / world if world > 1
                else max(1, int(batch)), loss_reduction=self.loss_reduction,
                generator=self.noise_generator, **self.optimizer_kwargs)
            trainer.strategy.optimizers = [opt]
        coefficients = getattr(opt, "noise_coefficients", None)
        self.scheme.check_noise_correlation([1.0] if coefficients is None else coefficients)
        previous = opt.step_hook

        def hook(optimizer, _previous=previous):
            self._record_step(optimizer)
            if _previous is not None:
                _previous(optimizer)

        opt.attach_step_hook(hook)
        self.optimizer = opt

    def _attach_grad_sampler(self, pl_module) -> None:
        if self.grad_sample_mode == "ghost":
            if hasattr(pl_module, "autograd_grad_sample_hooks"):
                raise ValueError("the module already has Opacus hooks; grad_sample_mode='ghost' "
                                 "installs its own")
            self._hooks = BookKeepingHooks(pl_module, max_grad_norm=self.max_grad_norm,
                                           batch_first=True, loss_reduction=self.loss_reduction)
            return
        if hasattr(pl_module, "autograd_grad_sample_hooks"):
            return  # already hooked (e.g. PrivacyEngine.make_private(module=self))
        self._hooks = GradSampleHooks(pl_module, batch_first=True,
                                      loss_reduction=self.loss_reduction, strict=False)

    # ---- accounting ---------------------------------------------------------------------
    def _record_step(self, optimizer) -> None:
        self.accountant.step(noise_multiplier=optimizer.noise_multiplier,
                             sample_rate=self.sample_rate * optimizer.accumulated_iterations)

    @property
    def steps(self) -> int:
        """Noisy optimizer steps priced so far (including before a resume)."""
        return len(self.accountant)

    def _key(self):
        try:
            return tuple(tuple(h) for h in self.accountant.history)
        except TypeError:
            return None

    def _require_priced(self) -> None:
        if not self._ready and len(self.accountant) == 0:
            raise AccountantNotAttachedError(
                "DPCallback was never attached to a Trainer (pass callbacks=[dp] to Trainer and "
                "call fit): no step was priced, so its epsilon would describe no training")

    def epsilon(self) -> float:
        """ε(δ) of all steps taken so far (0 after fit start, before the first step).

        A guarantee is returned as a float; with ``allow_estimate`` the accountant's labelled
        estimate (e.g. a ``MonteCarloEpsilon``) is returned as is, label included. Raises
        ``AccountantNotAttachedError`` if the callback never took part in a fit and holds no
        restored steps.
        """
        self._require_priced()
        if len(self.accountant) == 0:
            return 0.0
        key = self._key()
        if key is not None and key in self._memo:
            return self._memo[key]
        eps = self.accountant.get_epsilon(self.delta)
        if self.is_guarantee:
            if getattr(eps, "estimate", None) is not None:  # a labelled estimate after all
                raise ValueError(
                    f"the accountant reports bound kind {str(self.bound_kind)!r} but returned "
                    f"an estimate ({eps}); refusing to report it as a guarantee")
            eps = float(eps)
        if key is not None:
            self._memo = {key: eps}
        return eps

    def prospective_epsilon(self) -> float:
        """ε(δ) if one more step were taken at the current noise multiplier."""
        self._require_priced()
        sigma = (self.optimizer.noise_multiplier if self.optimizer is not None
                 else self.noise_multiplier)
        rate = self.sample_rate
        if rate is None:  # restored before fit: the last recorded step's rate
            history = getattr(self.accountant, "history", None) or []
            rate = history[-1][1] if history else self.scheme.expected_sample_rate()
        if sigma is None:
            history = getattr(self.accountant, "history", None) or []
            sigma = history[-1][0] if history else None
        if sigma is None or rate is None:
            raise ValueError("prospective_epsilon needs the noise multiplier and sample rate "
                             "of the next step: pass noise_multiplier= or call it during fit")
        saved = copy.deepcopy(self.accountant.state_dict())
        memo = dict(self._memo)
        self.accountant.step(noise_multiplier=sigma, sample_rate=rate)
        try:
            eps = self.epsilon()
            memo[self._key()] = eps
        finally:
            self.accountant.load_state_dict(saved)
            self._memo = memo
        return eps

    def _budget_exhausted(self) -> bool:
        if self.target_epsilon is None:
            return False
        if not self.is_guarantee and not self.stop_on_estimate:  # refused at construction
            return False
        return self.prospective_epsilon() > self.target_epsilon

    # ---- training hooks -----------------------------------------------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        if self._budget_exhausted():
            log.warning("DPCallback: one more step would take ε above target_epsilon=%s "
                        "(ε now %.4f); not training", self.target_epsilon, self.epsilon())
            trainer.should_stop = True

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # Hard guard before the noisy release: never exceed the budget.
        if self._budget_exhausted():
            raise RuntimeError(
                f"DPCallback: the next step would take ε above target_epsilon="
                f"{self.target_epsilon} (ε now {self.epsilon():.4f}) but training did not "
                f"stop (min_steps / min_epochs?); refusing to release it")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.sampler is not None:
            self.sampler.consumed += 1
            self.sampler.prune()
        eps = self.epsilon()
        self.epsilon_history.append((self.steps, eps))
        pl_module.log(self.epsilon_metric, _float32_up(eps), on_step=True, on_epoch=False,
                      prog_bar=True, logger=True, batch_size=1)
        pl_module.log(f"{self.log_prefix}delta", self.delta, on_step=True, on_epoch=False,
                      logger=True, batch_size=1)
        if self._budget_exhausted():
            log.info("DPCallback: stopping at ε=%.4f, the next step would exceed "
                     "target_epsilon=%s", eps, self.target_epsilon)
            trainer.should_stop = True

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        pl_module.log(f"{self.epsilon_metric}_epoch", _float32_up(self.epsilon()), on_step=False,
                      on_epoch=True, logger=True, batch_size=1)

    def on_fit_end(self, trainer, pl_module) -> None:
        self._teardown_hooks()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._teardown_hooks()

    def _teardown_hooks(self) -> None:
        if self._hooks is not None:
            self._hooks.remove_hooks()
            self._hooks = None

    # ---- checkpoint state ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"accountant": self.accountant.state_dict(),
                                 "scheme": self.scheme.to_dict(),
                                 "noise_generator": self.noise_generator.get_state(),
                                 "version": 1}
        if self.sampler is not None:
            state["sampler"] = self.sampler.state_for_consumed()
            state["consumed"] = self.sampler.consumed
        noise_state = getattr(self.optimizer, "noise_state_dict", None)
        if callable(noise_state):
            state["optimizer_noise"] = noise_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        saved = Scheme.from_dict(state_dict["scheme"])
        if saved != self.scheme:
            raise ValueError(f"the checkpoint was trained under {saved!r} but this DPCallback "
                             f"prices {self.scheme!r}; resume with the same scheme")
        if self._ready:
            self._apply_state(state_dict)
        else:  # objects are built at fit start; the priced steps count from now on
            self.accountant.load_state_dict(state_dict["accountant"])
            self._memo = {}
            self._pending = state_dict

    def _apply_state(self, state: dict[str, Any]) -> None:
        self.accountant.load_state_dict(state["accountant"])
        self._memo = {}
        self.noise_generator.set_state(state["noise_generator"])
        if "sampler" in state and self.sampler is not None:
            self.sampler.restore(state["sampler"], int(state.get("consumed", 0)))
        if "optimizer_noise" in state:
            loader = getattr(self.optimizer, "load_noise_state_dict", None)
            if not callable(loader):
                raise ValueError("the checkpoint holds correlated-noise state but the optimizer "
                                 "has no load_noise_state_dict(); use the same optimizer_class")
            loader(state["optimizer_noise"])
