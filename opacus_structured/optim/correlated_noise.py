"""Correlated-noise (banded matrix factorization, "BandMF") DP optimizer for Opacus.

DP-SGD adds i.i.d. noise ``z_i ~ N(0, σ² clip² I)`` to the clipped-gradient sum of step ``i``.
The matrix mechanism with a lower-triangular b-banded Toeplitz strategy ``C`` (first column
``c = (c_0, …, c_{b−1})``) adds instead ``w_i = (C^{-1} Z)_i``, obtained online by forward
substitution of ``C w = z`` (Algorithm 9 of Choquette-Choo et al. 2023, "Amplified banded
matrix factorization"):

    w_i = ( z_i − Σ_{k=1}^{b−1} c_k · w_{i−k} ) / c_0,        w_j := 0 for j < 0.

The ring buffer of the last ``b − 1`` noise vectors is **one contiguous storage** of ``(b−1)·D``
elements per (device, dtype) of the parameters (``D`` = their total size), at the parameter dtype;
:attr:`CorrelatedNoiseMixin._noise_buffers` holds each parameter's ``(b−1, *shape)`` view of it.
A step reads the ``(b−1)·d`` ring once (the reduction ``t = Σ_slot a_slot · buf[slot]``), writes
``w_i = (z_i − t) / c_0`` once, straight into the slot it replaces (``torch.sub(z, t, out=slot)``;
the slot's old value ``w_{i−b+1}`` was read by ``t`` before), and adds it to the clipped sum:
``(b − 1)·d`` (ring) + ``d`` (``t``) + ``3·d`` (``z − t`` into the slot) + ``2·d`` (Opacus'
``_generate_noise`` writes a zero tensor and the draw ``z``) + ``3·d`` (``S + w``) =
``(b + 8)·d`` elements, of which stock DP-SGD's noise moves ``5·d`` (``c_0 ≠ 1`` adds an
in-place division, ``2·d``; the per-parameter implementation moved ``2·d`` more: ``z − t`` and
the copy into the slot were separate passes).

Layout and reduction order. By default the storage is parameter-major: parameter ``p`` owns the
contiguous ``(b−1) × d_p`` block at ``(b−1)·offset_p``, reduced with one BLAS product per
parameter on exactly the operand the former per-parameter buffers gave it, so the noise is
bit-identical to the per-parameter implementation. A single GEMV over all parameters cannot
be: BLAS's reduction order over the ``b − 1`` terms depends on the operand's column count and
thread split (MKL's float32 ``sgemm`` rounds its tail columns and its per-thread chunk edges
differently for ``b − 1 ≥ 8``), so the same element of ``t`` can round differently in a
``(b−1) × D`` product than in the parameter's own ``(b−1) × d_p`` one. ``single_gemv = True``
(class attribute or constructor keyword) lays the storage out as one ``(b−1) × D`` matrix
(parameter ``p`` owns columns ``offset_p : offset_p + d_p``) and computes ``t`` with one GEMV
per (device, dtype): the same Gaussian recursion in exact arithmetic and the same memory
traffic, fewer kernel launches, last-bit differences in the sum. Releasing ``G + C^{-1}Z`` is post-processing of the
Gaussian mechanism on ``C G`` (§2.1 there), so the privacy cost is the one of the matrix
mechanism with columns of ``C`` as per-participation sensitivity: price it with an accountant
that knows ``C`` and the sampler (e.g. ``bandmf-cyclic-poisson`` with the cyclic Poisson sampler),
*not* with the stock Poisson accountant. ``c = [1]`` is exactly DP-SGD (bit-identical noise).

A :class:`~opacus_structured.optim.strategies.BufferedToeplitz` (BLT, dense ``C``) is streamed
with ``d`` decaying buffers instead (Algorithm 3 of McMahan et al. 2024):
``u_i = z_i − Σ_j ω_j s_{j,i}``, ``s_{j,i+1} = θ_j s_{j,i} + u_i``, ``w_i = u_i / scale`` — memory ``d·|θ|``
for any number of steps. Pass ``blt.normalized(n)`` and price it with a scheme that knows the
same ``C`` (``random-allocation-mf --strategy blt``).

One clip norm: the fresh ``z_i`` have std ``σ·max_grad_norm`` and ``w_i`` carries the earlier
``z_j``, so ``max_grad_norm`` must not change during the stream (a change would scale the
carry-over by ``C_j/C_i`` relative to step ``i``'s sensitivity): ``add_noise`` raises at the step
where it changed, and the norm is part of :meth:`CorrelatedNoiseMixin.noise_state_dict`.

Security notes:

* The ring buffer holds past noise. Anyone who reads it can subtract noise from past released
  gradients, so :meth:`CorrelatedNoiseDPOptimizer.state_dict` (which contains it, so a resumed run
  continues the same correlated stream) must be kept as secret as the raw gradients.
* ``secure_mode`` / ``generator`` are Opacus' own (:func:`opacus.optimizers.optimizer._generate_noise`):
  the fresh ``z_i`` come from the same call stock Opacus uses. The state of a plain
  ``torch.Generator`` is checkpointed, and restored only where the resume provably continues
  the run from its last released step (:mod:`~opacus_structured.accountants.noise_lineage`);
  a secure (CSPRNG) generator is not (and cannot be).
* Without a ``generator`` the noise does **not** come from torch's global RNG (stock Opacus
  does that, and scripts routinely seed it with a public constant such as
  ``torch.manual_seed(0)``, which makes the noise reproducible by anyone): each device gets its
  own ``torch.Generator`` seeded with 63 bits of OS entropy, which is not checkpointed (a
  resumed run draws fresh noise; its ring buffers still come from the checkpoint). It is not a
  CSPRNG: for that, use Opacus' ``secure_mode`` (torchcsprng) or pass your own generator.
"""

