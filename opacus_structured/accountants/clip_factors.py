r"""Per-sample clipping in one norm pass, with factors that callbacks may scale (issue 32).

Opacus' ``DPOptimizer.clip_and_accumulate`` (hooks mode) reads every per-sample gradient
``p.grad_sample`` twice: once for the per-example norms

.. math:: \lVert g_b\rVert_2 = \Big(\sum_p \lVert g_{b,p}\rVert_2^2\Big)^{1/2},

and once for the clipped sum :math:`\sum_b c_b\, g_b` (one ``einsum`` per parameter) with
:math:`c_b = \min\big(1, C/(\lVert g_b\rVert_2 + 10^{-6})\big)`.
:func:`install_clip_factors` replaces that method, on one optimizer instance, by the same two
passes (the same kernels, in the same order) plus work on the :math:`B` norms only:

* **masks** :math:`m_b \in [0, 1]` registered with :func:`add_clip_mask` (the individual GDP
  filter's active mask): :math:`c_b \leftarrow c_b\, m_b`. With :math:`m_b \in \{0, 1\}` the
  sum is bit-identical to zeroing the inactive rows of every ``grad_sample`` first (``c·1 = c``
  and ``c·0 = 0`` exactly), which is what a filter did before, at the cost of one more pass;
* **observers** registered with :func:`add_norm_observer` (the per-sample ε tracker) receive
  the norms of the examples' gradients *as summed*: :math:`\lVert g_b\rVert_2\, m_b` (0 for an
  example a mask removed, whose contribution is 0). Every example's contribution to the sum
  has norm :math:`\le \min(\lVert g_b\rVert_2, C)\, m_b`, which is what individual accounting
  charges;
* **non-finite examples** (an inf/NaN entry, or a norm that overflows): masks and observers
  see their norm as :math:`+\infty` (charged the clipping norm, the worst case). With
  ``zero_nonfinite=True`` (what the release guard installs,
  :mod:`opacus_structured.accountants.release_guard`) such an example also gets
  :math:`c_b = 0`, and on a step that holds one its rows are replaced by zeros before the sum
  (:math:`0 \cdot \infty` is NaN, and stock Opacus would release a NaN step). Finding out costs
  one host synchronisation per step (the sum of the ``B`` norms is finite iff every norm is,
  unless it overflows; then the per-example test decides); without ``zero_nonfinite`` the
  step has none.

A mask or observer therefore costs :math:`O(B)` work on the step and never touches a
``grad_sample`` tensor: the number of kernels that read or write per-sample gradients is the
stock step's (``tests/test_clip_factors.py`` counts them).

Only optimizers that use Opacus' own ``DPOptimizer.clip_and_accumulate`` are converted
(``DPOptimizer``, ``DistributedDPOptimizer``, the correlated-noise variants of both); the
per-layer and adaptive optimizers keep their method, and :func:`install_clip_factors` returns
``False`` for them, so a caller falls back to its own (slower) path. Ghost clipping and
book-keeping have their own coefficient hooks (:mod:`opacus_structured.optim.ghost_clipping`,
:mod:`opacus_structured.optim.bookkeeping`).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from opacus.optimizers.optimizer import DPOptimizer, _check_processed_flag, _mark_as_processed

__all__ = ["install_clip_factors", "has_clip_factors", "add_clip_mask", "add_norm_observer",
           "remove_clip_hooks"]

_KEY = "_clip_factor_hooks"

#: ``mask(optimizer, norms) -> Optional[Tensor[B]]``; ``observer(optimizer, norms) -> None``
Hook = Callable[[object, torch.Tensor], Optional[torch.Tensor]]


class _ClipFactorHooks:
    """The masks and observers of one optimizer, keyed by their owner (re-adding replaces)."""

    def __init__(self):
        self.masks: dict = {}
        self.observers: dict = {}
        self.zero_nonfinite = False


def _hooks(optimizer) -> Optional[_ClipFactorHooks]:
    return getattr(optimizer, "__dict__", {}).get(_KEY)


def has_clip_factors(optimizer) -> bool:
    """Whether ``optimizer`` clips through :func:`clip_and_accumulate` (installed)."""
    return _hooks(optimizer) is not None


def install_clip_factors(optimizer, *, zero_nonfinite: bool = False) -> bool:
    """Make ``optimizer`` clip with :func:`clip_and_accumulate` (idempotent; a later call with
    ``zero_nonfinite=True`` turns the non-finite rule on, see the module docstring).

    Returns ``False``, changing nothing, when the optimizer does not clip with Opacus' own
    ``DPOptimizer.clip_and_accumulate`` (per-layer, adaptive, ghost or book-keeping clipping,
    or a method someone replaced on the instance)."""
    if has_clip_factors(optimizer):
        _hooks(optimizer).zero_nonfinite |= bool(zero_nonfinite)
        return True
    if not isinstance(optimizer, DPOptimizer) or \
            type(optimizer).clip_and_accumulate is not DPOptimizer.clip_and_accumulate or \
            "clip_and_accumulate" in optimizer.__dict__:
        return False
    optimizer.__dict__[_KEY] = _ClipFactorHooks()
    optimizer.__dict__[_KEY].zero_nonfinite = bool(zero_nonfinite)
    optimizer.clip_and_accumulate = lambda: clip_and_accumulate(optimizer)
    return True


def _require(optimizer, what: str) -> _ClipFactorHooks:
    if not install_clip_factors(optimizer):
        raise ValueError(f"{type(optimizer).__name__} does not clip with Opacus' "
                         f"DPOptimizer.clip_and_accumulate, so a {what} cannot be folded into "
                         f"its clipping factors (check install_clip_factors() first)")
    return _hooks(optimizer)


def add_clip_mask(optimizer, owner, mask: Hook) -> None:
    """Register ``mask(optimizer, norms)`` (called once per clipping, in registration order;
    ``norms`` already carry the earlier masks): it returns ``None`` or a tensor of ``B``
    factors in [0, 1] (bool or float) that multiply the clipping factors. ``owner`` keys the
    registration (adding again replaces it)."""
    _require(optimizer, "mask").masks[id(owner)] = mask


def add_norm_observer(optimizer, owner, observer: Hook) -> None:
    """Register ``observer(optimizer, norms)``, called after every mask with the norms of the
    gradients as summed (``‖g_b‖·m_b``: 0 for a removed example, ``inf`` for a non-finite
    one)."""
    _require(optimizer, "norm observer").observers[id(owner)] = observer


def remove_clip_hooks(optimizer, owner) -> None:
    """Remove ``owner``'s mask and observer from ``optimizer`` (no-op if none)."""
    hooks = _hooks(optimizer)
    if hooks is not None:
        hooks.masks.pop(id(owner), None)
        hooks.observers.pop(id(owner), None)


