r"""Privacy records of trained weights: a second run from private weights composes (issue 29, 11).

DP fine-tuning that starts from the weights of an earlier DP run on the same data releases a
model that went through both runs: its privacy loss is the **composition** of the two
mechanisms, not the second run's ε. So every model trained by
:func:`~opacus_structured.forecasting.training.train_forecaster` carries a *privacy record*
(:attr:`TrainResult.privacy_record`, written next to the weights by
:meth:`TrainResult.save_weights`, into ``forecast``'s ``report.json`` and into
:class:`~opacus_structured.forecasting.dp_estimator.DPPyTorchPredictor`'s report), a
JSON-ready dict::

    {"format": RECORD_FORMAT,
     "weights": sha256 of the released weights (names, dtypes, shapes, bytes),
     "runs": [run, ...]}          # every training run on non-public data, oldest first

    run = {"dp_sgd", "private", "noise_multiplier", "steps", "delta", "epsilon", "bound",
           "accountant": the accountant's state_dict (scheme, history (σ, q, steps)),
           "data": keyed fingerprint of the training panel (below)}

and a run from initial weights (``init_state``) follows one rule (:func:`resolve_init`):

(a) the record has runs on **this** data (a series id in common, see below) → they are composed
    with the new run: ε is the ε at δ of the composition of every one of their PLDs
    (each priced by its own accountant from the stored history, at the new run's grid) with
    the new run's PLD — one heterogeneous PLD composition, exactly what one accountant
    recording all the steps would report. ``TrainResult.epsilon`` is that composed ε (the
    guarantee of the released model); ``run_epsilon`` is the new run alone. A target ε applies
    to the composed value: σ is calibrated so that the earlier runs plus the planned steps
    spend at most the target (refused when the earlier runs alone reach it). An earlier
    non-DP run on this data leaves no guarantee: a DP run from it is refused; an earlier
    seeded (reproducible-noise) run makes the new model not private.
(b) runs on **other** data (no series id in common) are not composed, only reported
    (``TrainResult.prior_runs``, each labelled ``"composed": False``).
(c) **no record** → the weights are accepted only if they are public by construction (the
    package's shipped pretrained weights, weights returned by
    :func:`~opacus_structured.forecasting.pretraining.pretrained_weights` /
    :func:`~opacus_structured.forecasting.pretraining.pretrain`, or a file written by
    ``opacus-structured pretrain``, whose record has no runs) or declared public with
    ``init_public=True`` (``forecast --init-public``); otherwise a ``ValueError`` names the
    flag. A record that does not belong to the weights (its ``"weights"`` hash differs) is
    refused too.

Data fingerprints. The record is published with the weights, so it must not depend on the
private values: a hash of the values is a deterministic function of them (whoever holds all
but one candidate dataset tells them apart: ε = ∞). The fingerprint therefore reads only the
series' **identities**, the ``item_id`` of each series — public metadata of a
:class:`~opacus_structured.forecasting.data.Panel`, unchanged between neighbouring datasets
under the scheme's relation (one time step, or ``w`` steps, of one series) — and is
**keyed** anyway (ids may be names): one 64-bit tag ``HMAC-SHA256(key, item_id)`` per
series, sorted (no order), and ``key_id`` = the first 16 hex digits of ``SHA256(key)``. The
key is 32 random bytes kept in ``<cache>/data-fingerprint.key`` (``$OPACUS_STRUCTURED_CACHE``,
else ``$XDG_CACHE_HOME/opacus-structured``, else ``~/.cache/opacus-structured``; mode 0600),
made on first use. Two panels are the *same data* when they share a series id (a subset, a
superset, updated values: all composed); an earlier run whose key differs (another machine or
cache) cannot be compared and is treated as a run on this data (composed: never
under-reports; declare the weights public with ``init_public`` if it was trained on other
data). Two unrelated panels that reuse ids (e.g. ``"0"``, ``"1"``, ...) are composed too: an
over-report, never an under-report. Limit: a series given a new id is not recognised as the
same — declare nothing public that saw this data.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import importlib.resources
import os
import secrets
from typing import Any, Optional

from ..accountants.base import accountant_class_for
from ..accounting import pld as pld_lib
from ..schemes.base import Scheme

__all__ = ["RECORD_FORMAT", "weights_fingerprint", "panel_fingerprint", "fingerprint_key_path",
           "register_public_weights", "is_known_public", "public_record", "run_entry",
           "resolve_init", "InitProvenance", "composed_epsilon", "compose_plds",
           "combined_bound"]

#: Version tag of the privacy record layout (the ``"format"`` field).
RECORD_FORMAT = "opacus_structured.privacy_record/1"
_TAG_HEX = 16  # 64-bit tags: a collision among 10^4 series has probability < 1e-11

# weights fingerprints known to be public in this process (pretrained on the public corpus)
_PUBLIC: set[str] = set()
_SHIPPED: Optional[frozenset] = None


# ---- fingerprints ----------------------------------------------------------------------------
def weights_fingerprint(state) -> str:
    """SHA-256 of a ``state_dict``: every entry's name, dtype, shape and raw bytes, by name."""
    import torch

    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name]
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"init_state[{name!r}] is a {type(t).__name__}, not a tensor")
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _cache_root() -> str:
    root = os.environ.get("OPACUS_STRUCTURED_CACHE")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                                  ".cache")
        root = os.path.join(base, "opacus-structured")
    return root


