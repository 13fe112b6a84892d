r"""Ghost norms + book-keeping: per-sample clipping in ONE backward, no per-sample gradients.

Opacus' ghost clipping (``grad_sample_mode="ghost"``) needs a second backward of the loss
reweighted by the clipping coefficients, so the training loop must return a per-sample loss
and call a special criterion — an unmodified LightningModule cannot. Book-keeping (Bu, Wang,
Zha & Karypis, "Differentially private optimization on large model at small cost", ICML 2023)
gets the same clipped sum from the *one* ordinary backward:

* during the backward, each hooked ``nn.Linear`` keeps its input ``A`` (B, T, i) and output
  gradient ``G`` (B, T, o) (Opacus' hooks capture both anyway), each ``nn.Embedding`` its token
  ids and output gradient; every other trainable layer gets its per-sample gradients from
  Opacus' grad samplers (functorch as a fallback);
* per-sample norms: ``‖∇W[b]‖² = Σ_{t,s} (a_{bt}·a_{bs})(g_{bt}·g_{bs})`` (the Gram / ghost
  trick, Li et al. 2022) or ``‖G_bᵀA_b‖²_F`` materialised per sample, whichever costs fewer
  flops; ``‖∇bias[b]‖² = ‖Σ_t g_{bt}‖²``; for an embedding, the gradient rows summed per
  (example, token id) (the padding row gets none, as in torch); the global norm ``‖g_b‖``;
* coefficients ``c_b = min(1, C / (‖g_b‖ + 1e-6))`` (Opacus' formula) times an optional mask
  ``m_b ∈ [0, 1]`` (the individual GDP filter's active set);
* the clipped sum, written to ``p.grad``: ``Σ_b c_b ∇W[b] = (c ⊙ G)ᵀ A`` — one matmul over
  the flattened (B·T) rows, never a (B, o, i) tensor — ``Σ_b c_b Σ_t g_{bt}`` for the bias, an
  ``index_add`` of ``c_b g_{bt}`` into the rows ``idx_{bt}`` for an embedding (never a
  (B, vocabulary, dim) tensor), and
  ``einsum('b,b...->...', c, grad_sample)`` for the other layers.

That is exactly ``Σ_b min(1, C/‖g_b‖) g_b``, the clipped sum of hooks mode (each summand has
norm ≤ C, so the sensitivity and the accounting are unchanged); ``tests/test_bookkeeping.py``
checks it against materialised per-sample gradients in float64. The optimizer then only adds
noise: :func:`bookkeeping_optimizer_class` wraps Opacus' ``DPOptimizerFastGradientClipping``
(or its correlated-noise variant) so that ``step()`` first writes the clipped sum.

The clipping norm is the optimizer's current ``max_grad_norm``, read at every step (so a
change of it moves clipping and noise together), and an example whose per-sample norm is
non-finite gets coefficient 0 with its recorded rows zeroed first (``0·inf`` would be NaN):
:mod:`opacus_structured.accountants.release_guard` (issue 29, cases 9-10).

**Several backward passes per step** (gradient accumulation, e.g. Lightning's
``Trainer(accumulate_grad_batches=K)``): each pass appends its rows, as Opacus' hooks append a
``grad_sample`` per pass and its clipping concatenates them. Row ``r`` of a module is the
``r``-th row of its passes in backward order; the per-sample norms, coefficients and clipped
sum run over all rows, each row clipped on its own (a row of pass 1 and a row of pass 2 are two
summands of norm ≤ C each, whichever example they belong to). The clipping reports the rows it
summed to the release record (:mod:`~opacus_structured.accountants.release_rows`), so the
accountant prices what the step summed.

Limits (each refused with a clear error, never silently wrong): every hooked module runs once
per forward (no parameter tying, no recurrent re-use: use
:class:`~opacus_structured.forecasting.fast_rnn.FastDPLSTM`, whose layers run once); every
backward pass of a step runs every hooked layer (else the layers disagree on the rows); every
trainable parameter must be covered by the hooks (a gradient that the hooks did not see would
otherwise be released unclipped).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from opacus.grad_sample import GradSampleHooks
from opacus.grad_sample.functorch import ft_compute_per_sample_gradient
from opacus.optimizers import DPOptimizerFastGradientClipping
from opacus.utils.module_utils import trainable_parameters
from torch import nn

from ..accountants.release_guard import clipping_norm, guard_of
from ..accountants.release_rows import recorder_of

__all__ = ["BookKeepingHooks", "bookkeeping_optimizer_class", "BookKeepingDPOptimizer"]


class BookKeepingHooks(GradSampleHooks):
    """Opacus hooks that record what the clipped sum needs instead of ``p.grad_sample``.

    Args:
        module: the model (hooks go on its sub-modules; the module is not replaced).
        max_grad_norm: clipping norm C.
        batch_first, loss_reduction, strict: as Opacus' ``GradSampleHooks``.

    After ``loss.backward()``: :meth:`per_sample_norms` (B,), :meth:`set_mask`, then
    :meth:`write_clipped_sum` (done by the optimizer's ``step``).
    """

    def __init__(self, module: nn.Module, *, max_grad_norm: float, batch_first: bool = True,
                 loss_reduction: str = "mean", strict: bool = False):
        super().__init__(module, batch_first=batch_first, loss_reduction=loss_reduction,
                         strict=strict)
        if not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm}")
        self.max_grad_norm = float(max_grad_norm)
        self.trainable_parameters = [p for _, p in trainable_parameters(self._module)]
        self._reset()

    # ---- recording (inside backward) -------------------------------------------------------
    def _reset(self) -> None:
        # per module / parameter, one entry per backward pass since the last clipped sum
        self._linear: dict[nn.Linear, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._embedding: dict[nn.Embedding, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._samples: dict[nn.Parameter, list[torch.Tensor]] = {}
        self._norms: Optional[torch.Tensor] = None
        self._mask = None

    @property
    def passes(self) -> int:
        """Backward passes recorded since the last clipped sum (the most of any layer)."""
        counts = [len(v) for d in (self._linear, self._embedding, self._samples)
                  for v in d.values()]
        return max(counts, default=0)

    def capture_activations_hook(self, module, forward_input, _forward_output):
        super().capture_activations_hook(module, forward_input, _forward_output)
        for _, p in trainable_parameters(module):
            if getattr(p, "_forward_counter", 0) > 1:
                raise ValueError(
                    f"{type(module).__name__} ran more than once in one step (parameter tying "
                    f"or a recurrent cell re-used over time): ghost/book-keeping clipping needs "
                    f"one call per module and step; use grad_sample_mode='hooks' (or "
                    f"FastDPLSTM instead of an LSTM cell loop)")

    def capture_backprops_hook(self, module, _forward_input, forward_output, loss_reduction,
                               batch_first):
        if not self.hooks_enabled:
            return
        activations, backprops = self.rearrange_grad_samples(
            module=module, backprops=forward_output[0].detach(), loss_reduction=loss_reduction,
            batch_first=batch_first)
        if type(module) is nn.Linear:
            a = activations[0].to(backprops.dtype)
            n, t = backprops.shape[0], math.prod(backprops.shape[1:-1])  # (B, T, ·); B may be 0
            self._linear.setdefault(module, []).append(
                (a.reshape(n, t, a.shape[-1]), backprops.reshape(n, t, backprops.shape[-1])))
        elif type(module) is nn.Embedding and module.weight.requires_grad:
            if module.sparse:
                raise ValueError("nn.Embedding(sparse=True) is not supported in ghost mode")
            n = backprops.shape[0]
            idx = activations[0].reshape(n, -1)
            g = backprops.reshape(n, idx.shape[1], backprops.shape[-1])
            if module.padding_idx is not None:  # torch gives the padding row no gradient
                g = g * (idx != module.padding_idx).unsqueeze(-1).to(g.dtype)
            self._embedding.setdefault(module, []).append((idx, g))
        else:
            sampler = self.GRAD_SAMPLERS.get(self._get_module_type(module),
                                             ft_compute_per_sample_gradient)
            for p, gs in sampler(module, activations, backprops).items():
                self._samples.setdefault(p, []).append(gs)
        self._norms = None
        for _, p in trainable_parameters(module):
            p._forward_counter -= 1
        if len(module.activations) == 0 and hasattr(module, "max_batch_len"):
            del module.max_batch_len

    # ---- norms, mask, clipped sum (after backward) -----------------------------------------
    @staticmethod
    def _linear_weight_sq_norms(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        _, t, i = a.shape
        o = g.shape[-1]
        if t == 1:
            return (a * a).sum((1, 2)) * (g * g).sum((1, 2))
        if t * (i + o) <= i * o:  # Gram (ghost) trick: B·T²·(i+o) flops
            return (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))
                    ).sum((1, 2)).clamp(min=0)
        return torch.bmm(g.transpose(1, 2), a).pow(2).sum((1, 2))  # B·T·i·o flops

    @staticmethod
    def _embedding_sq_norms(module: nn.Embedding, idx: torch.Tensor, g: torch.Tensor):
        """``‖∇E[b]‖² = Σ_v ‖Σ_{t: idx_bt = v} g_bt‖²``: rows summed per (example, token)."""
        n, t = idx.shape
        out = g.new_zeros(n)
        if n * t == 0:
            return out
        keys = torch.arange(n, device=idx.device).unsqueeze(1) * module.num_embeddings + idx
        uniq, inverse = torch.unique(keys.reshape(-1), return_inverse=True)
        rows = g.new_zeros(uniq.numel(), g.shape[-1]).index_add_(0, inverse,
                                                                  g.reshape(n * t, -1))
        return out.index_add_(0, uniq // module.num_embeddings, rows.pow(2).sum(1))

    def per_sample_norms(self) -> torch.Tensor:
        """Global per-sample gradient norms ‖g_b‖ (B,) of the rows recorded since the last
        clipped sum (the rows of every backward pass, in backward order)."""
        if self._norms is None:
            parts = []
            for module, recs in self._linear.items():
                if module.weight.requires_grad:
                    parts.append(torch.cat([self._linear_weight_sq_norms(a, g)
                                            for a, g in recs]))
                if module.bias is not None and module.bias.requires_grad:
                    parts.append(torch.cat([g.sum(1).pow(2).sum(1) for _, g in recs]))
            for module, recs in self._embedding.items():
                parts.append(torch.cat([self._embedding_sq_norms(module, idx, g)
                                        for idx, g in recs]))
            for gss in self._samples.values():
                parts.append(torch.cat([gs.reshape(gs.shape[0], math.prod(gs.shape[1:]))
                                        .pow(2).sum(1) for gs in gss]))
            if not parts:
                raise ValueError("no per-sample gradients recorded: run the backward of a "
                                 "training step first")
            sizes = {int(p.shape[0]) for p in parts}
            if len(sizes) != 1:
                raise ValueError(f"layers disagree on the batch size {sorted(sizes)} (with "
                                 f"several backward passes per step, every pass must run "
                                 f"every hooked layer)")
            self._norms = torch.stack([p.to(parts[0].device) for p in parts]).sum(0).sqrt()
        return self._norms

    def released_norms(self) -> torch.Tensor:
        """Per-sample norms of what this step will release: ``‖g_b‖·m_b`` once a tensor mask
        is set (a masked-out example contributes nothing, as a zeroed ``grad_sample`` row in
        hooks mode), else ``‖g_b‖``. A callable mask is not evaluated here (raw norms)."""
        norms = self.per_sample_norms()
        if self._mask is None or callable(self._mask):
            return norms
        return norms * torch.as_tensor(self._mask, device=norms.device).to(norms.dtype)

    def set_mask(self, mask) -> None:
        """Weights ``m_b ∈ [0, 1]`` (B,) multiplying the clipping coefficients (``None``: all
        1), or a callable ``mask(norms) -> tensor`` evaluated when the clipped sum is written."""
        self._mask = mask

    def clipping_coefficients(self) -> torch.Tensor:
        norms = self.per_sample_norms()
        coef = (self.max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
        mask = self._mask(norms) if callable(self._mask) else self._mask
        if mask is not None:
            mask = torch.as_tensor(mask, device=coef.device).to(coef.dtype).reshape(-1)
            if mask.numel() != coef.numel():
                raise ValueError(f"mask has {mask.numel()} entries for a batch of "
                                 f"{coef.numel()} examples")
            if bool(((mask < 0) | (mask > 1)).any()):
                raise ValueError("mask values must lie in [0, 1] (the clipped norm must stay "
                                 "<= max_grad_norm)")
            coef = coef * mask
        # a non-finite per-sample gradient is clipped to 0 (issue 29, case 10): never NaN
        return torch.where(torch.isfinite(norms), coef, torch.zeros_like(coef))

    @staticmethod
    def _slices(recs, coef: torch.Tensor):
        """``(record, its rows' coefficients)`` for a module's records (tuples whose last
        tensor has the rows, or per-sample gradient tensors), in backward order."""
        start = 0
        for rec in recs:
            n = int((rec[-1] if isinstance(rec, tuple) else rec).shape[0])
            yield rec, coef[start:start + n]
            start += n

    def write_clipped_sum(self, params) -> None:
        """Set ``p.grad = Σ_b c_b ∇p[b]`` for every parameter in ``params`` (``b`` over the rows
        of every backward pass recorded), then forget the step. Raises if a parameter with a
        gradient was not seen by the hooks."""
        coef = self.clipping_coefficients()
        bad = ~torch.isfinite(self.per_sample_norms())
        if bool(bad.any()):  # zero the rows themselves: 0 * inf would be NaN in the sums
            self._zero_examples(bad)
        written = set()
        for module, recs in self._linear.items():
            weight = bias = None
            for (a, g), c in self._slices(recs, coef):
                gc = g * c.to(g.dtype).view(-1, 1, 1)
                w = gc.reshape(-1, gc.shape[-1]).t() @ a.reshape(-1, a.shape[-1])
                weight = w if weight is None else weight + w
                bias = gc.sum((0, 1)) if bias is None else bias + gc.sum((0, 1))
            if module.weight.requires_grad:
                module.weight.grad = weight.to(module.weight.dtype)
                written.add(module.weight)
            if module.bias is not None and module.bias.requires_grad:
                module.bias.grad = bias.to(module.bias.dtype)
                written.add(module.bias)
        for module, recs in self._embedding.items():
            grad = torch.zeros_like(module.weight)
            for (idx, g), c in self._slices(recs, coef):
                gc = (g * c.to(g.dtype).view(-1, 1, 1)).reshape(-1, g.shape[-1])
                grad.index_add_(0, idx.reshape(-1), gc.to(module.weight.dtype))
            module.weight.grad = grad
            written.add(module.weight)
        for p, gss in self._samples.items():
            p.grad = sum(torch.einsum("b,b...->...", c.to(gs.dtype), gs)
                         for gs, c in self._slices(gss, coef)).to(p.dtype)
            written.add(p)
        for p in params:
            if p.requires_grad and p not in written:
                if p.grad is not None:
                    raise ValueError(
                        f"a trainable parameter of shape {tuple(p.shape)} has a gradient the "
                        f"per-sample hooks did not see (a module Opacus cannot hook, or a "
                        f"parameter used outside its module); its gradient would be released "
                        f"unclipped")
                p.grad = torch.zeros_like(p)  # unused this step: contributes nothing
        self._reset()

    def _zero_examples(self, bad: torch.Tensor) -> None:
        """Zero every recorded row of the examples flagged in ``bad`` (all rows, in order)."""
        def zero(t, m):
            return t.masked_fill(m.to(t.device).view(-1, *([1] * (t.dim() - 1))), 0)

        self._linear = {m: [(zero(a, b), zero(g, b)) for (a, g), b in self._slices(recs, bad)]
                        for m, recs in self._linear.items()}
        self._embedding = {m: [(idx, zero(g, b)) for (idx, g), b in self._slices(recs, bad)]
                           for m, recs in self._embedding.items()}
        self._samples = {p: [zero(gs, b) for gs, b in self._slices(gss, bad)]
                         for p, gss in self._samples.items()}

    def remove_hooks(self) -> None:
        self._reset()
        super().remove_hooks()


class _BookKeepingMixin:
    """``step()`` writes the book-keeping clipped sum into ``p.grad`` first; the wrapped
    ``DPOptimizerFastGradientClipping`` then accumulates it, adds noise, scales and steps."""

    bookkeeper: Optional[BookKeepingHooks] = None

    def attach_bookkeeper(self, hooks: BookKeepingHooks) -> None:
        if abs(hooks.max_grad_norm - self.max_grad_norm) > 1e-12 * self.max_grad_norm:
            raise ValueError(f"hooks clip at {hooks.max_grad_norm} but the optimizer's "
                             f"max_grad_norm is {self.max_grad_norm}")
        self.bookkeeper = hooks

    def pre_step(self, closure: Optional[Callable[[], float]] = None):
        if self.bookkeeper is None:
            raise ValueError("no BookKeepingHooks attached: call attach_bookkeeper(hooks)")
        # clip at the optimizer's current max_grad_norm, the one the noise uses (issue 29.9)
        norm = clipping_norm(self)
        self.bookkeeper.max_grad_norm = norm
        rec = recorder_of(self)
        if rec is not None:  # the rows this clipped sum holds (release_rows): priced from them
            rows = int(self.bookkeeper.per_sample_norms().shape[0])
            rec.on_clip(rows, fresh=not getattr(self, "_is_last_step_skipped", False))
        self.bookkeeper.write_clipped_sum(self.params)
        guard = guard_of(self)
        if guard is not None:
            guard.record(norm)
        return super().pre_step(closure)


def bookkeeping_optimizer_class(base: type = DPOptimizerFastGradientClipping) -> type:
    """The book-keeping variant of an Opacus fast-gradient-clipping optimizer class (e.g.
    :data:`~opacus_structured.optim.ghost_clipping.CorrelatedNoiseDPOptimizerFastGradientClipping`).
    """
    if not (isinstance(base, type) and issubclass(base, DPOptimizerFastGradientClipping)):
        raise ValueError(f"base must subclass opacus DPOptimizerFastGradientClipping, got "
                         f"{base!r}")
    return type(f"BookKeeping{base.__name__}", (_BookKeepingMixin, base), {})


#: Plain DP-SGD noise over the book-keeping clipped sum.
BookKeepingDPOptimizer = bookkeeping_optimizer_class(DPOptimizerFastGradientClipping)
