r"""What a released step must satisfy besides its batch: one clip norm, no data-dependent skip.

The accountants price a step as the subsampled Gaussian mechanism
``Σ_b clip_C(g_b) + N(0, σ²C²)`` (or its correlated-noise form): the noise is scaled to the
**same** ``C`` that bounds each example's contribution, and the step is released whatever the
batch holds. Three things in an Opacus training loop break that silently (issue 29, cases 9
and 10); this module is the one place that checks them, on every path (Opacus'
``make_private`` with our accountant, :func:`opacus_structured.make_private`,
``CorrelatedNoisePrivacyEngine``, ``DPCallback``, hooks, ghost clipping and book-keeping, DDP).

**1. The clip norm that clips is the clip norm that noises.** Opacus reads
``optimizer.max_grad_norm`` for the noise, but in ghost mode
(``make_private(grad_sample_mode="ghost")``) the clipping coefficients
``min(1, C/‖g_b‖)`` are computed by the module from its *own* copy of ``C`` taken at
``make_private``; lowering ``optimizer.max_grad_norm`` to ``0.1·C`` then adds noise
``σ·0.1·C`` to a sum clipped at ``C``: an effective multiplier ``σ/10`` priced as ``σ``.
:func:`guard_optimizer` makes ``optimizer.max_grad_norm`` the single source of truth:

* ghost (Opacus' ``GradSampleModuleFastGradientClipping``): the module's clipping reads the
  optimizer's current ``max_grad_norm`` at every backward and records it;
* hooks (``DPOptimizer`` and its per-layer / distributed / correlated subclasses): the norm
  ``clip_and_accumulate`` uses (``max_grad_norm``, or ``‖max_grad_norms‖₂`` per layer) is
  recorded at every clipping;
* book-keeping (:mod:`opacus_structured.optim.bookkeeping`): the hooks clip inside the
  optimizer's step with the optimizer's current ``max_grad_norm`` and record it.

At each priced step :class:`ClipNormLedger` (held by the accountant) compares the recorded
clipping norms with the norm the noise used (``optimizer.max_grad_norm``) and raises on a
mismatch, e.g. when ``max_grad_norm`` changed between the backward and ``optimizer.step()``.
A **change** of ``max_grad_norm`` from one step to the next is accepted only when the step's
clipping was seen to use the new value and the noise is independent: DP-SGD's privacy depends
on ``C`` only through ``σ = std/C``, so ε is unchanged. It raises

* under **correlated noise** (BandMF, BLT, b-min-sep: noise bands > 1): step ``i``'s noise
  ``w_i = (C^{-1}Z)_i`` carries earlier steps' ``z_j`` scaled to *their* ``C_j``; with
  ``C_t < C_j`` the carry-over is ``C_j/C_t`` times larger relative to step ``t``'s
  sensitivity than the strategy ``C`` assumes (×4 for a clip ×0.25: bandmf 6.677 printed,
  partition 1 composes to 10.93). The accountants price one clip norm; the optimizer raises
  too (:class:`~opacus_structured.optim.correlated_noise.CorrelatedNoiseMixin`);
* when the clipping of the step could not be seen (an optimizer that did not pass through
  :func:`guard_optimizer`, e.g. built and hooked by hand);
* for **adaptive clipping** (Opacus' ``AdaClipDPOptimizer``, ``clipping="adaptive"``, and
  ``PrivacyEngineAdaptiveClipping``): the norm is a data-dependent quantity released through
  a noisy count of unclipped examples. Opacus prices only ``σ``; its own code notes that the
  count's denominator, the actual batch size, is private under Poisson sampling and leaks.
  None of our accountants prices that release, so it is refused (:func:`refuse_adaptive`).

**2. No step is skipped because of the data (AMP).** ``torch.amp.GradScaler.step`` first
unscales and checks the *raw* ``p.grad`` that autograd summed over the batch (before any
clipping or noise: in hooks mode Opacus never uses it) and skips ``optimizer.step()`` when it
holds an inf/NaN; ``scaler.update()`` then halves the scale. One example whose gradient
overflows makes every step that samples it disappear (probability ≈ 1 with the example, 0
without it: no (ε, δ) claim survives), and the scale, which decides which examples overflow
later, becomes a function of private data that no noise covers. Zeroing per-sample gradients
inside the optimizer cannot prevent this (the decision is taken before ``step``), so the guard
**refuses GradScaler**: it marks the optimizer ``_step_supports_amp_scaling`` (GradScaler's
own protocol for optimizers that handle scaling), so an enabled scaler always calls
``optimizer.step()`` and announces itself through ``optimizer.grad_scale`` /
``optimizer.found_inf``; the step then raises before anything is released, at the first step
whatever the data (the refusal itself reveals nothing). ``GradScaler(enabled=False)`` passes
through. Mixed precision without a scaler (bf16 autocast) is fine.

**3. A non-finite per-sample gradient is clipped to 0, never propagated.** Opacus' clip factor
``C/(‖g_b‖ + 1e-6)`` of an inf/NaN gradient is 0 or NaN and ``0·inf = NaN``: one example would
turn the released sum, and the model, into NaN. In hooks mode the clipping
(:mod:`~opacus_structured.accountants.clip_factors`, installed on every optimizer that clips as
Opacus' ``DPOptimizer`` does) gives an example whose per-sample norm is non-finite the clip
factor 0 and replaces its rows by zeros in the sum (only on a step that holds one; no extra
pass over the per-sample gradients otherwise); for other hooks-mode clipping (per layer)
:func:`zero_nonfinite_grad_samples` zeroes them before the sum, and the book-keeping hooks do
the same in their own pass. The example counts as clipped (its contribution 0 has norm ≤ C),
and the step is released as usual. Opacus' ghost clipping cannot
do that (its second backward sums the batch inside autograd, and ``0·inf`` there is NaN): a
non-finite per-sample norm gets clip factor 0, and if the clipped sum is still non-finite the
step raises (:func:`check_finite_clipped_sum`) instead of releasing or skipping it. That stop
depends on the data; use hooks or ``DPCallback(grad_sample_mode="ghost")`` (book-keeping) where
inputs can produce non-finite gradients.
"""

