"""forecasting subpackage (see docs/architecture.md)."""
