"""Which parameters DP fine-tuning trains (the rest keep their public pretrained values).

DP-SGD adds noise ``N(0, σ²C²)`` to every trained coordinate of the summed clipped gradient,
while the clipping bounds the norm of the whole per-window gradient by ``C``. Training ``d``
coordinates therefore puts on each a signal of order ``C/√d`` against noise ``σC/Λ``: the fewer
coordinates, the better each is estimated. DLinear's two linear maps hold 17 280 of its
17 825 weights (monthly data, context 36); since issue 47 its location starts at a public
combination of local forecasts (:mod:`.baseline_skip`), and what the panel has to teach is
mostly that combination and the predictive distribution's shape, not new lag weights. Its
recipe (:data:`~.model_defaults.MODEL_DEFAULTS`' ``trained_parameters``) trains only the
distribution head (``args_proj``: degrees of freedom, location and scale from the hidden
layer) and the skip's weights: 69 coordinates. On the public study panels this scored 0.488
against 0.504 for every parameter (docs/guides/forecasting.md, "Local forecasts in the
window").

**Privacy.** Which parameters train is fixed before any data is read (a public choice). A
frozen parameter has ``requires_grad = False``: Opacus computes no per-window gradient for it,
clips and noises the trained ones only, and the released network holds the frozen ones at
their public values; the structured accountant prices the steps as before (the mechanism is
the same subsampled Gaussian on a lower-dimensional clipped gradient).

A run that starts from random weights trains every parameter (a frozen random map would
stay random).
"""

from __future__ import annotations

from typing import Optional, Sequence

__all__ = ["resolve_trained_parameters", "freeze_all_but", "thaw"]

#: ``trained_parameters="all"``: every parameter.
ALL = "all"


def resolve_trained_parameters(given, recipe: Optional[Sequence[str]],
                               fine_tuning: bool) -> Optional[tuple]:
    """The name prefixes of the parameters to train, or ``None`` for every parameter.

    ``given`` (the caller's ``trained_parameters``): ``None`` takes the ``recipe``'s when
    ``fine_tuning`` (initial weights were given) and every parameter otherwise; ``"all"`` is
    every parameter; a sequence of name prefixes (``"args_proj"``, ``"baseline_skip"``, ...)
    those parameters."""
    if given is None:
        return tuple(recipe) if (fine_tuning and recipe) else None
    if isinstance(given, str):
        if given != ALL:
            raise ValueError(f"trained_parameters must be 'all' or a sequence of parameter "
                             f"name prefixes, got {given!r}")
        return None
    prefixes = tuple(given)
    if not prefixes or not all(isinstance(p, str) and p for p in prefixes):
        raise ValueError(f"trained_parameters must be 'all' or a non-empty sequence of "
                         f"parameter name prefixes, got {given!r}")
    return prefixes


def freeze_all_but(network, prefixes: Optional[Sequence[str]], *, strict: bool = True) -> int:
    """Set ``requires_grad = False`` on every parameter of ``network`` whose name starts with
    none of ``prefixes`` (``None``: freeze nothing); returns the number of trained scalars.
    ``strict`` (the caller's own prefixes): a ValueError names the prefixes that match no
    parameter. Not strict (a recipe's, which names parameters a network may lack, e.g. a
    DLinear without the scale skip): those are skipped, and where none matches every
    parameter trains."""
    named = list(network.named_parameters())
    unmatched = [p for p in prefixes or () if not any(name.startswith(p) for name, _ in named)]
    if prefixes is not None and not strict:
        prefixes = tuple(p for p in prefixes if p not in unmatched) or None
        unmatched = []
    if prefixes is None:
        return sum(p.numel() for _, p in named)
    if unmatched:
        names = sorted({name.split(".")[0] for name, _ in named})
        raise ValueError(f"trained_parameters {unmatched} match no parameter of the network "
                         f"(its parameters start with {names})")
    trained = 0
    for name, param in named:
        keep = any(name.startswith(p) for p in prefixes)
        param.requires_grad_(keep)
        trained += param.numel() if keep else 0
    return trained


def thaw(network) -> None:
    """Every parameter of ``network`` trainable again (after training: a released network is
    an ordinary one)."""
    for param in network.parameters():
        param.requires_grad_(True)
