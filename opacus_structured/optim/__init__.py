"""optim subpackage (see docs/architecture.md)."""
