"""Replay a user-level call seen before in the same run instead of running it again.

A model repeats itself: the same layer on activations of the same shape, dozens or hundreds of times. On meta
tensors, what such a call leaves in the trace depends only on what it was given — its function, the metadata of its
tensors, its other arguments and the grad mode — so every repetition leaves the same events and storages. The first
call is recorded as any other, and its record is kept as a template (events with indices relative to the call, storage
records with their lifetimes): nearly every call of a model has a twin later (a ResNet-50's 53 convolutions have 22
keys), and a template costs less than a second recording. A later call with the same key appends a copy of the
template and returns new meta tensors made as the first call's outputs were, without running the function or any
operator inside it: no function or dispatch mode round trip per operator, no argument description, no kernel.

Only records that a copy reproduces exactly are kept as templates (:func:`_template` checks each):

* every tensor argument is a plain meta tensor whose storage the run has seen; whether its values are known is part
  of the key (an operator on known values computes values, engine/values.py), and so is what a kernel check reads of
  known values (their bounds: an embedding of positions or ids past its table fails, ``values.checked_values``);
* every operator inside is one whose record depends on metadata alone (:func:`replayable`: none draws random numbers,
  reads a value, resizes a storage or communicates; no attention reads a mask's values), nothing was imported or
  assumed, and no module ran inside;
* the events are the call's own, in the scope it ran in;
* each output is either a fresh tensor on a storage of its own that the call made, exactly as large as its shape
  needs, or an argument itself (an in-place operator), or a view of an argument no other argument shares a storage
  with, and neither a negative or conjugate view nor one read as another dtype; every other storage the call made
  was freed before it returned, and none made before it was freed inside it; no output has known values;
* a call that wrote its arguments (an in-place operator, found by their version counters) had none with known
  values: the replay bumps the same version counters.

Anything else is recorded every time. The run without replay is the oracle: ``tests/test_replay.py`` compares the
two traces, whole, on many models.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn
from torch.autograd.graph import increment_version

from .._torch_compat import OpOverload, any_autocast_enabled, no_dispatch, version_counter
from .fast_paths import FastPath
from .storages import StorageTracker
from .trace import OpEvent, Storage, Trace
from .values import checked_values, has_values

_PLAIN = frozenset({bool, int, str, type(None), type(Ellipsis), torch.dtype, torch.device, torch.layout,
                    torch.memory_format})
_TENSORS = (torch.Tensor, nn.Parameter)
_STRIDED = torch.strided
_META = torch.device("meta")  # a device object: a device given by its name is parsed at every call

_PATH = FastPath()
_UNSEEN: Any = object()  # a key not seen yet, or whose call imported a module


def replay_disabled() -> contextlib.AbstractContextManager[None]:
    """Record every call, repeated or not (the oracle of the replay's tests)."""
    return _PATH.off()


class Recording(Protocol):
    """What a replay reads and writes of the recorder (engine/recorder.py's ``Recorder``)."""

    trace: Trace
    storages: StorageTracker
    unreplayable: int  # operators run so far whose record is not their arguments' metadata alone
    imports: int  # operators run so far that imported modules
    guessed_values: list[str]  # every value assumed so far, repeats too (the trace lists each assumption once)

    def open_call(self) -> int: ...

    def current_scope(self) -> int: ...


class _Fresh(NamedTuple):
    """An output the call made, on a new storage of its own."""

    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype


class _View(NamedTuple):
    """An output that views argument ``argument`` (its tensors counted in order) with this shape, strides, offset."""

    argument: int
    shape: torch.Size
    stride: tuple[int, ...]
    offset: int


_Made = _Fresh | _View | int | None  # an output: made, a view, argument ``int`` itself, or None


class _Template:
    """What a call left in the trace: its events (``parent`` relative to the call's first event, -1 for the call's
    own event, whose parent is the call open around it), the storage records it made in order (a temporary's with
    ``born``/``died`` relative to the call; a fresh output's as (the output's index, ``born``)), how to make its
    outputs, and the version counters it bumped (argument, times)."""

    __slots__ = ("bumped", "events", "outputs", "records", "sequence", "single")

    def __init__(self, events: list[OpEvent], start: int, records: list[Storage | tuple[int, int]],
                 outputs: list[_Made], bumped: list[tuple[int, int]], single: bool, sequence: type) -> None:
        self.events = [(e.op, e.level, -1 if i == 0 else e.parent - start, e.inputs, e.outputs, e.kwargs, e.python,
                        e.overload) for i, e in enumerate(events)]
        self.records = [r if isinstance(r, tuple) else Storage(r.nbytes, r.dtype, r.device, r.kind, r.born - start,
                                                             r.died - start) for r in records]
        self.outputs, self.bumped, self.single, self.sequence = outputs, bumped, single, sequence

    def replay(self, rec: Recording, arguments: list[torch.Tensor]) -> Any:
        """Append the template's record to ``rec``'s trace as a call made now on ``arguments`` (the call's tensors,
        in order), and return its outputs."""
        events = rec.trace.events
        start = len(events)
        parent = rec.open_call()
        scope = rec.current_scope()
        for op, level, relative, inputs, outputs, kwargs, python, overload in self.events:  # (lists shared: OpEvent)
            events.append(OpEvent(op, level, parent if relative < 0 else start + relative, scope, "forward",
                                  inputs, outputs, kwargs, -1, python, overload))
        with no_dispatch():  # the outputs are made unseen: the events say how they were made
            tensors = [_made(made, arguments) for made in self.outputs]
        storages = rec.storages
        for record in self.records:
            if isinstance(record, tuple):
                position, born = record
                storages.outputs(tensors[position], start + born)
            else:
                storages.records.append(Storage(record.nbytes, record.dtype, record.device, record.kind,
                                                start + record.born, start + record.died))
        for argument, times in self.bumped:
            for _ in range(times):
                increment_version(arguments[argument])
        if self.single:
            return tensors[0]
        return self.sequence(tensors)


def _made(made: _Made, arguments: list[torch.Tensor]) -> torch.Tensor | None:
    if made is None:
        return None
    if isinstance(made, int):
        return arguments[made]
    if isinstance(made, _View):
        return arguments[made.argument].as_strided(made.shape, made.stride, made.offset)
    return torch.empty_strided(made.shape, made.stride, dtype=made.dtype, device=_META)


class Mark(NamedTuple):
    """Where the run stood when a call that may become a template started, and its tensors' version counters."""

    events: int
    records: int
    unreplayable: int
    assumptions: int
    called: int
    scope: int
    parent: int
    imports: int
    deaths: int
    versions: list[int]


class CallMemo:
    """The templates of one run (a forward pass on meta tensors), by the key of the call that left each."""

    def __init__(self, rec: Recording) -> None:
        self.rec = rec
        # None: the call's record cannot be replayed
        self.templates: dict[tuple[Any, ...], _Template | None] = {}
        self.silent: set[Any] = set()  # functions whose first call ran no operator

    def run(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], record: Callable[[], Any]) -> Any:
        """The result of the call ``func(*args, **kwargs)``: replayed from its template, or ``record()`` (kept as
        the template of calls like it when it can be one)."""
        try:
            silent = func in self.silent
        except TypeError:  # a function that cannot be hashed cannot be a key
            return record()
        if silent or not _PATH.enabled or any_autocast_enabled():
            return record()
        parts = _Parts(self.rec.storages.knows)
        if not parts.add(args) or (kwargs and not parts.add(tuple(kwargs.values()))) or not parts.tensors:
            return record()  # not keyed: see _Parts; a call on no tensor may make known values (engine/values.py)
        key = (func, len(args), tuple(kwargs), torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
               torch.get_default_dtype(), *parts.parts)
        template = self.templates.get(key, _UNSEEN)
        if template is None:
            return record()
        if template is not _UNSEEN:
            return template.replay(self.rec, parts.tensors)
        mark = self._mark(parts.tensors)
        result = record()
        if len(self.rec.trace.events) == mark.events:  # no operator (x.untyped_storage()): not worth a key again
            self.silent.add(func)
        elif self.rec.imports == mark.imports:  # a call that imported may not the next time: left unseen
            self.templates[key] = _template(self.rec, mark, parts, result)
        return result

    def _mark(self, tensors: list[torch.Tensor]) -> Mark:
        rec = self.rec
        return Mark(len(rec.trace.events), len(rec.storages.records), rec.unreplayable, _assumed(rec),
                    len(rec.trace.called), rec.current_scope(), rec.open_call(), rec.imports, rec.storages.deaths,
                    [version_counter(t) for t in tensors])


