r"""What one noisy step summed, observed: the rows clipped into it and where each came from.

A noisy step of DP-SGD releases ``Σ_rows clip_C(g_row) + N(0, σ²C²)``. Its price depends on
which examples the rows belong to, and this module records that for every release, on the
optimizer that clips (installed by
:func:`~opacus_structured.accountants.release_guard.guard_optimizer` with the private module):

* a **forward pre-hook** on the private module reads the row tokens of the model input
  (:mod:`~opacus_structured.samplers.row_provenance`), hands the model plain tensors, and
  keeps a :class:`ForwardRecord` per forward with gradients enabled;
* every **clipping** (Opacus' ``clip_and_accumulate`` in hooks mode, the clipping coefficients
  in ghost mode) moves the forwards since the previous clipping into the running **sum record**
  and counts the rows it clipped. The sum record lives as long as Opacus' clipped sum
  (``p.summed_grad``): a step skipped with ``optimizer.signal_skip_step(True)`` (manual
  accumulation, ``BatchMemoryManager``) carries both into the next noisy step;
* ``zero_grad`` drops the forwards whose per-sample gradients it drops (a generator step that
  backpropagated through the private module, say), and the sum unless the last step was skipped.
  The ``zero_grad`` that Opacus' ghost clipping calls inside ``loss.backward()``
  (``DPTensorFastGradientClipping.backward``, between its first backward and the clipping
  coefficients) drops ``p.grad`` only, not the per-sample norms the coefficients are computed
  from: the forwards are kept for that clipping (:func:`in_ghost_backward`), so ghost clipping
  is priced from the rows' tokens like hooks mode (two augmented views of each example: the
  draw at ``σ/2``);
* at the noisy step the accountant :meth:`RowRecorder.take`\ s the sum as a
  :class:`ReleaseRows`: the draws whose rows are in it, how many rows each example gave
  (``multiplicity``), untracked rows, rows whose examples are mixed, and declared public rows.

How the accountant prices a :class:`ReleaseRows` is in
:meth:`~opacus_structured.accountants.base.SchemeAccountant.release` (noise splitting: a sum
of ``m`` independent parts under one noise ``N(0, σ²C²)`` is post-processing of ``m`` releases
at noise ``σ/√m`` each).
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping

from ..samplers import row_provenance as rp
from ..samplers.torch_calls import eager_only, skip_wrapper_frames

__all__ = ["ForwardRecord", "ReleaseRows", "RowRecorder", "recorder_of", "install_recorder",
           "PublicRowsError", "row_count", "forward_tokens", "in_ghost_backward"]


class PublicRowsError(ValueError):
    """Rows of the private DataLoader were declared public."""


@dataclass
class ForwardRecord:
    """One forward of the private module with gradients enabled."""

    rows: int
    tokens: Optional[np.ndarray] = None   # per-row tokens (exact provenance), if any
    mixed: Optional[rp.Provenance] = None  # rows whose examples are mixed
    public: bool = False                   # inside opacus_structured.public_rows()
    span: Optional[int] = None             # the tokens are a delivered batch's (Provenance.span)


@dataclass
class ReleaseRows:
    """What one noisy step summed (module docstring).

    Attributes:
        multiplicity: draw -> the largest number of rows one row of that draw gave this sum
            (1: every sampled example once; 2: e.g. two augmented views of each example).
        untracked: rows without provenance (built outside torch, generated, or rows the
            clipping saw that no recorded forward explains).
        mixed: rows each of which may depend on every example of ``mixed_draws``.
        mixed_draws: the draws behind the mixed rows; ``lost_at`` the operation that mixed them.
        public: declared public rows (cost nothing).
        clipped: rows the clipping summed (``None`` when it was not observed).
        clippings: clipping passes summed into this release (> 1 after skipped steps).
    """

    multiplicity: dict = field(default_factory=dict)
    untracked: int = 0
    mixed: int = 0
    mixed_draws: frozenset = frozenset()
    lost_at: Optional[str] = None
    public: int = 0
    clipped: Optional[int] = None
    clippings: int = 0

    @property
    def tracked(self) -> bool:
        """Whether any row carries a private draw token (exact or mixed)."""
        return bool(self.multiplicity) or self.mixed > 0

    @property
    def draws(self) -> list[int]:
        """The draws whose rows are in the sum, in order."""
        return sorted(set(self.multiplicity) | set(self.mixed_draws))

    @property
    def private_rows(self) -> int:
        """Rows that are not declared public."""
        exact = sum(self._row_counts.values()) if self._row_counts else 0
        return exact + self.untracked + self.mixed

    _row_counts: dict = field(default_factory=dict, repr=False)

    def _count_tokens(self, allt: np.ndarray) -> None:
        self.public += int((allt == rp.PUBLIC).sum())
        self.untracked += int((allt == rp.UNTRACKED).sum())
        valid = allt[allt >= 0]
        if not len(valid):
            return
        values, counts = np.unique(valid, return_counts=True)
        draws = values >> rp.POSITION_BITS
        for d in np.unique(draws):
            sel = draws == d
            self.multiplicity[int(d)] = int(counts[sel].max())
            self._row_counts[int(d)] = int(counts[sel].sum())

    @staticmethod
    def of(records: list[ForwardRecord], clipped: Optional[int],
           clippings: int) -> "ReleaseRows":
        out = ReleaseRows(clipped=clipped, clippings=clippings)
        if len(records) == 1 and records[0].span is not None and (clipped is None
                                                                  or clipped <= records[0].rows):
            # one delivered batch as delivered: its draw, each row once (Provenance.span)
            out.multiplicity[records[0].span] = 1
            out._row_counts[records[0].span] = records[0].rows
            return out
        tokens = []
        recorded = 0
        for rec in records:
            recorded += rec.rows
            if rec.public:
                out.public += rec.rows
            elif rec.mixed is not None:
                out.mixed += rec.rows
                out.mixed_draws = out.mixed_draws | rec.mixed.draws
                out.lost_at = out.lost_at or rec.mixed.lost_at
            elif rec.tokens is not None:
                tokens.append(rec.tokens)
            else:
                out.untracked += rec.rows
        if tokens:
            allt = tokens[0] if len(tokens) == 1 else np.concatenate(tokens)
            if len(allt) and allt[0] >= 0 and bool((allt[1:] > allt[:-1]).all()) \
                    and allt[0] >> rp.POSITION_BITS == allt[-1] >> rp.POSITION_BITS:
                # the common step: rows of one draw, each once, in order (no sort needed)
                draw = int(allt[0] >> rp.POSITION_BITS)
                out.multiplicity[draw] = 1
                out._row_counts[draw] = len(allt)
            else:
                out._count_tokens(allt)
        if clipped is not None and clipped > recorded:
            out.untracked += clipped - recorded  # rows no recorded forward explains
        return out


_EAGER_REASON = (
    "opacus_structured records the rows of every forward of the private module in this forward "
    "pre-hook, outside the compiled graph. torch.compile(fullgraph=True) of a torch.nn container "
    "(e.g. nn.Sequential) traces module hooks into the graph, which cannot break there: compile "
    "without fullgraph=True, or compile a module of your own class (its hooks run outside the "
    "graph), or make_private(..., wrap_model=True) and compile what it returns")


class RowRecorder:
    """The forwards and clippings of one DP optimizer's private module (module docstring)."""

    def __init__(self, batch_first: bool = True):
        self.batch_dim = 0 if batch_first else 1
        self.forwards: list[ForwardRecord] = []
        self.summed: list[ForwardRecord] = []
        self.clipped = 0
        self.clippings = 0
        self.observed = False  # a clipping was seen (the optimizer reports its rows)
        self._handles: list = []

    # ---- the module ------------------------------------------------------------------------
    @eager_only(_EAGER_REASON)  # at every forward, also of a compiled model (torch_calls)
    def forward_pre_hook(self, module, args, kwargs):
        """Unwrap the row tokens of the input; record the forward (gradients enabled)."""
        plain, found = rp.untag((args, kwargs))
        if torch.is_grad_enabled():
            self.forwards.append(self._record(found))
        return plain

    def _record(self, found) -> ForwardRecord:
        if len(found) == 1:  # one input, a delivered batch as delivered (Provenance.span)
            t, prov = found[0]
            if prov is not None and prov.span is not None and prov.dim == self.batch_dim \
                    and t.dim() > self.batch_dim \
                    and t.shape[self.batch_dim] == len(prov.tokens) \
                    and not rp.in_public_block():
                return ForwardRecord(rows=len(prov.tokens), tokens=prov.tokens, span=prov.span)
        n = row_count(found, self.batch_dim)
        tokens, mixed = forward_tokens(found, self.batch_dim)
        if rp.in_public_block():
            private = mixed is not None or (tokens is not None and bool((tokens >= 0).any()))
            if private:
                raise PublicRowsError(
                    "a forward inside opacus_structured.public_rows() trains on rows of the "
                    "private DataLoader (they carry draw tokens): they are private whatever the "
                    "block says. Run only public rows (e.g. generated samples) inside the block")
            return ForwardRecord(rows=n, public=True)
        if mixed is not None:
            return ForwardRecord(rows=n, mixed=mixed)
        if tokens is not None and len(tokens) < n:
            tokens = np.concatenate([tokens, np.full(n - len(tokens), rp.UNTRACKED)])
        return ForwardRecord(rows=n, tokens=tokens)

    # ---- the optimizer ---------------------------------------------------------------------
    def on_clip(self, rows: int, *, fresh: bool) -> None:
        """A clipping pass summed ``rows`` rows; ``fresh``: it starts a new clipped sum."""
        if fresh:
            self.summed, self.clipped, self.clippings = [], 0, 0
        self.summed.extend(self.forwards)
        self.forwards = []
        self.clipped += int(rows)
        self.clippings += 1
        self.observed = True

    def on_zero_grad(self, *, keeps_sum: bool, keeps_forwards: bool = False) -> None:
        """``zero_grad`` drops the per-sample gradients of the forwards since the last
        clipping (unless ``keeps_forwards``: Opacus' ghost clipping between its two backward
        passes), and the clipped sum unless the last step was skipped."""
        if not keeps_forwards:
            self.forwards = []
        if not keeps_sum:
            self.summed, self.clipped, self.clippings = [], 0, 0

    def take(self) -> Optional[ReleaseRows]:
        """The sum record of the noisy step being released (``None`` when no forward of the
        private module was seen since the last release: nothing observed)."""
        if not self.observed:
            records, clipped, clippings = self.forwards, None, 1
        else:
            records, clipped, clippings = self.summed, self.clipped, self.clippings
        self.summed, self.forwards, self.clipped, self.clippings = [], [], 0, 0
        if not records and not clipped:
            return None
        return ReleaseRows.of(records, clipped, clippings)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


