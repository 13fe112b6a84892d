"""``DPCallback``'s module part: per-sample gradients on an unmodified LightningModule.

:class:`PerSampleGradients`

* **checks** the module's layers with Opacus' ``ModuleValidator`` rules (BatchNorm and other
  layers that mix examples have no per-sample gradient) and refuses the fit naming each layer;
* **hooks** the module: Opacus ``GradSampleHooks`` (``grad_sample_mode="hooks"``: per-sample
  gradients in ``p.grad_sample``) or book-keeping hooks (``"ghost"``: per-sample norms by the
  Gram trick and the clipped sum in the same single backward, see
  :mod:`opacus_structured.optim.bookkeeping`). The hooks sit on the sub-modules; the
  LightningModule itself is not replaced, and :meth:`PerSampleGradients.remove` takes them off
  again after the fit, with the attributes Opacus leaves behind (as Opacus' own
  ``GradSampleModule.cleanup()`` does, and more): ``grad_sample``, ``summed_grad``,
  ``_forward_counter``, ``_current_grad_sample``, ``_norm_sample`` on the parameters and
  ``activations``, ``max_batch_len`` on the layers — only those that were not there before.
"""

from __future__ import annotations

from typing import Optional

from opacus.grad_sample import GradSampleHooks
from opacus.validators import ModuleValidator

from opacus_structured.optim.bookkeeping import BookKeepingHooks

__all__ = ["PerSampleGradients", "check_layers", "OPACUS_PARAM_ATTRS", "OPACUS_MODULE_ATTRS"]

#: What Opacus' hooks and DPOptimizer set on parameters (``gsm_base.OPACUS_PARAM_MONKEYPATCH_ATTRS``
#: plus the optimizer's ``summed_grad``).
OPACUS_PARAM_ATTRS = ("grad_sample", "summed_grad", "_forward_counter", "_current_grad_sample",
                      "_norm_sample")
#: What Opacus' hooks set on the hooked layers.
OPACUS_MODULE_ATTRS = ("activations", "max_batch_len")


def check_layers(module) -> None:
    """Raise ``ValueError`` listing every trainable layer of ``module`` that Opacus'
    ``ModuleValidator`` rejects (e.g. BatchNorm), with the fix."""
    problems = []
    for name, sub in module.named_modules():
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


class PerSampleGradients:
    """The per-sample-gradient hooks ``DPCallback`` puts on the module (module docstring).

    Args:
        mode: ``"hooks"`` or ``"ghost"``.
        max_grad_norm: clipping norm C (book-keeping clips in the backward pass).
        loss_reduction: ``"mean"`` or ``"sum"``.

    ``hooks`` is the installed hook object (``None`` before :meth:`attach`, after
    :meth:`remove`, and when the module already carried Opacus hooks in ``"hooks"`` mode).
    """

    def __init__(self, mode: str, *, max_grad_norm: Optional[float], loss_reduction: str):
        if mode not in ("hooks", "ghost"):
            raise ValueError(f"grad_sample_mode must be 'hooks' or 'ghost', got {mode!r}")
        self.mode = mode
        self.max_grad_norm = max_grad_norm
        self.loss_reduction = loss_reduction
        self.hooks = None
        self._module = None
        self._had: dict = {}

    def snapshot(self, module) -> None:
        """Record which Opacus attributes ``module`` already carries (before the DP optimizer
        is built around its parameters): :meth:`remove` deletes only the others."""
        self._module = module
        self._had = {id(p): {a for a in OPACUS_PARAM_ATTRS if hasattr(p, a)}
                     for p in module.parameters()}
        self._had.update({id(m): {a for a in OPACUS_MODULE_ATTRS if hasattr(m, a)}
                          for m in module.modules()})

    def attach(self, module) -> None:
        """Hook ``module`` (see the class docstring; :func:`check_layers` it first)."""
        hooked = hasattr(module, "autograd_grad_sample_hooks")
        if self._module is not module:
            self.snapshot(module)
        if self.mode == "ghost":
            if hooked:
                raise ValueError("the module already has Opacus hooks; grad_sample_mode='ghost' "
                                 "installs its own")
            self.hooks = BookKeepingHooks(module, max_grad_norm=self.max_grad_norm,
                                          batch_first=True, loss_reduction=self.loss_reduction)
        elif not hooked:  # else already hooked (e.g. PrivacyEngine.make_private(module=self))
            self.hooks = GradSampleHooks(module, batch_first=True,
                                         loss_reduction=self.loss_reduction, strict=False)

    def remove(self) -> None:
        """Take the hooks off the module and delete the attributes they and the DP optimizer
        left (module docstring; idempotent). A module that carried Opacus hooks before the fit
        is left as it was."""
        if self.hooks is None:
            return
        self.hooks.remove_hooks()
        self.hooks = None
        module, self._module = self._module, None
        if module is None:  # pragma: no cover - hooks without attach cannot exist
            return
        for owner, names in ((module.parameters(), OPACUS_PARAM_ATTRS),
                             (module.modules(), OPACUS_MODULE_ATTRS)):
            for obj in owner:
                kept = self._had.get(id(obj), set())
                for name in names:
                    if name not in kept and name in vars(obj):
                        delattr(obj, name)
        self._had = {}
