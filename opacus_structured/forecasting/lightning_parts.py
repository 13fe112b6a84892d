"""The Lightning pieces of :func:`~opacus_structured.forecasting.training.train_forecaster`
(split out of :mod:`opacus_structured.forecasting.training`): the LightningModule that trains a
gluonts network on windows, the tail-averaging and progress callbacks."""

from __future__ import annotations

import math

from .. import _progress
from .baseline_skip import skip_parameters
from .estimators import PreparedModel


# ---- Lightning module ------------------------------------------------------------------------
def _lightning():
    import lightning.pytorch as pl

    return pl


def _window_module(prepared: PreparedModel, *, lr: float, weight_decay: float,
                   skip_lr: float | None = None):
    """A plain (non-private) LightningModule training ``prepared.module.model`` with Adam on
    window batches: one loss per window, averaged. DP-SGD is added from outside by
    :class:`~lightning_callbacks.DPCallback`, exactly as for any user's LightningModule.

    The weights of a baseline skip (:mod:`~opacus_structured.forecasting.baseline_skip`) are
    Adam's second parameter group, with step size ``skip_lr`` (default ``lr``)."""
    import torch
    from gluonts.itertools import select

    pl = _lightning()

    class WindowForecastModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = prepared.module.model
            self.inputs = prepared.module.inputs

        def training_step(self, batch, batch_idx):
            loss = self.model.loss(**select(self.inputs, batch),
                                   future_observed_values=batch["future_observed_values"],
                                   future_target=batch["future_target"])
            n = batch["future_target"].shape[0]
            if loss.shape != (n,):
                raise RuntimeError(f"expected one loss per window, got shape "
                                   f"{tuple(loss.shape)} for {n} windows")
            loss = loss.mean()
            self.log("train_loss", loss.detach(), on_step=True, prog_bar=False, logger=False,
                     batch_size=n)
            return loss

        def configure_optimizers(self):
            skip = {id(p) for p in skip_parameters(self.model)}
            if not skip:
                return torch.optim.Adam(self.model.parameters(), lr=lr,
                                        weight_decay=weight_decay)
            groups = [{"params": [p for p in self.model.parameters() if id(p) not in skip]},
                      {"params": [p for p in self.model.parameters() if id(p) in skip],
                       "lr": lr if skip_lr is None else skip_lr}]
            return torch.optim.Adam(groups, lr=lr, weight_decay=weight_decay)

    return WindowForecastModule()


def _tail_average_callback(total: int, fraction: float):
    """Replace the parameters, at the end of training, by the mean of the last
    ``ceil(fraction × total)`` iterates (Polyak–Ruppert tail averaging).

    Under DP-SGD each iterate is already a release of the mechanism, so their average is
    post-processing: it costs no privacy and averages the injected noise down.
    """
    import torch

    pl = _lightning()
    count = max(1, int(math.ceil(fraction * total)))
    first = total - count + 1  # 1-based index of the first averaged optimizer step

    class _TailAverage(pl.Callback):
        def __init__(self):
            self.sums = None
            self.n = 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step < first:
                return
            params = [p.detach() for p in pl_module.parameters()]
            if self.sums is None:
                self.sums = [p.double().clone() for p in params]
            else:
                for acc, p in zip(self.sums, params, strict=True):
                    acc.add_(p.double())
            self.n += 1

        def on_train_end(self, trainer, pl_module):
            if self.n == 0:
                return
            with torch.no_grad():
                for p, acc in zip(pl_module.parameters(), self.sums, strict=True):
                    p.copy_((acc / self.n).to(p.dtype))

    return _TailAverage()


def _progress_callback(total: int, desc: str, enabled: bool, log=None):
    """A tqdm bar of the training steps (``enabled``), else, where stderr is not a terminal
    and ``log`` is given, a plain line through ``log`` at most every ~10 s
    (:class:`~opacus_structured._progress.LineProgress`)."""
    pl = _lightning()
    lines = log is not None and not enabled and _progress.lines_wanted()

    class _Progress(pl.Callback):
        def __init__(self):
            self.bar = None
            self.lines = None

        def on_train_start(self, trainer, pl_module):
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, disable=not enabled, unit="step",
                            leave=False, dynamic_ncols=True)
            if lines:
                self.lines = _progress.LineProgress(desc, total, log)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.lines is not None:
                self.lines.update(int(trainer.global_step))
            if self.bar is not None:
                self.bar.update(1)
                loss = trainer.callback_metrics.get("train_loss")
                if loss is not None:
                    self.bar.set_postfix(loss=f"{float(loss):.3f}", refresh=False)

        def on_train_end(self, trainer, pl_module):
            if self.bar is not None:
                self.bar.close()

    return _Progress()
