"""Count a metric over a trace: handles applied to events, totals attributed to modules.

A pure function of the trace, the handle table and the ancestor mode, so changing any of them
recomputes in milliseconds without running the model again.
"""

from __future__ import annotations

import numbers
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..engine.naming import ModuleNames
from ..engine.trace import PHASES, OpEvent, TensorMeta, Trace
from ..handles.base import CountInside, Handle, backward_key
from ..handles.classify import is_elementwise, is_free

AncestorMode = Literal["owner", "caller"]
HandleTable = Mapping[str, "Handle | CountInside | None"]


@dataclass
class Statistics:
    """Per canonical module name: counts by operator (all phases, and per phase), by the dtype the work was
    done in, the unsupported operators, and the uncalled modules. A module with nothing to count is absent
    from the tables (read them with ``.get``); the count tables are plain dicts (made by the thousand)."""

    counts: Mapping[str, Mapping[str, Any]]
    by_phase: Mapping[str, Mapping[str, Mapping[str, Any]]]
    dtypes: Mapping[str, Mapping[str, Any]]
    unsupported: dict[str, Counter[str]]
    uncalled: set[str]


def count(trace: Trace, names: ModuleNames, handles: HandleTable, ancestor_mode: AncestorMode = "owner", *,
          elementwise: Handle | None = None, phases: Collection[str] = PHASES) -> Statistics:
    """Apply ``handles`` to the events of ``trace`` in ``phases``.

    Events are visited from the outside in: a call with a handle is counted by it and what it ran
    inside is not looked at again; a call whose handle is ``None`` is ignored with all it ran; a
    user-level call without a handle is looked into. An aten operator that is neither handled,
    free nor element-wise is reported as unsupported under the name of the user-level call that
    ran it — except inside a :class:`CountInside` call, which is supported as a whole (the sum an
    ``einsum`` runs for an index of one operand is part of the einsum). A user-level call with keyword
    arguments its operator's schema could not place is looked into, since its handle would not see them. A
    backward operator whose autograd
    node was made by a user-level call with a ``backward:`` entry (:func:`backward_key`) is covered by that
    entry, applied once per call to the forward call's ``(inputs, outputs)`` (an entry set to ``None`` counts
    them operator by operator again). Element-wise operators without
    a handle cost ``elementwise`` (free when it is None). Each count is also kept under the event's phase
    and under the dtype the work was done in (see :func:`work_dtype`).
    """
    tally = _Tally({p: {} for p in phases})
    unsupported: dict[str, Counter[str]] = {}
    ancestors = _Ancestors(trace, ancestor_mode)
    children = trace.children()
    events = trace.events

    covered: set[int] = set()

    def visit(index: int, user_op: str | None, into: Counter[str] | None) -> None:
        event = events[index]
        if event.origin >= 0 and event.phase == "backward":
            origin = events[event.origin]
            whole = handles.get(backward_key(origin.op))
            if whole is not None and not isinstance(whole, CountInside):  # a formula of its own: counted once
                if event.origin not in covered:
                    covered.add(event.origin)
                    tally.add(event, ancestors(event.scope),
                              _as_items(origin.op, whole(origin.inputs, origin.outputs)), into)
                return
        handle = handles.get(event.op, _MISSING)
        if handle is None:
            return
        if event.kwargs and handle is not _MISSING and not isinstance(handle, CountInside):
            handle = _MISSING  # keyword arguments the schema could not place: the operators it ran know them
        if isinstance(handle, CountInside):
            inside: Counter[str] = Counter()
            for child in children[index]:
                visit(child, None, inside)
            tally.add(event, ancestors(event.scope), [(handle.key, sum(inside.values()))], into)
            return
        if handle is _MISSING:
            if event.level == "function":
                for child in children[index]:
                    visit(child, event.op, into)
                return
            if is_free(event.op) or _integer_only(event.outputs):
                return
            if is_elementwise(event.op):
                handle = elementwise
                if handle is None:
                    return
            elif into is None:
                name = user_op if user_op is not None and not is_free(user_op) else event.op
                for module in ancestors(event.scope):
                    unsupported.setdefault(module, Counter())[name] += 1
                return
            else:
                return
        tally.add(event, ancestors(event.scope), _as_items(event.op, handle(event.inputs, event.outputs)), into)

    for root in children[-1]:
        if events[root].phase in tally.by_phase:
            visit(root, None, None)
    return Statistics(tally.totals(), tally.by_phase, tally.dtypes, unsupported, ancestors.uncalled(names))


_MISSING: Any = object()


