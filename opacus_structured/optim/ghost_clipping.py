r"""Ghost clipping (Opacus ``grad_sample_mode="ghost"``) for our optimizer wrappers.

In ghost mode Opacus never materialises per-sample gradients: a first backward computes the
per-sample gradient *norms* layer by layer (for a linear layer on sequences with the Gram trick
``‖∇W[b]‖² = Σ_{t,s} (a_{bt}·a_{bs})(g_{bt}·g_{bs})``, Li et al. 2022 "Large language models can
be strong differentially private learners", §4), then the loss is reweighted by the clipping
coefficients ``min(1, C/(‖g_b‖ + 1e-6))`` and a second backward yields the clipped sum
``Σ_b min(1, C/‖g_b‖) g_b`` directly in ``p.grad``; the optimizer only adds noise. The released
update is the same function of the batch as in hooks mode, so the privacy accounting is
unchanged.

* Correlated (BandMF) noise: :class:`CorrelatedNoisePrivacyEngine` with
  ``grad_sample_mode="ghost"`` already builds :data:`CorrelatedNoiseDPOptimizerFastGradientClipping`
  (the correlated-noise mixin over Opacus' ``DPOptimizerFastGradientClipping``) and returns
  Opacus' ``DPLossFastGradientClipping`` criterion as 4th value, exactly like
  ``PrivacyEngine.make_private``; the noise stream equals the hooks-mode one bit for bit
  (``tests/test_fast_dp_rnn.py``).
* Per-sample norms for consumers that need them (individual GDP filter/accounting):
  :func:`ghost_per_sample_norms` returns the global per-sample norms of the ghost pass (the
  analogue of :func:`~opacus_structured.accountants.individual_gdp.per_sample_norms`, which
  reads ``p.grad_sample``), and :func:`set_clipping_mask` multiplies the clipping coefficients
  by a 0/1 (or [0, 1]) per-sample mask *between* the two backward passes, so an excluded
  example contributes nothing to the clipped sum (the ghost analogue of zeroing its
  ``grad_sample`` rows).
"""

from __future__ import annotations

import torch
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import (
    GradSampleHooksFastGradientClipping,
)
from opacus.optimizers import DPOptimizerFastGradientClipping

from .correlated_noise import correlated_optimizer_class

__all__ = ["CorrelatedNoiseDPOptimizerFastGradientClipping", "ghost_per_sample_norms",
           "set_clipping_mask"]

#: Correlated-noise optimizer for ghost clipping (``grad_sample_mode="ghost"``): clipped sum from
#: Opacus' second backward, noise ``w_i = (C^{-1} Z)_i`` from :class:`CorrelatedNoiseMixin`.
CorrelatedNoiseDPOptimizerFastGradientClipping = correlated_optimizer_class(
    DPOptimizerFastGradientClipping)


def _ghost_module(module) -> GradSampleHooksFastGradientClipping:
    if not isinstance(module, GradSampleHooksFastGradientClipping):
        raise ValueError(f"module must be Opacus' GradSampleModuleFastGradientClipping or "
                         f"GradSampleHooksFastGradientClipping (what "
                         f"make_private(grad_sample_mode='ghost') returns, with wrap_model="
                         f"True or False), got {type(module).__name__}")
    return module


def ghost_per_sample_norms(module) -> torch.Tensor:
    """Global per-sample gradient L2 norms ``‖g_b‖`` (over all trainable parameters) of the
    last ghost backward, shape (B,). Valid after ``loss.backward()`` of the
    ``DPLossFastGradientClipping`` criterion and before the next forward.

    Raises ValueError when ``module`` is not a ghost-mode module or no backward ran yet.
    """
    module = _ghost_module(module)
    norms = getattr(module, "per_sample_gradient_norms", None)
    if norms is None:
        if not all(hasattr(p, "_norm_sample") for p in module.trainable_parameters):
            raise ValueError("no per-sample norms yet: run the ghost backward "
                             "(criterion(...).backward()) first")
        norms = module.get_norm_sample()
    return norms.detach()


def set_clipping_mask(module, mask) -> None:
    """Multiply the ghost clipping coefficients of the next backward(s) by ``mask`` (B,).

    ``mask[b] = 0`` removes example ``b`` from the clipped sum (its second-backward weight is
    0); ``None`` removes the mask. The mask must have one entry per example of the batch and
    values in [0, 1] (so the clipped norm stays ≤ C); a wrong length raises ValueError at the
    backward. ``mask`` may also be a callable ``mask(norms) -> tensor`` evaluated between the
    two backward passes with the per-sample norms of the first one (how the individual GDP
    filter decides, per step, which examples stay active).
    """
    module = _ghost_module(module)
    if mask is not None and not callable(mask):
        mask = torch.as_tensor(mask).detach()
        if mask.ndim != 1:
            raise ValueError(f"mask must be 1-d (one entry per example), got shape "
                             f"{tuple(mask.shape)}")
        if bool(((mask < 0) | (mask > 1)).any()):
            raise ValueError("mask values must be in [0, 1]")
    module._clipping_mask = mask
    if getattr(module.get_clipping_coef, "_clipping_mask_wrapper", False):
        return  # already wrapped (another wrapper, e.g. the release guard's, may sit below)
    plain = module.get_clipping_coef

    def get_clipping_coef() -> torch.Tensor:
        coef = plain()
        m = getattr(module, "_clipping_mask", None)
        if m is None:
            return coef
        if callable(m):
            m = torch.as_tensor(m(module.get_norm_sample().detach()))
            if bool(((m < 0) | (m > 1)).any()):
                raise ValueError("mask values must be in [0, 1]")
        if m.shape != coef.shape:
            raise ValueError(f"clipping mask has {m.shape[0]} entries but the batch has "
                             f"{coef.shape[0]} examples")
        return coef * m.to(device=coef.device, dtype=coef.dtype)

    get_clipping_coef._clipping_mask_wrapper = True
    module.get_clipping_coef = get_clipping_coef
