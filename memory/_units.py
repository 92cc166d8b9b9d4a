"""Byte formatting shared by ceilings and decisions, so every reason reads the same."""

from __future__ import annotations

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


def format_bytes(n: int | float) -> str:
    """Format a byte count for a human: GiB above 1 GiB, MiB above 1 MiB, else KiB or B.

    One decimal is enough to explain a decision; exact numbers live in the Decision fields.
    """
    sign = "-" if n < 0 else ""
    a = abs(n)
    if a >= GiB:
        return f"{sign}{a / GiB:.1f} GiB"
    if a >= MiB:
        return f"{sign}{a / MiB:.1f} MiB"
    if a >= KiB:
        return f"{sign}{a / KiB:.1f} KiB"
    return f"{sign}{int(a)} B"