def work_dtype(event: OpEvent) -> str:
    """The dtype an operator computed in: its first floating-point input (else output), else ``"other"``."""
    for group in (event.inputs, event.outputs):
        for value in group:
            for meta in value if isinstance(value, list) else (value,):
                if isinstance(meta, TensorMeta) and meta.is_floating_point:
                    return meta.dtype
    return "other"


class _Tally:
    """Counts by phase, module and operator, and by module and dtype."""

    def __init__(self, by_phase: dict[str, dict[str, dict[str, Any]]]) -> None:
        self.by_phase = by_phase
        self.dtypes: dict[str, dict[str, Any]] = {}

    def add(self, event: OpEvent, modules: Collection[str], items: list[tuple[str, Any]],
            into: Counter[str] | None) -> None:
        """Add ``items`` ((operator key, count) pairs) to every module of ``modules``, or into ``into``."""
        if into is not None:
            for key, count in items:
                into[key] += count
            return
        table, dtypes = self.by_phase[event.phase], self.dtypes
        total = items[0][1] if len(items) == 1 else sum(v for _, v in items)
        dtype = work_dtype(event)
        for module in modules:
            counter = table.get(module)
            if counter is None:
                counter = table[module] = {}
            for key, count in items:
                counter[key] = counter.get(key, 0) + count
            by_dtype = dtypes.get(module)
            if by_dtype is None:
                by_dtype = dtypes[module] = {}
            by_dtype[dtype] = by_dtype.get(dtype, 0) + total

    def totals(self) -> dict[str, dict[str, Any]]:
        """Counts of all phases together, per module that has any (one phase's table is its own total)."""
        tables = [table for table in self.by_phase.values() if table]
        if len(tables) == 1:
            return tables[0]
        out: dict[str, dict[str, Any]] = {}
        for table in tables:
            for module, counter in table.items():
                total = out.get(module)
                if total is None:
                    out[module] = dict(counter)
                else:
                    for key, count in counter.items():
                        total[key] = total.get(key, 0) + count
        return out


def _integer_only(outputs: list[Any]) -> bool:
    """True when every output is an integer or boolean tensor (index and mask arithmetic is free)."""
    tensors = [o for o in outputs if isinstance(o, TensorMeta)]
    return bool(tensors) and not any(t.is_floating_point for t in tensors)


def _as_items(op: str, value: Any) -> list[tuple[str, Any]]:
    """A handle's value as (operator key, count) pairs, each count checked."""
    if isinstance(value, Counter):
        for v in value.values():
            _check_number(op, v)
        return list(value.items())
    _check_number(op, value)
    return [(_short_name(op), value)]


def _short_name(op: str) -> str:
    name = _SHORT.get(op)
    if name is None:
        name = _SHORT[op] = op.split("::", 1)[-1]
    return name


_SHORT: dict[str, str] = {}


def _check_number(op: str, value: Any) -> None:
    if type(value) is int or type(value) is float:  # what handles return: decided without the ABC check
        return
    itemsize = getattr(getattr(value, "dtype", None), "itemsize", 8)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or itemsize < 8:
        raise ValueError(f"the handle of {op} returned {value!r} of type {type(value).__name__}; a handle "
                         "must return an int or float (64-bit), or a Counter of them")


class _Ancestors:
    """Which modules an event counts toward, per scope (cached: scopes repeat)."""

    def __init__(self, trace: Trace, mode: AncestorMode) -> None:
        self.trace = trace
        self.mode = mode
        self.cache: dict[int, frozenset[str]] = {}

    def __call__(self, scope: int) -> frozenset[str]:
        found = self.cache.get(scope)
        if found is None:
            stack = self.trace.scopes[scope]
            found = frozenset(("", *stack)) if self.mode == "caller" else _prefixes(stack[-1] if stack else "")
            self.cache[scope] = found
        return found

    def uncalled(self, names: ModuleNames) -> set[str]:
        seen = set(self.trace.called)
        if self.mode == "owner":
            for name in self.trace.called:
                seen.update(_prefixes(name))
        return set(names.canonical) - seen


def _prefixes(name: str) -> frozenset[str]:
    """``"a.b.c"`` -> ``{"", "a", "a.b", "a.b.c"}`` (remembered: the same names come back run after run)."""
    found = _PREFIXES.get(name)
    if found is None:
        if len(_PREFIXES) > _PREFIXES_LIMIT:
            _PREFIXES.clear()
        parent = _prefixes(name.rpartition(".")[0]) if "." in name else _ROOT
        found = _PREFIXES[name] = parent | {name}
    return found


_ROOT = frozenset({""})
_PREFIXES: dict[str, frozenset[str]] = {"": _ROOT}
_PREFIXES_LIMIT = 1 << 17