class _Parts:
    """The parts of a call's key, one per argument: a tensor by its metadata and whether its values are known, a
    float by its exact bits (``-0.0 == 0.0``), other plain values by type and value (``1 == 1.0 == True``),
    sequences item by item; and the call's tensors in order. A tensor that is not a plain real-valued meta tensor
    whose storage the run has seen (nor a negative view), or a value of another kind, cannot be keyed."""

    __slots__ = ("knows", "parts", "tensors", "valued")

    def __init__(self, knows: Callable[[torch.Tensor], bool]) -> None:
        self.knows = knows
        self.parts: list[Any] = []
        self.tensors: list[torch.Tensor] = []
        self.valued = False  # a tensor has known values

    def add(self, items: tuple[Any, ...] | list[Any]) -> bool:
        """Add a key part per item; False when one of them cannot be keyed."""
        parts = self.parts
        for item in items:
            kind = type(item)
            if kind in _PLAIN:
                parts.append(item if kind is int or kind is str else (kind, item))  # ints, strings: kept as they are
            elif kind in _TENSORS:
                if not (item.is_meta and item.layout is _STRIDED and self.knows(item)) or item.dtype.is_complex \
                        or item.is_neg():  # a conjugate or negative view: resolved by operators of its own
                    return False
                valued = has_values(item)
                self.valued = self.valued or valued
                parts.append((kind, item.shape, item.stride(), item.storage_offset(), item.dtype, item.requires_grad,
                              checked_values(item) if valued else None))
                self.tensors.append(item)
            elif kind is float:
                parts.append((float, item.hex()))
            elif kind is slice:  # indexing: x[..., :half]
                bounds = (item.start, item.stop, item.step)
                if not all(type(b) is int or b is None for b in bounds):
                    return False
                parts.append((slice, *bounds))
            elif kind is tuple or kind is list or kind is torch.Size:
                if all(type(k) is int for k in item):  # sizes, strides, paddings: at once
                    parts.append((kind, *item))
                else:  # marked apart from the above: a string first
                    parts.append(("items", kind, len(item)))
                    if not self.add(item):
                        return False
            else:
                return False
        return True


