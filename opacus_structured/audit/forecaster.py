r"""The forecasting trainer audited end to end (paths ``forecaster`` / ``forecaster-ghost`` of
the ``structured`` audit).

:func:`run_forecaster_audit` audits :func:`~opacus_structured.forecasting.training.
train_forecaster` itself: the gluonts transformation and ``InstanceSplitter`` that cut the
windows, the structured sampler, the trainer's LightningModule (one loss per window,
averaged), :class:`~lightning_callbacks.DPCallback` with Opacus' per-window gradients (hooks) or
our book-keeping (``forecaster-ghost``), Opacus' ``DPOptimizer``, Adam and the trainer's
structured accountant, whose ε is the one reported. Nothing is replaced: the audit builds a
panel, an estimator and a callback that reads what the optimizer releases, and calls the
trainer.

**Many runs in one trainer run.** With the **deterministic top level** (``top_level=
"deterministic"``, Algorithm 3: step ``b`` of every epoch takes the fixed block ``b`` of
series; each drawn series' window is drawn independently, WR bottom level), which series is in
which step is public, and every series' windows are independent of every other series'. The
audit lays out ``R`` runs of ``num_series`` series each, interleaved so that step ``b`` of an
epoch takes series ``b`` of every run (``Λ = R`` series per step, ``num_series`` steps per
epoch): each run sees exactly the steps and window law of the ``structured`` hooks audit at the
same flags. The trainer's accountant prices the panel of ``num_series · R`` series; under the
deterministic top level its ε depends only on the covering ratio ``r`` and the epochs, so it
equals the hooks audit's reported ε (tested). A WOR top level draws the series of a step
jointly (exactly ``Λ`` of them), so its canary series are not independent runs; it is audited
on the other paths.

**The canary head.** Run ``k``'s series hold the constant value ``k + 1`` (a code); its canary
is an **event**, one time step of its series 0 (time ``L_F − 1``, as in the hooks audit), whose
value becomes ``−(k + 1)`` in the runs "with" it. The network is wrapped by
:class:`CanaryHeadNetwork`, which adds to every window's loss a linear term ``⟨θ, h⟩`` of its
own coordinates ``θ ∈ R^R``: ``h = −M e_k`` for a window of run ``k`` without the event and
``h = +M e_k`` for one that holds it (``M`` = :data:`MAGNITUDE`), read off the raw window the
trainer feeds the network (``past_target`` and ``future_target``, before any scaling). The
window's gradient is ``(g, ±M e_k)`` with ``g`` the network's own; clipped to ``C`` it puts
``±C·M/‖(g, M)‖ = ±C(1 − O(‖g‖²/M²))`` on coordinate ``k`` and nothing on any other run's.
The optimizer releases ``(Σ clipped + N(0, σ²C²))/Λ``; the audit reads ``θ``'s noisy gradient
after every step (in the optimizer's step hook, after the noise) and scales it by ``Λ/C``:
``y_t = −1 + σξ`` without the event, ``+1 + σξ`` at the steps where a covering window was
drawn (probability ``r`` at the canary series' step of every epoch), the pair of Theorem 4.2.
The score is the hooks audit's likelihood ratio (:func:`~opacus_structured.audit.pipelines.
likelihood_ratio_scores`). Any score gives a valid lower bound; the residual ``O(‖g‖²/M²)``
only moves the score off the optimal one by a negligible amount.

The network barely learns (its share of every clipped gradient is ``‖g‖/M``): the audit is of
what the pipeline releases, not of the forecasts.
"""

from __future__ import annotations

import time
import types
from typing import Callable, Optional

import lightning.pytorch as pl
import numpy as np
import pandas as pd
import torch
from torch import nn

from .._validation import check_int
from ..forecasting.data import Panel
from ..forecasting.training import train_forecaster
from .pipelines import _audit_scores, _Plan, _scores

__all__ = ["CanaryHeadNetwork", "canary_head_estimator", "canary_panel",
           "ReleasedHeadGradient", "run_forecaster_audit", "MAGNITUDE",
           "FORECASTER_CHUNK_RUNS"]

