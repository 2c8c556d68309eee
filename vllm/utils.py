"""Small helpers shared across the engine."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the number of size-`b` blocks that hold `a` items."""
    return -(-a // b)