from __future__ import annotations

from typing import Optional

import opacus.optimizers as opacus_optimizers
import torch
from opacus.optimizers.optimizer import (
    DPOptimizer,
    _check_processed_flag,
    _generate_noise,
    _mark_as_processed,
)

from ..accountants import budget_guard, noise_lineage
from ..accountants.release_guard import (
    CORRELATED_CLIP_MESSAGE,
    ClipNormChangedError,
    adds_correlated_noise,
)
from ..samplers._generator import fresh_seed
from .strategies import BufferedToeplitz, validate_coefficients

__all__ = ["CorrelatedNoiseMixin", "CorrelatedNoiseDPOptimizer", "correlated_optimizer_class"]

_STATE_KEY = "correlated_noise"

#: start of each parameter's ring block in the default layout, in elements (512 B at float32):
#: BLAS kernels may pick their code path by the operand's alignment, so each block is aligned
#: like the separately allocated buffer it replaces (padding: < 128 elements per parameter).
_BLOCK_ALIGN = 128


def _coefficients_key(coefs):
    """Comparable form of banded coefficients (list) or BLT parameters (dict)."""
    if isinstance(coefs, dict):
        return ("blt", tuple(coefs["buf_decay"]), tuple(coefs["output_scale"]),
                float(coefs["scale"]))
    return [float(v) for v in coefs]