def _assumed(rec: Recording) -> int:
    """How many assumptions the run has made: those the trace lists and every value assumed, repeated ones too."""
    return len(rec.trace.assumptions) + len(rec.guessed_values)


def _template(rec: Recording, mark: Mark, parts: _Parts, result: Any) -> _Template | None:
    """The template of the call on ``parts`` recorded since ``mark`` that returned ``result``, or None when a copy
    would not be the record a run makes (see the module's docstring)."""
    trace = rec.trace
    if (rec.unreplayable != mark.unreplayable or _assumed(rec) != mark.assumptions
            or len(trace.called) != mark.called or rec.current_scope() != mark.scope):
        return None  # an operator whose record is not the metadata's alone ran, something was assumed, a module ran
    events = trace.events[mark.events:]
    if not events or events[0].parent != mark.parent or events[0].level != "function":
        return None
    for event in events:
        if event.scope != mark.scope or event.phase != "forward" or event.origin != -1:
            return None
    versions = [version_counter(t) for t in parts.tensors]
    bumped = [(i, now - before) for i, (now, before) in enumerate(zip(versions, mark.versions, strict=True))
              if now != before]
    if bumped and parts.valued:  # an in-place update forgets the values it overwrote (engine/values.py)
        return None
    single = isinstance(result, torch.Tensor)
    if not single and not (type(result) is list or isinstance(result, tuple)):  # a tuple, or torch.return_types
        return None
    made = rec.storages.records[mark.records:]
    fresh: dict[int, int] = {}  # id(record) -> the fresh output on its storage
    outputs = _outputs([result] if single else result, parts.tensors, rec.storages, made, fresh)
    if outputs is None:
        return None
    records: list[Storage | tuple[int, int]] = []
    if rec.storages.deaths - mark.deaths != sum(1 for record in made if record.died >= 0):
        return None  # a storage made before the call was freed inside it
    for record in made:
        position = fresh.get(id(record))
        if position is not None:
            records.append((position, record.born - mark.events))
        elif record.died >= 0 and record.saved < 0 and record.born >= mark.events:
            records.append(record)  # a temporary, freed inside the call
        else:
            return None  # something the call made lives on beyond its outputs (a cache, a cycle)
    return _Template(events, mark.events, records, outputs, bumped, single, type(result))


