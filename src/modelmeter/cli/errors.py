"""The command's usage error and the words of its one-line messages (no torch: every subcommand needs them)."""

from __future__ import annotations

import difflib
from collections.abc import Sequence

from ..errors import ModelMeterError

MAX_TENSOR_BYTES = (1 << 63) - 1  # torch counts a tensor's bytes in an int64


class ModelSpecError(ModelMeterError, ValueError):
    """The spec names nothing that exists (unknown name, missing file or factory, bad override): a usage error."""


def suggest(name: str, choices: Sequence[str], n: int = 3) -> list[str]:
    """Close matches of ``name`` among ``choices`` (case-insensitive), best first."""
    lowered = {c.lower(): c for c in choices}
    return [lowered[m] for m in difflib.get_close_matches(name.lower(), list(lowered), n=n, cutoff=0.6)]


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's message on one line, at most ``limit`` characters (for the command's error output)."""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."
