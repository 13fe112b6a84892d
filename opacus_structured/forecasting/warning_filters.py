"""The few third-party warnings the forecasting code silences, each by category *and* message.

Nothing is filtered by module or by category alone: a warning from Opacus (or anything else)
that is not listed here reaches the user. Each entry was observed while training and evaluating
the bundled gluonts models and is harmless for what this package does with them:

* pandas (via gluonts) deprecates the period-end frequency aliases ``'M'``, ``'Q'`` and
  ``'Y'`` (and ``'Q-DEC'``, ``'Y-DEC'``, ``'A'``) in favour of ``'ME'`` / ``'QE'`` / ``'YE'``;
  the bundled panels are monthly, a ``--data`` panel may be quarterly or yearly, and gluonts
  still passes the old (Period) aliases to pandas;
* Lightning's ``_pytree`` uses a deprecated ``LeafSpec`` check of ``torch.utils._pytree``;
* torch warns that a full backward hook fires for module outputs when no input of the module
  requires a gradient (the first layer of every model): Opacus' per-sample gradient hooks
  (``GradSampleHooks``) read only the output gradients, which are exact, and
  ``tests/test_forecasting.py`` checks the per-window gradients against one-window batches;
* gluonts indexes a tensor with a list (deprecated indexing form; same result);
* pandas deprecates ``Period`` at the business-day frequency ``"B"``; gluonts datasets are
  Period-indexed, so a business-day panel needs it (the periods are still exact);
* gluonts says it falls back to the standard ``json`` module when neither ``orjson`` nor
  ``ujson`` is installed (a speed hint, raised once when ``gluonts.json`` is first imported).

Two scopes:

* :func:`known_harmless_warnings_filtered` ignores every entry inside a ``with`` block (the
  command-line commands and our own training and evaluation run in one);
* :func:`install_gluonts_filters` (run once when :mod:`opacus_structured.forecasting` is
  imported) ignores the entries **raised from gluonts' own modules** process-wide, matched by
  category, message *and* the module ``gluonts.*``: gluonts code the user calls directly on
  our predictors (``make_evaluation_predictions``, ``Evaluator`` — which calls
  ``get_seasonality("M")`` once per series, i.e. 148 pandas ``'M'→'ME'`` FutureWarnings on
  the bundled panel) is then quiet too. The same messages from any other module still show.
"""

from __future__ import annotations

import contextlib
import warnings

__all__ = ["KNOWN_HARMLESS_WARNINGS", "known_harmless_warnings_filtered",
           "install_gluonts_filters", "GLUONTS_JSON_WARNING"]

#: ``(category, message regex)`` pairs, matched at the start of the message.
KNOWN_HARMLESS_WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    (FutureWarning, r"'(M|Q|Y|A|(Q|Y|A)-[A-Z]{3})' is deprecated and will be removed in a "
                    r"future version, please use '(ME|QE|YE|(QE|YE)-[A-Z]{3})' instead"),
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
    (UserWarning, r"Full backward hook is firing when gradients are computed with respect to "
                  r"module outputs since no inputs require gradients"),
    (UserWarning, r"Using a non-tuple sequence for multidimensional indexing is deprecated"),
    (FutureWarning, r"(Period with BDay freq|PeriodDtype\[B\]) is deprecated"),
)

#: gluonts' speed hint when ``orjson`` / ``ujson`` is missing (raised by ``gluonts.json``).
GLUONTS_JSON_WARNING = (UserWarning, r"Using `json`-module for json-handling")

#: ``(category, message regex, module regex)`` installed by :func:`install_gluonts_filters`.
_GLUONTS_SOURCES = (
    (FutureWarning,  # any period-end alias ('M', 'Q-DEC', 'A', 'Y') from gluonts' to_offset
     r"'[A-Z]+(-[A-Z]{3})?' is deprecated and will be removed in a future version, please use "
     r"'[A-Z]+(-[A-Z]{3})?' instead", r"gluonts\."),
    (*KNOWN_HARMLESS_WARNINGS[3], r"gluonts\."),  # list indexing inside gluonts.torch.util
    (*GLUONTS_JSON_WARNING, r"gluonts\.json"),
    (*KNOWN_HARMLESS_WARNINGS[4], r"gluonts\."),  # business-day Periods inside gluonts
)


def install_gluonts_filters() -> None:
    """Ignore, process-wide, the known-harmless warnings raised *from gluonts modules* (module
    docstring); idempotent. Filters match category, message and module together."""
    for category, message, module in _GLUONTS_SOURCES:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


@contextlib.contextmanager
def known_harmless_warnings_filtered():
    """Ignore exactly :data:`KNOWN_HARMLESS_WARNINGS` inside the block (filters restored after)."""
    with warnings.catch_warnings():
        for category, message in KNOWN_HARMLESS_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield
