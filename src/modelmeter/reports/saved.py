"""Saved traces (``.mmtrace``): one recorded run, the settings it was counted with, and their result.

A file is gzipped UTF-8 JSON (schema in docs/reports.md, "Saved traces")::

    {"format": "modelmeter-saved-trace", "version": 1,
     "saved_by": {"modelmeter": "0.1.0", "torch": "2.14.1"},
     "settings": {"name": ..., "convention": ..., ...},      # how the result was counted
     "result": {...},                                       # Result.to_dict() of those settings
     "trace": {...}}                                        # the whole Trace (modelmeter.engine.serialize)

The trace is the record: every metric can be recounted from it, under any settings, without the model. The
result is kept beside it so that reading a file as it was saved (``modelmeter report``, ``modelmeter diff``)
needs no recount. Reading is strict: anything damaged, foreign or of another version is a :class:`SavedTraceError`
naming the file, never a half-read file.
"""

from __future__ import annotations

import gzip
import os
import sys
from dataclasses import dataclass, field, fields
from typing import Any

from ..engine.gc_pause import no_gc
from ..engine.serialize import MAX_ENTRY_BYTES, gunzip, trace_from_dict, trace_to_dict
from ..engine.trace import Trace
from ..errors import InvalidValueError, ModelMeterError
from ..handles.catalog import ATTENTION_KERNELS, CONVENTIONS
from ..io.atomic import atomic_write
from . import jsontext
from .files import file_problem
from .result import Result

FORMAT = "modelmeter-saved-trace"
FORMAT_VERSION = 1
SUFFIX = ".mmtrace"
# The counting settings a file records, with their defaults (what analyze() uses).
SETTINGS: dict[str, Any] = {"name": None, "convention": "fvcore", "dense_attention": False,
                            "attention_kernel": "fused", "memory": False, "optimizer": None,
                            "state_dtype": None, "foreach": None, "device": None, "efficiency": 1.0,
                            "launch_overhead": 0.0, "tf32": False, "measured_time": None}
# The types a file's settings may have (a device and an optimizer of the user's are saved as their fields).
_NUMBER = (int, float)
_SETTING_TYPES: dict[str, tuple[type, ...]] = {
    "name": (str, type(None)), "convention": (str,), "dense_attention": (bool,), "attention_kernel": (str,),
    "memory": (bool,), "optimizer": (str, dict, type(None)), "state_dtype": (str, type(None)),
    "foreach": (bool, type(None)), "device": (str, dict, type(None)), "efficiency": _NUMBER,
    "launch_overhead": _NUMBER, "tf32": (bool,), "measured_time": (*_NUMBER, type(None))}
# The settings of the time on a device, with their values when there is none.
_TIME_SETTINGS = {name: SETTINGS[name] for name in ("efficiency", "launch_overhead", "tf32", "measured_time")}
# The settings that hold one of a few names.
_SETTING_NAMES = {"convention": CONVENTIONS, "attention_kernel": ATTENTION_KERNELS}


class SavedTraceError(ModelMeterError, ValueError):
    """A saved trace that cannot be read: missing, damaged, not a saved trace, or of another format version."""


@dataclass
class SavedTrace:
    """What a ``.mmtrace`` file holds: the ``trace``, the ``settings`` it was counted with (see :data:`SETTINGS`),
    the ``result`` of those settings and the versions of the software that saved it."""

    trace: Trace
    result: Result
    settings: dict[str, Any] = field(default_factory=lambda: dict(SETTINGS))
    saved_by: dict[str, str] = field(default_factory=dict)


