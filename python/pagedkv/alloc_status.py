"""The answer of `can_allocate` and `can_swap_in`."""

from __future__ import annotations

import enum


class AllocStatus(enum.IntEnum):
    """OK: fits now, keeping the watermark; LATER: fits once blocks are freed; NEVER: too big."""

    OK = 0
    LATER = 1
    NEVER = 2


__all__ = ["AllocStatus"]
