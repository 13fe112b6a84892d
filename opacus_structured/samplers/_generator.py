"""Seeding shared by every sampler: one ``torch.Generator`` from a generator *or* a seed."""

from __future__ import annotations

import os
from typing import Optional

import torch

from .._validation import check_int

__all__ = ["fresh_seed", "resolve_generator"]


def fresh_seed() -> int:
    """A 63-bit seed from the OS entropy pool (used when neither generator nor seed is given)."""
    return int.from_bytes(os.urandom(8), "little") >> 1


def resolve_generator(generator: Optional[torch.Generator], seed: Optional[int],
                      owner: str) -> torch.Generator:
    """Return ``generator``, or a new one seeded with ``seed`` (fresh entropy if ``None``).

    Raises ``ValueError`` if both are given or ``generator`` is not a ``torch.Generator``.
    """
    if generator is not None and seed is not None:
        raise ValueError(f"pass either generator or seed to {owner}, not both")
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise ValueError(
                f"generator must be a torch.Generator, got {type(generator).__name__}")
        return generator
    seed = fresh_seed() if seed is None else check_int("seed", seed, minimum=0)
    return torch.Generator().manual_seed(seed)
