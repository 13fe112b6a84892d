"""forecasting subpackage (see docs/architecture.md)."""

from .warning_filters import install_gluonts_filters

install_gluonts_filters()  # gluonts' own known-harmless warnings only (warning_filters.py)
from .fast_rnn import FastDPGRU, FastDPLSTM, replace_gru, replace_lstm  # noqa: E402

__all__ = ["FastDPGRU", "FastDPLSTM", "replace_gru", "replace_lstm"]
