"""Lightning callbacks for opacus-structured (accounting, individual GDP filter, per-sample ε).

Import ``lightning.pytorch`` (the namespace gluonts uses), not ``pytorch_lightning``.
"""

__all__: list[str] = []
