"""The one error the checkpointer raises on purpose."""

from __future__ import annotations

from typing import Any

from ..errors import ModelMeterError

__all__ = ["CheckpointError"]


class CheckpointError(ModelMeterError, RuntimeError):
    """A checkpoint could not be read or written; the message names the file.

    ``reason`` is one of ``"missing"`` (no such file), ``"corrupt"`` (truncated, unreadable, or holding something
    other than a checkpoint), ``"unsafe"`` (refused by the ``weights_only`` unpickler, or a ``last_checkpoint`` that
    points outside ``save_dir``), ``"incompatible"`` (read fine but cannot be applied, e.g. an optimizer state that
    does not match) or ``"write"`` (saving failed, e.g. no space left on device).
    """

    def __init__(self, message: str, path: str, reason: str) -> None:
        super().__init__(message)
        self.path = path
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        # DCP gathers the exceptions of every rank with pickle; the default would call __init__(message) only.
        return type(self), (str(self), self.path, self.reason)
