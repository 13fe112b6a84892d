"""Lightning callbacks for opacus-structured (accounting, individual GDP filter, per-sample ε).

Import ``lightning.pytorch`` (the namespace gluonts uses), not ``pytorch_lightning``.
"""

from .dp_callback import DPCallback

__all__ = ["DPCallback"]
