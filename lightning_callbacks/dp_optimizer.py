"""``DPCallback``'s optimizer part: the one optimizer clips, adds the noise once, and reports.

:class:`OptimizerWrapper` takes the optimizer ``configure_optimizers`` returned and

* **verifies** it: exactly one optimizer (several noisy releases on one batch are not what the
  scheme's accountant prices); an Opacus ``DPOptimizer`` returned by the module must agree with
  the callback's noise multiplier and, under DDP, add its noise once across ranks; a plain
  optimizer is refused unless the callback may wrap it;
* **wraps** a plain optimizer in the class for the mode, from the ``(ghost, distributed)``
  variant table (:func:`optimizer_variants`; :func:`optimizer_class_for`): ``DPOptimizer`` →
  Opacus ``DistributedDPOptimizer`` / ``DPOptimizerFastGradientClipping`` / both, and the same
  for ``CorrelatedNoiseDPOptimizer``; with ``grad_sample_mode="ghost"`` the fast-gradient-
  clipping class gets the book-keeping step
  (:func:`~opacus_structured.optim.bookkeeping.bookkeeping_optimizer_class`). Under DDP the
  normaliser is the per-rank ``expected_batch_size / world_size`` (as Opacus'
  ``make_private(distributed=True)`` computes it). Whether a class adds the noise once across
  ranks is decided by its class hierarchy
  (:func:`~opacus_structured.optim.distributed.adds_noise_once_across_ranks`);
* **checks** that the scheme prices the optimizer's noise correlation
  (``scheme.check_noise_correlation``) and **hooks** the step: the given callback runs in the
  optimizer's step hook, after clipping and noising and before the parameter update (Opacus'
  order: clip, noise, scale, hook, step), then any hook the optimizer already had;
* **guards** the release (:func:`~opacus_structured.accountants.release_guard.guard_optimizer`):
  clipping and noise use the optimizer's current ``max_grad_norm`` at every step (a change is
  priced, or refused under correlated noise), an enabled ``torch.amp.GradScaler`` is refused,
  non-finite per-sample gradients are zeroed before the sum, adaptive clipping is refused.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from opacus.optimizers import (
    DistributedDPOptimizer,
    DPOptimizer,
    DPOptimizerFastGradientClipping,
)
from opacus.optimizers.ddpoptimizer_fast_gradient_clipping import (
    DistributedDPOptimizerFastGradientClipping,
)

from opacus_structured.accountants.release_guard import (
    guard_optimizer,
    is_adaptive,
    refuse_adaptive,
)
from opacus_structured.optim.bookkeeping import bookkeeping_optimizer_class
from opacus_structured.optim.correlated_noise import CorrelatedNoiseDPOptimizer
from opacus_structured.optim.distributed import (
    DistributedCorrelatedNoiseDPOptimizer,
    DistributedCorrelatedNoiseDPOptimizerFastGradientClipping,
    adds_noise_once_across_ranks,
)
from opacus_structured.optim.ghost_clipping import CorrelatedNoiseDPOptimizerFastGradientClipping
from opacus_structured.schemes.base import Scheme

__all__ = ["OptimizerWrapper", "optimizer_variants", "optimizer_class_for"]


def optimizer_variants() -> dict:
    """``{base: {(ghost, distributed): class}}`` for the two optimizers DPCallback maps."""
    return {
        DPOptimizer: {(False, False): DPOptimizer, (False, True): DistributedDPOptimizer,
                      (True, False): DPOptimizerFastGradientClipping,
                      (True, True): DistributedDPOptimizerFastGradientClipping},
        CorrelatedNoiseDPOptimizer: {
            (False, False): CorrelatedNoiseDPOptimizer,
            (False, True): DistributedCorrelatedNoiseDPOptimizer,
            (True, False): CorrelatedNoiseDPOptimizerFastGradientClipping,
            (True, True): DistributedCorrelatedNoiseDPOptimizerFastGradientClipping},
    }


def optimizer_class_for(optimizer_class: type, *, ghost: bool, distributed: bool) -> type:
    """The optimizer class for this mode: ``(ghost, distributed)`` picks the variant of
    DPOptimizer / CorrelatedNoiseDPOptimizer; any other class must already be it (``ValueError``
    naming ``optimizer_class`` otherwise)."""
    cls = optimizer_class
    variants = optimizer_variants()
    if cls in variants:
        cls = variants[cls][(ghost, distributed)]
    elif distributed and not adds_noise_once_across_ranks(cls):
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


def _skip_when_training_step_returns_none(optimizer: DPOptimizer) -> None:
    """Lightning skips a batch whose ``training_step`` returns ``None`` (no backward), but
    still calls ``optimizer.step(closure)``; a plain optimizer then does nothing, while a
    DPOptimizer would clip gradients that were never computed. Make the DP optimizer do
    nothing too: no noisy step is released, so nothing is priced (the privacy ledger sees the
    skipped draw and prices it by the scheme's release policy)."""
    if getattr(optimizer, "_skips_none_closure", False):
        return
    dp_step = type(optimizer).step

    def step(closure=None):
        if closure is None:
            return dp_step(optimizer)
        with torch.enable_grad():
            loss = closure()
        if loss is None:
            optimizer.zero_grad(set_to_none=True)
            return None
        return dp_step(optimizer)

    optimizer.step = step
    optimizer._skips_none_closure = True


class OptimizerWrapper:
    """Verifies or wraps the module's optimizer and hooks its step (module docstring).

    Args: as the same-named arguments of ``DPCallback`` (``wrap`` is ``wrap_optimizer``,
    ``ghost`` is ``grad_sample_mode == "ghost"``).
    """

    def __init__(self, *, optimizer_class: type, optimizer_kwargs: dict,
                 noise_multiplier: Optional[float], max_grad_norm: Optional[float],
                 loss_reduction: str, ghost: bool, wrap: bool):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, DPOptimizer)):
            raise ValueError(f"optimizer_class must be a subclass of opacus DPOptimizer, got "
                             f"{optimizer_class!r}")
        if is_adaptive(optimizer_class):
            refuse_adaptive(clipping="adaptive")
        self.optimizer_class = optimizer_class
        self.optimizer_kwargs = optimizer_kwargs
        self.noise_multiplier = noise_multiplier
        self.max_grad_norm = max_grad_norm
        self.loss_reduction = loss_reduction
        self.ghost = ghost
        self.wrap = wrap

    def install(self, trainer, *, expected_batch_size: Callable[[], float],
                generator: torch.Generator, scheme: Scheme, on_step: Callable) -> DPOptimizer:
        """The DP optimizer the trainer will step (set in ``trainer.strategy`` when wrapped),
        with ``on_step(optimizer)`` in its step hook. ``expected_batch_size()`` is the global
        expected batch size (asked only when wrapping). A module's own DPOptimizer without a
        generator gets ``generator`` (so a resumed run draws the same noise); its own generator
        is kept (read it back from ``optimizer.generator``)."""
        optimizers = list(trainer.optimizers)
        if len(optimizers) != 1:
            raise ValueError(
                f"DPCallback supports exactly one optimizer, got {len(optimizers)}: several "
                f"noisy releases on the same batch are not priced by the scheme's accountant")
        opt = optimizers[0]
        if isinstance(opt, DPOptimizer):
            self._check_given(opt, trainer.world_size)
            if opt.generator is None:  # give it a seeded generator so resumption is exact
                opt.generator = generator
        elif not self.wrap:
            raise ValueError(
                f"configure_optimizers returned {type(opt).__module__}.{type(opt).__name__}, "
                f"which neither clips per-sample gradients nor adds noise: return an Opacus "
                f"DPOptimizer (e.g. from PrivacyEngine.make_private) or let DPCallback wrap it "
                f"(wrap_optimizer=True, the default)")
        else:
            world = max(1, trainer.world_size)
            batch = expected_batch_size()  # public constant, or int(n·q) from the data
            cls = optimizer_class_for(self.optimizer_class, ghost=self.ghost,
                                      distributed=world > 1)
            opt = cls(opt, noise_multiplier=self.noise_multiplier,
                      max_grad_norm=self.max_grad_norm,
                      expected_batch_size=batch / world if world > 1 else batch,
                      loss_reduction=self.loss_reduction, generator=generator,
                      **self.optimizer_kwargs)
            trainer.strategy.optimizers = [opt]
        # one clip norm for clipping and noise, GradScaler refused, non-finite per-sample
        # gradients zeroed (opacus_structured.accountants.release_guard); refuses AdaClip
        guard_optimizer(opt, trainer.lightning_module)  # + the rows each step sums (issue 39)
        coefficients = getattr(opt, "noise_coefficients", None)
        scheme.check_noise_correlation([1.0] if coefficients is None else coefficients)
        previous = opt.step_hook

        def hook(optimizer, _previous=previous):
            on_step(optimizer)
            if _previous is not None:
                _previous(optimizer)

        opt.attach_step_hook(hook)
        _skip_when_training_step_returns_none(opt)
        return opt

    def _check_given(self, opt: DPOptimizer, world_size: int) -> None:
        if world_size > 1 and not adds_noise_once_across_ranks(opt):
            raise ValueError(f"configure_optimizers returned {type(opt).__name__}, which adds "
                             f"noise on every rank under DDP; return a distributed DP "
                             f"optimizer or let DPCallback wrap the optimizer")
        if self.noise_multiplier is not None and not math.isclose(
                opt.noise_multiplier, self.noise_multiplier):
            raise ValueError(f"configure_optimizers returned a DPOptimizer with "
                             f"noise_multiplier={opt.noise_multiplier} but DPCallback was "
                             f"given {self.noise_multiplier}")
