"""Count a metric over a trace: handles applied to events, totals attributed to modules.

A pure function of the trace, the handle table and the ancestor mode, so changing any of them
recomputes in milliseconds without running the model again.
"""

from __future__ import annotations

import numbers
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

from ..engine.gc_pause import no_gc
from ..engine.trace import PHASES, OpEvent, TensorMeta, Trace
from ..errors import InvalidValueError, ModelMeterError
from ..handles.base import CountInside, Handle, backward_key
from ..handles.binding import at_overload
from ..handles.classify import BRIDGE_OPS, Classifier
from ..handles.fvcore import CONVOLUTION_CALLS, PYTHON_OP, fvcore_alias

AncestorMode = Literal["owner", "caller"]
HandleTable = Mapping[str, "Handle | CountInside | None"]
# A rule every kernel has: the handle of an operator (by name) that has no entry in the table.
KernelRule = Callable[[str], Handle]


@dataclass(frozen=True)
class Unit:
    """One count the tally took: the event it was counted at, its total, whether a ``backward:`` formula of
    the forward call ``events[event].origin`` counted it (for the whole backward pass of that call), and the
    operator key it was counted under (``""`` when a formula gave several). Metrics that combine two counts
    operator by operator (the roofline time pairs FLOPs with bytes) read these."""

    event: int
    total: Any
    whole_backward: bool = False
    key: str = ""


@dataclass
class Statistics:
    """Per canonical module name: counts by operator (all phases, and per phase), by the dtype the work was
    done in, the unsupported operators, and the uncalled modules. A module with nothing to count is absent
    from the tables (read them with ``.get``); the count tables are plain dicts (made by the thousand).

    ``find_uncalled`` gives the uncalled modules when :attr:`uncalled` is first read: a walk over the module
    table that most readers of a result's second metric never need."""

    counts: Mapping[str, Mapping[str, Any]]
    by_phase: Mapping[str, Mapping[str, Mapping[str, Any]]]
    dtypes: Mapping[str, Mapping[str, Any]]
    unsupported: dict[str, Counter[str]]
    find_uncalled: Callable[[], set[str]] = field(repr=False, compare=False)

    @cached_property
    def uncalled(self) -> set[str]:
        """Canonical names of the modules that never ran (found once, on first reading)."""
        return self.find_uncalled()