from __future__ import annotations

import math
import weakref
from typing import Optional

import torch
from opacus import optimizers as opacus_optimizers
from opacus.optimizers import DPOptimizerFastGradientClipping

from . import noise_lineage
from .clip_factors import install_clip_factors
from .release_rows import install_recorder, recorder_of, rows_in_grad_samples

__all__ = ["guard_optimizer", "guard_of", "ClipNormLedger", "clipping_norm", "refuse_adaptive",
           "is_adaptive", "adds_correlated_noise", "zero_nonfinite_grad_samples",
           "check_finite_clipped_sum", "GradScalerRefusedError", "ClipNormChangedError",
           "NonFiniteReleaseError",
           "CORRELATED_CLIP_MESSAGE"]

#: The error text for a clip-norm change under correlated noise (kept in one place).
CORRELATED_CLIP_MESSAGE = ("correlated noise is priced for one clip norm; keep max_grad_norm "
                           "fixed")


class NonFiniteReleaseError(RuntimeError):
    """Opacus' ghost clipping produced a non-finite clipped sum (see the module docstring)."""


class ClipNormChangedError(RuntimeError):
    """A step would release noise and clipping at different norms, or a clip-norm change that
    the accountant cannot price (correlated noise, adaptive clipping, unseen clipping)."""


class GradScalerRefusedError(RuntimeError):
    """An enabled ``torch.amp.GradScaler`` drives a DP optimizer (see the module docstring)."""


# ---- what the optimizer does -------------------------------------------------------------
def clipping_norm(optimizer) -> float:
    """The norm the optimizer's own per-sample clipping uses now: ``‖max_grad_norms‖₂`` for
    Opacus' per-layer optimizers, else ``max_grad_norm``."""
    per_layer = getattr(optimizer, "max_grad_norms", None)
    if per_layer is not None:
        return math.sqrt(sum(float(c) ** 2 for c in per_layer))
    return float(optimizer.max_grad_norm)


def is_adaptive(optimizer) -> bool:
    """Whether ``optimizer`` (an instance or a class) adapts its clip norm from the data
    (Opacus' ``AdaClipDPOptimizer``, or an optimizer that Opacus' ghost adaptive-clipping loss
    has set ``_adjusted_noise_multiplier`` on)."""
    ada = getattr(opacus_optimizers, "AdaClipDPOptimizer", None)
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    if ada is not None and issubclass(cls, ada):
        return True
    return not isinstance(optimizer, type) and \
        "_adjusted_noise_multiplier" in getattr(optimizer, "__dict__", {})


