"""samplers subpackage (see docs/architecture.md)."""