_KEY = "_row_recorder"


def recorder_of(optimizer) -> Optional[RowRecorder]:
    """The :class:`RowRecorder` installed on ``optimizer`` (``None`` if none)."""
    return getattr(optimizer, "__dict__", {}).get(_KEY)


_MODULES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _hooked_module(module) -> Optional[torch.nn.Module]:
    """The module whose forward the recorder observes: Opacus' ``GradSampleModule`` itself,
    or, for the hooks object of ``make_private(..., wrap_model=False)`` (Opacus 1.6's
    ``GradSampleHooks``, not a module), the user's module it hooks, which the loop calls."""
    if isinstance(module, torch.nn.Module):
        return module
    inner = getattr(module, "_module", None)
    return inner if isinstance(inner, torch.nn.Module) else None


def install_recorder(optimizer, module) -> Optional[RowRecorder]:
    """Install (once) a :class:`RowRecorder` on ``optimizer`` observing ``module`` (the
    private model Opacus wrapped, or the hooks object Opacus attached to it). Returns it, or
    ``None`` without a module."""
    batch_first = bool(getattr(module, "batch_first", True))
    module = _hooked_module(module)
    if module is None:
        return None
    rec = recorder_of(optimizer)
    if rec is not None:
        return rec
    previous = _MODULES.get(module)
    if previous is not None:  # make_private again on the same module: one recorder
        previous.remove()
    skip_wrapper_frames()  # a model compiled before make_private (samplers/torch_calls)
    rec = RowRecorder(batch_first=batch_first)
    rec._handles.append(module.register_forward_pre_hook(rec.forward_pre_hook,
                                                         with_kwargs=True))
    optimizer.__dict__[_KEY] = rec
    _MODULES[module] = rec
    plain_zero_grad = optimizer.zero_grad

    def zero_grad(*args, **kwargs):
        rec.on_zero_grad(keeps_sum=bool(getattr(optimizer, "_is_last_step_skipped", False)),
                         keeps_forwards=in_ghost_backward())
        return plain_zero_grad(*args, **kwargs)

    optimizer.zero_grad = zero_grad
    return rec