def refuse_adaptive(optimizer=None, *, clipping: Optional[str] = None) -> None:
    """Raise ``ValueError`` for adaptive clipping (``clipping="adaptive"`` or an adaptive
    optimizer): see the module docstring."""
    if clipping == "adaptive" or (optimizer is not None and is_adaptive(optimizer)):
        raise ValueError(
            "adaptive clipping (clipping='adaptive', Opacus' AdaClipDPOptimizer or "
            "PrivacyEngineAdaptiveClipping) is refused: the clip norm follows a noisy count of "
            "unclipped examples divided by the private batch size, a release that none of this "
            "package's accountants prices (they price sigma at one clip norm). Use a fixed "
            "max_grad_norm (clipping='flat'), or a clip-norm schedule fixed in advance")


def adds_correlated_noise(optimizer) -> bool:
    """Whether the optimizer's noise is correlated across steps (more than one band, or a dense
    BLT strategy)."""
    coefficients = getattr(optimizer, "noise_coefficients", None)
    if coefficients is None:
        return False
    if hasattr(coefficients, "buf_decay"):
        return True
    return len([float(v) for v in coefficients]) > 1


# ---- the guard on one optimizer ----------------------------------------------------------
class _Guard:
    """Clipping norms seen since the last release, and the wrappers installed."""

    def __init__(self, optimizer):
        self.optimizer = weakref.ref(optimizer)
        self.pending: set[float] = set()
        self.module = None

    def record(self, norm: float) -> None:
        self.pending.add(float(norm))

    def take(self) -> set[float]:
        seen, self.pending = self.pending, set()
        return seen


def guard_of(optimizer) -> Optional[_Guard]:
    """The guard :func:`guard_optimizer` installed on ``optimizer`` (``None`` if none)."""
    return getattr(optimizer, "__dict__", {}).get("_release_guard")


def _is_book_keeping(optimizer) -> bool:
    return callable(getattr(optimizer, "attach_bookkeeper", None))


def guard_optimizer(optimizer, module=None):
    """Install the release checks on ``optimizer`` (idempotent; returns the guard).

    ``module``: the model Opacus' ghost mode clips in (its ``GradSampleModuleFastGradientClipping``);
    given later calls link it. Refuses adaptive clipping. Installs (instance attributes, the
    class is not touched): the GradScaler refusal and, for Opacus' ghost optimizers, the
    finite-sum check in ``pre_step``; the non-finite zeroing and the norm record in
    ``clip_and_accumulate`` (hooks: folded into Opacus' own norm pass by
    :func:`~opacus_structured.accountants.clip_factors.install_clip_factors` where the optimizer
    clips as ``DPOptimizer`` does, a zeroing pass before the clipping otherwise); the norm sync and record in the ghost module's
    ``get_clipping_coef``. Book-keeping optimizers record their own clipping norm.
    """
    refuse_adaptive(optimizer)
    guard = guard_of(optimizer)
    if guard is None:
        guard = _Guard(optimizer)
        optimizer.__dict__["_release_guard"] = guard
        # GradScaler's protocol: an optimizer that handles scaling is always stepped, with
        # grad_scale / found_inf set on it; we refuse it there (module docstring, 2.)
        optimizer._step_supports_amp_scaling = True
        plain_pre_step = optimizer.pre_step
        ghost = isinstance(optimizer, DPOptimizerFastGradientClipping)

        def pre_step(closure=None):
            refuse_grad_scaler(optimizer)
            if ghost and not _is_book_keeping(optimizer):
                check_finite_clipped_sum(optimizer)
            return plain_pre_step(closure)

        optimizer.pre_step = pre_step
        _guard_noise(optimizer)
        if not ghost:
            # Opacus' own clipping: one norm pass, non-finite examples get factor 0 there
            # (clip_factors); other clipping (per layer): a zeroing pass first
            fused = install_clip_factors(optimizer, zero_nonfinite=True)
            plain_clip = optimizer.clip_and_accumulate

            def clip_and_accumulate():
                rec = recorder_of(optimizer)
                if rec is not None:  # the rows this pass sums (release_rows)
                    rows, fresh = rows_in_grad_samples(optimizer)
                    rec.on_clip(rows, fresh=fresh)
                if not fused:
                    zero_nonfinite_grad_samples(optimizer)
                guard.record(clipping_norm(optimizer))
                return plain_clip()

            optimizer.clip_and_accumulate = clip_and_accumulate
    if module is not None and guard.module is None:
        _guard_ghost_module(guard, optimizer, module)
    if module is not None:
        install_recorder(optimizer, module)
    return guard


