"""A :class:`Trace` as JSON-safe plain data and back, exactly; optionally gzipped bytes.

No pickle: a cache entry is data, never code. Every field of ``Trace``, ``OpEvent`` and ``TensorMeta`` is
written (found through :func:`dataclasses.fields`, so a field added later is covered, and the list of field
names is stored and checked on reading). Values keep their exact type: JSON's own ``null``, booleans,
integers, finite floats, strings, arrays (Python lists) and objects (dicts whose keys are all strings, but for
one key that starts with ``$``) are written as they are; everything else is a one-key object tagged with ``$``::

    {"$t": [...]}          tuple                   {"$f": "inf" | "-inf" | "nan"}   non-finite float
    {"$c": [re, im]}       complex                 {"$s": [...]}                    set
    {"$z": [...]}          frozenset               {"$d": [[key, value], ...]}      dict (any keys, in order)
    {"$m": [field, ...]}   TensorMeta, fields in ``dataclasses.fields`` order
    {"$M": [field, ...]}   ModuleInfo, likewise    {"$p": [field, ...]}             ParameterInfo, likewise
    {"$g": [field, ...]}   GroupMeta, likewise

Anything else (a tensor, a module, an arbitrary object) cannot be written: :class:`TypeError`.
Reading checks the structure and raises :class:`ValueError` on anything unexpected, so a damaged entry is
detected rather than returned.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import gzip
import json
import math
import operator
import sys
import zlib
from array import array
from collections.abc import Callable, Collection, Mapping
from typing import Any

from ..errors import InvalidTypeError, InvalidValueError
from .gc_pause import no_gc
from .trace import PHASES, STORAGE_KINDS, GroupMeta, ModuleInfo, OpEvent, ParameterInfo, Storage, TensorMeta, Trace

FORMAT = "modelmeter-trace"
FORMAT_VERSION = 8  # 2: the module table, the run's description (model, versions) and the operators' tags;
#                     3: TensorMeta.footprint (a broadcast tensor's distinct elements: what the bytes metric reads);
#                     4: Trace.output_shapes (each module's output shapes, per call);
#                     5: events' arguments written once per distinct value (the ``values`` table);
#                     6: events and storages as columns, their strings in the ``strings`` table;
#                     7: Trace.parallel (the plan of a simulated rank), ParameterInfo.global_shape, a
#                        collective's process group as a GroupMeta;
#                     8: OpEvent.overload (the schema overload that placed an event's arguments)
#: The most bytes of JSON a stored trace may hold: reading refuses more, so a crafted entry that decompresses
#: to gigabytes (a decompression bomb) is a damaged entry, not a MemoryError. ViT-B/16 is ~0.3 MB.
MAX_ENTRY_BYTES = 512 << 20

_TRACE_FIELDS = tuple(f.name for f in dataclasses.fields(Trace))
_EVENT_FIELDS = tuple(f.name for f in dataclasses.fields(OpEvent))
_META_FIELDS = tuple(f.name for f in dataclasses.fields(TensorMeta))
_STORAGE_FIELDS = tuple(f.name for f in dataclasses.fields(Storage))
_MODULE_FIELDS = tuple(f.name for f in dataclasses.fields(ModuleInfo))
_PARAMETER_FIELDS = tuple(f.name for f in dataclasses.fields(ParameterInfo))
_GROUP_FIELDS = tuple(f.name for f in dataclasses.fields(GroupMeta))
# The columns of events and storages, in their classes' field order, with the type of each field's values: a
# ``str`` is written as its index in the ``strings`` table, a ``list`` or ``dict`` (an event's arguments) as its
# index in the ``values`` table, numbers as they are. A field added to OpEvent or Storage must be given a type here.
_EVENT_COLUMNS: dict[str, type[Any]] = {"op": str, "level": str, "parent": int, "scope": int, "phase": str,
                                        "inputs": list, "outputs": list, "kwargs": dict, "origin": int, "python": bool,
                                        "overload": str}
_STORAGE_COLUMNS: dict[str, type[Any]] = {"nbytes": int, "dtype": str, "device": str, "kind": str, "born": int,
                                          "died": int, "saved": int, "saved_scope": int, "order": int}
# The string fields that hold one of a few names: reading refuses any other.
_EVENT_NAMES = {"level": frozenset(("function", "dispatch")), "phase": frozenset(PHASES)}
_STORAGE_NAMES = {"kind": frozenset(STORAGE_KINDS)}
_COLUMNAR = ("events", "storages")  # the Trace fields written as columns
_MAX_SIZE = (1 << 63) - 1  # torch's sizes and counts are int64: a larger or negative one is a damaged entry
_TYPECODES = ("b", "h", "i", "q")  # the array types a column's numbers are packed in, narrowest first


def schema_signature() -> dict[str, list[str]]:
    """The field names of the trace classes, as written in every entry (and part of the cache key)."""
    return {"Trace": list(_TRACE_FIELDS), "OpEvent": list(_EVENT_FIELDS), "TensorMeta": list(_META_FIELDS),
            "Storage": list(_STORAGE_FIELDS), "ModuleInfo": list(_MODULE_FIELDS),
            "ParameterInfo": list(_PARAMETER_FIELDS), "GroupMeta": list(_GROUP_FIELDS)}


# encoding ------------------------------------------------------------------------------------------
def _encode(value: Any) -> Any:
    kind = type(value)
    if value is None or kind is bool or kind is int or kind is str:
        return value
    if kind is float:
        if math.isfinite(value):
            return value
        return {"$f": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if kind is list:
        return [_encode(v) for v in value]
    if kind is TensorMeta:
        return {"$m": [_encode(getattr(value, name)) for name in _META_FIELDS]}
    if kind is ModuleInfo:
        return {"$M": [_encode(getattr(value, name)) for name in _MODULE_FIELDS]}
    if kind is ParameterInfo:
        return {"$p": [_encode(getattr(value, name)) for name in _PARAMETER_FIELDS]}
    if kind is GroupMeta:
        return {"$g": [_encode(getattr(value, name)) for name in _GROUP_FIELDS]}
    if kind is tuple:
        return {"$t": [_encode(v) for v in value]}
    if kind is dict:
        if all(type(k) is str for k in value) and not _looks_tagged(value):
            return {k: _encode(v) for k, v in value.items()}
        return {"$d": [[_encode(k), _encode(v)] for k, v in value.items()]}
    if kind is complex:
        return {"$c": [_encode(value.real), _encode(value.imag)]}
    if kind is set or kind is frozenset:
        items = sorted(value) if all(type(v) is str for v in value) else list(value)
        return {"$s" if kind is set else "$z": [_encode(v) for v in items]}
    raise InvalidTypeError(f"a trace value of type {kind.__name__} cannot be serialised: {value!r:.80}")


def to_data(value: Any) -> Any:
    """``value`` — plain data, tuples, sets, dicts with any keys, non-finite floats, complex numbers, trace records —
    as JSON-safe data that :func:`parse` reads back exactly; :class:`TypeError` for anything else."""
    return _encode(value)


def trace_to_dict(trace: Trace) -> dict[str, Any]:
    """``trace`` as JSON-safe data (``json.dumps`` works on it with ``allow_nan=False``).

    Events and storages are written as columns, one per field (:data:`_EVENT_COLUMNS`, :data:`_STORAGE_COLUMNS`),
    each a packed array of integers (``[typecode, base64 of its little-endian bytes]``, the narrowest of
    ``b h i q`` that holds them): a string field's indices into the table ``strings`` (operator names, phases,
    dtypes), an argument field's (``inputs``, ``outputs``, ``kwargs``) into the table ``values``, where each
    distinct argument description is written once (a model's layers repeat them), a number field's numbers and a
    boolean field's 0 and 1. Reading decodes a column at once, with no number parsed on its own, and builds each
    record with one call."""
    fields = {name: _encode(getattr(trace, name)) for name in _TRACE_FIELDS if name not in _COLUMNAR}
    tables = _Tables()
    events = tables.columns(trace.events, _EVENT_COLUMNS)
    storages = tables.columns(trace.storages, _STORAGE_COLUMNS)
    return {"format": FORMAT, "version": FORMAT_VERSION, "schema": schema_signature(), "fields": fields,
            "strings": tables.strings, "values": tables.values, "events": events, "storages": storages}


class _Tables:
    """The ``strings`` and ``values`` tables of one trace being written, each entry once."""

    def __init__(self) -> None:
        self.strings: list[str] = []
        self.values: list[Any] = []
        self._string_index: dict[str, int] = {}
        self._value_index: dict[str, int] = {}

    def string(self, text: str) -> int:
        found = self._string_index.get(text)
        if found is None:
            found = self._string_index[text] = len(self.strings)
            self.strings.append(text)
        return found

    def value(self, value: Any) -> int:
        encoded = _encode(value)
        text = json.dumps(encoded, separators=(",", ":"), allow_nan=False)
        found = self._value_index.get(text)
        if found is None:
            found = self._value_index[text] = len(self.values)
            self.values.append(encoded)
        return found

    def columns(self, records: list[Any], kinds: dict[str, type[Any]]) -> list[list[Any]]:
        """One array per field of ``records`` (in ``kinds``' order): a ``TypeError`` for a value of another kind."""
        out = []
        for name, kind in kinds.items():
            column = [getattr(record, name) for record in records]
            if not all(type(v) is kind for v in column):
                bad = next(v for v in column if type(v) is not kind)
                raise InvalidTypeError(f"a trace's {name} must be a {kind.__name__}, got {type(bad).__name__}: "
                                       f"{bad!r:.80}")
            if kind is str:
                column = [self.string(v) for v in column]
            elif kind is not int and kind is not bool:
                column = [self.value(v) for v in column]
            out.append(_packed(column))
        return out


def _packed(numbers: list[int]) -> list[str]:
    """Integers as ``[typecode, base64]``: the bytes of an :class:`array.array` of the narrowest type that holds
    them all, little-endian — what reading turns back into numbers without parsing each."""
    low, high = min(numbers, default=0), max(numbers, default=0)
    for code in _TYPECODES:
        bound = 1 << (array(code).itemsize * 8 - 1)
        if -bound <= low and high < bound:
            break
    else:
        raise InvalidValueError(f"a number of the trace does not fit 64 bits: {high if high > 0 else low}")
    packed = array(code, numbers)
    if sys.byteorder == "big":
        packed.byteswap()
    return [code, base64.b64encode(packed.tobytes()).decode("ascii")]


def _unpacked(column: Any, what: str) -> list[int]:
    """The integers :func:`_packed` wrote; ValueError for anything else."""
    if type(column) is not list or len(column) != 2 or column[0] not in _TYPECODES or type(column[1]) is not str:
        raise InvalidValueError(f"{what}: expected [typecode, base64 data]")
    try:
        raw = base64.b64decode(column[1], validate=True)
    except binascii.Error as exc:
        raise InvalidValueError(f"{what}: {exc}") from None
    numbers = array(column[0])
    if len(raw) % numbers.itemsize:
        raise InvalidValueError(f"{what}: the data is not a whole number of items")
    numbers.frombytes(raw)
    if sys.byteorder == "big":
        numbers.byteswap()
    return numbers.tolist()


# decoding ------------------------------------------------------------------------------------------
def _list(value: Any, what: str) -> list[Any]:
    if type(value) is not list:
        raise InvalidValueError(f"{what}: expected a list, got {type(value).__name__}")
    return value


def _untag(tag: str, body: Any, metas: dict[tuple[Any, ...], TensorMeta] | None = None) -> Any:
    """The value of one tagged object whose contents are decoded already.

    ``metas``: TensorMeta objects made so far, to share one (they are immutable) among equal descriptions.
    """
    if tag == "$f":
        if body not in ("inf", "-inf", "nan"):
            raise InvalidValueError(f"unexpected non-finite float {body!r:.80}")
        return float(body)
    items = _list(body, tag)
    if tag == "$m":
        if len(items) != len(_META_FIELDS):
            raise InvalidValueError("a TensorMeta entry has the wrong number of fields")
        memo_key = tuple(items)
        if metas is not None:
            found = metas.get(memo_key)  # TypeError for an unhashable field: a malformed entry
            if found is not None:
                return found
        meta = dict(zip(_META_FIELDS, items, strict=True))
        shape = meta.get("shape")
        if type(shape) is not tuple or not all(type(s) is int and 0 <= s <= _MAX_SIZE for s in shape):
            raise InvalidValueError(f"a TensorMeta shape must be a tuple of sizes (integers from 0 to 2**63 - 1), got "
                                    f"{shape!r:.80}")
        if type(meta.get("dtype")) is not str or type(meta.get("device")) is not str:
            raise InvalidValueError(f"a TensorMeta dtype and device must be names, got {items!r:.80}")
        for name in ("attended", "footprint"):
            count = meta.get(name)
            if count is not None and (type(count) is not int or not 0 <= count <= _MAX_SIZE):
                raise InvalidValueError(f"a TensorMeta {name} must be a count of elements or null, got {count!r:.80}")
        made = TensorMeta(**meta)
        if metas is not None:
            metas[memo_key] = made
        return made
    if tag == "$M":
        return _record(ModuleInfo, _MODULE_FIELDS, items)
    if tag == "$p":
        return _record(ParameterInfo, _PARAMETER_FIELDS, items)
    if tag == "$g":
        return _group(items)
    if tag == "$t":
        return tuple(items)
    if tag == "$d":
        out = {}
        for pair in items:
            key, item = _list(pair, "dict item")  # ValueError unless exactly two
            out[key] = item
        return out
    if tag == "$c":
        real, imag = items
        if type(real) is not float or type(imag) is not float:
            raise InvalidValueError("a complex entry needs two floats")
        return complex(real, imag)
    if tag == "$s":
        return set(items)
    if tag == "$z":
        return frozenset(items)
    raise InvalidValueError(f"unknown tag {tag!r:.20} in a trace entry")


def _record(kind: type[Any], fields: tuple[str, ...], items: list[Any]) -> Any:
    if len(items) != len(fields):
        raise InvalidValueError(f"a {kind.__name__} entry has the wrong number of fields")
    return kind(*items)  # the fields in dataclasses.fields order, as written


def _group(items: list[Any]) -> GroupMeta:
    group = _record(GroupMeta, _GROUP_FIELDS, items)
    if type(group.name) is not str or type(group.size) is not int or type(group.ranks) is not tuple \
            or not all(type(r) is int for r in group.ranks):
        raise InvalidValueError(f"a GroupMeta entry must hold a name, a size and a tuple of ranks, got {items!r:.80}")
    return group


def _looks_tagged(value: dict[Any, Any]) -> bool:
    """A one-key object whose key starts with ``$``: a tag, so a dict like it is written tagged itself."""
    return len(value) == 1 and str(next(iter(value)))[:1] == "$"


def _decode(value: Any) -> Any:
    """A value of :func:`trace_to_dict`'s output back as it was (strict: any other object is an error)."""
    kind = type(value)
    if value is None or kind is bool or kind is int or kind is str or kind is float:
        return value
    if kind is list:
        return [_decode(v) for v in value]
    if kind is not dict:
        raise InvalidValueError(f"unexpected value in a trace entry: {value!r:.80}")
    if not _looks_tagged(value):
        return {k: _decode(v) for k, v in value.items()}
    (tag, body), = value.items()
    return _untag(tag, _decode(body))


def parse(text: str | bytes) -> Any:
    """JSON written by :func:`dumps` parsed with its tags decoded as the parser meets them (no second walk
    in Python; equal tensor descriptions share one TensorMeta); give it to :func:`trace_from_parsed`."""
    metas: dict[tuple[Any, ...], TensorMeta] = {}

    def hook(obj: dict[str, Any]) -> Any:
        if len(obj) == 1:
            (tag, body), = obj.items()
            if tag == "$t" and type(body) is list:  # the most frequent tag (a trace's shapes, a module's slots)
                return tuple(body)
            if tag[:1] == "$":
                return _untag(tag, body, metas)
        return obj

    try:
        return json.loads(text, object_hook=hook)
    except (TypeError, RecursionError) as exc:  # an unhashable dict key, absurd nesting
        raise InvalidValueError(f"malformed trace entry: {type(exc).__name__}: {exc}") from None


def trace_from_dict(data: Any) -> Trace:
    """The :class:`Trace` that :func:`trace_to_dict` wrote; :class:`ValueError` for anything else."""
    return _trace(data, _decode)


def trace_from_parsed(data: Any) -> Trace:
    """Like :func:`trace_from_dict`, for what :func:`parse` returned (tags already decoded)."""
    return _trace(data, lambda value: value)


def _trace(data: Any, decode: Callable[[Any], Any]) -> Trace:
    if type(data) is not dict or data.get("format") != FORMAT:
        raise InvalidValueError("not a modelmeter trace")
    version = data.get("version")
    if version != FORMAT_VERSION:
        hint = ""
        if type(version) is int and version < FORMAT_VERSION:
            hint = " (recorded by an older modelmeter: record the model again)"
        raise InvalidValueError(f"trace format version {version!r}; this modelmeter reads {FORMAT_VERSION}{hint}")
    if data.get("schema") != schema_signature():
        raise InvalidValueError("the trace was written for other Trace/OpEvent/TensorMeta fields")
    fields = data.get("fields")
    if type(fields) is not dict or set(fields) != set(_TRACE_FIELDS) - set(_COLUMNAR):
        raise InvalidValueError("a trace entry has the wrong fields")
    try:
        strings = _list(data.get("strings"), "strings")
        if not all(type(text) is str for text in strings):
            raise InvalidValueError("the strings table holds something other than strings")
        values = [decode(v) for v in _list(data.get("values"), "values")]
        plain = {name: decode(value) for name, value in fields.items()}
        events = _columns(data.get("events"), _EVENT_COLUMNS, _EVENT_NAMES, strings, values, "events")
        storages = _columns(data.get("storages"), _STORAGE_COLUMNS, _STORAGE_NAMES, strings, values, "storages")
        scopes = plain.get("scopes")
        n_scopes = len(scopes) if type(scopes) is list else 0
        _check_events(events, n_scopes)
        _check_storages(storages, len(events["op"]), n_scopes)
        trace = Trace(**plain)
    except (TypeError, RecursionError) as exc:  # a dict key that cannot be hashed, say
        raise InvalidValueError(f"malformed trace entry: {type(exc).__name__}: {exc}") from None
    _check(trace)
    records = _Records(strings, values, events, storages)
    trace.defer(records.sizes, records)
    return trace


class _Records:
    """The events and storages of a trace read back, checked column by column but not yet made into records: made
    the first time a metric reads them (:meth:`Trace.defer`), since a result kept beside a cached trace needs
    none of them. Everything they are made of was checked, so making them cannot fail."""

    def __init__(self, strings: list[str], values: list[Any], events: dict[str, list[int]],
                 storages: dict[str, list[int]]) -> None:
        self.sizes = {"events": len(events["op"]), "storages": len(storages["nbytes"])}
        self.strings, self.values, self.events, self.storages = strings, values, events, storages

    def __call__(self) -> dict[str, list[Any]]:
        with no_gc():
            return {"events": self._made(OpEvent, _EVENT_COLUMNS, self.events),
                    "storages": self._made(Storage, _STORAGE_COLUMNS, self.storages)}

    def _made(self, record: type[Any], kinds: dict[str, type[Any]], columns: dict[str, list[int]]) -> list[Any]:
        """The records of ``columns`` (in ``record``'s field order, as written): strings and arguments looked up in
        their tables, each record given its own copy of its lists and dicts."""
        fields: list[Any] = []
        for name, kind in kinds.items():
            column = columns[name]
            if kind is int:
                fields.append(column)
            elif kind is bool:
                fields.append(map(bool, column))
            elif kind is str:
                fields.append(map(self.strings.__getitem__, column))
            else:
                fields.append(map(kind, map(self.values.__getitem__, column)))  # copies: records do not share them
        return list(map(record, *fields))


def _within(column: Collection[int], low: int, high: int, what: str) -> None:
    """Every number of ``column`` (integers, checked) lies in ``[low, high]``."""
    if column and (min(column) < low or max(column) > high):
        raise InvalidValueError(f"{what} out of range in the trace")


def _columns(data: Any, kinds: dict[str, type[Any]], names: Mapping[str, frozenset[str]], strings: list[str],
             values: list[Any], what: str) -> dict[str, list[int]]:
    """The columns ``trace_to_dict`` wrote for ``kinds``, unpacked and checked: a string's or an argument's index
    within its table (and an argument of the field's type; a string among ``names`` where it gives the field's),
    a boolean's 0 or 1."""
    columns = _list(data, what)
    if len(columns) != len(kinds):
        raise InvalidValueError(f"{what}: expected {len(kinds)} columns, got {len(columns)}")
    out: dict[str, list[int]] = {}
    size = None
    for (name, kind), packed in zip(kinds.items(), columns, strict=True):
        column = out[name] = _unpacked(packed, f"{what}.{name}")
        if size is not None and len(column) != size:
            raise InvalidValueError(f"{what}: the columns differ in length")
        size = len(column)
        if kind is int:
            continue
        distinct = set(column)  # few: a column of indices is checked by the indices it holds
        if kind is bool:
            _within(distinct, 0, 1, f"{what}.{name} (a boolean)")
        elif kind is str:
            _within(distinct, 0, len(strings) - 1, f"{what}.{name} (an index into its table)")
            if name in names and not {strings[i] for i in distinct} <= names[name]:
                raise InvalidValueError(f"{what}.{name}: a {name} that does not exist")
        else:
            _within(distinct, 0, len(values) - 1, f"{what}.{name} (an index into its table)")
            if not all(type(values[i]) is kind for i in distinct):
                raise InvalidValueError(f"{what}.{name} refers to a value of the values table that is not a "
                                        f"{kind.__name__}")
    return out


def _check_events(events: dict[str, list[int]], n_scopes: int) -> None:
    """What metrics rely on in the events' columns besides their tables: parents and origins before the event,
    scopes of the scope table."""
    n = len(events["op"])
    for name in ("parent", "origin"):
        column = events[name]
        _within(column, -1, n, f"an event's {name}")
        if not all(map(operator.lt, column, range(n))):
            raise InvalidValueError(f"an event's {name} is not an earlier event")
    _within(events["scope"], 0, n_scopes - 1, "an event's scope")


def _check_storages(storages: dict[str, list[int]], n_events: int, n_scopes: int) -> None:
    """Storage records: sizes, and times within the run."""
    _within(storages["nbytes"], 0, 1 << 63, "a storage's size")
    for name in ("born", "died", "saved"):
        _within(storages[name], -1, n_events, f"a storage's {name}")
    _within(storages["saved_scope"], -1, n_scopes - 1, "a storage's saved_scope")


def _check(trace: Trace) -> None:
    """The types every metric relies on, so a damaged entry fails here and not in a handle (the events and
    storages were checked column by column)."""
    if not all(type(s) is tuple and all(type(n) is str for n in s) for s in trace.scopes):
        raise InvalidValueError("trace scopes must be tuples of module names")
    if type(trace.called) is not set or type(trace.assumptions) is not list or type(trace.execution) is not str \
            or type(trace.inputs) is not list or not all(type(t) is TensorMeta for t in trace.inputs) \
            or type(trace.gradients) is not list or not all(type(t) is TensorMeta for t in trace.gradients) \
            or type(trace.model) is not str or type(trace.versions) is not dict:
        raise InvalidValueError("malformed trace fields")
    _check_modules(trace)
    if type(trace.output_shapes) is not dict or not all(
            type(name) is str and type(calls) is dict
            and all(type(shape) is str and type(n) is int and n > 0 for shape, n in calls.items())
            for name, calls in trace.output_shapes.items()):
        raise InvalidValueError("malformed output shapes in the trace")


def _check_modules(trace: Trace) -> None:
    """The module table: described modules with unique names, aliases that lead to one of them."""
    if type(trace.modules) is not list or not all(type(m) is ModuleInfo for m in trace.modules):
        raise InvalidValueError("malformed module table in the trace")
    names = {m.name for m in trace.modules}
    if len(names) != len(trace.modules) or not all(type(n) is str for n in names):
        raise InvalidValueError("module names in the trace are not unique strings")
    for module in trace.modules:
        if type(module.children) is not tuple or type(module.parameters) is not tuple \
                or not all(type(p) is ParameterInfo and type(p.nbytes) is int
                           and (p.global_shape is None or type(p.global_shape) is tuple) for p in module.parameters) \
                or not all(type(c) is tuple and len(c) == 2 and (c[1] is None or c[1] in names)
                           for c in module.children):
            raise InvalidValueError(f"malformed module {module.name!r} in the trace")
    if type(trace.aliases) is not dict or not all(type(k) is str and v in names for k, v in trace.aliases.items()):
        raise InvalidValueError("module aliases in the trace lead to no module of it")


# bytes ---------------------------------------------------------------------------------------------
def gunzip(data: bytes, limit: int | None = None) -> str:
    """The UTF-8 text gzipped in ``data``, decompressed to at most ``limit`` bytes (default
    :data:`MAX_ENTRY_BYTES`); :class:`ValueError` for anything damaged, or bigger than that."""
    limit = MAX_ENTRY_BYTES if limit is None else limit
    inflater = zlib.decompressobj(wbits=31)  # the gzip container
    try:
        raw = inflater.decompress(data, limit + 1)  # never more than the limit (and one byte) in memory
    except zlib.error as exc:
        raise InvalidValueError(f"not gzip data: {exc}") from None
    if len(raw) > limit:
        raise InvalidValueError(f"it decompresses to more than {limit} bytes, the limit of a trace (a decompression "
                                "bomb?)")
    if not inflater.eof or inflater.unused_data:
        raise InvalidValueError("truncated gzip data, or data after it")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidValueError(f"not UTF-8 text: {exc}") from None


def dumps(trace: Trace, *, compress: bool = True) -> bytes:
    """``trace`` as UTF-8 JSON, gzipped unless ``compress=False``."""
    with no_gc():
        text = json.dumps(trace_to_dict(trace), separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    raw = text.encode("utf-8")
    return gzip.compress(raw, compresslevel=6, mtime=0) if compress else raw


def loads(data: bytes) -> Trace:
    """The trace in ``data`` (gzipped or not); :class:`ValueError` for anything damaged or foreign, or
    bigger than :data:`MAX_ENTRY_BYTES` of JSON."""
    with no_gc():
        if data[:2] == b"\x1f\x8b":
            text = gunzip(data)
        elif len(data) > MAX_ENTRY_BYTES:
            raise InvalidValueError(f"unreadable trace entry: over {MAX_ENTRY_BYTES} bytes")
        else:
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InvalidValueError(f"unreadable trace entry: {exc}") from None
        return trace_from_parsed(parse(text))
