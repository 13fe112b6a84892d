"""The few third-party warnings the forecasting code silences, each by category *and* message.

Nothing is filtered by module or by category alone: a warning from Opacus (or anything else)
that is not listed here reaches the user. Each entry was observed while training and evaluating
the bundled gluonts models and is harmless for what this package does with them:

* pandas (via gluonts) deprecates the period-end frequency aliases ``'M'`` and ``'Q'`` (and
  ``'Q-DEC'``) in favour of ``'ME'`` / ``'QE'``; the bundled panels are monthly, a ``--data``
  panel may be quarterly, and gluonts still passes the old aliases to pandas;
* Lightning's ``_pytree`` uses a deprecated ``LeafSpec`` check of ``torch.utils._pytree``;
* torch warns that a full backward hook fires for module outputs when no input of the module
  requires a gradient (the first layer of every model): Opacus' per-sample gradient hooks
  (``GradSampleHooks``) read only the output gradients, which are exact, and
  ``tests/test_forecasting.py`` checks the per-window gradients against one-window batches;
* gluonts indexes a tensor with a list (deprecated indexing form; same result).
"""

from __future__ import annotations

import contextlib
import warnings

__all__ = ["KNOWN_HARMLESS_WARNINGS", "known_harmless_warnings_filtered"]

#: ``(category, message regex)`` pairs, matched at the start of the message.
KNOWN_HARMLESS_WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    (FutureWarning, r"'(M|Q|Q-[A-Z]{3})' is deprecated and will be removed in a future "
                    r"version, please use '(ME|QE|QE-[A-Z]{3})' instead"),
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
    (UserWarning, r"Full backward hook is firing when gradients are computed with respect to "
                  r"module outputs since no inputs require gradients"),
    (UserWarning, r"Using a non-tuple sequence for multidimensional indexing is deprecated"),
)


@contextlib.contextmanager
def known_harmless_warnings_filtered():
    """Ignore exactly :data:`KNOWN_HARMLESS_WARNINGS` inside the block (filters restored after)."""
    with warnings.catch_warnings():
        for category, message in KNOWN_HARMLESS_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield
