"""The one registry: scheme names, and which sampler and which accountant implement a scheme.

A scheme is a pure description; it never imports what implements it. Implementations register
themselves here from the layer above, keyed by scheme class:

* ``register_scheme`` — the scheme class under its ``name`` (the CLI's ``epsilon NAME``);
* ``register_sampler(SchemeClass, ...)`` — a factory ``(scheme, *args, **kwargs) -> sampler``
  (``samplers/``; one sampler module per scheme);
* ``register_accountant(SchemeClass, AccountantClass)`` — the Opacus accountant pricing it
  (done by ``SchemeAccountant`` subclasses that set ``scheme_class``);
* ``register_runner(SchemeClass)`` — for schemes priced by running something (Monte Carlo),
  the object that runs it at scale (process pool, shards on disk, torch backend;
  ``runners/``), so the description never imports the machinery that prices it.

Lookups walk the scheme's MRO, so a subclass of a scheme inherits its sampler and accountant
unless it registers its own. A lookup that misses first imports every layer once
(:func:`opacus_structured._lazy.ensure_loaded`; ``import opacus_structured`` itself is lazy), so
every registration has happened before a lookup answers "none".

Noise strategies are not registered: they are math (``accounting/strategies.py``), which a
scheme imports directly.
"""

from __future__ import annotations

from typing import Callable, Optional

from .._lazy import ensure_loaded

__all__ = ["SCHEMES", "register_scheme", "get_scheme_class", "register_sampler",
           "sampler_factory_for", "register_accountant", "accountant_class_for",
           "register_runner", "runner_for"]

#: Scheme name -> scheme class.
SCHEMES: dict[str, type] = {}
_SAMPLERS: dict[type, Callable] = {}
_ACCOUNTANTS: dict[type, type] = {}
_RUNNERS: dict[type, object] = {}


def register_scheme(cls: type) -> type:
    """Class decorator adding a scheme to :data:`SCHEMES` under ``cls.name``."""
    if not getattr(cls, "name", None):
        raise TypeError(f"{cls.__name__} must define a class attribute `name`")
    if cls.name in SCHEMES and SCHEMES[cls.name] is not cls:
        raise ValueError(f"scheme name {cls.name!r} is already registered by "
                         f"{SCHEMES[cls.name].__name__}")
    SCHEMES[cls.name] = cls
    return cls


def get_scheme_class(name: str) -> type:
    """The scheme class registered as ``name``; ``ValueError`` listing the known names."""
    try:
        return SCHEMES[name]
    except KeyError:
        raise ValueError(f"unknown scheme {name!r}; known schemes: {sorted(SCHEMES)}") from None


def register_sampler(*scheme_classes: type):
    """Decorator: ``factory(scheme, *args, **kwargs)`` builds the sampler of these schemes."""
    def decorate(factory: Callable) -> Callable:
        for klass in scheme_classes:
            _SAMPLERS[klass] = factory
        return factory
    return decorate


def _lookup(table: dict, scheme) -> Optional[object]:
    for klass in type(scheme).__mro__:
        if klass in table:
            return table[klass]
    if ensure_loaded():  # the layers were not imported yet (lazy package): load, look again
        return _lookup(table, scheme)
    return None


def sampler_factory_for(scheme) -> Optional[Callable]:
    """The registered sampler factory of ``scheme`` (``None`` if the scheme has no sampler)."""
    return _lookup(_SAMPLERS, scheme)


def register_accountant(scheme_class: type, accountant_class: type) -> None:
    """Record that ``accountant_class`` prices ``scheme_class`` (one accountant per scheme)."""
    existing = _ACCOUNTANTS.get(scheme_class)
    if existing is not None and existing is not accountant_class \
            and not issubclass(accountant_class, existing):
        raise ValueError(f"{scheme_class.__name__} is already priced by {existing.__name__}")
    _ACCOUNTANTS[scheme_class] = accountant_class


def accountant_class_for(scheme) -> Optional[type]:
    """The accountant class registered for ``type(scheme)`` or a base class (``None``: none)."""
    return _lookup(_ACCOUNTANTS, scheme)


def register_runner(*scheme_classes: type):
    """Decorator: the runner (an object or class) that executes these schemes' pricing."""
    def decorate(runner):
        for klass in scheme_classes:
            _RUNNERS[klass] = runner
        return runner
    return decorate


def runner_for(scheme):
    """The runner registered for ``scheme``; ``LookupError`` naming the scheme if none is."""
    runner = _lookup(_RUNNERS, scheme)
    if runner is None:
        raise LookupError(f"no runner is registered for scheme {getattr(scheme, 'name', scheme)!r}"
                          f" (every layer is loaded; register one with register_runner)")
    return runner
