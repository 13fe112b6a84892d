"""What a computed ε is: a guarantee, a lower bound, or a Monte Carlo estimate.

Every ε this package returns carries one of these kinds, so nothing downstream (the CLI,
``DPCallback``, calibration) can mistake an optimistic lower bound or an uncertified estimate
for a guarantee.
"""

from __future__ import annotations

import enum

__all__ = ["BoundKind"]


class BoundKind(str, enum.Enum):
    """The kind of an ε. A ``str`` enum: ``BoundKind.TIGHT == "tight"``, and JSON / f-strings
    show the value, so reports and checkpoints keep plain strings."""

    TIGHT = "tight"              # a guarantee that some mechanism attains
    UPPER = "upper"              # a guarantee (an upper bound on the true ε)
    LOWER = "lower"              # an optimistic lower bound: never a guarantee
    MONTE_CARLO = "monte-carlo"  # a Monte Carlo estimate: a guarantee only once certified

    __str__ = str.__str__
    __format__ = str.__format__

    def __repr__(self) -> str:  # scheme reprs in error messages read bound='tight'
        return repr(self.value)

    @property
    def is_guarantee(self) -> bool:
        """True for the kinds that bound ε from above with certainty (tight, upper)."""
        return self in (BoundKind.TIGHT, BoundKind.UPPER)