def fingerprint_key_path() -> str:
    """Where the secret data-fingerprint key lives (module docstring)."""
    return os.path.join(_cache_root(), "data-fingerprint.key")


def _fingerprint_key() -> bytes:
    path = fingerprint_key_path()
    if not os.path.isfile(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process made it first
            pass
        else:
            with os.fdopen(fd, "wb") as fh:
                fh.write(secrets.token_bytes(32))
    with open(path, "rb") as fh:
        key = fh.read()
    if len(key) != 32:
        raise ValueError(f"the data-fingerprint key {path} is damaged ({len(key)} bytes, "
                         f"expected 32): delete it (earlier records then count as another key "
                         f"and are composed)")
    return key


def panel_fingerprint(panel) -> dict[str, Any]:
    """Keyed fingerprint of the series ids of a
    :class:`~opacus_structured.forecasting.data.Panel`: ``{"key_id", "ids"}`` (sorted 64-bit
    HMAC tags of the ``item_ids``; no value is read; module docstring)."""
    key = _fingerprint_key()
    ids = {hmac.new(key, f"id|{item}".encode(), "sha256").hexdigest()[:_TAG_HEX]
           for item in panel.item_ids}
    return {"key_id": hashlib.sha256(key).hexdigest()[:_TAG_HEX], "ids": sorted(ids)}


def _overlap(earlier: Optional[dict], current: dict) -> Optional[bool]:
    """True/False: the fingerprints share / do not share a series id; None: not comparable
    (no fingerprint, or another key)."""
    if not isinstance(earlier, dict) or earlier.get("key_id") != current["key_id"]:
        return None
    return bool(set(earlier.get("ids", ())) & set(current["ids"]))


# ---- public weights --------------------------------------------------------------------------
def register_public_weights(state) -> str:
    """Mark ``state`` as public (trained on public data only) in this process; returns its
    fingerprint. Called by the pretraining functions; not for weights that saw private data."""
    fp = weights_fingerprint(state)
    _PUBLIC.add(fp)
    return fp


def _shipped_fingerprints() -> frozenset:
    global _SHIPPED
    if _SHIPPED is None:
        import torch

        found = set()
        folder = importlib.resources.files("opacus_structured") / "data" / "pretrained"
        if folder.is_dir():
            for entry in folder.iterdir():
                if entry.name.endswith(".pt") and entry.is_file():
                    with importlib.resources.as_file(entry) as path:
                        blob = torch.load(path, map_location="cpu", weights_only=True)
                    found.add(weights_fingerprint(blob.get("state_dict", blob)))
        _SHIPPED = frozenset(found)
    return _SHIPPED


def is_known_public(state) -> bool:
    """The weights are the package's shipped pretrained weights or were registered public."""
    fp = weights_fingerprint(state)
    return fp in _PUBLIC or fp in _shipped_fingerprints()


def public_record(state, note: str) -> dict[str, Any]:
    """The record of weights trained on public data only (no runs): ``note`` says which."""
    return {"format": RECORD_FORMAT, "weights": register_public_weights(state), "runs": [],
            "public": str(note)}


# ---- runs and records ------------------------------------------------------------------------
def json_ready(value):
    """``value`` with numpy scalars, enums and tuples turned into plain JSON types (dicts with
    ``str`` keys, lists, bool / int / float / str / None); anything else as its ``str``. Infinite
    and NaN floats stay floats (``json`` writes them as ``Infinity`` / ``NaN``)."""
    import enum

    import numpy as np

    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, dict):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if value is None:
        return None
    if isinstance(value, str):
        return str.__str__(value)  # plain str (a str enum such as BoundKind included)
    return str(getattr(value, "value", value))


