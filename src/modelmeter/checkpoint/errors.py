"""The one error the checkpointer raises on purpose."""

from __future__ import annotations

from ..errors import ModelMeterError

__all__ = ["CheckpointError"]


class CheckpointError(ModelMeterError, RuntimeError):
    """A checkpoint could not be read or written; the message names the file.

    ``reason`` is one of ``"missing"`` (no such file), ``"corrupt"`` (truncated or unreadable),
    ``"unsafe"`` (refused by the ``weights_only`` unpickler) or ``"incompatible"`` (read fine but cannot be
    applied, e.g. a sharded checkpoint whose optimizer state does not match).
    """

    def __init__(self, message: str, path: str, reason: str) -> None:
        super().__init__(message)
        self.path = path
        self.reason = reason
