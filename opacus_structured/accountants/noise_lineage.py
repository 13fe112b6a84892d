r"""The noise a run has drawn: no noise value is ever added to two releases (issue 46).

A noisy step releases ``S + Z`` (or ``S + (C^{-1}Z)_i`` with correlated noise). If the same
``Z`` is added to two releases ``S_a + Z`` and ``S_b + Z`` (two steps, two runs, or a run and
its resumed copy), their difference ``S_a - S_b`` carries no noise at all: the true ε is
infinite, whatever an accountant prints. That happens without any error when a generator is
put back into a state it has already drawn from: ``trainer.fit(..., ckpt_path=<an earlier
epoch>)`` restoring the noise generator of that epoch, a script that re-seeds the noise
generator with the run's seed in a new process and resumes from a checkpoint, a correlated-noise
ring buffer loaded from an older step.

**The noise position belongs to the ledger.** What a generator draws next is a function of
its state, so the privacy ledger (:class:`~opacus_structured.accountants.ledger.ReleaseLedger`)
keeps, for the run it prices, a :class:`NoiseLineage`:

* a **lineage id**, 128 random bits drawn when the run starts, carried by every checkpoint of
  the run and by every run resumed from one;
* its **position**: how many noise draws the lineage has released;
* a 128-bit **digest** (BLAKE2b, :func:`state_digest`) of the generator's state before each
  of those draws.

The accountant's ``state_dict`` (hence Opacus' ``save_checkpoint``, Lightning checkpoints and
``DPCallback``'s entry) holds the lineage; a process-wide registry also holds, for every
lineage id drawn in this process, its **high-water mark** (the largest position reached) and
its digests, so a lineage restored into a new accountant object is still known. Three rules:

1. **Never the same state twice** (:func:`check_before_draw`, run by a wrapper of the
   optimizer's ``add_noise`` that the release guard installs). Before a draw, the state digest
   of the generator the noise comes from (the optimizer's ``generator``; torch's global RNG of
   the parameters' device when Opacus is given none; nothing for Opacus' ``secure_mode``
   CSPRNG and for the correlated-noise optimizer's own per-object OS-entropy generators, whose
   state is never saved) is compared with the lineage's digests. A match means the draw would
   repeat noise already released; the generator is then **reseeded from OS entropy**
   (:func:`~opacus_structured.samplers._generator.fresh_seed`; a global RNG is not touched: the
   optimizer gets a fresh generator of its own) before the draw, with one
   :class:`FreshNoiseWarning`. After the draw the digest is recorded and the position advances
   (σ = 0, or a DDP rank other than 0, where Opacus adds no noise, records nothing).
2. **A restore continues the noise only when it provably continues the run**
   (:func:`may_restore`). A checkpoint's generator state is restored only when this process
   has drawn noise for that lineage up to exactly the checkpoint's position, i.e. the restored
   run continues from its last released step (bit-identical to the run that was not
   interrupted). Otherwise the state is not restored and the generator is reseeded from OS
   entropy:

   * the lineage went on past the checkpoint (an earlier epoch's checkpoint): restoring would
     replay its later noise on other batches (:class:`FreshNoiseWarning`);
   * the lineage is unknown here (a new process): whether the run released steps after its
     last checkpoint cannot be known, so the resumed run draws fresh noise (logged, not
     warned: the privacy is intact, only bit-identity is given up).

3. **Correlated noise needs its positions** (:func:`check_correlated_position`): the noise of
   step ``i`` is ``(C^{-1}Z)_i``, computed from the ring buffer of the steps before it. A ring
   buffer restored behind noise this process already released for the same lineage (or an
   optimizer whose noise step differs from the position its accountant prices) cannot be
   priced by the accountant's matrix, so it raises :class:`NoiseReplayError` naming the fix
   instead of drawing.

What this does not see: noise drawn from torch's *global* RNG whose draws are shifted against
the earlier run's (other code consuming a different amount of the same RNG between releases
makes the states differ while the values overlap). Opacus draws from the global RNG when no
``noise_generator`` is given; :func:`opacus_structured.make_private`,
``CorrelatedNoisePrivacyEngine`` and ``DPCallback`` never do (their generators are their own).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import secrets
import threading
import weakref
from typing import Any, Optional

import torch

from .._warnings import warn
from ..samplers._generator import fresh_seed

__all__ = ["NoiseLineage", "NoiseReplayError", "FreshNoiseWarning", "may_restore",
           "reseed_fresh", "restore_or_reseed", "noise_source", "link", "lineage_of_optimizer",
           "check_before_draw", "record_after_draw", "check_correlated_position",
           "DIGEST_SIZE"]

log = logging.getLogger(__name__)

#: Bytes of each recorded state digest (BLAKE2b).
DIGEST_SIZE = 16


class NoiseReplayError(RuntimeError):
    """A correlated-noise state would be restored behind noise already released (rule 3 of
    the module docstring): the draw is refused before any noise is added."""


class FreshNoiseWarning(UserWarning):
    """A generator was about to repeat noise already added to a release (or to be restored
    behind it); it was reseeded from OS entropy instead (module docstring, rules 1 and 2)."""


class _Drawn:
    """What this process drew for one lineage id."""

    __slots__ = ("high_water", "digests")

    def __init__(self):
        self.high_water = 0
        self.digests: set[bytes] = set()


_LOCK = threading.Lock()
_DRAWN: dict[str, _Drawn] = {}


def _new_id() -> str:
    return secrets.token_hex(16)


def _high_water_of(lineage: str) -> Optional[int]:
    """The largest position this process drew for ``lineage`` (``None``: none)."""
    with _LOCK:
        drawn = _DRAWN.get(lineage)
        return None if drawn is None else drawn.high_water


#: Bytes of each end of a generator's state that the digest reads (the whole state when it is
#: at most twice this: a CUDA Philox state is 16 bytes).
DIGEST_ENDS = 256


def state_digest(generator: torch.Generator) -> bytes:
    """BLAKE2b digest of ``generator``'s state (what it draws next is a function of it).

    It reads the state's first and last :data:`DIGEST_ENDS` bytes: for torch's CPU Mersenne
    Twister (5056 bytes) the position counters and the first state words lead, the cached
    Gaussian sample (Box–Muller's second value) trails. Equal states give equal digests, so no
    replay is missed; two different states would share one only by matching counters, cached
    sample and leading words of different twist blocks (a coincidence of ~2⁻²⁵⁶), which would
    cost a needless reseed, never a replay. Hashing 512 bytes instead of 5056 keeps the check
    at a few microseconds inside a training step."""
    raw = memoryview(generator.get_state().numpy())
    if len(raw) <= 2 * DIGEST_ENDS:
        return hashlib.blake2b(raw, digest_size=DIGEST_SIZE).digest()
    digest = hashlib.blake2b(raw[:DIGEST_ENDS], digest_size=DIGEST_SIZE)
    digest.update(raw[-DIGEST_ENDS:])
    return digest.digest()


class NoiseLineage:
    """The noise draws of one run (module docstring): lineage id, position, state digests.

    Round-trips through :meth:`state_dict` / :meth:`load_state_dict`; the restored position and
    digests continue the lineage, the process registry keeps what was drawn here.
    """

    def __init__(self):
        self.lineage = _new_id()
        self.position = 0
        self._digests: list[bytes] = []
        self._digest_set: set[bytes] = set()
        #: generators already reseeded once in this lineage (one warning per cause)
        self._warned: set[str] = set()
        #: the optimizers drawing in this lineage (several: private modules on one run)
        self._optimizers: "weakref.WeakSet" = weakref.WeakSet()

    # ---- what was drawn ---------------------------------------------------------------------
    def seen(self, digest: bytes) -> bool:
        """Whether a draw from a generator in this state was already released (this object's
        record, or anything this process drew for the same lineage id)."""
        if digest in self._digest_set:
            return True
        with _LOCK:
            drawn = _DRAWN.get(self.lineage)
            return drawn is not None and digest in drawn.digests

    def record(self, digest: Optional[bytes]) -> None:
        """One noise draw was released from a generator in state ``digest`` (``None``: a
        source whose state is not tracked)."""
        self.position += 1
        if digest is not None and digest not in self._digest_set:
            self._digests.append(digest)
            self._digest_set.add(digest)
        with _LOCK:
            drawn = _DRAWN.setdefault(self.lineage, _Drawn())
            drawn.high_water = max(drawn.high_water, self.position)
            if digest is not None:
                drawn.digests.add(digest)

    def high_water(self) -> Optional[int]:
        """The largest position this process drew for this lineage (``None``: none)."""
        return _high_water_of(self.lineage)

    def fork(self, position: Optional[int] = None) -> None:
        """Continue under a new lineage id (after a rewind: the noise is fresh from here on;
        ``position``: the new id's position, e.g. 0 at the start of a new phase); the digests
        recorded so far are kept, so none of them is drawn again."""
        old = self.lineage
        self.lineage = _new_id()
        if position is not None:
            self.position = int(position)
        with _LOCK:
            previous = _DRAWN.get(old)
            drawn = _DRAWN.setdefault(self.lineage, _Drawn())
            drawn.high_water = self.position
            drawn.digests.update(self._digest_set)
            if previous is not None:
                drawn.digests.update(previous.digests)

    def adopt(self, tag: Optional[dict[str, Any]], *, proven: bool) -> None:
        """Continue a saved lineage (``tag``): as itself where the restore is ``proven`` a
        continuation, else as a new lineage id at the same position (a branch with noise of
        its own)."""
        if not tag:
            return
        self.position = int(tag.get("position", 0))
        if proven:
            self.lineage = str(tag["lineage"])
            return
        self.lineage = _new_id()
        with _LOCK:
            _DRAWN.setdefault(self.lineage, _Drawn()).high_water = self.position

    def tag(self) -> dict[str, Any]:
        """``{"lineage": id, "position": p}``: what a saved generator state is tagged with."""
        return {"lineage": self.lineage, "position": self.position}

    # ---- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-ready: the digests as one base64 string."""
        return {"lineage": self.lineage, "position": self.position,
                "digests": base64.b64encode(b"".join(self._digests)).decode("ascii")}

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        """Continue the saved lineage (a state without one, saved by an older version, starts
        a new lineage at the saved position)."""
        if not state:
            return
        self.lineage = str(state.get("lineage") or _new_id())
        self.position = int(state.get("position", 0))
        try:
            raw = base64.b64decode(state.get("digests") or "", validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise ValueError("the saved noise lineage's digests are not base64: the checkpoint "
                             "is corrupted") from None
        if len(raw) % DIGEST_SIZE:
            raise ValueError(f"the saved noise lineage holds {len(raw)} digest bytes, not a "
                             f"multiple of {DIGEST_SIZE}: the checkpoint is corrupted")
        self._digests = [raw[i:i + DIGEST_SIZE] for i in range(0, len(raw), DIGEST_SIZE)]
        self._digest_set = set(self._digests)

    def __repr__(self) -> str:
        return f"NoiseLineage(lineage={self.lineage[:8]}…, position={self.position})"


# ---- restoring a saved generator state ------------------------------------------------------
def may_restore(tag: Optional[dict[str, Any]], journal=None) -> bool:
    """Whether a generator state saved with ``tag`` (:meth:`NoiseLineage.tag`) may be restored:
    only when this process drew that lineage up to exactly the tagged position (rule 2), or,
    for a lineage this process has not drawn (a new process), when ``journal`` (the run's
    :class:`~opacus_structured.DatasetBudget`) shows that the lineage's draws end exactly there
    (:func:`journal_high_water`)."""
    if not tag or tag.get("lineage") is None:
        return False
    lineage, position = str(tag["lineage"]), int(tag.get("position", -1))
    high = _high_water_of(lineage)
    if high is not None:
        return high == position
    return journal is not None and journal_high_water(journal, lineage) == position


def journal_high_water(journal, lineage: str) -> Optional[int]:
    """How far ``lineage`` may have drawn, by the dataset budget's journal: its latest
    ``noise_stream`` record's position, plus the steps a reservation let it draw beyond it
    (a run reserves blocks of steps before drawing them, and settles to what it drew when it
    ends). ``None``: the journal never saw the lineage."""
    try:
        records = journal.records()
    except (AttributeError, OSError, ValueError):
        return None
    for record in reversed(records):
        stream = record.get("noise_stream")
        if isinstance(stream, dict) and stream.get("lineage") == lineage:
            ahead = int(record.get("reserved", 0)) if record.get("kind") == "reserve" else 0
            return int(stream.get("position", 0)) + ahead
    return None


def journal_entry(optimizer) -> Optional[dict[str, Any]]:
    """``{"lineage", "position"}`` of the lineage ``optimizer`` draws in, for a journal record
    (``None`` where the journal cannot vouch for it: no lineage, or several optimizers drawing
    in one lineage, whose position counts the draws of all of them)."""
    lineage = lineage_of_optimizer(optimizer)
    if lineage is None or len(lineage._optimizers) > 1:
        return None
    return lineage.tag()


def rewinds(tag: Optional[dict[str, Any]]) -> bool:
    """Whether restoring a state saved with ``tag`` would rewind a lineage this process has
    drawn beyond the tagged position."""
    if not tag or tag.get("lineage") is None:
        return False
    high = _high_water_of(str(tag["lineage"]))
    return high is not None and high > int(tag.get("position", 0))


def reseed_fresh(generator: torch.Generator) -> torch.Generator:
    """Reseed ``generator`` in place from OS entropy (the objects holding it keep it)."""
    generator.manual_seed(fresh_seed())
    return generator


def restore_or_reseed(generator: torch.Generator, saved_state, tag: Optional[dict[str, Any]],
                      owner: str, journal=None, *, proven: Optional[bool] = None) -> bool:
    """Rule 2 on one generator: restore ``saved_state`` (saved with ``tag``) into ``generator``
    where the resume provably continues the run (``proven``, by default :func:`may_restore`),
    else say why not (:func:`explain_restore`) and reseed it from OS entropy. Returns whether
    the state was restored."""
    if proven is None:
        proven = may_restore(tag, journal)
    if proven:
        generator.set_state(saved_state)
    else:
        explain_restore(tag, owner, journal)
        reseed_fresh(generator)
    return proven


def explain_restore(tag: Optional[dict[str, Any]], owner: str, journal=None) -> None:
    """Say why a saved generator state was not restored (a warning for a rewind, a log line for
    an unknown lineage)."""
    if rewinds(tag):
        high = _high_water_of(str(tag["lineage"]))
        warn(f"{owner}: the checkpoint's noise generator is at noise draw {tag['position']} "
             f"of this run, which has already drawn {high} in this process (an earlier "
             f"checkpoint): restoring it would add the same noise to new releases. The resumed "
             f"steps draw fresh noise from OS entropy instead; the accountant keeps every "
             f"released step", FreshNoiseWarning)
    else:
        how = ("its dataset budget's journal shows draws past it" if journal is not None
               else "pass the run's DatasetBudget (budget=) to resume exactly")
        log.info("%s: the checkpoint's run is not known to this process (it may have released "
                 "steps after this checkpoint; %s), so its noise generator is reseeded from OS "
                 "entropy instead of restored: the resumed run is not bit-identical to an "
                 "uninterrupted one, and no noise value is added twice", owner, how)


# ---- where an optimizer's noise comes from ---------------------------------------------------
def _default_generator(device: torch.device) -> Optional[torch.Generator]:
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return None


def noise_source(optimizer) -> tuple[Optional[torch.Generator], bool]:
    """``(generator, is_global)``: the generator ``optimizer``'s next noise draw comes from.

    ``(None, False)`` where the state is not tracked: Opacus' ``secure_mode`` (a CSPRNG), and
    the correlated-noise optimizer's own per-object OS-entropy generators (never saved, so
    never restored)."""
    if getattr(optimizer, "secure_mode", False):
        return None, False
    generator = getattr(optimizer, "generator", None)
    if isinstance(generator, torch.Generator):
        return generator, False
    if generator is not None or callable(getattr(optimizer, "_noise_generator", None)):
        return None, False
    params = list(getattr(optimizer, "params", []) or [])
    if not params:
        return None, False
    return _default_generator(params[0].device), True


def _replace_global(optimizer) -> torch.Generator:
    """Give ``optimizer`` a generator of its own, seeded from OS entropy, on its parameters'
    device (torch's global RNG is the user's and is not reseeded)."""
    devices = {p.device for p in optimizer.params}
    if len(devices) != 1:
        raise NoiseReplayError(
            f"the optimizer's noise comes from torch's global RNG, which is about to repeat a "
            f"state whose noise was already released, and its parameters span {len(devices)} "
            f"devices: pass noise_generator=torch.Generator(...) to make_private")
    device = devices.pop()
    generator = torch.Generator(device=device).manual_seed(fresh_seed())
    optimizer.generator = generator
    return generator


# ---- the link from an optimizer to the lineage of the run that prices it ---------------------
_LINK_KEY = "_noise_lineage"


def link(optimizer, lineage: NoiseLineage) -> None:
    """Make ``optimizer``'s draws part of ``lineage`` (the accountant that prices its steps)."""
    optimizer.__dict__[_LINK_KEY] = weakref.ref(lineage)
    try:
        lineage._optimizers.add(optimizer)
    except TypeError:  # pragma: no cover - an optimizer that cannot be weakly referenced
        pass


def lineage_of_optimizer(optimizer) -> Optional[NoiseLineage]:
    ref = getattr(optimizer, "__dict__", {}).get(_LINK_KEY)
    return None if ref is None else ref()


def check_correlated_position(optimizer, lineage: NoiseLineage) -> None:
    """Rule 3: a correlated-noise optimizer's next noise step must be the lineage's position."""
    step = getattr(optimizer, "noise_step", None)
    if step is None or int(step) == lineage.position or len(lineage._optimizers) > 1:
        return  # several optimizers (private modules) draw in one lineage: each its own stream
    raise NoiseReplayError(
        f"the correlated-noise optimizer is at noise step {int(step)}, but the run its "
        f"accountant prices has drawn {lineage.position} noise vectors: the noise of a step "
        f"is correlated with the steps before it, so the optimizer's state and the "
        f"accountant's must come from the same save. Restore both from the latest checkpoint "
        f"(Opacus' load_checkpoint, or DPCallback's entry of a Lightning checkpoint), or start "
        f"a new run with a new optimizer and a new accountant. After a resume under another "
        f"scheme (a new phase) the correlated stream starts again: build a new optimizer and do "
        f"not load the earlier optimizer's noise state")


def _source_of(optimizer) -> tuple[Optional[torch.Generator], bool]:
    """:func:`noise_source`, remembered per optimizer while its ``generator`` and
    ``secure_mode`` stay the same (a step reads it twice; the global RNG of the parameters'
    device does not change)."""
    key = (id(getattr(optimizer, "generator", None)), bool(getattr(optimizer, "secure_mode",
                                                                   False)))
    cached = optimizer.__dict__.get("_noise_source")
    if cached is None or cached[0] != key:
        cached = (key, noise_source(optimizer))
        optimizer.__dict__["_noise_source"] = cached
    return cached[1]


def _draws(optimizer) -> bool:
    """Whether Opacus' ``add_noise`` draws on this process: σ > 0, and on rank 0 under DDP
    (Opacus' distributed optimizers add the noise on rank 0 only)."""
    sigma = getattr(optimizer, "_adjusted_noise_multiplier",
                    getattr(optimizer, "noise_multiplier", 0.0))
    return float(sigma or 0.0) > 0.0 and int(getattr(optimizer, "rank", 0) or 0) == 0


def check_before_draw(optimizer, *, correlated: bool = False) -> Optional[bytes]:
    """Rule 1, before ``optimizer`` draws its noise: reseed (or refuse) if the generator's state
    was already drawn from in the lineage; returns the state's digest (``None`` if untracked,
    or if this process draws nothing: σ = 0, a DDP rank other than 0)."""
    lineage = lineage_of_optimizer(optimizer)
    if lineage is None:
        return None
    if correlated:
        check_correlated_position(optimizer, lineage)
    generator, is_global = _source_of(optimizer)
    if generator is None or not _draws(optimizer):
        return None
    digest = state_digest(generator)
    if not lineage.seen(digest):
        return digest
    if is_global:
        generator = _replace_global(optimizer)
    else:
        reseed_fresh(generator)
    if "replay" not in lineage._warned:
        lineage._warned.add("replay")
        warn(f"noise draw {lineage.position + 1} of this run would come from a generator state "
             f"whose noise was already added to an earlier release (a generator restored from "
             f"an older state, or reseeded with the run's seed): the two releases' difference "
             f"would carry no noise. The generator was reseeded from OS entropy; keep the "
             f"generator's state with the accountant's (one checkpoint) to resume exactly",
             FreshNoiseWarning)
    return state_digest(generator)


def record_after_draw(optimizer, before: Optional[bytes], noise_step: Optional[int]) -> None:
    """After ``optimizer`` drew: record the draw in its lineage. ``before``: the state digest
    :func:`check_before_draw` returned (``None``: untracked, or nothing drawn here);
    ``noise_step``: a correlated-noise optimizer's ``noise_step`` before the draw. The position
    advances with a correlated optimizer's noise step, else with every draw (σ > 0, rank 0)."""
    lineage = lineage_of_optimizer(optimizer)
    if lineage is None:
        return
    if noise_step is not None:
        if int(getattr(optimizer, "noise_step", noise_step)) != int(noise_step):
            lineage.record(before)
    elif before is not None or (_source_of(optimizer)[0] is None and _draws(optimizer)):
        lineage.record(before)
