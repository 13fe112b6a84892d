r"""Canaries planted into real training runs (issue 19).

Every audit trains a model whose loss is **linear** in the parameters,
:math:`\ell(w; x) = \langle w, x\rangle`, so the per-example gradient *is* the input:
:math:`\nabla_w \ell(w; x) = x` at every ``w``. That makes the canary exactly what the
accountant's worst case assumes, for every clipping path (Opacus' per-sample hooks, ghost
clipping, book-keeping) — the pipeline computes the gradients itself, through its own hooks.

* :class:`DiracCanary` — a **gradient canary**: the input :math:`x = m\,C\,e_k` in a coordinate
  ``k`` that no other example touches. Clipping (to norm ``C``) turns it into :math:`C e_k`, a
  Dirac gradient of exactly the sensitivity the accountant prices; every released noisy sum has
  :math:`y_t[k] = C\,b_t + \sigma C\,\xi_t` (``b_t`` = 1 if the canary was in batch ``t``,
  :math:`\xi` the noise in that coordinate). With ``m > 1`` a pipeline that does not clip
  releases :math:`m C b_t` instead, which the audit sees.
* :class:`InputCanary` — the black-box view of the same example: only the **loss** of the
  canary input under the trained model is observed,
  :math:`s = \ell(w_0; x) - \ell(w_T; x) = \eta\,\langle \sum_t y_t, x\rangle` for SGD with
  learning rate :math:`\eta`; a post-processing of the released gradients, hence a weaker
  (still valid) attack.
* :class:`EventCanary` — for time series: one **time step of one series** (an "event"), the
  unit of the ``structured`` scheme's relation. Every window whose context or forecast span
  covers the event carries it; the audit plants it as a Dirac in the event's own coordinate
  with magnitude ``m`` in every window that covers it, so the structured (window) relation —
  how many windows one event reaches, and how often they are drawn — is what is audited.

The "without" runs hold the canary's slot with a **zero** input (zero gradient): for samplers
that draw every example independently (Poisson, balls-in-bins, cyclic Poisson) that is the same
mechanism as removing the example; for fixed-size batches (truncated Poisson) it is the
zero-out relation, which the audits then price.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .._validation import check_positive

__all__ = ["LinearLoss", "DiracCanary", "InputCanary", "EventCanary", "CANARIES"]


class LinearLoss(nn.Module):
    r"""The linear loss :math:`\ell(\hat y, t) = t\,\hat y` (per example), so that a bias-free
    ``nn.Linear(d, 1)`` has per-example gradient :math:`t\,x`.

    ``reduction`` is an attribute, as for torch's losses, so Opacus' ghost-clipping loss wrapper
    can switch it to ``"none"`` (per-sample losses, shape ``(B,)``).
    """

    def __init__(self, reduction: str = "sum"):
        super().__init__()
        if reduction not in ("sum", "mean", "none"):
            raise ValueError(f"reduction must be 'sum', 'mean' or 'none', got {reduction!r}")
        self.reduction = reduction

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        per_sample = output.reshape(output.shape[0]) * target.reshape(target.shape[0])
        if self.reduction == "none":
            return per_sample
        if self.reduction == "mean":
            return per_sample.mean() if per_sample.numel() else per_sample.sum()
        return per_sample.sum()


@dataclasses.dataclass(frozen=True)
class DiracCanary:
    r"""Gradient canary :math:`x = m\,C\,e_k` (white-box: the auditor reads the released noisy
    gradient sum at every step).

    Args:
        magnitude: ``m``, the canary's gradient norm in units of the clipping norm ``C``; >= 1
            so that a clipping pipeline releases exactly ``C`` (the accountant's sensitivity)
            and a non-clipping one releases ``m C``.
    """

    magnitude: float = 4.0
    name = "dirac"
    observes = "gradients"

    def __post_init__(self):
        if check_positive("magnitude", self.magnitude) < 1.0:
            raise ValueError(f"magnitude must be >= 1 (the canary's gradient must reach the "
                             f"clipping norm), got {self.magnitude!r}")

    def value(self, clip: float) -> float:
        """The canary input's entry in its coordinate: ``m·C``."""
        return float(self.magnitude) * float(clip)


@dataclasses.dataclass(frozen=True)
class InputCanary(DiracCanary):
    r"""The same example seen black-box: the score is the drop of the canary's loss,
    :math:`\ell(w_0; x) - \ell(w_T; x)`, computed by querying the trained model only."""

    name = "input"
    observes = "loss"

    @staticmethod
    def loss_drop(model_before: nn.Module, model_after: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """:math:`\\ell(w_0; x) - \\ell(w_T; x)` for a batch of canary inputs ``x``."""
        with torch.no_grad():
            return (model_before(x) - model_after(x)).reshape(-1)


@dataclasses.dataclass(frozen=True)
class EventCanary(DiracCanary):
    r"""A time-series **event** (one time step of one series) carried by every window covering
    it; its gradient is the Dirac :math:`m\,C\,e_k` in each such window (see module docstring).

    Args:
        series: index of the series holding the event.
        time: the event's time step within that series.
    """

    series: int = 0
    time: int = 0
    name = "event"

    def covering_windows(self, starts, window_length: int) -> list[int]:
        """Indices ``i`` of ``starts`` whose window ``[start, start + window_length)`` covers
        the event's time step."""
        return [i for i, s in enumerate(starts) if s <= self.time < s + window_length]


#: Canary name -> class, for ``run_audit(canary=...)``.
CANARIES = {c.name: c for c in (DiracCanary, InputCanary, EventCanary)}
