r"""Several private modules on one draw stream: one draw released through several noisy sums.

An encoder and a head made private separately (two ``make_private`` calls on one engine, or
two engines), trained together on the batches of one private loader, release at every step two
noisy sums of the **same** draw: ``S_1(d) + σ_1 C_1 Z_1`` and ``S_2(d) + σ_2 C_2 Z_2``. Each
example moves the pair by at most ``(C_1, C_2)``, so the pair is one Gaussian mechanism whose
noise, measured in units of its sensitivity, is

.. math:: \sigma_{\mathrm{eff}} = \Big(\sum_i \sigma_i^{-2}\Big)^{-1/2}
          \qquad(\sigma/\sqrt 2 \text{ for two modules at } \sigma),

and the subsampling is the draw's, once. (The releases may be adaptive, the head's gradient
computed after the encoder's update: Gaussian DP composes adaptively to the same
:math:`\mu = \sqrt{\sum\mu_i^2}`, and amplification by subsampling applies to any mechanism
that this Gaussian pair dominates.) Pricing the releases as two independent subsampled steps
would under-report: their draws are the same.

**How it is priced.** Every noisy step that one of our accountants prices registers, on the
sampler whose draw it released (its last 64 draws are kept: a module training on a batch
older than that is not matched to it), ``(accountant, optimizer, σ', step)``: ``σ'`` the noise
multiplier its history holds for that draw (after noise splitting), ``step`` its position in
the accountant's history. A step of *another optimizer* on a draw already registered is a
**co-release**: every accountant that priced that draw re-prices its step at ``σ_eff`` over all
the releases of the draw (an accountant that had not priced it records it at ``σ_eff``), and
no draw is counted twice. So each engine reports the ε of everything released from the draws
it trained on (with two engines, both print the joint ε). Two steps of the *same* optimizer on
one draw are still refused by the ledger (train on each batch once).

**Which stream.** An accountant whose own loader never drew while its optimizer steps (the
head's engine got a loader of its own, but the loop iterates the encoder's) adopts the one
private stream of the same scheme that drew since it was attached; with several candidates it
raises, naming them.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["Entry", "register", "co_released", "effective_sigma", "releases_of"]

#: draws remembered per sampler (co-releases happen within one training step)
_KEEP = 64


@dataclass
class Entry:
    """One release of a draw: who priced it, at which noise, at which history position."""

    accountant: Any           # weakref to the accountant
    optimizer: int            # id() of the torch optimizer under the DPOptimizer
    sigma: float              # the noise multiplier priced for this draw (σ')
    step: Optional[int]       # position of the draw's step in the accountant's history
    phase: int                # the accountant's phase count when it priced it


#: sampler -> {draw: [Entry, ...]} for its most recent draws (insertion order: oldest first)
_REGISTRY: "weakref.WeakKeyDictionary[Any, dict[int, list[Entry]]]" = \
    weakref.WeakKeyDictionary()


def _base(optimizer) -> int:
    return id(getattr(optimizer, "original_optimizer", optimizer))


def _draws_of(source) -> Optional[dict]:
    try:
        return _REGISTRY.get(source)
    except TypeError:
        return None


def releases_of(source, draw: int) -> list[Entry]:
    """The releases of ``draw`` of ``source`` registered so far (live accountants only)."""
    draws = _draws_of(source)
    if not draws:
        return []
    return [e for e in draws.get(int(draw), ()) if e.accountant() is not None]


def co_released(source, draws, optimizer) -> bool:
    """Whether every one of ``draws`` was already released by an optimizer other than
    ``optimizer`` (and none by ``optimizer`` itself): a co-release."""
    if source is None or not draws:
        return False
    registry = _draws_of(source)
    if not registry:
        return False
    me = _base(optimizer)
    for d in draws:
        entries = registry.get(int(d))
        if not entries or any(e.optimizer == me for e in entries) or \
                all(e.accountant() is None for e in entries):
            return False
    return True


def register(source, draw: int, accountant, optimizer, sigma: float,
             step: Optional[int]) -> None:
    """Record that ``accountant`` priced ``draw`` of ``source`` at ``sigma`` (history position
    ``step``) for ``optimizer``'s release (the last ``_KEEP`` draws are kept)."""
    if source is None or draw is None:
        return
    try:
        draws = _REGISTRY.setdefault(source, {})
    except TypeError:  # a source that cannot be weakly referenced
        return
    ref = accountant.__dict__.get("_weak_self")
    if ref is None:
        ref = accountant.__dict__["_weak_self"] = weakref.ref(accountant)
    entry = Entry(ref, _base(optimizer), float(sigma), step, len(accountant.phases))
    entries = draws.get(int(draw))
    if entries is None:
        draws[int(draw)] = [entry]
        while len(draws) > _KEEP:
            del draws[next(iter(draws))]
    else:
        entries.append(entry)


def effective_sigma(sigmas) -> float:
    r"""``(Σ σ_i⁻²)^{-1/2}``: the noise of several Gaussian releases of one draw (0 if any is
    noiseless)."""
    sigmas = [float(s) for s in sigmas]
    if any(s == 0.0 for s in sigmas):
        return 0.0
    return 1.0 / math.sqrt(sum(1.0 / s ** 2 for s in sigmas))