#: The trainer's ``grad_sample_mode`` of each path of
#: :data:`~opacus_structured.audit.pipelines.FORECASTER_PATHS`.
_GRAD_SAMPLE_MODE = {"forecaster": "hooks", "forecaster-ghost": "ghost"}
#: Magnitude ``M`` of the canary head's per-window gradient (≫ the network's own gradient).
MAGNITUDE = 1e6
#: Runs per trainer run (the head has one coordinate per run; ``Λ`` = runs per step).
FORECASTER_CHUNK_RUNS = 1024
#: The clipping norm the audit trains with (the trainer's default).
AUDIT_CLIP = 1e-4


class CanaryHeadNetwork(nn.Module):
    """A gluonts network with canary-head coordinates added to its training loss.

    ``forward`` is the network's (forecasts are untouched); ``loss(**inputs)`` is the
    network's per-window loss plus ``⟨θ, h(window)⟩`` (module docstring), ``θ`` a bias-free
    ``nn.Linear(codes, 1)`` initialised to zero, so that Opacus computes its per-window
    gradient ``h`` and clips it together with the network's.
    """

    def __init__(self, network: nn.Module, codes: int, magnitude: float = MAGNITUDE):
        super().__init__()
        self.network = network
        self.codes = check_int("codes", codes, minimum=1)
        self.magnitude = float(magnitude)
        self.head = nn.Linear(self.codes, 1, bias=False)
        nn.init.zeros_(self.head.weight)

    def forward(self, *args, **kwargs):
        return self.network(*args, **kwargs)

    def describe_inputs(self, *args, **kwargs):
        return self.network.describe_inputs(*args, **kwargs)

    def features(self, past_target: torch.Tensor, future_target: torch.Tensor) -> torch.Tensor:
        """``h`` per window: ``∓M`` in the coordinate of the window's code (its largest
        ``|value|``, padding zeros aside), ``+M`` when the window holds a negative value (the
        event), zero for a window with no code in ``1..codes``."""
        n = past_target.shape[0]
        values = torch.cat([past_target.reshape(n, -1), future_target.reshape(n, -1)], dim=1)
        code = values.abs().amax(dim=1).round().long()
        event = (values < 0).any(dim=1)
        h = torch.zeros(n, self.codes, dtype=values.dtype, device=values.device)
        rows = torch.nonzero((code >= 1) & (code <= self.codes)).reshape(-1)
        sign = torch.where(event[rows], 1.0, -1.0).to(values.dtype)
        h[rows, code[rows] - 1] = sign * self.magnitude
        return h

    def loss(self, **inputs) -> torch.Tensor:
        base = self.network.loss(**inputs)
        extra = self.head(self.features(inputs["past_target"], inputs["future_target"]))
        return base + extra.reshape(base.shape)


def canary_head_estimator(codes: int, *, prediction_length: int, context_length: int,
                          batch_size: int, magnitude: float = MAGNITUDE):
    """A gluonts ``SimpleFeedForwardEstimator`` (a subclass, so ``train_forecaster`` accepts it
    as ``estimator=``) whose network is wrapped by :class:`CanaryHeadNetwork`."""
    from gluonts.torch.model.simple_feedforward import SimpleFeedForwardEstimator

    class CanaryHeadEstimator(SimpleFeedForwardEstimator):
        def create_lightning_module(self):
            module = super().create_lightning_module()
            module.model = CanaryHeadNetwork(module.model, codes, magnitude)
            return module

    return CanaryHeadEstimator(prediction_length=prediction_length,
                               context_length=context_length, hidden_dimensions=[16],
                               batch_norm=False, batch_size=batch_size, lr=1e-3,
                               weight_decay=0.0)


def canary_panel(present: np.ndarray, num_series: int, series_length: int,
                 event_time: int) -> Panel:
    """``num_series`` series per run, interleaved (series ``b·R + k`` is series ``b`` of run
    ``k``); run ``k``'s values are ``k + 1``, and ``−(k + 1)`` at ``event_time`` of its series
    0 where ``present[k]``."""
    runs = present.size
    targets = []
    for b in range(num_series):
        for k in range(runs):
            x = np.full(series_length, k + 1.0, dtype=np.float32)
            if b == 0 and present[k]:
                x[event_time] = -(k + 1.0)
            targets.append(x)
    start = pd.Period("2000-01-01", freq="D")
    return Panel(tuple(targets), (start,) * len(targets),
                 tuple(f"run{k}-series{b}" for b in range(num_series) for k in range(runs)),
                 "D")


