"""Attaching a scheme accountant to a training run, and the step hook that prices each step.

:class:`AttachmentMixin` is the part of
:class:`~opacus_structured.accountants.base.SchemeAccountant` that a training run talks to:
:meth:`~AttachmentMixin.attach` checks the DataLoader against the scheme (and makes its batches
carry row tokens), :meth:`~AttachmentMixin.get_optimizer_hook_fn` is Opacus' step hook, and
:meth:`~AttachmentMixin.release` prices one noisy step from what it summed
(:mod:`~opacus_structured.accountants.release_rows`) or, where rows carry no tokens, from the
sampler draw the privacy ledger matches it to (:mod:`~opacus_structured.accountants.ledger`).
"""

from __future__ import annotations

import sys
import weakref
from typing import Optional

from ..samplers import verification
from . import co_release, noise_lineage, parameter_guard
from .ledger import LedgerError
from .observed_release import split_sigma
from .release_guard import guard_optimizer
from .release_rows import recorder_of

__all__ = ["AttachmentMixin", "data_loader_of_make_private"]


def data_loader_of_make_private(max_depth: int = 4):
    """The DataLoader that Opacus' ``PrivacyEngine.make_private`` is about to return, when the
    caller (up to ``max_depth`` frames up) is ``make_private``; else ``None``.

    Opacus builds the accountant's step hook inside ``make_private`` right after preparing the
    DataLoader (``data_loader = self._prepare_data_loader(...)``; ``optimizer.attach_step_hook(
    self.accountant.get_optimizer_hook_fn(sample_rate=...))``) but passes the hook factory only
    the rate. Reading that local is how a stock ``PrivacyEngine`` lets the accountant check the
    sampler; ``tests/test_wiring_soundness.py`` pins the Opacus behaviour it relies on.
    """
    from torch.utils.data import DataLoader

    frame = sys._getframe(1)
    for _ in range(max_depth):
        frame = frame.f_back
        if frame is None:
            return None
        if frame.f_code.co_name == "make_private":
            loader = frame.f_locals.get("data_loader")
            return loader if isinstance(loader, DataLoader) else None
    return None


def _optimizer_and_module_of_make_private(max_depth: int = 4):
    """``(optimizer, module)`` of the enclosing Opacus ``make_private`` (its locals right
    before ``attach_step_hook``: the DP optimizer and the wrapped module), else ``(None, None)``.
    Used to install :func:`~opacus_structured.accountants.release_guard.guard_optimizer`."""
    from opacus.optimizers import DPOptimizer

    frame = sys._getframe(1)
    for _ in range(max_depth):
        frame = frame.f_back
        if frame is None:
            break
        if frame.f_code.co_name == "make_private":
            optimizer = frame.f_locals.get("optimizer")
            if isinstance(optimizer, DPOptimizer):
                return optimizer, frame.f_locals.get("module")
            break
    return None, None


def _check_covered(module, optimizer) -> None:
    """:func:`~opacus_structured.accountants.parameter_guard.check_coverage` inside Opacus'
    ``make_private``, which has already hooked the module for per-sample gradients: on a
    refusal the hooks are removed again, so the user's module is left as it was given."""
    try:
        parameter_guard.check_coverage(module, optimizer, where="make_private")
    except parameter_guard.UncoveredParametersError:
        # a GradSampleModule closes; the hooks of wrap_model=False clean up
        close = getattr(module, "_close", None) or getattr(module, "cleanup", None)
        if callable(close) and module is not parameter_guard.unwrap_module(module):
            close()
        raise