# ---- the rows of a forward (moved from samplers/row_provenance.py, which passed 600 lines) --
def row_count(found: list[tuple[torch.Tensor, Optional[rp.Provenance]]], batch_dim: int) -> int:
    """The number of rows of a forward (Opacus' rule: the largest size along the batch
    dimension among the input tensors)."""
    sizes = [int(t.shape[batch_dim]) for t, _ in found if t.dim() > batch_dim]
    return max(sizes) if sizes else 0


def forward_tokens(found, batch_dim: int) -> tuple[Optional[np.ndarray],
                                                   Optional[rp.Provenance]]:
    """``(tokens, mixed)`` of a forward's input leaves (``found``, as
    :func:`~opacus_structured.samplers.row_provenance.untag` returns them): the per-row tokens
    of the rows (exact, with ``UNTRACKED`` for rows of untracked leaves), or the mixed
    provenance that makes the rows untraceable."""
    n = row_count(found, batch_dim)
    tokens: Optional[np.ndarray] = None
    mixed: Optional[rp.Provenance] = None
    for t, prov in found:
        if prov is None:
            continue
        if not prov.is_exact or (t.dim() > batch_dim and prov.dim != batch_dim) \
                or len(prov.tokens) != (t.shape[batch_dim] if t.dim() > batch_dim else -1):
            mixed = _mixed_with(mixed, prov.draws, prov.lost_at or "a row dimension other "
                                "than the model's batch dimension")
            continue
        if len(prov.tokens) != n:
            mixed = _mixed_with(mixed, prov.draws, "input tensors with different row counts")
            continue
        if tokens is None:
            tokens = prov.tokens
        elif not np.array_equal(tokens, prov.tokens):
            both = np.where(tokens == prov.tokens, tokens, rp.UNTRACKED)
            if (both != tokens).any() and ((tokens >= 0) & (prov.tokens >= 0)).any():
                mixed = _mixed_with(mixed, prov.draws | rp.token_draws(tokens),
                                    "input tensors whose rows hold different examples")
            tokens = np.maximum(tokens, prov.tokens)
    return tokens, mixed


