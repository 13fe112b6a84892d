"""forecasting subpackage (see docs/architecture.md).

Importing the package imports neither torch nor gluonts (docs/architecture.md, "Lazy
loading"): the ``forecast`` command checks its arguments and reads the ``--data`` file with
:mod:`.user_data` (numpy / pandas) before any of them loads. ``FastDPLSTM``, ``FastDPGRU``,
``replace_lstm`` and ``replace_gru`` import :mod:`.fast_rnn` (torch) on first access.
"""

import importlib

from .warning_filters import install_gluonts_filters

install_gluonts_filters()  # gluonts' own known-harmless warnings only (warning_filters.py)

__all__ = ["FastDPGRU", "FastDPLSTM", "replace_gru", "replace_lstm"]


def __getattr__(name: str):
    # Only the names above: ``from opacus_structured.forecasting import training`` probes the
    # attribute before importing the submodule, so any other name must raise AttributeError.
    if name in __all__:
        return getattr(importlib.import_module(f"{__name__}.fast_rnn"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
