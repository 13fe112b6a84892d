"""forecasting subpackage (see docs/architecture.md)."""

from .fast_lstm import FastDPLSTM, replace_lstm

__all__ = ["FastDPLSTM", "replace_lstm"]
