"""Validation shared by export and load."""

from __future__ import annotations

import math
import numbers


def check_dt(dt) -> float:
    """``dt`` as a float, or a ValueError: it must be a finite number > 0."""
    if isinstance(dt, bool) or not isinstance(dt, numbers.Real) or not math.isfinite(dt) or dt <= 0:
        raise ValueError(
            f"dt must be a finite number > 0 (the time step, in the unit of the graph's time constants), got {dt!r}"
        )
    return float(dt)