def check_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` completed with the defaults; a :class:`ValueError` for a setting no file records."""
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise InvalidValueError(f"unknown saved-trace settings: {', '.join(unknown)}; known: {', '.join(SETTINGS)}")
    return {**SETTINGS, **settings}


def is_saved_trace(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` starts like a saved trace (gzip), so callers can tell it from a JSON result; False for what
    is not a regular file, which is not opened (a pipe would block)."""
    try:
        if file_problem(path, sys.maxsize, "a saved trace") is not None:
            return False
        with open(path, "rb") as f:
            return f.read(2) == b"\x1f\x8b"
    except OSError:
        return False


def write_saved_trace(saved: SavedTrace, path: str | os.PathLike[str]) -> None:
    """Write ``saved`` to ``path`` atomically (a reader never sees half a file)."""
    with no_gc():
        data = {"format": FORMAT, "version": FORMAT_VERSION, "saved_by": dict(saved.saved_by),
                "settings": check_settings(saved.settings), "result": saved.result.to_dict(),
                "trace": trace_to_dict(saved.trace)}
        text = jsontext.dumps(data, separators=(",", ":"), ensure_ascii=False)
    raw = gzip.compress(text.encode("utf-8"), compresslevel=6, mtime=0)
    atomic_write(os.fspath(path), lambda f: f.write(raw))


def read_saved_trace(path: str | os.PathLike[str]) -> SavedTrace:
    """The saved trace in ``path``; :class:`SavedTraceError` naming the file for anything unreadable."""
    where = repr(os.fspath(path))
    try:
        problem = file_problem(path, MAX_ENTRY_BYTES, "a saved trace")
        if problem is not None:
            raise SavedTraceError(problem)
        with open(path, "rb") as f:
            raw = f.read(MAX_ENTRY_BYTES + 1)
    except OSError as exc:
        raise SavedTraceError(f"cannot read the saved trace {where}: {exc.strerror or exc}") from None
    try:
        with no_gc():
            return _parse(raw)
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
        raise SavedTraceError(f"{where} is not a readable saved trace ({SUFFIX}): {exc}") from None
    except RecursionError:  # JSON nested deeper than Python's parser recurses: no file this module writes
        raise SavedTraceError(f"{where} is not a readable saved trace ({SUFFIX}): its JSON is nested too deeply") \
            from None


def _parse(raw: bytes) -> SavedTrace:
    if raw[:2] != b"\x1f\x8b":
        raise InvalidValueError("not gzip data (a saved trace is written by --save-trace or save_trace())")
    data = jsontext.loads(gunzip(raw), "a saved trace")
    if type(data) is not dict or data.get("format") != FORMAT:
        raise InvalidValueError(f"its format is not {FORMAT!r}")
    version = data.get("version")
    if type(version) is not int or version != FORMAT_VERSION:  # not True, not 1.0
        raise InvalidValueError(f"format version {version!r:.40}; this modelmeter reads {FORMAT_VERSION}")
    settings, saved_by = data.get("settings"), data.get("saved_by")
    if type(settings) is not dict or type(saved_by) is not dict \
            or not all(type(k) is str and type(v) is str for k, v in saved_by.items()):
        raise InvalidValueError("malformed settings or saved_by")
    result = data.get("result")
    if type(result) is not dict:
        raise InvalidValueError("it holds no result")
    return SavedTrace(trace=trace_from_dict(data.get("trace")), result=_result(result),
                      settings=_file_settings(settings), saved_by=saved_by)




def _file_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """A file's settings, completed and checked: each of its type, a convention or kernel of the known ones (so
    a setting edited by hand is refused here, not taken as true or met as a traceback in a recount)."""
    settings = check_settings(settings)
    for name, kinds in _SETTING_TYPES.items():
        value = settings[name]
        if type(value) not in kinds:
            raise InvalidValueError(f"the setting {name} is a {type(value).__name__}: {value!r:.40}")
    for name, known in _SETTING_NAMES.items():
        if settings[name] not in known:
            raise InvalidValueError(f"the setting {name} is {settings[name]!r:.40}, not one of {', '.join(known)}")
    time = {name: settings[name] for name in _TIME_SETTINGS}
    if settings["device"] is None and time != _TIME_SETTINGS:  # what save_trace writes without a device
        raise InvalidValueError(f"the settings of the time on a device without a device: {time}")
    return settings


def _result(data: dict[str, Any]) -> Result:
    """The saved result, every field present (a report prints it as it is: checked by :meth:`Result.from_dict`)."""
    missing = sorted({f.name for f in fields(Result)} - data.keys())
    if missing:
        raise InvalidValueError(f"its result lacks {', '.join(missing)}")
    return Result.from_dict(data)