def count(trace: Trace, handles: HandleTable, ancestor_mode: AncestorMode = "owner", *,
          user: HandleTable | None = None, elementwise: Handle | None = None,
          phases: Collection[str] = PHASES, fallback: KernelRule | None = None,
          units: list[Unit] | None = None, tables: bool = True) -> Statistics:
    """Apply ``handles`` (a convention's table) and ``user`` (the handles set on the analysis, which win) to the
    events of ``trace`` in ``phases``.

    Events are visited from the outside in: a call with a handle is counted by it and what it ran
    inside is not looked at again; a call whose handle is ``None`` is ignored with all it ran; a
    user-level call without a handle is looked into. An aten operator that is neither handled,
    free nor element-wise is reported as unsupported under the name of the user-level call that
    ran it — except inside a :class:`CountInside` call, which is supported as a whole (the sum an
    ``einsum`` runs for an index of one operand is part of the einsum). A user-level call with keyword
    arguments its operator's schema could not place is looked into, since its handle would not see them. A
    backward operator whose autograd node was made by a user-level call with a ``backward:`` entry
    (:func:`backward_key`) is covered by that entry, applied once per call to the forward call's
    ``(inputs, outputs)`` (an entry set to ``None`` counts them operator by operator again). Element-wise
    operators without a handle cost ``elementwise`` (free when it is None). Each count is also kept under the
    event's phase and under the dtype the work was done in (see :func:`work_dtype`).

    ``fallback`` is for a metric every kernel has (the bytes it moves): ``fallback(op)`` is the handle that counts
    any aten operator ``op`` without an entry that is not a view — free operators, integer results and unknown
    operators included — so nothing is reported as unsupported; the table's entries then apply to C-level calls
    only: a Python-level call (``F.relu``, ``x[i]``, ``x[i] = v``) runs no kernel of its own, its operators are
    counted. ``units``, when given, receives every count taken (see :class:`Unit`); with ``tables=False`` only
    they are made, and the statistics' count tables stay empty (a metric that pairs the units of two counts
    builds its own tables, and need not pay for these).

    ``user`` handles follow fvcore's names (docs/handles.md, "fvcore's operator names"): they count the calls
    ``torch.jit`` records under their name — the outermost C-level call, not the operators it ran (a handle
    for ``aten::view`` counts ``x.view``, not the ``view`` inside ``flatten``; inside a free, element-wise or
    ``CountInside`` call the convention's table alone applies), Python-level calls being transparent;
    ``aten::_convolution`` (``aten::_convolution_mode`` with a string padding) names every convolution. A
    custom autograd Function (``prim::PythonOp.<class name>``) without a handle counts what it ran, and is
    reported as unsupported when it returned tensors without running any visible computation.
    """
    with no_gc():  # a table per module, a unit per count: many small objects, none of them in a cycle
        visitor = _Visitor(trace, handles, user or {}, ancestor_mode, elementwise, phases, fallback, units, tables)
        for root in visitor.children[-1]:
            if trace.events[root].phase in visitor.tally.by_phase:
                visitor.visit(root, -1, None, _OPEN)
    # (a new Ancestors: the statistics keep no cache of the pass)
    return Statistics(visitor.tally.totals(), visitor.tally.by_phase, visitor.tally.dtypes, visitor.unsupported,
                      Ancestors(trace, ancestor_mode).uncalled)


# Where user handles apply: everywhere; only they (inside a Python-level call the table ignores); not at all
# (inside a call fvcore records as a whole: its operators are counted by the table).
_OPEN, _USER_ONLY, _CLOSED = 0, 1, 2
# What an aten operator without a handle is (see :meth:`_Visitor.kind`).
_FREE, _ELEMENTWISE, _OTHER = 0, 1, 2


