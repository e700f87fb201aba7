"""What graphquant's passes in Inductor's hooks share: the pass a user set in the same hook is
kept (``then``), and the pass names itself to Inductor's FX graph cache."""

from __future__ import annotations

import hashlib
import inspect
from typing import Any, Callable, Optional


class ChainedPass:
    def __init__(self, then: Optional[Callable[..., Any]] = None) -> None:
        self.then = then

    def uuid(self) -> Optional[Any]:
        """For Inductor's FX graph cache: the text of the file that defines the pass and the
        chained pass's own uuid (None, which bypasses the cache, where that pass has none)."""
        then = None if self.then is None else getattr(self.then, "uuid", lambda: None)()
        if self.then is not None and then is None:
            return None
        with open(inspect.getfile(type(self)), "rb") as source:
            return hashlib.sha256(source.read()).hexdigest(), then
