"""Which scheme ``make_private`` builds, and from which options (split out of
:mod:`opacus_structured.engine`, which it serves): the options each scheme takes
(:data:`SCHEME_OPTIONS`), the scheme named by ``scheme=`` or the engine's accountant,
:func:`scheme_for_training` (the scheme of a DataLoader over a dataset), and truncated
Poisson's default ``max_batch_size`` (:func:`default_max_batch_size`: the smallest B whose ε is
within :data:`TRUNCATION_SLACK` of Poisson's).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Optional

from torch.utils.data import IterableDataset

from ._validation import check_int, check_positive
from ._warnings import warn
from .accountants import ACCOUNTANTS
from .accountants.base import SchemeAccountant
from .accounting import pld as pld_lib
from .accounting import truncated_poisson as tp_lib
from .schemes.base import Scheme
from .schemes.registry import SCHEMES, get_scheme_class
from .schemes.structured import StructuredScheme
from .schemes.truncated_poisson import TruncatedPoissonScheme

__all__ = ["SCHEME_OPTIONS", "scheme_for_training", "default_max_batch_size",
           "TRUNCATION_SLACK", "DEFAULT_SELECTION_DELTA"]

_FIXED = ("dataset_size", "steps_per_epoch", "epochs")
#: Read from the dataset (a WindowDataset), never given as options.
_FROM_DATASET = ("series_lengths", "context_length", "forecast_length", "num_series",
                 "series_length")
#: Options consumed by make_private itself, per scheme class (not passed to from_training).
_SAMPLER_OPTIONS = {TruncatedPoissonScheme: ("pad", "target_delta")}
#: Relative ε slack of the default truncated-Poisson ``max_batch_size`` (vs. Poisson, same σ).
TRUNCATION_SLACK = 0.01
#: δ at which :func:`make_private` chooses the default ``max_batch_size`` unless
#: ``target_delta=`` is given (Opacus' ``examples/mnist.py`` default).
DEFAULT_SELECTION_DELTA = 1e-5


def _scheme_options(cls: type) -> tuple[str, ...]:
    """Keyword options of ``cls.from_training`` (plus sampler options) besides the fixed ones."""
    if cls.from_training.__func__ is Scheme.from_training.__func__:
        return ()  # not buildable from training parameters: a configured scheme is needed
    params = inspect.signature(cls.from_training).parameters
    names = [n for n, p in params.items()
             if n not in _FIXED and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        names += [f.name for f in dataclasses.fields(cls) if f.name not in names]
    names = [n for n in names if n not in _FROM_DATASET]
    for klass, extra in _SAMPLER_OPTIONS.items():
        if issubclass(cls, klass):
            names += list(extra)
    return tuple(dict.fromkeys(names))


#: Scheme name -> the options ``make_private`` accepts for it (besides Opacus' arguments).
SCHEME_OPTIONS = {name: _scheme_options(cls) for name, cls in SCHEMES.items()}


def _all_option_names() -> set:
    return {o for cls in SCHEMES.values() for o in _scheme_options(cls)} | {"epochs"}


# ---- which scheme -------------------------------------------------------------------------
def _resolve_scheme(engine, scheme) -> tuple[type, Optional[Scheme]]:
    """``(scheme class, configured scheme or None)`` from ``scheme=`` or the engine."""
    if scheme is not None:
        if isinstance(scheme, Scheme):
            return type(scheme), scheme
        if isinstance(scheme, str):
            return get_scheme_class(scheme), None
        if isinstance(scheme, type) and issubclass(scheme, Scheme):
            return scheme, None
        raise ValueError(f"scheme must be a scheme name {sorted(SCHEMES)}, a Scheme class or a "
                         f"Scheme object, got {scheme!r}")
    acc = getattr(engine, "accountant", None)
    if not isinstance(acc, SchemeAccountant):
        mech = acc.mechanism() if hasattr(acc, "mechanism") else type(acc).__name__
        extra = (" (Opacus' 'gdp' is a central-limit approximation for Poisson sampling; "
                 "full-batch DP-GD is 'gdp-full-batch')" if mech == "gdp" else "")
        raise ValueError(
            f"the engine's accountant is {mech!r}, which is not one of this package's scheme "
            f"accountants{extra}: build the engine with PrivacyEngine(accountant=NAME) for NAME "
            f"in {sorted(_scheme_accountant_names())}, or pass scheme=NAME. (For Opacus' own "
            f"accountants call engine.make_private directly.)")
    configured = acc.scheme
    if configured is not None and not configured.is_template():
        return type(configured), configured
    cls = type(acc).scheme_class
    if cls is None:  # pragma: no cover - SchemeAccountant without a scheme cannot exist
        raise ValueError(f"{type(acc).__name__} names no scheme class")
    return cls, None


def _template_options(engine, scheme) -> dict:
    """Pricing choices of the engine accountant's template scheme (a ``ShuffleScheme()``'s
    relation), kept by the scheme :func:`make_private` builds; none when ``scheme=`` is given."""
    acc = getattr(engine, "accountant", None)
    configured = getattr(acc, "scheme", None)
    if scheme is None and configured is not None and configured.is_template():
        return dict(configured.template_options())
    return {}


def _scheme_accountant_names() -> list[str]:
    return list(ACCOUNTANTS)


def scheme_for_training(scheme_class: type, *, dataset, steps_per_epoch: int,
                        epochs: Optional[int] = None, batch_size: Optional[int] = None,
                        dataset_size: Optional[int] = None, **options) -> Scheme:
    """The scheme of ``scheme_class`` for training on ``dataset`` with ``steps_per_epoch``
    batches per epoch (``len(data_loader)``) and ``epochs`` — what :func:`make_private` builds.

    ``options`` are the scheme's own (see the module table); an option the scheme does not take
    raises ``ValueError`` naming it and the options it does take. For ``structured`` the window
    geometry is read from the dataset (a ``WindowDataset``) and ``batch_size`` is the number of
    windows per step. ``dataset_size`` is a declared public size used instead of
    ``len(dataset)`` (schemes that price the size itself — ``structured``,
    ``truncated-poisson`` — need the two to agree).
    """
    if not (isinstance(scheme_class, type) and issubclass(scheme_class, Scheme)):
        raise ValueError(f"scheme_class must be a Scheme subclass, got {scheme_class!r}")
    allowed = _scheme_options(scheme_class)
    for key in options:
        if key not in allowed:
            raise ValueError(f"scheme {scheme_class.name!r} takes no option {key!r}; its "
                             f"options are {list(allowed) or 'none'}")
    options = {k: v for k, v in options.items() if k in allowed
               and k not in _SAMPLER_OPTIONS.get(scheme_class, ())}
    size = _dataset_size(dataset)
    if dataset_size is not None and dataset_size != size:
        sized = "dataset_size" in {f.name for f in dataclasses.fields(scheme_class)}
        if issubclass(scheme_class, StructuredScheme) or sized:
            what = ("number of series N (its relation changes values inside one series, so N "
                    "is fixed and public)" if issubclass(scheme_class, StructuredScheme) else
                    "dataset size n (a parameter of its analysis, fixed and public)")
            raise ValueError(
                f"scheme {scheme_class.name!r} prices the {what}: dataset_size={dataset_size} "
                f"must equal len(dataset) = {size}")
        size = dataset_size
    if issubclass(scheme_class, StructuredScheme):
        missing = [a for a in ("lengths", "forecast_length", "effective_context_length")
                   if not hasattr(dataset, a)]
        if missing:
            raise ValueError(f"scheme 'structured' draws (series, start) windows: the dataset "
                             f"must be a WindowDataset (it lacks {missing}); build it with "
                             f"opacus_structured.forecasting.windowing.WindowDataset")
        options.setdefault("context_noise", getattr(dataset, "context_noise", 0.0))
        options.setdefault("forecast_noise", getattr(dataset, "forecast_noise", 0.0))
        built = scheme_class.from_training(
            dataset_size=size, steps_per_epoch=steps_per_epoch, epochs=epochs,
            series_lengths=list(dataset.lengths), context_length=dataset.effective_context_length,
            forecast_length=dataset.forecast_length, batch_size=batch_size, **options)
        if hasattr(dataset, "check_scheme"):
            dataset.check_scheme(built)
        return built
    return scheme_class.from_training(dataset_size=size, steps_per_epoch=steps_per_epoch,
                                      epochs=epochs, **options)


def _dataset_size(dataset) -> int:
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise ValueError("the DataLoader wraps an IterableDataset (or a dataset without len()): "
                         "DP sampling needs a map-style dataset of known size, as Opacus' "
                         "DPDataLoader does")
    return check_int("len(data_loader.dataset)", len(dataset), minimum=1)


# ---- the DataLoader -------------------------------------------------------------------------
# ---- truncated Poisson's default B ----------------------------------------------------------
def default_max_batch_size(*, dataset_size: int, steps_per_epoch: int, epochs: int,
                           noise_multiplier: float, delta: float, relation: str = "add-remove",
                           discretization: float = pld_lib.DEFAULT_DISCRETIZATION
                           ) -> tuple[int, float, float]:
    """``(B, ε_truncated, ε_Poisson)``: the smallest truncated-Poisson ``max_batch_size`` B ≥
    ⌈np⌉ with ε_truncated(B) ≤ (1 + :data:`TRUNCATION_SLACK`) · ε_Poisson, both after
    ``epochs × steps_per_epoch`` steps at ``noise_multiplier`` and δ, with n = ``dataset_size``
    and p = 1/``steps_per_epoch`` (Opacus' rate), tight analysis under ``relation``
    (:func:`opacus_structured.accounting.truncated_poisson.smallest_max_batch_size`; B = n is
    Poisson itself, so one always exists). Both ε are returned as evaluated."""
    n = check_int("dataset_size", dataset_size, minimum=1)
    k = check_int("steps_per_epoch", steps_per_epoch, minimum=1)
    steps = check_int("epochs", epochs, minimum=1) * k
    b, eps, poisson = tp_lib.max_batch_size_search(
        n, 1.0 / k, noise_multiplier, steps, delta, TRUNCATION_SLACK, relation,
        discretization=discretization)
    return b, eps, poisson


def _resolve_discretization(engine, discretization) -> float:
    """The accountant's discretization: ``discretization``, else the engine accountant's, else
    the package default."""
    if discretization is None:
        old = getattr(engine, "accountant", None)
        discretization = (old.discretization if isinstance(old, SchemeAccountant)
                          else pld_lib.DEFAULT_DISCRETIZATION)
    return check_positive("discretization", discretization)


def _wants_default_max_batch_size(engine, scheme, kwargs: dict, poisson_sampling: bool) -> bool:
    """Whether this call builds a tight truncated-Poisson scheme from the DataLoader without
    ``max_batch_size`` (then :func:`default_max_batch_size` chooses it)."""
    if not poisson_sampling or kwargs.get("max_batch_size") is not None:
        return False
    if kwargs.get("analysis", "tight") != "tight":
        return False
    try:
        cls, configured = _resolve_scheme(engine, scheme)
    except ValueError:
        return False  # _Plan raises with the full message
    return configured is None and issubclass(cls, TruncatedPoissonScheme)


def _choose_max_batch_size(engine, data_loader, kwargs: dict, *, epochs, noise_multiplier,
                           delta, discretization, how: str) -> None:
    """Sets ``kwargs["max_batch_size"]`` to :func:`default_max_batch_size` and warns with it."""
    if epochs is None:
        raise ValueError(
            "truncated-poisson needs max_batch_size (the truncated, fixed batch size B), or "
            "epochs= so that make_private chooses it for the planned run (the smallest B whose "
            "epsilon over epochs x len(data_loader) steps is within 1% of Poisson's)")
    size = _dataset_size(data_loader.dataset)
    k = len(data_loader)
    relation = kwargs.get("relation", "add-remove")
    b, eps, poisson = default_max_batch_size(
        dataset_size=size, steps_per_epoch=k, epochs=epochs, noise_multiplier=noise_multiplier,
        delta=delta, relation=relation, discretization=discretization)
    kwargs["max_batch_size"] = b
    warn(
        f"truncated-poisson: max_batch_size={b} chosen (expected batch {size / k:.6g}): the "
        f"smallest B whose epsilon is within {TRUNCATION_SLACK:.0%} of Poisson's, {eps:.4g} vs "
        f"{poisson:.4g} at noise_multiplier={noise_multiplier:.4g} ({how}), {epochs * k} steps "
        f"({epochs} epochs x {k}), delta={delta:g}, {relation}; pass max_batch_size= to set B",
        UserWarning)
