"""Crash-safe, fvcore-compatible checkpointing: ``Checkpointer`` and ``PeriodicCheckpointer``.

Same names, file layout (``<name>.pth`` + ``last_checkpoint``) and log messages as
``fvcore.common.checkpoint``, plus: atomic writes, ``torch.load(weights_only=True)`` by default, an optional
safetensors format, recovery from truncated files, distributed (DDP / FSDP2) saving and loading, and ``http(s)://``
sources. See docs/checkpoint.md.
"""

from ._keys import get_missing_parameters_message, get_unexpected_parameters_message
from .checkpointer import Checkpointer, PeriodicCheckpointer
from .errors import CheckpointError

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "PeriodicCheckpointer",
    "get_missing_parameters_message",
    "get_unexpected_parameters_message",
]