def _guard_noise(optimizer) -> None:
    """Wrap ``add_noise``: no generator state whose noise was released is drawn from again, and
    every draw is recorded in the noise lineage of the run that prices the optimizer
    (:mod:`~opacus_structured.accountants.noise_lineage`)."""
    plain_add_noise = optimizer.add_noise

    def add_noise(*args, **kwargs):
        correlated = adds_correlated_noise(optimizer)
        step = getattr(optimizer, "noise_step", None) if correlated else None
        before = noise_lineage.check_before_draw(optimizer, correlated=correlated)
        out = plain_add_noise(*args, **kwargs)
        noise_lineage.record_after_draw(optimizer, before, step)
        return out

    optimizer.add_noise = add_noise


def _guard_ghost_module(guard: _Guard, optimizer, module) -> None:
    """Opacus ghost clipping: the module's coefficients use the optimizer's current
    ``max_grad_norm`` (synced at every call), record it, and give a non-finite per-sample
    norm the coefficient 0."""
    if not callable(getattr(module, "get_clipping_coef", None)) or \
            not hasattr(module, "max_grad_norm"):
        return  # hooks mode: the optimizer clips
    guard.module = weakref.ref(module)
    plain = module.get_clipping_coef

    def get_clipping_coef() -> torch.Tensor:
        norm = clipping_norm(optimizer)
        module.max_grad_norm = norm
        coef = plain()
        rec = recorder_of(optimizer)
        if rec is not None:
            rec.on_clip(len(coef), fresh=not getattr(optimizer, "_is_last_step_skipped", False))
        guard.record(norm)
        return torch.where(torch.isfinite(coef), coef, torch.zeros_like(coef))

    get_clipping_coef._release_guard = True
    module.get_clipping_coef = get_clipping_coef


def refuse_grad_scaler(optimizer) -> None:
    """Raise :class:`GradScalerRefusedError` if an enabled GradScaler is stepping
    ``optimizer`` (it has set ``grad_scale`` / ``found_inf`` on it, or passed itself)."""
    state = getattr(optimizer, "__dict__", {})
    if "found_inf" in state or "grad_scale" in state:
        raise GradScalerRefusedError(
            "torch.amp.GradScaler is refused with a DP optimizer: it skips optimizer.step() "
            "when the raw, un-noised batch gradient holds an inf/NaN and rescales from it, so "
            "one example whose gradient overflows decides whether a step is released, which "
            "no accountant prices. Train without GradScaler (fp32, or bf16 autocast, which "
            "needs no loss scaling); a non-finite per-sample gradient is then zeroed (counted "
            "as clipped) by the DP optimizer and the step is released as usual")


def zero_nonfinite_grad_samples(optimizer) -> int:
    """Zero, in every parameter's ``grad_sample``, the rows of each example whose per-sample
    gradient is non-finite (clip factor 0). Returns how many examples were zeroed.

    An example is flagged when the sum of its entries is non-finite, in any parameter: that is
    every example with an inf/NaN entry, plus finite rows so large that their sum overflows,
    whose norm overflows too (Opacus would give them the clip factor ``C/inf = 0`` anyway).
    One pass and one host synchronisation per step."""
    params = [p for p in optimizer.params if getattr(p, "grad_sample", None) is not None]
    if not params:
        return 0

    def chunks(p):
        return p.grad_sample if isinstance(p.grad_sample, list) else [p.grad_sample]

    layout = [len(c) for c in chunks(params[0])]
    if any([len(c) for c in chunks(p)] != layout for p in params):
        return 0  # Opacus' own clipping refuses the inconsistent batch sizes
    device = chunks(params[0])[0].device
    bad = None
    for p in params:
        # flatten(1): a rank's shard (or a Poisson batch) may hold no example
        rows = torch.cat([~torch.isfinite((c.flatten(1) if c.dim() > 1 else c.unsqueeze(1))
                                          .sum(1)).to(device) for c in chunks(p)])
        bad = rows if bad is None else bad | rows
    if not bool(bad.any()):
        return 0
    for p in params:
        zeroed, start = [], 0
        for c in chunks(p):
            m = bad[start:start + len(c)].to(c.device).view(-1, *([1] * (c.dim() - 1)))
            fresh = c.masked_fill(m, 0)
            if hasattr(c, "_processed"):  # keep Opacus' "zero_grad() was not called" check
                fresh._processed = c._processed
            zeroed.append(fresh)
            start += len(c)
        p.grad_sample = zeroed if isinstance(p.grad_sample, list) else zeroed[0]
    return int(bad.sum())


