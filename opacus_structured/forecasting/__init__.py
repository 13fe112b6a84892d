"""forecasting subpackage (see docs/architecture.md)."""

from .fast_rnn import FastDPGRU, FastDPLSTM, replace_gru, replace_lstm

__all__ = ["FastDPGRU", "FastDPLSTM", "replace_gru", "replace_lstm"]