def clip_and_accumulate(optimizer) -> None:
    """Opacus' ``DPOptimizer.clip_and_accumulate`` with the masks, observers and non-finite
    rule of the module docstring (stores the clipped sum in ``p.summed_grad``); installed by
    :func:`install_clip_factors`, so the optimizer has its hooks."""
    hooks = _hooks(optimizer)
    grad_samples = optimizer.grad_samples
    bad = None
    if len(grad_samples[0]) == 0:  # empty batch (Poisson), as Opacus
        norms = factor = torch.zeros((0,), device=grad_samples[0].device)
    else:
        per_param = [g.reshape(len(g), -1).norm(2, dim=-1) for g in grad_samples]
        device = per_param[0].device
        norms = torch.stack([n.to(device) for n in per_param], dim=1).norm(2, dim=1)
        factor = (optimizer.max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
        finite = None
        # one host sync: the sum of the norms is finite iff every norm is (or it overflows:
        # norms near 1e308, and the exact test finds them all finite)
        if hooks.zero_nonfinite and not math.isfinite(float(norms.sum())):
            finite = torch.isfinite(norms)
            if not bool(finite.all()):
                bad = ~finite
                factor = torch.where(finite, factor, torch.zeros_like(factor))
        if hooks.masks or hooks.observers:  # no host sync
            finite = torch.isfinite(norms) if finite is None else finite
            norms = torch.where(finite, norms, torch.full_like(norms, float("inf")))
    for mask in list(hooks.masks.values()):
        m = mask(optimizer, norms)
        if m is None:
            continue
        if m.shape != norms.shape:
            raise ValueError(f"a clip mask returned shape {tuple(m.shape)} for a batch of "
                             f"{norms.shape[0]} examples")
        m = m.to(device=norms.device, dtype=norms.dtype)
        factor = factor * m
        norms = torch.where(m == 0, torch.zeros_like(norms), norms * m)  # inf·0 -> 0
    for observer in list(hooks.observers.values()):
        observer(optimizer, norms)
    for p in optimizer.params:
        _check_processed_flag(p.grad_sample)
        grad_sample = optimizer._get_flat_grad_sample(p).to(p.dtype)
        if bad is not None:
            rows = bad.to(grad_sample.device).view(-1, *([1] * (grad_sample.dim() - 1)))
            grad_sample = grad_sample.masked_fill(rows, 0)
        coefficients = factor.to(grad_sample.device).to(p.dtype)
        grad = torch.einsum("i,i...", coefficients, grad_sample)
        if p.summed_grad is not None:
            p.summed_grad += grad
        else:
            p.summed_grad = grad
        _mark_as_processed(p.grad_sample)
