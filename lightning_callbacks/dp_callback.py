"""``DPCallback``: make an unmodified ``lightning.pytorch`` LightningModule differentially private.

Attaching :class:`DPCallback` to a :class:`lightning.pytorch.Trainer` does seven things, most by
one part (a class in its own module) that the callback composes:

1. **the module** (:class:`~lightning_callbacks.dp_module.PerSampleGradients`): refuses layers
   incompatible with per-sample gradients (BatchNorm etc., via Opacus' ``ModuleValidator``) and
   hooks the sub-modules for per-sample gradients (Opacus ``GradSampleHooks``; with
   ``grad_sample_mode="ghost"`` book-keeping hooks that clip without materialising per-sample
   gradients, see :mod:`opacus_structured.optim.bookkeeping`); the LightningModule itself is not
   replaced, and the hooks come off after the fit with the attributes Opacus leaves on the
   parameters and layers (``grad_sample``, ``summed_grad``, ``_forward_counter``,
   ``activations``), as Opacus' own cleanup leaves a module;
2. **the data** (:class:`~lightning_callbacks.dp_loader.SamplerInstaller`): verifies that the
   train DataLoader draws batches with the sampler the accountant prices (checked through the
   sampler's ``scheme``), or installs the scheme's sampler (``scheme.sampler(...)`` from the
   scheme registry, or a sampler / factory you pass) with Opacus' empty-batch collate wrapper;
3. **the optimizer** (:class:`~lightning_callbacks.dp_optimizer.OptimizerWrapper`): exactly one
   optimizer, which is (or is wrapped into) an Opacus ``DPOptimizer`` or a supplied subclass
   such as a correlated-noise optimizer, in the variant for ``(ghost, distributed)``; it must
   step every trainable parameter of the LightningModule not declared public
   (``public_parameters=``), and no other optimizer may step them during the fit
   (:mod:`opacus_structured.accountants.parameter_guard`);
4. **the accounting** (:class:`~lightning_callbacks.dp_budget.PrivacyBudget`): attaches the
   accountant (``SchemeAccountant(scheme)`` or the one you pass) to the installed DataLoader,
   which checks it with the rules of Opacus' ``make_private`` path, and prices every optimizer
   step through the optimizer's step hook, which runs after clipping and noising and before the
   parameter update (Opacus order: clip, noise, scale, hook, step); **logs** ``dp/epsilon`` and
   ``dp/delta`` to the Lightning logger every step (or every ``log_every_n_steps``; and
   ``dp/epsilon_epoch`` at the end of an epoch, under the same ``log_every_n_steps`` rule), and
   **stops** training before the step that would take ε above ``target_epsilon`` (a hard check
   before each noisy release raises if something, e.g. ``min_steps``, keeps training going);
5. **gradient accumulation** (:class:`~lightning_callbacks.dp_accumulation.GradientAccumulation`):
   ``Trainer(accumulate_grad_batches=K)`` is priced, not refused. A noisy step releases the
   clipped rows of the ``n ≤ K`` batches since the last ``zero_grad`` (``K``, fewer in the last
   group of an epoch) under one noise; the tracked sampler knows those ``n`` draws and the
   accountant prices each at ``σ/√n`` (noise splitting; a Poisson release is a
   ``Binomial(n, q)`` mixture, which the tests compare against). Each row is clipped on its
   own loss (Lightning's ``loss / K`` is undone in the per-sample hooks) and the noisy sum is
   divided by ``n × expected_batch_size``: the step is DP-SGD on the union of the ``n`` draws.
   Correlated noise (one draw per noise position) with ``K > 1`` is refused at fit start;
6. **rows per example** (``rows_per_example=k``): the batches carry no row tokens under
   Lightning, so a step that clips more rows than its batches hold (``k`` augmented views of
   each example concatenated in one forward, hooks or ghost mode) raises, naming the cause,
   unless ``k`` is declared: each draw is then priced at ``σ/k`` (``k`` rows of one example,
   each clipped to C, move the sum by up to ``kC``), and at most ``k`` rows per example are
   accepted;
7. **the checkpoint** (:class:`~lightning_callbacks.dp_checkpoint.DPCheckpoint`): saves the
   accountant, the sampler position and the noise generator (and an optimizer's extra noise
   state if it defines ``noise_state_dict`` / ``load_noise_state_dict``) in the Lightning
   checkpoint, so a run resumed with ``trainer.fit(..., ckpt_path=...)`` draws the same batches
   and neither loses nor double-counts a step; it draws the same noise only where the resume
   provably continues the run from its last released step (never a replayed noise: an
   earlier checkpoint, or a new process, draws fresh noise; see
   :mod:`~lightning_callbacks.dp_checkpoint`).

Lightning hook order used (automatic optimisation; Lightning's "Hooks" documentation,
https://lightning.ai/docs/pytorch/stable/common/hooks.html):
``on_fit_start`` (parts 1-6, and 7 for a state loaded before it) → per batch
``training_step`` → ``zero_grad`` (``on_before_zero_grad``: the clipped sum starts anew) →
``backward`` → ``on_after_backward`` → ``on_before_optimizer_step`` (our budget guard) → DP
clip / noise / accountant hook → inner step → ``on_train_batch_end`` (our logging and
stopping). With ``accumulate_grad_batches=K`` Lightning calls ``zero_grad`` during the first
batch of each group and steps on its last.

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

The optimizer's normaliser (``expected_batch_size``) is public where declared
(:class:`~lightning_callbacks.dp_normaliser.PublicNormaliser`, which also records
:attr:`DPCallback.sampling_constants`).

``scheme_of_batch_sampler`` (from :mod:`opacus_structured.samplers.verification`),
``build_sampler`` and ``loader_with_batch_sampler`` (from :mod:`lightning_callbacks.dp_loader`)
are re-exported here.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Union

import torch
from torch.utils.data import Sampler

try:  # the namespace gluonts uses; fall back for old installs
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover
    import pytorch_lightning as pl

from opacus.optimizers import DPOptimizer

from opacus_structured._validation import check_int, check_open_unit, check_positive
from opacus_structured.accountants import noise_lineage, parameter_guard
from opacus_structured.accountants.base import AccountantNotAttachedError, SchemeAccountant
from opacus_structured.accountants.budget_guard import guard_budget
from opacus_structured.accounting import pld as pld_lib
from opacus_structured.samplers import public_sizes
from opacus_structured.samplers._generator import fresh_seed
from opacus_structured.samplers.verification import scheme_of_batch_sampler
from opacus_structured.schemes.base import Scheme

from .dp_accumulation import GradientAccumulation
from .dp_budget import PrivacyBudget
from .dp_checkpoint import DPCheckpoint
from .dp_loader import (
    SamplerFactory,
    SamplerInstaller,
    TrackedBatchSampler,
    build_sampler,
    loader_with_batch_sampler,
    resolve_scheme,
)
from .dp_module import PerSampleGradients, check_layers
from .dp_normaliser import PublicNormaliser
from .dp_optimizer import OptimizerWrapper

__all__ = ["DPCallback", "scheme_of_batch_sampler", "build_sampler",
           "loader_with_batch_sampler"]

log = logging.getLogger(__name__)


def _carry_noise_state(previous, optimizer) -> None:
    """A later ``fit`` of the same callback builds a new DP optimizer: a correlated-noise one
    continues the previous optimizer's stream (ring buffers and noise step), since the
    accountant goes on pricing the same run."""
    save = getattr(previous, "noise_state_dict", None)
    load = getattr(optimizer, "load_noise_state_dict", None)
    if previous is None or previous is optimizer or not (callable(save) and callable(load)):
        return
    if int(getattr(previous, "noise_step", 0)) > 0:
        load(save())


def _public_list(public_parameters) -> Any:
    """``public_parameters`` kept as a list (a generator is read once, at construction)."""
    if public_parameters is None or isinstance(public_parameters,
                                               (str, torch.Tensor, torch.nn.Module)):
        return public_parameters
    return list(public_parameters)


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
        accountant: an Opacus accountant; its ``scheme``, if it has one, must be the run's.
            Default ``SchemeAccountant(scheme, discretization=discretization)``. One without
            ``attach`` (e.g. ``"individual-gdp"``) is fed the steps without the DataLoader
            checks.
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
            optimizer and every hooked module run once per forward; works under DDP and with
            ``accumulate_grad_batches`` too.
        allow_estimate: accept an accountant whose ε is an estimate, not a guarantee (bound
            kind ``"monte-carlo"``). Its value is logged as ``<log_prefix>epsilon_mc_estimate``
            (never as ``<log_prefix>epsilon``) and :meth:`epsilon` returns it labelled. Default
            False: such an accountant is refused.
        stop_on_estimate: with ``allow_estimate``, allow ``target_epsilon`` to stop training on
            the estimate (default False: ``target_epsilon`` with an estimate is refused).
        log_every_n_steps: compute, record (``epsilon_history``) and log ε every this many
            optimizer steps and at the last step of the fit (default 1: every step). Every step
            is priced either way, and the budget guard of ``target_epsilon`` still runs before
            every step; a larger value only saves the composition of a long history per step.
            ``dp/epsilon_epoch`` follows the same rule: it is logged at an epoch's end when ε
            is already known for the steps taken (computed at that step) or when at least this
            many steps were priced since ε was last computed (with short epochs, a per-epoch
            ε would otherwise compose the whole history every few steps: the cost of a fit
            would grow with the history's privacy-loss distribution, i.e. with ε).
        dataset_size: a declared **public** dataset size n (under add/remove adjacency the
            real size is private): the mean-reduction normaliser is ``n × sample_rate`` (a
            float, the same for every neighbouring dataset) instead of the sampler's
            ``len(dataset) × sample_rate``; for a rate-less ``PoissonScheme`` the rate is
            ``1/len(sampler)`` of the scheme's sampler, from the data, so give the scheme its
            rate.
        expected_batch_size: a declared public normaliser (takes precedence). Without either,
            the normaliser is Opacus' ``int(len(dataset) × sample_rate)`` (the sampler's, e.g.
            Λ for structured subsampling), a
            :class:`~opacus_structured.samplers.public_sizes.DatasetSizeFromDataWarning` says
            so once, and :attr:`sampling_constants` (also ``accountant.sampling_constants``)
            records ``dataset_size_source="data"``.
        public_parameters: parameters of the LightningModule (an iterable of parameters or
            of names from ``named_parameters()``, or a sub-module) declared **public**:
            trained only on public data, or not moved from private gradients. Your claim, not
            checked. Every other trainable parameter (``requires_grad=True``) must be in the
            optimizer ``configure_optimizers`` returns, else fit start raises
            :class:`~opacus_structured.accountants.parameter_guard.UncoveredParametersError`
            naming them; during the fit no other optimizer may step them
            (:mod:`~opacus_structured.accountants.parameter_guard`).
        budget: a :class:`~opacus_structured.dataset_budget.DatasetBudget`: every noisy step
            is charged to the dataset's budget file before its noise; training stops before
            the step that would take the dataset's total past the cap (as for
            ``target_epsilon``), and a step released anyway raises
            :class:`~opacus_structured.dataset_budget.BudgetExhaustedError` before its noise
            (:mod:`~opacus_structured.accountants.budget_guard`; the run settles at fit end).
        rows_per_example: the most rows one example gives a noisy step (default 1), e.g. 2
            for two augmented views of each example concatenated in one forward. Your claim:
            the batches carry no row tokens under Lightning (checked only as "at most ``k``
            rows per example of the step's batches"); each draw is priced at ``σ/k``. A step
            with more rows than declared raises, naming the fix.

    ``Trainer(accumulate_grad_batches=K)`` is priced (module doc, part 5); :attr:`steps` then
    counts the draws priced (``n`` per release), as ``len(accountant)`` does.
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
                 stop_on_estimate: bool = False, log_every_n_steps: int = 1,
                 dataset_size: Optional[int] = None,
                 expected_batch_size: Optional[float] = None, public_parameters=None,
                 budget=None, rows_per_example: int = 1):
        super().__init__()
        #: The dataset's budget (``None``: none) and the guard charging it (set at fit start).
        self.dataset_budget, self.budget_guard = budget, None
        self.rows_per_example = check_int("rows_per_example", rows_per_example, minimum=1)
        self._accumulation = GradientAccumulation()
        self._released_in_batch = False
        #: Parameters (or names in ``pl_module.named_parameters()``) declared public.
        self.public_parameters = _public_list(public_parameters)
        self.dataset_size, _, self.expected_batch_size = public_sizes.check_declared(
            dataset_size=dataset_size, expected_batch_size=expected_batch_size)
        #: Where the rate and the normaliser came from (set at fit start; module
        #: :mod:`opacus_structured.samplers.public_sizes`).
        self.sampling_constants: Optional[dict] = None
        self.log_every_n_steps = check_int("log_every_n_steps", log_every_n_steps, minimum=1)
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
        self.optimizer_class = optimizer_class
        self.optimizer_kwargs = dict(optimizer_kwargs or {})
        self.wrap_optimizer = bool(wrap_optimizer)
        self._optimizer_part = OptimizerWrapper(
            optimizer_class=optimizer_class, optimizer_kwargs=self.optimizer_kwargs,
            noise_multiplier=self.noise_multiplier, max_grad_norm=self.max_grad_norm,
            loss_reduction=loss_reduction, ghost=grad_sample_mode == "ghost",
            wrap=self.wrap_optimizer)
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        self.install_sampler = bool(install_sampler)
        self.loss_reduction = loss_reduction
        self.log_prefix = log_prefix
        self.discretization = check_positive("discretization", discretization)
        self.scheme: Scheme = resolve_scheme(scheme, sampler, accountant)
        self._normaliser = PublicNormaliser(
            self.scheme, dataset_size=self.dataset_size,
            expected_batch_size=self.expected_batch_size, wrap_optimizer=self.wrap_optimizer)
        self._budget = PrivacyBudget(
            self.scheme, accountant, delta=self.delta, target_epsilon=self.target_epsilon,
            discretization=self.discretization, allow_estimate=allow_estimate,
            stop_on_estimate=stop_on_estimate, log_prefix=log_prefix)
        self.accountant = self._budget.accountant
        self.allow_estimate = self._budget.allow_estimate
        self.stop_on_estimate = self._budget.stop_on_estimate
        self.epsilon_metric = self._budget.epsilon_metric
        seed = fresh_seed() if seed is None else int(seed)
        self.sampler_generator = torch.Generator().manual_seed(seed)
        self._noise_seed = seed + 1
        self.noise_generator = torch.Generator().manual_seed(self._noise_seed)
        self._loader_part = SamplerInstaller(self.scheme, sampler, install=self.install_sampler,
                                             generator=self.sampler_generator)
        self._module_part = PerSampleGradients(grad_sample_mode,
                                               max_grad_norm=self.max_grad_norm,
                                               loss_reduction=loss_reduction)
        self._checkpoint = DPCheckpoint(self.scheme)
        ledger = getattr(self.accountant, "_ledger", None)
        #: the run's noise lineage: the accountant's (its privacy ledger owns the noise
        #: position), or the callback's own for an accountant without a ledger
        self._own_lineage = getattr(ledger, "noise", None) is None
        self._noise_lineage = (noise_lineage.NoiseLineage() if self._own_lineage
                               else ledger.noise)

        self.sampler: Optional[TrackedBatchSampler] = None
        self.optimizer: Optional[DPOptimizer] = None
        self.sample_rate: Optional[float] = None
        self.epsilon_history: list[tuple[int, float]] = []  # (optimizer steps, ε)
        self._epsilon_steps = 0  # the steps ε was last computed for (log_every_n_steps)
        self._ready = False
        #: a checkpoint older than the last release was loaded into this live run: its sampler
        #: goes on (Lightning's loader restore is ignored until training starts)
        self._sampler_goes_on = False

    # ---- what kind of ε -------------------------------------------------------------------
    @property
    def bound_kind(self):
        """The accountant's bound kind (its ``bound``, else the scheme's): a
        :class:`~opacus_structured.accounting.bounds.BoundKind` when it is a known one."""
        return self._budget.bound_kind

    @property
    def is_guarantee(self) -> bool:
        """Whether the reported ε is a certain upper bound (bound kind tight or upper)."""
        return self._budget.is_guarantee

    # ---- verification + wrapping at fit start -------------------------------------------
    def on_fit_start(self, trainer, pl_module) -> None:
        check_layers(pl_module)
        self._module_part.snapshot(pl_module)  # before the DP optimizer marks the parameters
        loader, self.sampler = self._loader_part.install(trainer)
        self.sampler.hold_position = self._sampler_goes_on
        self.sampler.rows_per_example = self.rows_per_example
        self._accumulation.attach(trainer, self.scheme, self.sampler, self.accountant)
        self.sample_rate = self._loader_part.sample_rate(self.sampler)
        record_step = self._release_hook(
            self._budget.attach(loader, self.sample_rate, step_draws=self.sampler.step_draws))

        normaliser = self._normaliser.value(loader, self.sampler, self.sample_rate)

        def expected_batch_size() -> float:
            return normaliser

        device = pl_module.device
        if self.noise_generator.device.type != device.type:
            # Opacus draws the noise on the parameters' device, with a generator living there
            self.noise_generator = torch.Generator(device=device).manual_seed(self._noise_seed)

        previous = self.optimizer
        self.optimizer = self._optimizer_part.install(
            trainer, expected_batch_size=expected_batch_size, generator=self.noise_generator,
            scheme=self.scheme, on_step=record_step)
        _carry_noise_state(previous, self.optimizer)
        self._accumulation.normalise(self.optimizer)  # n draws: n × expected_batch_size
        if self.optimizer.generator is not None:  # a module's DPOptimizer keeps its own
            self.noise_generator = self.optimizer.generator
        # every noise draw is checked against the run's lineage (never a replayed noise)
        noise_lineage.link(self.optimizer, self._noise_lineage)
        self.sampling_constants = self._normaliser.sampling_constants(
            loader, self.optimizer, normaliser, self.sample_rate, self.accountant)
        if self.public_parameters is not None:
            parameter_guard.declare_public_parameters(pl_module, self.public_parameters)
        # every trainable parameter is stepped by the DP optimizer, no other optimizer steps
        # them during the fit
        parameter_guard.guard_parameters(pl_module, self.optimizer, where="DPCallback")
        self._module_part.attach(pl_module)
        self._accumulation.unscale_per_sample_gradients(self._module_part.hooks)
        self.budget_guard = guard_budget(self.dataset_budget, self.optimizer, self.accountant,
                                         sample_rate=self.sample_rate, label="DPCallback")
        if self.grad_sample_mode == "ghost":
            self.optimizer.attach_bookkeeper(self._module_part.hooks)
        self._ready = True
        if self._checkpoint.pending is not None:
            self._checkpoint.apply_pending(**self._live_parts())
            self._budget.forget()

    def _release_hook(self, record_step):
        """The optimizer's step hook: price the release, then empty the tracked sum."""
        def on_release(optimizer) -> None:
            record_step(optimizer)
            self._accumulation.on_release()
            self._released_in_batch = True

        return on_release

    # ---- accounting ---------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """Noisy optimizer steps priced so far (including before a resume)."""
        return self._budget.steps

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
        return self._budget.epsilon()

    def _next_step(self) -> tuple[Optional[float], Optional[float]]:
        sigma = (self.optimizer.noise_multiplier if self.optimizer is not None
                 else self.noise_multiplier)
        return sigma, self.sample_rate

    def _next_release(self, exact: bool = False) -> dict:
        """Draws and rows per example of the next release (``K`` draws under accumulation,
        or the ``n`` the sum being released holds when ``exact``)."""
        return {"parts": self._accumulation.next_release(exact=exact),
                "rows_per_example": self.rows_per_example}

    def prospective_epsilon(self) -> float:
        """ε(δ) if one more noisy step were taken at the current noise multiplier (summing
        ``accumulate_grad_batches`` draws, with ``rows_per_example`` rows each)."""
        self._require_priced()
        return self._budget.prospective_epsilon(*self._next_step(), **self._next_release())

    def _budget_exhausted(self, exact: bool = False) -> bool:
        if self._budget.target_epsilon is None:
            return False
        self._require_priced()
        return self._budget.exhausted(*self._next_step(), **self._next_release(exact))

    # ---- training hooks -----------------------------------------------------------------
    def _dataset_budget_exhausted(self) -> bool:
        """The next step does not fit the dataset's budget (it is reserved when it does)."""
        release = (self._accumulation.k, self.rows_per_example)  # a whole group next
        return self.budget_guard is not None and not self.budget_guard.admits_next(release)

    def on_train_start(self, trainer, pl_module) -> None:
        self._sampler_goes_on = False  # Lightning has restored its loader state by now
        if self.sampler is not None:
            self.sampler.hold_position = False
        if self._dataset_budget_exhausted():
            log.warning("DPCallback: the next step does not fit the dataset budget %s; not "
                        "training", self.dataset_budget.path)
            trainer.should_stop = True
        elif self._budget_exhausted():
            log.warning("DPCallback: one more step would take ε above target_epsilon=%s "
                        "(ε now %.4f); not training", self.target_epsilon, self.epsilon())
            trainer.should_stop = True

    def on_before_zero_grad(self, trainer, pl_module, optimizer) -> None:
        self._accumulation.on_zero_grad()  # the clipped sum starts anew with this batch

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # Hard guard before the noisy release: never exceed the budget.
        if self._budget_exhausted(exact=True):
            raise RuntimeError(
                f"DPCallback: the next step would take ε above target_epsilon="
                f"{self.target_epsilon} (ε now {self.epsilon():.4f}) but training did not "
                f"stop (min_steps / min_epochs?); refusing to release it")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.sampler is not None:
            self.sampler.batch_trained()
        released, self._released_in_batch = self._released_in_batch, False
        exhausted = self._budget_exhausted() or self._dataset_budget_exhausted()
        last = exhausted or (0 < trainer.max_steps <= trainer.global_step)
        accumulating = self._accumulation.k > 1 and not released  # no release this batch
        if last or (self.steps % self.log_every_n_steps == 0 and not accumulating):
            eps = self.epsilon()
            self.epsilon_history.append((self.steps, eps))
            self._budget.log_step(pl_module, eps)
            self._epsilon_steps = self.steps
        if exhausted:
            log.info("DPCallback: stopping at ε=%.4f, the next step would exceed "
                     "target_epsilon=%s or the dataset budget", self.epsilon(),
                     self.target_epsilon)
            trainer.should_stop = True

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        # under the log_every_n_steps rule (its docstring): no composition of the whole
        # history at every short epoch
        since = self.steps - self._epsilon_steps
        if since == 0 or since >= self.log_every_n_steps:
            self._budget.log_epoch(pl_module, self.epsilon())
            self._epsilon_steps = self.steps

    def on_fit_end(self, trainer, pl_module) -> None:
        if self.budget_guard is not None:
            self.budget_guard.settle()
        self._module_part.remove()
        parameter_guard.release_parameters(pl_module)

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._module_part.remove()
        parameter_guard.release_parameters(pl_module)

    # ---- checkpoint state ---------------------------------------------------------------
    def _live_parts(self) -> dict[str, Any]:
        return dict(accountant=self.accountant, noise_generator=self.noise_generator,
                    lineage=self._noise_lineage, own_lineage=self._own_lineage,
                    sampler=self.sampler, optimizer=self.optimizer,
                    journal=self.dataset_budget)

    def state_dict(self) -> dict[str, Any]:
        return self._checkpoint.state_dict(**self._live_parts())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self._ready:
            self._sampler_goes_on = self._checkpoint.apply(state_dict, **self._live_parts())
        else:  # objects are built at fit start; the priced steps count from now on
            self._checkpoint.defer(state_dict, accountant=self.accountant,
                                   lineage=self._noise_lineage, own_lineage=self._own_lineage)
            # another scheme: a new phase, whose sampler must not take the old one's state
            self._sampler_goes_on = self._checkpoint.is_new_phase(state_dict)
        self._budget.forget()
