"""A switch for each of the recorder's fast paths, so their tests can record the plain way (their oracle)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class FastPath:
    """On unless :meth:`off` is in effect (process-wide: a test's switch, not a setting)."""

    def __init__(self) -> None:
        self.enabled = True

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        """Record the plain way inside."""
        before, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = before