class _Visitor:
    """One counting pass over a trace (see :func:`count`)."""

    def __init__(self, trace: Trace, handles: HandleTable, user: HandleTable, ancestor_mode: AncestorMode,
                 elementwise: Handle | None, phases: Collection[str], fallback: KernelRule | None,
                 units: list[Unit] | None, tables: bool = True) -> None:
        self.events = trace.events
        self.children = trace.children()
        self.handles, self.user, self.elementwise, self.fallback = handles, user, elementwise, fallback
        self.fallbacks: dict[str, Handle] = {}  # fallback(op), per operator
        self.tally = _Tally({p: {} for p in phases}, units, tables)
        self.unsupported: dict[str, Counter[str]] = {}
        self.ancestors = Ancestors(trace, ancestor_mode)
        self.covered: set[int] = set()
        self.reported: set[int] = set()  # the C-level calls reported (see :meth:`report_call`)
        self.classify = Classifier(trace.op_tags)  # torch's facts about the operators, as the run recorded them
        # Per operator, remembered for this pass (operators repeat event after event): its handle in each mode,
        # and its kind when it has none (see :meth:`kind`).
        self.handle_memo: tuple[dict[str, tuple[Any, bool]], ...] = ({}, {}, {})
        self.kinds: dict[str, int] = {}
        self.results: dict[tuple[Any, ...], tuple[list[Any], str]] = {}  # see :meth:`counted`
        self.ours: dict[int, bool] = {}  # _ours(handle), per handle (by identity)
        self.overloaded: dict[tuple[int, str], Handle] = {}  # see :meth:`at_overload`

    def lookup(self, op: str, mode: int) -> tuple[Any, bool]:
        """The handle of ``op`` in ``mode``, and whether it is a user handle."""
        memo = self.handle_memo[mode]
        found = memo.get(op)
        if found is None:
            found = memo[op] = self._lookup(op, mode)
        return found

    def _lookup(self, op: str, mode: int) -> tuple[Any, bool]:
        if self.user and mode != _CLOSED:
            found = self.user.get(op, _MISSING)
            if found is _MISSING and op.startswith(PYTHON_OP):
                found = self.user.get(PYTHON_OP, _MISSING)  # fvcore's key for every Function
            if found is not _MISSING:
                return found, True
        return (_MISSING if mode == _USER_ONLY else self.handles.get(op, _MISSING)), False

    def visit(self, index: int, caller: int, into: Counter[str] | None, mode: int) -> None:
        """Count event ``index`` and what it ran; ``caller``: the C-level call an unknown operator inside it is
        reported as (its event index; -1: none)."""
        event = self.events[index]
        if event.origin >= 0 and event.phase == "backward" and self.covered_backward(index, into):
            return
        op = key = event.op
        inputs = event.inputs
        alias = fvcore_alias(event, self.events[event.parent] if event.parent >= 0 else None) \
            if self.user and mode != _CLOSED else None
        if alias is not None and alias[0] in self.user and op not in self.user:
            (key, inputs), handle, from_user = alias, self.user[alias[0]], True
        else:
            found = self.handle_memo[mode].get(op)  # (self.lookup, without the call: every event comes here)
            handle, from_user = self.lookup(op, mode) if found is None else found
            if event.python and self.fallback is not None and not from_user:
                handle = _MISSING  # a metric of kernels: Python code runs none of its own
        if handle is None:
            if not from_user and event.python and mode == _OPEN and self.user:
                self.visit_children(index, caller, into, _USER_ONLY)  # user handles of what it called
            return
        if event.kwargs and handle is not _MISSING and not isinstance(handle, CountInside):
            handle = _MISSING  # keyword arguments the schema could not place: the operators it ran know them
        if isinstance(handle, CountInside):
            inside: Counter[str] = Counter()
            self.visit_children(index, -1, inside, _CLOSED)
            self.tally.add(index, event, self.ancestors(event.scope), [(handle.key, sum(inside.values()))], into,
                           dtype=self.call_dtype(index, None))
            return
        if handle is _MISSING:
            if event.level == "function":
                self.look_into(index, caller, into, mode)
                return
            if mode == _USER_ONLY:
                return
            if self.fallback is not None:
                if self.classify.is_view(op):
                    return
                handle = self.fallbacks.get(op)
                if handle is None:
                    handle = self.fallbacks[op] = self.fallback(op)
            else:
                kind = self.kind(op)
                if kind == _FREE:
                    return
                if kind == _OTHER:  # unknown, unless it only did index or mask arithmetic (free)
                    if into is None and not _integer_only(event.outputs):
                        if caller >= 0 and not self.classify.is_free(self.events[caller].op):
                            self.report_call(caller)
                        else:
                            self.report(event, _fvcore_name(self, event))
                    return
                handle = self.elementwise
                if handle is None or _integer_only(event.outputs):
                    return
        if inputs is event.inputs:  # (not an alias's: those its parent placed)
            handle = self.at_overload(handle, event.overload)
        if from_user:  # (the user's code, with arguments an alias may have made: called every time)
            self.tally.add(index, event, self.ancestors(event.scope), _as_items(key, _run(handle, key, inputs,
                                                                                          event.outputs)), into,
                           dtype=self.call_dtype(index, None))
        else:
            items, dtype = self.counted(handle, key, inputs, event.outputs)
            self.tally.add(index, event, self.ancestors(event.scope), items, into, dtype=self.call_dtype(index, dtype))

    def counted(self, handle: Handle, key: str, inputs: list[Any], outputs: list[Any]) -> tuple[list[Any], str]:
        """``_as_items(key, handle(inputs, outputs))`` and the work's dtype (:func:`work_dtype`) of an event's own
        arguments and results, remembered for this pass by their identity when ``handle`` is one of modelmeter's
        formulas (:func:`_ours`).

        The recorder makes one TensorMeta per distinct tensor description, so repeated layers meet the same
        objects. Sound because modelmeter's formulas are pure functions of what they are given, so the same
        objects give the same values; and the trace holds every object keyed on while the pass runs, so no id is
        reused meanwhile (the memo is the pass's own). Other code (a handle the user registered or wrote) is
        called every time, as written."""
        code = id(handle)  # (a handle need not be hashable; the tables hold it while the pass runs)
        ours = self.ours.get(code)
        if ours is None:
            ours = self.ours[code] = _ours(handle)
        if not ours:
            return _as_items(key, _run(handle, key, inputs, outputs)), _work_dtype(inputs, outputs)
        memo_key = (code, key, len(inputs), *map(id, inputs), *map(id, outputs))
        found = self.results.get(memo_key)
        if found is None:
            found = self.results[memo_key] = (_as_items(key, handle(inputs, outputs)), _work_dtype(inputs, outputs))
        return found

    def call_dtype(self, index: int, dtype: str | None) -> str | None:
        """The work dtype of event ``index``: ``dtype`` (its own arguments', None: found when needed), except that a
        user-level call whose result is of another dtype than its first floating-point input takes that of the first
        kernel it ran that computes, whose operands autocast has cast (a ``linear`` called in float32 under bfloat16
        autocast runs its ``addmm`` in bfloat16)."""
        event = self.events[index]
        if event.level != "function" or not self.tally.tables:
            return dtype
        result = _first_floating(event.outputs)
        if result is None or result == (dtype or work_dtype(event)):
            return dtype  # (nothing changed its dtype: its kernels computed in its inputs')
        return self.kernel_dtype(index) or dtype

    def kernel_dtype(self, index: int) -> str | None:
        """:func:`work_dtype` of the first kernel (dispatched operator) call ``index`` ran, in order and inner calls
        included, that is not free (a copy, a cast, a view) and computes in a floating-point dtype; None if none."""
        for child in self.children[index]:
            event = self.events[child]
            if event.level == "function":
                found = self.kernel_dtype(child)
            elif self.kind(event.op) == _FREE:
                continue
            else:
                found = work_dtype(event)
            if found is not None and found != "other":
                return found
        return None

    def at_overload(self, handle: Handle, overload: str) -> Handle:
        """``handle`` for a call that ``overload`` placed (:func:`binding.at_overload`), remembered for this pass."""
        if not overload:
            return handle
        memo_key = (id(handle), overload)  # (the tables hold every handle while the pass runs)
        found = self.overloaded.get(memo_key)
        if found is None:
            found = self.overloaded[memo_key] = at_overload(handle, overload)
        return found

    def kind(self, op: str) -> int:
        """Whether operator ``op`` (without a handle) is free, element-wise or neither (remembered)."""
        found = self.kinds.get(op)
        if found is not None:
            return found
        if self.classify.is_free(op):
            found = _FREE
        elif self.classify.is_elementwise(op):
            found = _ELEMENTWISE
        else:
            found = _OTHER
        self.kinds[op] = found
        return found

    def covered_backward(self, index: int, into: Counter[str] | None) -> bool:
        """Count backward operator ``index`` by its forward call's ``backward:`` formula; False when it has none."""
        event = self.events[index]
        origin = self.events[event.origin]
        whole, _ = self.lookup(backward_key(origin.op), _OPEN)
        if whole is _MISSING or whole is None or isinstance(whole, CountInside):
            return False
        if event.origin not in self.covered:  # a formula of its own: counted once
            self.covered.add(event.origin)
            self.tally.add(index, event, self.ancestors(event.scope),
                           _as_items(origin.op, self.at_overload(whole, origin.overload)(origin.inputs,
                                                                                           origin.outputs)),
                           into, whole_backward=True)
        return True

    def look_into(self, index: int, caller: int, into: Counter[str] | None, mode: int) -> None:
        """Count what a user-level call without a handle ran."""
        event = self.events[index]
        op = event.op
        function = op.startswith(PYTHON_OP)
        if event.python or function or op in CONVOLUTION_CALLS:  # calls fvcore does not record as themselves
            self.visit_children(index, caller, into, mode)
        elif mode != _USER_ONLY:  # (where only user handles count, a C-level call's operators are not theirs)
            known = self.kind(op) != _OTHER  # free or element-wise
            self.visit_children(index, index, into, _CLOSED if known and mode == _OPEN else mode)
        if function and into is None and mode != _USER_ONLY and self.opaque(index):
            self.report(event, op)

    def visit_children(self, index: int, caller: int, into: Counter[str] | None, mode: int) -> None:
        for child in self.children[index]:
            self.visit(child, caller, into, mode)

    def opaque(self, index: int) -> bool:
        """True for a call that returned tensors without running any operator that computes (a Function whose
        forward went through numpy, or an extension whose kernels the recorder cannot see)."""
        if not any(isinstance(value, TensorMeta) for value in self.events[index].outputs):
            return False
        pending = list(self.children[index])
        while pending:
            inner = pending.pop()
            event = self.events[inner]
            if event.level == "dispatch" and _short_name(event.op) not in BRIDGE_OPS:
                return False
            pending.extend(self.children[inner])
        return True

    def report_call(self, index: int) -> None:
        """Report C-level call ``index`` under its own name, once however many unknown operators it ran (fvcore
        counts the calls ``torch.jit`` records: ``torch.linalg.inv`` is one ``aten::linalg_inv``)."""
        if index not in self.reported:
            self.reported.add(index)
            self.report(self.events[index], self.events[index].op)

    def report(self, event: OpEvent, name: str) -> None:
        for module in self.ancestors(event.scope):
            self.unsupported.setdefault(module, Counter())[name] += 1