class AttachmentMixin:
    """Attachment to a training run (module docstring)."""

    @property
    def released_steps(self) -> int:
        """Noisy steps released through the step hook (a step that summed ``K`` draws counts
        once here and ``K`` times in ``len(accountant)``, the scheme steps priced)."""
        return self._ledger.releases

    # ---- attachment to a training run ----------------------------------------------------
    @property
    def attached(self) -> bool:
        """Whether an optimizer step hook (or ``DPCallback``) feeds this accountant."""
        return self._attached

    def attach(self, data_loader=None) -> None:
        """Declare that an optimizer's steps will be recorded here, drawn from ``data_loader``.

        With a loader, its batch sampler must implement :attr:`scheme` (see
        :func:`~opacus_structured.samplers.verification.check_data_loader`; raises
        ``ValueError`` naming the fix otherwise) and its draws are checked at every hooked step.
        Without one, the first hooked step looks for the sampler of this scheme that drew since
        now and raises if none did. The loader is made to deliver as a
        :class:`~opacus_structured.samplers.ledger_loader.LedgerDataLoader` (its batches carry
        row tokens; :func:`~opacus_structured.samplers.ledger_loader.track_deliveries`) unless
        someone who knows which batch trains (``DPCallback``) holds the sampler's cursor. Called by :meth:`get_optimizer_hook_fn` (with the loader of
        Opacus' ``make_private``), ``CorrelatedNoisePrivacyEngine`` and ``DPCallback``.
        """
        self._require_bound("be attached to an optimizer")
        source = None
        exact = True
        if data_loader is not None:
            source = verification.check_data_loader(self.scheme, data_loader)
            # its batches then carry row tokens and report their draws (release_rows)
            verification.track_deliveries(data_loader)
            exact = verification.sees_trained_batch(data_loader, source)
            if not exact and not self.scheme.accepts_new_stream:
                raise ValueError(
                    f"the DataLoader has num_workers={data_loader.num_workers}: it draws batches "
                    f"ahead of training, so the accountant cannot see which draw each noisy step "
                    f"trains on, and scheme {self.scheme.name!r} "
                    f"(release policy {self.scheme.release_policy!r}) is priced by the draws "
                    f"released. Train on the DataLoader opacus_structured.make_private returns "
                    f"(a LedgerDataLoader, exact with any num_workers) or use num_workers=0")
        self._attached = True
        self._hooked_steps = 0
        self._attach_tick = verification.draw_clock()
        self._discover = data_loader is None
        self._draw_source = None if source is None else weakref.ref(source)
        self._draws_at_attach = 0 if source is None else source.batches_drawn
        self._exact_cursor = exact
        self._loader_workers = int(getattr(data_loader, "num_workers", 0) or 0)
        self._ledger.bind(source)

    def get_optimizer_hook_fn(self, sample_rate: float, *, data_loader=None):
        """Opacus' step hook, plus the DataLoader checks of :meth:`attach`.

        ``data_loader`` defaults to the loader of the enclosing Opacus ``make_private`` call.
        Raises :class:`UnboundAccountantError` for an unbound accountant. Inside Opacus'
        ``make_private`` it also refuses a module with trainable parameters that the DP
        optimizer does not step (:class:`~opacus_structured.accountants.parameter_guard.
        UncoveredParametersError`) and guards the module's parameters against other optimizers
        (:mod:`~opacus_structured.accountants.parameter_guard`).
        """
        self._require_bound("be attached to an optimizer")
        if data_loader is None:
            data_loader = data_loader_of_make_private()
        optimizer, module = _optimizer_and_module_of_make_private()
        if optimizer is not None and module is not None:  # every trainable parameter is in it
            _check_covered(module, optimizer)
        self.attach(data_loader)
        if optimizer is not None:  # Opacus' make_private: guard before the first step
            guard_optimizer(optimizer, module)
            self.watch_noise(optimizer)
            if module is not None:  # no other optimizer steps the module's parameters
                parameter_guard.guard_parameters(module, optimizer, where="make_private")

        def hook_fn(optim):
            self.release(optim, sample_rate=sample_rate * optim.accumulated_iterations,
                         batches=optim.accumulated_iterations, base_rate=sample_rate)

        return hook_fn

    def watch_noise(self, optimizer) -> None:
        """Make ``optimizer``'s noise draws part of this run's noise lineage (checked before
        every draw: :mod:`~opacus_structured.accountants.noise_lineage`)."""
        guard_optimizer(optimizer)
        noise_lineage.link(optimizer, self._ledger.noise)

    def release(self, optimizer, *, sample_rate: float, batches: int = 1,
                base_rate: Optional[float] = None) -> None:
        """Price one noisy step the optimizer is about to apply (the step hook's body).

        Where the rows the step summed were observed
        (:mod:`~opacus_structured.accountants.release_rows`: the private module's forwards and
        the optimizer's clipping) and carry draw tokens, the step is priced from them
        (:mod:`~opacus_structured.accountants.observed_release`: the draws, rows per example,
        untraceable rows) at the scheme's rate ``base_rate``. Otherwise the step is matched to
        the sampler draw it trained on by the privacy ledger
        (:mod:`~opacus_structured.accountants.ledger`), which raises :class:`LedgerError` when
        the released sequence is not one the scheme prices and, for schemes priced by the draws
        (``release_policy == "span"``), prices skipped draws as released; observed rows
        without tokens must then fit in that one draw.
        """
        padding = 0
        if self._hooked_steps == 0:
            self._adopt_trained_stream()
        self._clip_norms.check(optimizer, step=len(self) + 1)
        if noise_lineage.lineage_of_optimizer(optimizer) is not self._ledger.noise:
            # an optimizer wired by hand: this step's draw was not seen; later ones are checked
            self.watch_noise(optimizer)
            self._ledger.noise.record(None)
        recorder = recorder_of(optimizer)
        rows = recorder.take() if recorder is not None else None
        if self._co_release(optimizer, rows, sample_rate if base_rate is None else base_rate):
            return
        if base_rate is not None and not (rows is not None and rows.tracked) \
                and self._release_counted(optimizer, rows, base_rate):
            return  # DPCallback counted the draws the step sums (observed_release)
        if rows is not None and base_rate is not None:
            if rows.tracked and self._exact_cursor and self._ledger.source is not None:
                self._release_observed(optimizer, rows, base_rate)
                return
            sample_rate, batches = base_rate, 1  # the rows say what was summed
        exact = self._exact_cursor and not self._prefetched_elsewhere()
        checked = self._discover or not (exact and self._ledger.source is not None)
        if checked:
            self.check_draws()  # finds the sampler (discovery), or counts draws
        if exact and self._ledger.source is not None:
            padding = self._ledger.take(self.scheme, batches=batches, priced_steps=len(self),
                                        optimizer=optimizer)
            if rows is not None:
                self._check_untracked_rows(rows)
        else:  # Opacus' own sampler, or a prefetching loader: the draw count is checked
            self._ledger.count_release(optimizer)
            if rows is not None:
                self._check_untracked_rows(rows)
        sigma = optimizer.noise_multiplier
        if padding:
            self.step(noise_multiplier=sigma, sample_rate=sample_rate, num_steps=padding)
        if not checked:  # after the ledger's finer checks; subclasses' bookkeeping runs here
            self.check_draws()
        self.step(noise_multiplier=sigma, sample_rate=sample_rate)
        if exact and self._ledger.source is not None and batches == 1:
            co_release.register(self._ledger.source, self._ledger.source.current_draw(), self,
                                optimizer, sigma, len(self) - 1)
        self._ledger.note_priced()
        self._hooked_steps += 1

    # ---- several private modules on one draw stream (co_release) ---------------------------
    def _adopt_trained_stream(self) -> None:
        """At the first step: if this accountant's sampler drew nothing since it was attached
        but exactly one other private loader (one that ``make_private`` returned) of the same
        scheme did, the loop trains on that one (an encoder's loader feeding a head made
        private apart): follow it."""
        source = self._ledger.source
        if source is None or not self._exact_cursor or \
                source.batches_drawn > self._draws_at_attach:
            return
        others = [s for s in verification.live_samplers_drawn_since(self._attach_tick)
                  if s is not source
                  and verification.scheme_accepts(self.scheme, getattr(s, "scheme", None))
                  # a private loader make_private returned (its batches are tracked), not a
                  # loader the user built around a sampler of the scheme
                  and getattr(getattr(s, "cursor", None), "from_ledger_loader", False)
                  and getattr(s, "current_draw", lambda: None)() is not None]
        if len(others) != 1:
            return
        stream = others[0]
        self._draw_source = weakref.ref(stream)
        self._draws_at_attach = stream.batches_drawn - 1
        self._ledger.bind(stream)

    def _co_release(self, optimizer, rows, sample_rate: float) -> bool:
        """Price a step of ``optimizer`` on draws another optimizer already released (module
        :mod:`~opacus_structured.accountants.co_release`); ``False`` if it is not one."""
        source = self._ledger.source
        if source is None or not self._exact_cursor:
            return False
        if rows is not None and rows.tracked:
            if rows.untracked or rows.mixed or \
                    not co_release.co_released(source, rows.draws, optimizer):
                return False
            sigma = float(optimizer.noise_multiplier)
            parts = len(rows.multiplicity)
            mine = {d: split_sigma(sigma, parts, rows.multiplicity.get(d, 1)) for d in rows.draws}
        else:
            draw = source.current_draw()
            if draw is None or not co_release.co_released(source, (draw,), optimizer):
                return False
            size = source.size_of(draw) if hasattr(source, "size_of") else None
            if rows is not None and size is not None and rows.private_rows > size:
                return False  # more rows than the draw holds: not one module's pass over it
            mine = {int(draw): float(optimizer.noise_multiplier)}
        newly = False  # this accountant prices a draw it had not priced (it consumed a draw)
        for draw, own in mine.items():
            entries = co_release.releases_of(source, draw)
            joint = co_release.effective_sigma([e.sigma for e in entries] + [own])
            priced_here = False
            for e in entries:
                acc = e.accountant()
                if acc is self:
                    priced_here = True
                if e.step is not None and len(acc.phases) == e.phase:
                    acc.reprice_step(e.step, joint)
            step = None
            if not priced_here:  # this accountant's first release of the draw
                self._ledger.take(self.scheme, priced_steps=len(self), optimizer=optimizer,
                                  draws=[draw])
                self.step(noise_multiplier=joint, sample_rate=sample_rate)
                step = len(self) - 1
                newly = True
            co_release.register(source, draw, self, optimizer, own, step)
        if newly:
            self._hooked_steps += 1
        return True

    def _prefetched_elsewhere(self) -> bool:
        """The sampler is iterated by a DataLoader other than the tagging one (e.g. Opacus'
        ``BatchMemoryManager`` wraps the loader in its own) that prefetches with workers: its
        latest draw is not the batch being trained on, so only the draw count is checked."""
        source = self._ledger.source
        if source is None or source.__dict__.get("_ledger_iteration", True):
            return False
        cursor = source.cursor  # None, or the tagging loader's: nobody else knows the batch
        return (cursor is None or getattr(cursor, "from_ledger_loader", False)) \
            and self._loader_workers > 0

    def _check_untracked_rows(self, rows) -> None:
        """Rows without draw tokens (a loader that does not tag its batches): they must fit in
        the one draw the ledger matched the step to, else the step summed several batches or
        several rows per example, which cannot be told apart here."""
        source = self._ledger.source if self._ledger.source is not None else (
            self._draw_source() if self._draw_source is not None else None)
        if source is None or not hasattr(source, "size_of"):
            return
        if self._exact_cursor and not self._prefetched_elsewhere():
            index = source.current_draw()
            size = source.size_of(index)
        else:  # a prefetching loader: the step's batch is one of the recent draws
            index, sizes = "unknown", source.__dict__.get("_draw_sizes", {})
            size = max(sizes.values()) if sizes else None
        if size is None or rows.private_rows <= size:
            return
        raise LedgerError(
            f"noisy step {len(self) + 1} summed {rows.private_rows} private rows in "
            f"{rows.clippings} clipping pass(es), but the batch it trained on (draw {index}) "
            f"has {size}: the step sums several batches (accumulation across "
            f"optimizer.signal_skip_step, concatenated batches) or several rows per example "
            f"(augmented views), and this DataLoader does not mark which example each row "
            f"is. Fix: train on the DataLoader opacus_structured.make_private returns (it "
            f"tracks rows, and such steps are priced), or one optimizer.step() per batch with "
            f"one row per example; declare generated or public rows with "
            f"opacus_structured.public(x) or `with opacus_structured.public_rows():`")

    def check_draws(self) -> None:
        """Before pricing a hooked step: the scheme's sampler must have drawn a batch for it.

        Raises ``RuntimeError`` when no sampler of this scheme drew since :meth:`attach` (the
        loader trained on is not the scheme's) or fewer batches than steps were drawn (the
        loader checked at ``make_private`` is not the loader trained on).
        """
        if self._discover:
            drawn = [s for s in verification.live_samplers_drawn_since(self._attach_tick)
                     if verification.scheme_accepts(self.scheme, getattr(s, "scheme", None))]
            if not drawn:
                raise RuntimeError(
                    f"the optimizer is stepping, but no sampler of scheme {self.scheme.name!r} "
                    f"({self.scheme!r}) drew a batch since the accountant was attached: the "
                    f"DataLoader trained on does not use scheme.sampler(...), so the epsilon "
                    f"would not describe this training. Build the DataLoader with "
                    f"batch_sampler=scheme.sampler(...) (and poisson_sampling=False in "
                    f"make_private), or pass data_loader= to get_optimizer_hook_fn")
            self._discover = False
            self._draw_source = weakref.ref(drawn[0])
            self._draws_at_attach = 0  # it had not drawn for this run before attach
            self._ledger.bind(drawn[0])
        source = self._draw_source() if self._draw_source is not None else None
        if source is None:
            return
        drawn = source.batches_drawn - self._draws_at_attach
        if drawn < self._hooked_steps + 1:
            raise RuntimeError(
                f"step {self._hooked_steps + 1} is being priced but the scheme's sampler drew "
                f"only {drawn} batch(es) since make_private: the training loop iterates another "
                f"DataLoader than the one make_private returned (use the returned loader)")
