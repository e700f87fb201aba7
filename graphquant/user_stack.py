"""Warnings that point at the user's own line.

graphquant warns from inside torch.compile, dozens of torch frames below the call that started
the compile, so no fixed ``stacklevel`` reaches the user's code; ``warn`` walks out to it.
"""

from __future__ import annotations

import sys
import warnings

_INTERNAL = ("torch", "graphquant")


def warn(message: str) -> None:
    """A UserWarning attributed to the innermost calling frame outside torch and graphquant."""
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and frame.f_globals.get("__name__", "").partition(".")[0] in _INTERNAL:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, UserWarning, stacklevel=level)