def run_entry(*, panel, dp_sgd: bool, private: bool, accountant, noise_multiplier,
              steps: int, delta, epsilon, bound) -> dict[str, Any]:
    """One run of a privacy record (module docstring): JSON-ready.

    The accountant's state goes in without its sampler ledger's ``fingerprint``: that tag
    hashes the window sampler's generator state at the start of the run (the secret coins),
    and a record is published with the weights. Pricing needs the scheme and the history only;
    an accountant loads a ledger without a fingerprint (nothing to compare)."""
    state = None if accountant is None else dict(accountant.state_dict())
    if state is not None and isinstance(state.get("ledger"), dict):
        state["ledger"] = {k: v for k, v in state["ledger"].items() if k != "fingerprint"}
    return json_ready({
        "dp_sgd": bool(dp_sgd), "private": bool(private), "noise_multiplier": noise_multiplier,
        "steps": int(steps), "delta": delta, "epsilon": epsilon,
        "bound": bound, "accountant": state, "data": panel_fingerprint(panel)})


def _accountant_of(run: dict):
    state = run.get("accountant")
    if not isinstance(state, dict) or "scheme" not in state:
        raise ValueError("a run of the init weights' privacy record has no accountant state "
                         "(scheme and history): the record is damaged; it cannot be priced")
    scheme = Scheme.from_dict(state["scheme"])
    acc = accountant_class_for(scheme)(scheme)
    acc.load_state_dict({**state, "history": [tuple(h) for h in state.get("history", [])]})
    return acc


def compose_plds(plds):
    """The heterogeneous composition of PLDs (``None`` entries: nothing spent)."""
    return pld_lib.compose((p, 1) for p in plds if p is not None)


def composed_epsilon(prior_pld, scheme, noise_multiplier: float, steps: int, delta: float,
                     discretization: float) -> float:
    """ε at δ of ``prior_pld`` composed with ``steps`` steps of ``scheme`` at σ (the
    calibration target of a run from private weights)."""
    n = scheme.compositions(steps)
    step = scheme.pld(noise_multiplier, discretization=discretization) if n else None
    return pld_lib.epsilon_for_delta(
        pld_lib.compose([(p, c) for p, c in ((prior_pld, 1), (step, n)) if p is not None]),
        delta)


_BOUND_ORDER = {"tight": 0, "upper": 1, "lower": 2}


def combined_bound(*bounds) -> Optional[str]:
    """The kind of a composed bound: a lower bound anywhere makes it a lower bound (not a
    guarantee), else an upper bound anywhere an upper bound, else tight."""
    known = [str(getattr(b, "value", b)) for b in bounds if b is not None]
    if not known:
        return None
    return max(known, key=lambda b: _BOUND_ORDER.get(b, 2))


