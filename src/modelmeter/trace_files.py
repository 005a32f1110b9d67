"""Saved traces as a user feature: an analysis's run written to a ``.mmtrace`` file, and read back as a
:class:`~modelmeter.Result` by a process that never built the model (docs/reports.md, "Saved traces")."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .engine.trace import Trace
from .metrics.memory import OptimizerSpec
from .reports.saved import SavedTrace, check_settings, read_saved_trace, write_saved_trace
from .session import plain_settings, result_from_trace

if TYPE_CHECKING:
    from .analysis import Analysis
    from .reports.result import Result

__all__ = ["load_trace", "recount", "save_trace"]


def save_trace(analysis: Analysis, path: str | os.PathLike[str], *, name: str | None = None) -> None:
    """Write ``analysis``'s run to ``path``: its trace, its counting settings and their result (under ``name``,
    by default the model's class name), for :func:`load_trace` and ``modelmeter report``.

    The file keeps what the conventions count: handles set with ``set_op_handle`` are code, so they are not
    saved, and the saved result is the one the analysis's settings give without them.
    """
    settings = check_settings({**plain_settings(analysis.settings), "name": name})
    trace = analysis.trace
    saved_by = {"modelmeter": __version__, "torch": trace.versions.get("torch", "")}
    write_saved_trace(SavedTrace(trace, _count(trace, settings), settings, saved_by), path)


def load_trace(path: str | os.PathLike[str], **settings: Any) -> Result:
    """The :class:`~modelmeter.Result` of the saved trace in ``path``, counted again from the trace with the
    settings it was saved with, changed by the ones given (``convention``, ``dense_attention``,
    ``attention_kernel``, ``memory``, ``optimizer``, ``state_dtype``, ``foreach``, ``name``). No model is built
    or run. :class:`~modelmeter.reports.saved.SavedTraceError` for a file that cannot be read."""
    return recount(read_saved_trace(path), **settings)


def recount(saved: SavedTrace, **changes: Any) -> Result:
    """The Result of ``saved``'s trace under its settings, with ``changes`` made to them."""
    return _count(saved.trace, check_settings({**saved.settings, **changes}))


def _count(trace: Trace, settings: dict[str, Any]) -> Result:
    if not settings["memory"]:  # the optimizer's options mean nothing without the memory analysis
        settings = {**settings, "optimizer": None, "state_dtype": None, "foreach": None}
    elif isinstance(settings["optimizer"], dict):  # an OptimizerSpec of the user's, saved as its fields
        settings = {**settings, "optimizer": OptimizerSpec(**settings["optimizer"])}
    return result_from_trace(trace, quiet=True, **settings)