def _fvcore_name(visitor: _Visitor, event: OpEvent) -> str:
    """The name fvcore reports an operator under (every convolution is ``aten::_convolution``)."""
    alias = fvcore_alias(event, visitor.events[event.parent] if event.parent >= 0 else None)
    return event.op if alias is None else alias[0]


_MISSING: Any = object()


def _ours(handle: Handle) -> bool:
    """True for a handle whose code is modelmeter's own (a function, or a formula bound to an operator, defined in
    the package): a pure function of its arguments. A user's function, or a formula of the user's, is not."""
    formula = getattr(handle, "formula", None)
    code = handle if formula is None else getattr(formula, "fn", None)
    return str(getattr(code, "__module__", "")).startswith("modelmeter.")


def work_dtype(event: OpEvent) -> str:
    """The dtype an operator computed in: its first floating-point input (else output), else ``"other"``."""
    return _work_dtype(event.inputs, event.outputs)


def _work_dtype(inputs: list[Any], outputs: list[Any]) -> str:
    return _first_floating(inputs) or _first_floating(outputs) or "other"


def _first_floating(values: list[Any]) -> str | None:
    """The dtype of the first floating-point tensor among ``values`` (lists walked), or None."""
    for value in values:
        for meta in value if isinstance(value, list) else (value,):
            if isinstance(meta, TensorMeta) and meta.is_floating_point:
                return meta.dtype
    return None