def _outputs(tensors: Any, arguments: list[torch.Tensor], storages: StorageTracker, made: list[Storage],
             fresh: dict[int, int]) -> list[_Made] | None:
    """How to make each of a call's outputs again (see :data:`_Made`), or None when one of them cannot be; the
    storage records of the fresh outputs go into ``fresh`` (by identity, with the output's position)."""
    outputs: list[_Made] = []
    for tensor in tensors:
        if tensor is None:  # an optional output not computed (attention's weights, say)
            outputs.append(None)
            continue
        if type(tensor) is not torch.Tensor or not tensor.is_meta or tensor.layout != torch.strided \
                or tensor.requires_grad or has_values(tensor) or tensor.is_neg() or tensor.is_conj():
            return None
        argument = next((i for i, a in enumerate(arguments) if a is tensor), None)
        if argument is not None:
            outputs.append(argument)
            continue
        record = storages.record_of(tensor)
        if record is None:
            return None
        if any(r is record for r in made):
            if record.kind != "activation" or id(record) in fresh or not _whole(tensor):
                return None
            fresh[id(record)] = len(outputs)
            outputs.append(_Fresh(tensor.shape, tensor.stride(), tensor.dtype))
            continue
        viewed = [i for i, a in enumerate(arguments) if storages.record_of(a) is record]
        if len(viewed) != 1 or arguments[viewed[0]].dtype != tensor.dtype:
            return None  # a storage of none of the arguments, or of several (which it views is unknown); or read as
            # another dtype (x.view(torch.int32))
        outputs.append(_View(viewed[0], tensor.shape, tensor.stride(), int(tensor.storage_offset())))
    return outputs


def _whole(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is the whole of its storage: what ``torch.empty_strided`` of its shape and strides makes."""
    if tensor.storage_offset() != 0:
        return False
    needed = 0 if tensor.numel() == 0 else \
        (1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True)))
    return tensor.untyped_storage().nbytes() == needed * tensor.element_size()


def replayable(func: OpOverload, collective: bool) -> bool:
    """Whether an aten operator's record depends on its arguments' metadata alone: it draws no random numbers, reads
    no value, makes no output whose shape is values' (``nonzero``, boolean indexing: meta kernels cannot run them
    today, but a tensor's known values could), changes no storage's size and communicates nothing."""
    tags = func.tags
    return not (collective or torch.Tag.nondeterministic_seeded in tags or torch.Tag.data_dependent_output in tags
                or torch.Tag.dynamic_output_shape in tags or func in _NOT_REPLAYABLE)


# Reading a value; resizing or replacing a tensor's storage (its record's size would change).
_NOT_REPLAYABLE = frozenset({torch.ops.aten._local_scalar_dense.default, *(
    getattr(getattr(torch.ops.aten, name), overload) for name in ("resize_", "resize_as_", "set_")
    for overload in getattr(torch.ops.aten, name).overloads())})