def check_finite_clipped_sum(optimizer) -> None:
    """Opacus' ghost clipping: raise if the clipped sum in ``p.grad`` is non-finite (an example
    whose gradient is non-finite cannot be taken out of autograd's batched second backward)."""
    flags = [torch.isfinite(p.grad).all() for p in optimizer.params if p.grad is not None]
    if flags and not bool(torch.stack([f.to(flags[0].device) for f in flags]).all()):
        raise NonFiniteReleaseError(
            "the ghost-clipped gradient sum is non-finite: an example of this batch has a "
            "non-finite gradient, and Opacus' ghost clipping sums the batch inside autograd "
            "(0 * inf = NaN), so it cannot be clipped to 0 there. The step is not released. "
            "This stop depends on the data: use grad_sample_mode='hooks' (or DPCallback's "
            "book-keeping ghost mode), which zero such an example before the sum, or "
            "sanitise the inputs")


# ---- the accountant's record ------------------------------------------------------------
class ClipNormLedger:
    """The clip norm a run is priced at, checked at every priced step (module docstring).

    ``norm`` is the first priced step's ``max_grad_norm`` (later: the current one after an
    accepted change); ``changes`` counts accepted changes. Round-trips through
    :meth:`state_dict` / :meth:`load_state_dict` (a resumed run must keep pricing the same
    norm under correlated noise).
    """

    def __init__(self):
        self.norm: Optional[float] = None
        self.changes = 0

    def check(self, optimizer, *, step: int, correlated: bool = False) -> None:
        """Before pricing step ``step``: raise :class:`ClipNormChangedError` if this step's
        clipping and noise norms differ, or its norm changed in a way that cannot be priced."""
        refuse_adaptive(optimizer)
        guard = guard_of(optimizer)
        if guard is None:
            guard = guard_optimizer(optimizer)  # later steps are seen (installed by hand)
            seen: set[float] = set()
        else:
            seen = guard.take()
        noise = float(optimizer.max_grad_norm)
        wrong = sorted(n for n in seen if n != noise)
        if wrong:
            raise ClipNormChangedError(
                f"step {step}: the per-sample gradients were clipped at max_grad_norm="
                f"{wrong[0]:g} but the noise is scaled to max_grad_norm={noise:g}; the "
                f"accountant would price a noise multiplier the step does not have. Change "
                f"optimizer.max_grad_norm only after optimizer.step() (or before the forward "
                f"pass), never between backward and step")
        if self.norm is None or noise == self.norm:
            self.norm = noise
            return
        correlated = correlated or adds_correlated_noise(optimizer)
        if correlated:
            raise ClipNormChangedError(
                f"step {step}: max_grad_norm changed from {self.norm:g} to {noise:g}: "
                f"{CORRELATED_CLIP_MESSAGE} (a step's noise carries earlier steps' noise "
                f"scaled to their clip norm)")
        if not seen:
            raise ClipNormChangedError(
                f"step {step}: max_grad_norm changed from {self.norm:g} to {noise:g}, but the "
                f"clipping of this step was not seen to use the new value (an optimizer "
                f"wired by hand, outside make_private / DPCallback): keep max_grad_norm fixed, "
                f"or build the run with opacus_structured.make_private or DPCallback")
        self.norm = noise
        self.changes += 1

    def state_dict(self) -> dict:
        return {"norm": self.norm, "changes": self.changes}

    def load_state_dict(self, state: Optional[dict]) -> None:
        state = state or {}
        self.norm = None if state.get("norm") is None else float(state["norm"])
        self.changes = int(state.get("changes", 0))