class _Tally:
    """Counts by phase, module and operator, and by module and dtype (and each count as a :class:`Unit`)."""

    def __init__(self, by_phase: dict[str, dict[str, dict[str, Any]]], units: list[Unit] | None,
                 tables: bool = True) -> None:
        self.by_phase = by_phase
        self.dtypes: dict[str, dict[str, Any]] = {}
        self.units = units
        self.tables = tables

    def add(self, index: int, event: OpEvent, modules: Collection[str], items: list[tuple[str, Any]],
            into: Counter[str] | None, whole_backward: bool = False, dtype: str | None = None) -> None:
        """Add ``items`` ((operator key, count) pairs) of event ``index`` to every module of ``modules``, or into
        ``into``; ``dtype`` is the event's :func:`work_dtype` when known."""
        if into is not None:
            for key, count in items:
                into[key] += count
            return
        table, dtypes = self.by_phase[event.phase], self.dtypes
        single = len(items) == 1
        key, total = items[0] if single else ("", sum(v for _, v in items))
        if self.units is not None:
            self.units.append(Unit(index, total, whole_backward, key))
        if not self.tables:
            return
        if dtype is None:
            dtype = work_dtype(event)
        for module in modules:
            counter = table.get(module)
            if counter is None:
                counter = table[module] = {}
            if single:  # most counts: one operator key (the loop below, without its loop)
                counter[key] = counter.get(key, 0) + total
            else:
                for name, count in items:
                    counter[name] = counter.get(name, 0) + count
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
    """True when every output is an integer or boolean tensor (index and mask arithmetic is free); a quantized one
    (``quint8``, ``qint8``...) stands for real numbers, so an operator making it is not free."""
    found = False
    for value in outputs:
        if isinstance(value, TensorMeta):
            if value.is_floating_point or value.dtype.startswith(("qint", "quint")):
                return False
            found = True
    return found