class ReleasedHeadGradient(pl.Callback):
    """Reads the canary head's noisy gradient in the DP optimizer's step hook (after the noise,
    before Adam's step), in units of ``C`` per window: ``θ.grad · scale`` with ``scale = Λ/C``
    (``rows``: one array per step)."""

    def __init__(self, scale: float):
        self.scale, self.rows = float(scale), []

    def on_train_start(self, trainer, pl_module):
        head = pl_module.model.head
        optimizer = trainer.optimizers[0]  # DPCallback's DP optimizer (installed at fit start)
        previous = optimizer.step_hook

        def hook(opt, _previous=previous):
            if _previous is not None:
                _previous(opt)
            self.rows.append(head.weight.grad.detach().reshape(-1).double().cpu().numpy()
                             * self.scale)

        optimizer.attach_step_hook(hook)


def run_forecaster_audit(plan: _Plan, runs: int, seed: Optional[int],
                         progress: Optional[Callable[[int, int], None]] = None):
    """The audit of ``plan`` (``structured`` scheme, a path of
    :data:`~opacus_structured.audit.pipelines.FORECASTER_PATHS`)
    through :func:`~opacus_structured.forecasting.training.train_forecaster` (module
    docstring); ``runs`` runs with and ``runs`` without the event, in trainer runs of up to
    :data:`FORECASTER_CHUNK_RUNS` runs."""
    f = plan.flags
    if f["top_level"] != "deterministic":
        raise ValueError(f"top_level: the {plan.path} path needs 'deterministic' (a WOR top "
                         f"level draws the series of a step jointly, so canary series are not "
                         f"independent runs), got {f['top_level']!r}: pass "
                         f"top_level='deterministic' (--top-level deterministic)")
    if f["context_length"] < 1:
        raise ValueError(f"context_length: the {plan.path} path trains a gluonts network, "
                         f"which needs >= 1, got {f['context_length']}")
    if plan.mutation not in (None, "noise-halved"):
        raise ValueError(f"mutation: the {plan.path} path runs 'noise-halved' only (the "
                         f"trainer's own clipping and sampler are not replaceable), got "
                         f"{plan.mutation!r}")
    if plan.canary.observes != "gradients":
        raise ValueError(f"canary: the {plan.path} path reads the released gradients (a "
                         f"'dirac' canary)")
    started = time.perf_counter()
    scheme = plan.scheme
    event_time = plan.spec.event(plan).time
    seq = np.random.SeedSequence(seed)
    present = np.concatenate([np.ones(runs, dtype=bool), np.zeros(runs, dtype=bool)])
    present = present[np.random.default_rng(seq.spawn(1)[0]).permutation(present.size)]
    chunks, reported = [], None
    for start in range(0, present.size, FORECASTER_CHUNK_RUNS):
        part = present[start:start + FORECASTER_CHUNK_RUNS]
        child = int(seq.spawn(1)[0].generate_state(1, dtype=np.uint64)[0] & ((1 << 62) - 1))
        panel = canary_panel(part, scheme.num_series, scheme.series_length, event_time)
        estimator = canary_head_estimator(part.size, prediction_length=scheme.forecast_length,
                                          context_length=scheme.context_length,
                                          batch_size=part.size)
        released = ReleasedHeadGradient(part.size / AUDIT_CLIP)
        result = train_forecaster(
            None, panel, estimator=estimator, batch_size=part.size,
            noise_multiplier=plan.actual_noise_multiplier, delta=plan.delta,
            max_grad_norm=AUDIT_CLIP, max_steps=plan.steps, top_level="deterministic",
            seed=child, init_seed=child, grad_sample_mode=_GRAD_SAMPLE_MODE[plan.path],
            callbacks=[released])
        if result.steps != plan.steps or len(released.rows) != plan.steps:
            raise RuntimeError(f"the trainer took {result.steps} steps ({len(released.rows)} "
                               f"released), not {plan.steps}")
        if reported is None:  # what the trainer's accountant reports, told the claimed σ
            reported = (float(result.epsilon) if plan.mutation is None else float(
                result.scheme.epsilon(plan.noise_multiplier, plan.steps, plan.delta)))
        chunks.append(types.SimpleNamespace(present=part, samplers=[None] * part.size,
                                            observed=np.stack(released.rows, axis=1),
                                            strategy=lambda: None))
        if progress is not None:
            progress(min(start + part.size, present.size), present.size)
    return _audit_scores(plan, present, _scores(plan, chunks), reported, runs, seed, started)