def _mixed_with(mixed: Optional[rp.Provenance], draws, lost_at: str) -> rp.Provenance:
    """A mixed provenance over ``mixed``'s draws (if any) and ``draws``, lost at ``lost_at``."""
    return rp.Provenance.mixed((mixed.draws if mixed else frozenset()) | draws, lost_at)


#: Opacus' ghost-clipping ``loss.backward()`` (:func:`in_ghost_backward`).
_GHOST_BACKWARD = DPTensorFastGradientClipping.backward.__code__


def in_ghost_backward(max_depth: int = 4) -> bool:
    """Whether the caller (up to ``max_depth`` frames up, wrappers included) runs inside
    Opacus' ghost-clipping ``loss.backward()``: its ``optimizer.zero_grad()`` between the first
    backward and the clipping coefficients clears ``p.grad`` (and the clipped sum of a step
    that was not skipped), while the per-sample norms of the forwards it is about to clip stay
    on the parameters (``_norm_sample``)."""
    frame = sys._getframe(1)
    for _ in range(max_depth):
        frame = frame.f_back
        if frame is None:
            return False
        if frame.f_code is _GHOST_BACKWARD:
            return True
    return False


def rows_in_grad_samples(optimizer) -> tuple[int, bool]:
    """``(rows, fresh)`` of a hooks-mode clipping about to run: the per-sample rows of the
    first parameter (all backward passes since the last clipping) and whether the clipped sum
    starts anew (``p.summed_grad`` is ``None``). No pass over the gradients."""
    for p in optimizer.params:
        gs = getattr(p, "grad_sample", None)
        if gs is None:
            continue
        rows = sum(len(g) for g in gs) if isinstance(gs, list) else len(gs)
        return int(rows), getattr(p, "summed_grad", None) is None
    return 0, True