def _as_items(op: str, value: Any) -> list[tuple[str, Any]]:
    """A handle's value as (operator key, count) pairs, each count checked."""
    if isinstance(value, Counter):
        for k, v in value.items():
            if not isinstance(k, str):  # (the results key operators by name; JSON would turn 1 into "1")
                raise InvalidValueError(f"the handle of {op} returned a Counter keyed by {k!r:.40}; its keys are "
                                        "the names the counts are reported under (strings)")
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


def _run(handle: Handle, op: str, inputs: list[Any], outputs: list[Any]) -> Any:
    """What the user's ``handle`` (set or registered for ``op``, or given to ``supported_ops``) returns for one
    call; its own failure (a wrong signature, an assertion on shapes) raised as an error naming the operator."""
    try:
        return handle(inputs, outputs)
    except ModelMeterError:
        raise
    except Exception as exc:
        raise InvalidValueError(f"the handle of {op} ({getattr(handle, '__name__', type(handle).__name__)}) "
                                f"raised {type(exc).__name__}: {exc}"[:500]) from exc


def _check_number(op: str, value: Any) -> None:
    # What handles return, at once (no ABC check); ``not value < 0`` lets a NaN through on purpose: a handle may
    # say "unknown" so, and a result holds it (reports print it as nan).
    if (type(value) is int or type(value) is float) and not value < 0:
        return
    itemsize = getattr(getattr(value, "dtype", None), "itemsize", 8)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or itemsize < 8:
        raise InvalidValueError(f"the handle of {op} returned {value!r} of type {type(value).__name__}; a handle "
                                "must return an int or float (64-bit), or a Counter of them")
    if value < 0:  # (a cost cannot be: a result holding one could not be read back)
        raise InvalidValueError(f"the handle of {op} returned {value!r}; a cost cannot be negative")


class Ancestors:
    """Which modules an event counts toward, per scope (cached: scopes repeat): in ``"owner"`` mode the module
    that owns it and its parents by name, in ``"caller"`` mode every module whose call is on the stack."""

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

    def uncalled(self) -> set[str]:
        """Canonical names of the modules that never ran (in ``"owner"`` mode: neither directly nor through a
        child)."""
        seen = set(self.trace.called)
        if self.mode == "owner":
            for name in self.trace.called:
                seen.update(_prefixes(name))
        return set(self.trace.module_table().canonical) - seen


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
