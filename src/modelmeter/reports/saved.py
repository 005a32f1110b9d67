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
import json
import os
from dataclasses import dataclass, field
from typing import Any

from ..engine.gc_pause import no_gc
from ..engine.serialize import MAX_ENTRY_BYTES, gunzip, trace_from_dict, trace_to_dict
from ..engine.trace import Trace
from ..errors import ModelMeterError
from ..handles.catalog import ATTENTION_KERNELS, CONVENTIONS
from ..io.atomic import atomic_write
from .result import SCHEMA_VERSION, ModuleRow, Result

FORMAT = "modelmeter-saved-trace"
FORMAT_VERSION = 1
SUFFIX = ".mmtrace"
# The counting settings a file records, with their defaults (what analyze() uses).
SETTINGS: dict[str, Any] = {"name": None, "convention": "fvcore", "dense_attention": False,
                            "attention_kernel": "fused", "memory": False, "optimizer": None,
                            "state_dtype": None, "foreach": None, "device": None, "efficiency": 1.0,
                            "launch_overhead": 0.0, "tf32": False, "measured_time": None}
MAX_COST = 1e30  # no model's cost comes near this (the guard's limit): a larger one is a damaged file
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
# The fields of a saved result and of its module rows, with their types.
_RESULT_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str,), "inputs": (list,), "metrics": (list,), "modules": (list,), "convention": (str,),
    "execution": (str,), "device": (str,), "unsupported": (dict,), "assumptions": (list,), "dtypes": (dict,),
    "memory": (dict,), "roofline": (dict,), "parallel": (dict, type(None)), "schema_version": (int,)}
_ROW_TYPES: dict[str, type] = {"name": str, "type": str, "params": int, "metrics": dict, "by_operator": dict,
                               "called": bool, "output_shapes": dict}


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
        raise ValueError(f"unknown saved-trace settings: {', '.join(unknown)}; known: {', '.join(SETTINGS)}")
    return {**SETTINGS, **settings}


def is_saved_trace(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` starts like a saved trace (gzip), so callers can tell it from a JSON result."""
    try:
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
        text = json.dumps(data, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    raw = gzip.compress(text.encode("utf-8"), compresslevel=6, mtime=0)
    atomic_write(os.fspath(path), lambda f: f.write(raw))


def read_saved_trace(path: str | os.PathLike[str]) -> SavedTrace:
    """The saved trace in ``path``; :class:`SavedTraceError` naming the file for anything unreadable."""
    where = repr(os.fspath(path))
    try:
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
        raise ValueError("not gzip data (a saved trace is written by --save-trace or save_trace())")
    data = json.loads(gunzip(raw), parse_constant=_refuse_constant)
    if type(data) is not dict or data.get("format") != FORMAT:
        raise ValueError(f"its format is not {FORMAT!r}")
    version = data.get("version")
    if type(version) is not int or version != FORMAT_VERSION:  # not True, not 1.0
        raise ValueError(f"format version {version!r:.40}; this modelmeter reads {FORMAT_VERSION}")
    settings, saved_by = data.get("settings"), data.get("saved_by")
    if type(settings) is not dict or type(saved_by) is not dict \
            or not all(type(k) is str and type(v) is str for k, v in saved_by.items()):
        raise ValueError("malformed settings or saved_by")
    result = data.get("result")
    if type(result) is not dict:
        raise ValueError("it holds no result")
    return SavedTrace(trace=trace_from_dict(data.get("trace")), result=_result(result),
                      settings=_file_settings(settings), saved_by=saved_by)


def _refuse_constant(name: str) -> Any:
    """JSON's NaN and Infinity, which Python's parser reads but no saved trace holds (the trace tags a
    non-finite float, the result has none)."""
    raise ValueError(f"{name} is not a value a saved trace holds")


def _file_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """A file's settings, completed and checked: each of its type, a convention or kernel of the known ones (so
    a setting edited by hand is refused here, not taken as true or met as a traceback in a recount)."""
    settings = check_settings(settings)
    for name, kinds in _SETTING_TYPES.items():
        value = settings[name]
        if type(value) not in kinds:
            raise ValueError(f"the setting {name} is a {type(value).__name__}: {value!r:.40}")
    for name, known in _SETTING_NAMES.items():
        if settings[name] not in known:
            raise ValueError(f"the setting {name} is {settings[name]!r:.40}, not one of {', '.join(known)}")
    time = {name: settings[name] for name in _TIME_SETTINGS}
    if settings["device"] is None and time != _TIME_SETTINGS:  # what save_trace writes without a device
        raise ValueError(f"the settings of the time on a device without a device: {time}")
    return settings


def _result(data: dict[str, Any]) -> Result:
    """The saved result, its fields and rows of their types and every cost a finite number >= 0: a report
    renders it as it is, so a damaged one is refused here rather than printed."""
    if data.get("schema_version") != SCHEMA_VERSION or type(data.get("schema_version")) is not int:
        raise ValueError(f"its result's schema_version is {data.get('schema_version')!r:.40}; this modelmeter "
                         f"reads {SCHEMA_VERSION}")
    if data.keys() != _RESULT_TYPES.keys():
        missing, extra = sorted(_RESULT_TYPES.keys() - data.keys()), sorted(data.keys() - _RESULT_TYPES.keys())
        raise ValueError(f"its result has other fields (missing: {missing}, unknown: {extra})")
    for name, kinds in _RESULT_TYPES.items():
        if type(data[name]) not in kinds:
            raise ValueError(f"its result's {name} is a {type(data[name]).__name__}")
    if not all(type(metric) is str for metric in data["metrics"]):
        raise ValueError("its result's metrics are not names")
    return Result(**{**data, "modules": [_row(row) for row in data["modules"]]})


def _row(row: Any) -> ModuleRow:
    """A module row of a saved result, checked as :func:`_result` says."""
    if type(row) is not dict or row.keys() != _ROW_TYPES.keys():
        raise ValueError(f"a module row of its result has other fields: {row!r:.80}")
    for name, kind in _ROW_TYPES.items():
        if type(row[name]) is not kind:
            raise ValueError(f"module {row['name']!r:.80} of its result: {name} is a {type(row[name]).__name__}")
    where = f"module {row['name']!r:.80} of its result"
    _costs({"params": row["params"], **row["metrics"]}, where)
    for operator, values in row["by_operator"].items():
        if type(values) is not dict:
            raise ValueError(f"{where}: by_operator {operator!r:.80} is not an object")
        _costs(values, f"{where}, by_operator {operator!r:.80}")
    if not all(type(n) is int and n > 0 for n in row["output_shapes"].values()):
        raise ValueError(f"{where}: output_shapes holds a count that is not a positive integer")
    return ModuleRow(**row)


def _costs(values: dict[str, Any], where: str) -> None:
    """Every value of ``values`` a number (not a boolean) from 0 to :data:`MAX_COST`."""
    for name, value in values.items():
        if type(value) not in _NUMBER or not 0 <= value <= MAX_COST:  # NaN fails both comparisons
            raise ValueError(f"{where}: {name} is {value!r:.40}, not a number from 0 to {MAX_COST:g}")