class CorrelatedNoiseMixin:
    """Overrides ``DPOptimizer.add_noise`` with banded-Toeplitz correlated noise.

    Mix into any Opacus optimizer whose ``add_noise`` is the stock per-parameter one
    (:class:`~opacus.optimizers.DPOptimizer`, ``DPPerLayerOptimizer``,
    ``DPOptimizerFastGradientClipping``); see :func:`correlated_optimizer_class`. The
    constructor takes the base optimizer's arguments plus ``noise_correlation``.
    """

    #: one GEMV per (device, dtype) over the whole ring buffer instead of one BLAS product per
    #: parameter's column range (see module): same distribution, not bit-identical to the
    #: per-parameter rounding.
    single_gemv: bool = False

    def __init__(self, optimizer: torch.optim.Optimizer, *, noise_correlation=None,
                 single_gemv: Optional[bool] = None, **kwargs):
        super().__init__(optimizer, **kwargs)
        if single_gemv is not None:
            if not isinstance(single_gemv, bool):
                raise ValueError(f"single_gemv must be a bool, got {single_gemv!r}")
            self.single_gemv = single_gemv
        self._init_correlated_noise(noise_correlation)

    def _init_correlated_noise(self, noise_correlation) -> None:
        if noise_correlation is None:
            noise_correlation = [1.0]
        if isinstance(noise_correlation, BufferedToeplitz):
            blt = noise_correlation
            self._blt = (torch.tensor(blt.buf_decay, dtype=torch.float64),
                         torch.tensor(blt.output_scale, dtype=torch.float64), blt.scale)
            self.noise_coefficients = blt
            self._coef_list = {"buf_decay": list(blt.buf_decay),
                               "output_scale": list(blt.output_scale), "scale": blt.scale}
            self.bands = None  # dense C
        else:
            self._blt = None
            c = validate_coefficients(noise_correlation, name="noise_correlation")
            self.noise_coefficients = c
            self._coef_list = [float(v) for v in c]
            self.bands = int(c.size)
        self.noise_step = 0  # number of noise vectors drawn so far (index i of the next w_i)
        #: the noise lineage of a stand-alone optimizer (no accountant links its own): saved
        #: with the noise state, so a restore is trusted only when it continues the stream
        self._own_lineage = noise_lineage.NoiseLineage()
        self.noise_clip_norm: Optional[float] = None  # the one max_grad_norm of the stream
        self._noise_buffers: list[Optional[torch.Tensor]] = [None] * len(self.params)
        # banded path: (device, dtype) -> _FlatRing; None until the first banded step (or after
        # a load_noise_state_dict, whose buffers are copied in at the next step)
        self._flat_rings: Optional[dict] = None

    def _noise_generator(self, reference: torch.Tensor):
        """The caller's ``generator``, else this optimizer's OS-entropy generator for
        ``reference``'s device (never torch's global, possibly publicly seeded, RNG)."""
        if self.generator is not None:
            return self.generator
        own = self.__dict__.setdefault("_entropy_generators", {})
        device = reference.device
        if device not in own:
            own[device] = torch.Generator(device=device).manual_seed(fresh_seed())
        return own[device]

    # ---- the streaming recursion --------------------------------------------------------
    def _on_device(self, key: str, like: torch.Tensor, make, *, per_step: bool = True
                   ) -> torch.Tensor:
        """``make()`` (float64, CPU) moved to ``like``'s dtype/device once per step
        (``per_step``) or once for the run: one host-to-device copy per step and device at
        most, not one per parameter."""
        cache = self.__dict__.setdefault("_device_cache", {})
        k = (key, self.noise_step if per_step else None, like.dtype, like.device)
        if k not in cache:
            if len(cache) > 16:
                cache.clear()
            cache[k] = make().to(dtype=like.dtype, device=like.device)
        return cache[k]

    def _slot_weights(self, buf: torch.Tensor) -> torch.Tensor:
        """Weights ``a`` with ``Σ_slot a[slot] buf[slot] = Σ_{k=1}^{b-1} c_k w_{i−k}``."""
        def make():
            i, m = self.noise_step, self.bands - 1
            a = [0.0] * m
            for k in range(1, min(i, m) + 1):
                a[(i - k) % m] = self._coef_list[k]
            return torch.tensor(a, dtype=torch.float64)
        return self._on_device("slots", buf, make)

    def _new_buffer(self, idx: int, z: torch.Tensor, slots: int) -> torch.Tensor:
        buf = self._noise_buffers[idx]
        if buf is None or buf.shape[1:] != z.shape or buf.dtype != z.dtype or \
                buf.device != z.device:
            if self.noise_step > 0 and buf is not None:
                raise RuntimeError(
                    "correlated-noise buffer does not match the gradient (shape, dtype or "
                    "device changed mid-run); restore it with load_state_dict or restart")
            buf = torch.zeros((slots, *z.shape), dtype=z.dtype, device=z.device)
            self._noise_buffers[idx] = buf
        return buf

    def _correlate_blt(self, idx: int, z: torch.Tensor) -> torch.Tensor:
        theta, omega, scale = self._blt
        buf = self._new_buffer(idx, z, theta.numel())
        theta = self._on_device("theta", z, lambda: theta, per_step=False)
        omega = self._on_device("omega", z, lambda: omega, per_step=False)
        u = z - torch.tensordot(omega, buf, dims=1)  # u = C_raw^{-1} z, buffers track u
        buf.mul_(theta.view(-1, *([1] * z.ndim))).add_(u)
        return u / scale

    def _correlate(self, idx: int, z: torch.Tensor) -> torch.Tensor:
        """``w_i`` of parameter ``idx`` for the independent paths (BLT, ``b = 1``); the banded
        path (``b ≥ 2``) runs over the contiguous ring in :meth:`_add_banded_noise`."""
        if self._blt is not None:
            return self._correlate_blt(idx, z)
        c0 = self._coef_list[0]
        return z if c0 == 1.0 else z / c0

    def _flat_layout(self) -> dict:
        """The contiguous ring buffers, one storage of ``(b−1)·D`` elements per (device, dtype)
        of the parameters, built at the first banded step.

        Default layout: parameter-major, parameter ``p`` owning a contiguous ``(b−1) × d_p``
        block (starts aligned to ``_BLOCK_ALIGN`` elements; so its reduction is the very BLAS call, on the very
        operand, of the per-parameter implementation: bit-identical). ``single_gemv``: one
        ``(b−1) × D`` matrix, parameter ``p`` owning columns ``offset_p : offset_p + d_p``.
        :attr:`_noise_buffers` holds each parameter's ``(b−1, *shape)`` view either way.
        Buffers restored by :meth:`load_noise_state_dict` (standalone tensors) are copied in; a
        restored buffer whose shape or dtype no longer matches its parameter after step 0 is
        refused (the stream cannot continue)."""
        if self._flat_rings is not None:
            return self._flat_rings
        m = self.bands - 1
        groups: dict = {}
        for idx, p in enumerate(self.params):
            groups.setdefault((p.device, p.dtype), []).append(idx)
        rings = {}
        for (device, dtype), idxs in groups.items():
            sizes = [self.params[i].numel() for i in idxs]
            total = sum(sizes)
            if self.single_gemv:
                starts, length = None, m * total
            else:  # blocks start at _BLOCK_ALIGN elements, as a fresh allocation would
                starts, length = [], 0
                for n in sizes:
                    length = -(-length // _BLOCK_ALIGN) * _BLOCK_ALIGN
                    starts.append(length)
                    length += m * n
            storage = torch.zeros(length, dtype=dtype, device=device)
            views, off = {}, 0
            for k, i in enumerate(idxs):
                p = self.params[i]
                n = sizes[k]
                if self.single_gemv:
                    view = storage.view(m, total)[:, off:off + n].view(m, *p.shape)
                else:
                    view = storage[starts[k]:starts[k] + m * n].view(m, *p.shape)
                old = self._noise_buffers[i]
                if old is not None:
                    if old.shape != view.shape or old.dtype != dtype:
                        if self.noise_step > 0:
                            raise RuntimeError(
                                f"correlated-noise buffer of parameter {i} has shape "
                                f"{tuple(old.shape)} and dtype {old.dtype}, the parameter needs "
                                f"{tuple(view.shape)} at {dtype}: restore it with "
                                f"load_state_dict or restart")
                    else:
                        view.copy_(old)
                self._noise_buffers[i] = view
                views[i] = (off, n)
                off += n
            rings[(device, dtype)] = {
                "storage": storage, "cols": views,
                "t": torch.empty(total, dtype=dtype, device=device) if self.single_gemv
                else None}
        self._flat_rings = rings
        return rings

    def _add_banded_noise(self, sigma: float) -> None:
        """``p.grad = p.summed_grad + w_i`` for every parameter, ``b ≥ 2``.

        Step ``i``, slot weights ``a`` (:meth:`_slot_weights`), per parameter in parameter
        order: ``t = a · buf_p`` (one BLAS product over its contiguous ``(b−1) × d_p`` block;
        with ``single_gemv`` one product over each ``(b−1) × D`` ring, before the loop), the
        fresh ``z`` (the stock Opacus draw), ``w = (z − t) / c_0`` written straight into slot
        ``i mod (b−1)`` (which held ``w_{i−b+1}``, read by ``t`` before), and
        ``p.grad = p.summed_grad + w``. Step 0 has an empty history: ``w = z / c_0``."""
        rings = self._flat_layout()
        params = self.params
        if len(params) != len(self._noise_buffers):
            raise RuntimeError(
                f"the optimizer has {len(params)} parameters needing noise, its correlated-"
                f"noise buffers were built for {len(self._noise_buffers)} (a parameter was "
                f"frozen or unfrozen mid-run); restore it with load_state_dict or restart")
        for p, buf in zip(params, self._noise_buffers, strict=True):  # refuse before any slot is overwritten
            ref = p.summed_grad
            if (ref.device, ref.dtype) not in rings or ref.shape != p.shape or \
                    buf.shape[1:] != p.shape:
                raise RuntimeError(
                    "correlated-noise buffer does not match the gradient (shape, dtype or "
                    "device changed mid-run); restore it with load_state_dict or restart")
        c0 = self._coef_list[0]
        m = self.bands - 1
        slot = self.noise_step % m
        history = self.noise_step > 0
        if history and self.single_gemv:  # one GEMV per ring, before any slot is overwritten
            for ring in rings.values():
                a = self._slot_weights(ring["storage"])
                torch.mm(a.view(1, m), ring["storage"].view(m, -1), out=ring["t"].view(1, -1))
        for idx, p in enumerate(params):
            _check_processed_flag(p.summed_grad)
            ref = p.summed_grad
            ring = rings[(ref.device, ref.dtype)]
            z = _generate_noise(std=sigma * self.max_grad_norm, reference=ref,
                                generator=self._noise_generator(ref),
                                secure_mode=self.secure_mode)
            buf = self._noise_buffers[idx]
            out = buf[slot]
            if history:
                if self.single_gemv:
                    off, n = ring["cols"][idx]
                    t = ring["t"][off:off + n].view(p.shape)
                else:  # the per-parameter call of the reference, on a contiguous block
                    t = torch.tensordot(self._slot_weights(buf), buf, dims=1)
                torch.sub(z, t, out=out)
            else:
                out.copy_(z)
            if c0 != 1.0:
                out.div_(c0)
            p.grad = (p.summed_grad + out).view_as(p)
            _mark_as_processed(p.summed_grad)

    def _check_clip_norm(self) -> None:
        """Correlated noise is priced for one clip norm: ``w_i`` carries the earlier ``z_j``,
        drawn at *their* ``max_grad_norm``, so a change of ``max_grad_norm`` mid-stream (a
        schedule, adaptive clipping, a resume with another value) would scale the carry-over
        by ``C_j / C_i`` relative to step ``i``'s sensitivity, which the strategy's accounting
        does not cover. Raises :class:`ClipNormChangedError` before any noise is drawn."""
        norm = float(self.max_grad_norm)
        if not adds_correlated_noise(self):
            return  # c = [1]: DP-SGD, independent noise
        if self.noise_clip_norm is None:
            self.noise_clip_norm = norm
        elif norm != self.noise_clip_norm:
            raise ClipNormChangedError(
                f"{CORRELATED_CLIP_MESSAGE}: max_grad_norm is {norm:g} at noise step "
                f"{self.noise_step + 1}, but the correlated noise stream was started at "
                f"{self.noise_clip_norm:g} (earlier steps' noise, carried into this one, is "
                f"scaled to it)")

    def add_noise(self):
        """Set ``p.grad = p.summed_grad + w_i`` with the correlated noise ``w_i`` (see module);
        raises if ``max_grad_norm`` changed since the stream started (:meth:`_check_clip_norm`)."""
        self._check_clip_norm()
        sigma = getattr(self, "_adjusted_noise_multiplier", self.noise_multiplier)
        if self._blt is None and self.bands > 1:
            self._add_banded_noise(sigma)
            self._advance()
            return
        for idx, p in enumerate(self.params):
            _check_processed_flag(p.summed_grad)
            z = _generate_noise(std=sigma * self.max_grad_norm, reference=p.summed_grad,
                                generator=self._noise_generator(p.summed_grad),
                                secure_mode=self.secure_mode)
            w = self._correlate(idx, z)
            p.grad = (p.summed_grad + w).view_as(p)
            _mark_as_processed(p.summed_grad)
        self._advance()

    def _advance(self) -> None:
        """One noise vector more; a stand-alone optimizer records it in its own lineage (an
        accountant's lineage records the draws of the optimizers it prices)."""
        self.noise_step += 1
        if noise_lineage.lineage_of_optimizer(self) is None:
            self._own_lineage.record(None)

    def _lineage(self):
        return noise_lineage.lineage_of_optimizer(self) or self._own_lineage

    # ---- checkpointing -------------------------------------------------------------------
    def noise_state_dict(self) -> dict:
        """Correlated-noise state: coefficients, step index, ring buffers, generator state, and
        the noise lineage tag of the run that prices this optimizer
        (:mod:`~opacus_structured.accountants.noise_lineage`)."""
        gen_state = None
        if isinstance(self.generator, torch.Generator) and not self.secure_mode:
            gen_state = self.generator.get_state()
        return {
            "noise_tag": self._lineage().tag(),
            "coefficients": self._coef_list if isinstance(self._coef_list, dict)
            else list(self._coef_list),
            "noise_step": self.noise_step,
            "clip_norm": self.noise_clip_norm,
            "buffers": [None if b is None else b.detach().clone() for b in self._noise_buffers],
            "generator_state": gen_state,
        }

    def load_noise_state_dict(self, state: dict, *, journal=None) -> None:
        """Restore :meth:`noise_state_dict`. The ring buffers and step index are restored; the
        generator state only where the resume provably continues the run from its last
        released step (:func:`~opacus_structured.accountants.noise_lineage.may_restore`), else
        the generator is reseeded from OS entropy (the buffers' earlier noise is kept, the new
        ``z_i`` are fresh). A state behind noise this process already drew for the same run
        raises :class:`~opacus_structured.accountants.noise_lineage.NoiseReplayError`: step
        ``i``'s noise is correlated with the steps before it, so the later steps' noise cannot
        be replaced."""
        tag = state.get("noise_tag")
        if noise_lineage.rewinds(tag):
            raise noise_lineage.NoiseReplayError(
                f"this correlated-noise state is at noise step {tag['position']} of a run that "
                f"has already drawn more noise in this process (an earlier checkpoint): the "
                f"noise of a step is correlated with the steps before it, so restoring it would "
                f"release a second noise at positions already released. Resume from the run's "
                f"latest checkpoint, or start a new run (a new optimizer and accountant)")
        coefs = _coefficients_key(state["coefficients"])
        if coefs != _coefficients_key(self._coef_list):
            raise ValueError(f"checkpoint noise_correlation {coefs} differs from this "
                             f"optimizer's {self._coef_list}: build it with the same strategy "
                             f"(after a resume under another batch size, a new phase, the "
                             f"correlated stream starts again: do not load the earlier "
                             f"optimizer's state)")
        buffers = state["buffers"]
        if len(buffers) != len(self.params):
            raise ValueError(f"checkpoint has noise buffers for {len(buffers)} parameters, "
                             f"this optimizer has {len(self.params)}")
        self.noise_step = int(state["noise_step"])
        if journal is None:  # the dataset budget charging this optimizer keeps the journal
            journal = next((g.budget for g in budget_guard.guards_of(self).values()), None)
        proven = noise_lineage.may_restore(tag, journal)
        clip = state.get("clip_norm")
        self.noise_clip_norm = None if clip is None else float(clip)
        self._noise_buffers = [
            None if b is None else b.detach().clone().to(p.device)
            for b, p in zip(buffers, self.params, strict=True)]
        self._flat_rings = None  # the banded path copies them into its contiguous ring
        if state.get("generator_state") is not None:
            if not isinstance(self.generator, torch.Generator):
                raise ValueError("checkpoint holds a noise generator state but this optimizer "
                                 "has no torch.Generator: pass noise_generator=torch.Generator()")
            noise_lineage.restore_or_reseed(self.generator, state["generator_state"], tag,
                                            type(self).__name__, journal, proven=proven)
        if noise_lineage.lineage_of_optimizer(self) is None:
            self._own_lineage.adopt(tag or {"position": self.noise_step}, proven=proven)

    def state_dict(self):
        """The wrapped optimizer's state plus ``"correlated_noise"`` (:meth:`noise_state_dict`)."""
        sd = dict(super().state_dict())
        sd[_STATE_KEY] = self.noise_state_dict()
        return sd

    def load_state_dict(self, state_dict) -> None:
        state_dict = dict(state_dict)
        noise = state_dict.pop(_STATE_KEY, None)
        if noise is not None and _coefficients_key(noise["coefficients"]) != \
                _coefficients_key(self._coef_list):
            raise ValueError(f"checkpoint noise_correlation {noise['coefficients']} differs "
                             f"from this optimizer's {self._coef_list}: build it with the "
                             f"same strategy (after a resume under another batch size, a new "
                             f"phase, the correlated stream starts again: do not load the "
                             f"earlier optimizer's state)")
        super().load_state_dict(state_dict)
        if noise is not None:
            self.load_noise_state_dict(noise)


class CorrelatedNoiseDPOptimizer(CorrelatedNoiseMixin, DPOptimizer):
    """Opacus ``DPOptimizer`` adding banded-Toeplitz correlated noise (BandMF).

    Args:
        optimizer: the wrapped torch optimizer.
        noise_multiplier: σ; the fresh ``z_i`` have std ``σ · max_grad_norm`` (not divided by
            ``‖c‖``: with unit-norm ``c`` each participation has sensitivity ≤ 1).
        max_grad_norm: clipping bound.
        expected_batch_size: data-independent normaliser for ``loss_reduction="mean"``.
        noise_correlation: first column ``c`` of the banded Toeplitz strategy ``C`` (``c_0 > 0``,
            ``c ≥ 0``), e.g. :func:`~opacus_structured.optim.strategies.banded_toeplitz_coefficients`.
            ``None`` or ``[1.0]`` is DP-SGD.
        loss_reduction, secure_mode: as in Opacus.
        generator: ``torch.Generator`` (or Opacus' secure generator) for the fresh ``z_i``;
            ``None``: a per-device generator seeded from OS entropy (not Opacus' global RNG).
    """


_CLASS_CACHE: dict = {}

#: Opacus distributed optimizer class -> its correlated-noise variant, which must add the noise
#: once (rank 0) rather than on every rank. Filled by :mod:`opacus_structured.optim.distributed`.
DISTRIBUTED_VARIANTS: dict[type, type] = {}


def _unsupported_bases() -> tuple[type, ...]:
    """Opacus optimizers whose noise is not the stock per-parameter ``add_noise`` (distributed,
    FSDP, adaptive clipping): a correlated-noise mixin in front of them would be wrong."""
    names = ("DistributedDPOptimizer", "DistributedPerLayerOptimizer",
             "SimpleDistributedPerLayerOptimizer", "DistributedDPOptimizerFastGradientClipping",
             "FSDPOptimizerFastGradientClipping", "AdaClipDPOptimizer")
    return tuple(getattr(opacus_optimizers, n) for n in names if hasattr(opacus_optimizers, n))


def correlated_optimizer_class(base: type) -> type:
    """A subclass of Opacus optimizer class ``base`` with correlated noise.

    Only classes that use the stock per-parameter ``add_noise`` are supported, plus Opacus'
    ``DistributedDPOptimizer`` (noise on rank 0 only), which maps to
    :class:`~opacus_structured.optim.distributed.DistributedCorrelatedNoiseDPOptimizer`; other
    distributed/FSDP optimizers and AdaClip raise ``ValueError``.
    """
    if base is DPOptimizer:
        return CorrelatedNoiseDPOptimizer
    if base in DISTRIBUTED_VARIANTS:
        return DISTRIBUTED_VARIANTS[base]
    if not (isinstance(base, type) and issubclass(base, DPOptimizer)):
        raise ValueError(f"base must be an opacus DPOptimizer subclass, got {base!r}")
    name = base.__name__
    if issubclass(base, _unsupported_bases()):
        raise ValueError(f"correlated noise is not supported with {name} (distributed/adaptive "
                         f"clipping optimizers generate noise differently)")
    if base not in _CLASS_CACHE:
        _CLASS_CACHE[base] = type(f"CorrelatedNoise{name}", (CorrelatedNoiseMixin, base),
                                  {"__module__": __name__})
    return _CLASS_CACHE[base]