@dataclasses.dataclass
class InitProvenance:
    """What :func:`resolve_init` found out about initial weights.

    ``source``: ``"public"`` (known public weights), ``"declared public"`` (``init_public``)
    or ``"privacy record"``. ``composed``: earlier runs on this data (composed with the new
    run); ``other``: runs on other data (reported only). ``not_private_reason``: why a model
    trained from them cannot be private (``None`` when it can).
    """

    source: str
    fingerprint: str
    composed: list = dataclasses.field(default_factory=list)
    other: list = dataclasses.field(default_factory=list)
    not_private_reason: Optional[str] = None
    note: Optional[str] = None

    def prior_pld(self, discretization: float):
        """The earlier same-data runs' PLDs composed, each priced by its own accountant at
        ``discretization`` (``None`` when there are none)."""
        plds = [_accountant_of(run).composed_pld(discretization)
                for run in self.composed if run.get("dp_sgd")]
        return compose_plds(plds)

    def prior_bounds(self) -> list:
        return [run.get("bound") for run in self.composed]

    def summary(self) -> list[dict[str, Any]]:
        """The earlier runs, labelled (no fingerprints, no accountant state)."""
        out = []
        for run, composed in [(r, True) for r in self.composed] + [(r, False)
                                                                    for r in self.other]:
            out.append({k: run.get(k) for k in ("dp_sgd", "private", "epsilon", "delta",
                                                 "noise_multiplier", "steps", "bound")}
                       | {"composed": composed,
                          "data": "this data" if composed else "other data"})
        return out

    def runs(self) -> list[dict[str, Any]]:
        return [*self.composed, *self.other]


def resolve_init(init_state, *, init_record: Optional[dict], init_public: bool, panel,
                 dp_sgd: bool) -> InitProvenance:
    """Apply the rule of the module docstring to initial weights ``init_state`` for a run on
    ``panel``; raises ``ValueError`` (naming ``init_public`` / ``--init-public``) where the
    weights cannot be used."""
    fp = weights_fingerprint(init_state)
    if init_record is None:
        if fp in _PUBLIC or fp in _shipped_fingerprints():
            return InitProvenance("public", fp, note="public pretrained weights")
        if init_public:
            return InitProvenance("declared public", fp,
                                  note="declared public by the user (init_public)")
        raise ValueError(
            "init_state: these weights carry no privacy record and are not the package's "
            "public pretrained weights, so they may have been trained on this data (a second "
            "DP run would then compose with the first, and its epsilon alone would "
            "under-report). Pass the record the first run wrote (init_record=result."
            "privacy_record, or start from a file written by TrainResult.save_weights / "
            "forecast --save-weights), or declare the weights public (trained without this "
            "data) with init_public=True (forecast --init-public)")
    if not isinstance(init_record, dict) or init_record.get("format") != RECORD_FORMAT:
        raise ValueError(f"init_record is not a privacy record (format "
                         f"{RECORD_FORMAT!r}); got "
                         f"{type(init_record).__name__ if not isinstance(init_record, dict) else init_record.get('format')!r}")  # noqa: E501
    if init_record.get("weights") != fp:
        raise ValueError("init_record belongs to other weights (its weights hash differs from "
                         "init_state's): pass the record written with these weights, or "
                         "declare them public with init_public=True (forecast --init-public) "
                         "only if they never saw this data")
    runs = list(init_record.get("runs") or [])
    if not runs:
        return InitProvenance("public", fp, note=str(init_record.get("public")
                                                     or "record without runs"))
    current = panel_fingerprint(panel)
    out = InitProvenance("privacy record", fp)
    for run in runs:
        overlap = _overlap(run.get("data"), current)
        if overlap is None and init_public:
            overlap = False  # not comparable; the user declares the weights public here
        (out.composed if overlap in (True, None) else out.other).append(run)
        if overlap is True and init_public:
            raise ValueError("init_public=True (--init-public) but the weights' privacy record "
                             "shows a run on this data (a series in common): they are not "
                             "public; drop the flag and the runs are composed")
    if dp_sgd:
        for run in out.composed:
            if not run.get("dp_sgd"):
                raise ValueError("init_state was trained WITHOUT DP on this data (its privacy "
                                 "record has a non-private run with a series in common): no DP "
                                 "guarantee can hold for a model trained from it; start from "
                                 "public weights")
    seeded = [run for run in out.composed if run.get("dp_sgd") and not run.get("private")]
    if seeded:
        out.not_private_reason = ("started from the weights of a run on this data with "
                                  "reproducible (seeded) noise")
    if out.composed:
        out.note = (f"{len(out.composed)} earlier run(s) on this data composed"
                    + (f"; {len(out.other)} on other data reported" if out.other else ""))
    else:
        out.note = f"{len(out.other)} earlier run(s) on other data (not composed)"
    return out
