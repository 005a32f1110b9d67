"""Replay a user-level call seen before in the same run instead of running it again.

A model repeats itself: the same layer on activations of the same shape, dozens or hundreds of times. On meta
tensors, what such a call leaves in the trace depends only on what it was given — its function, the metadata of its
tensors, its other arguments and the grad mode — so every repetition leaves the same events and storages. The first
call is recorded as any other and its record kept as a template (events with indices relative to the call, storage
records with their lifetimes). A later call with the same key appends a copy of the template and returns new meta
tensors made as the first call's outputs were, without running the function or any operator inside it: no function
or dispatch mode round trip per operator, no argument description, no kernel.

Only records that a copy reproduces exactly are kept as templates (:meth:`CallMemo.keep` checks each):

* every tensor argument is a plain meta tensor whose storage the run has seen, without known values (no shadow);
* every operator inside is one whose record depends on metadata alone (:func:`replayable`: none that writes an
  argument, draws random numbers, reads a value or communicates), and nothing was imported, assumed or entered (no
  module ran inside);
* the events are the call's own, in the scope it ran in;
* each output is a fresh tensor on a storage of its own that the call made, exactly as large as its shape needs, and
  every other storage the call made was freed before it returned.

Anything else is recorded every time. The run without replay is the oracle: ``tests/test_replay.py`` compares the
two traces, whole, on many models.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from .._torch_compat import any_autocast_enabled, no_dispatch
from .trace import OpEvent, Storage

if TYPE_CHECKING:
    from .recorder import Recorder

_VALUES = "_modelmeter_values"  # where engine/values.py keeps a tensor's known values
_PLAIN = frozenset({bool, int, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format})
_TENSORS = (torch.Tensor, nn.Parameter)

_enabled = True
_UNSEEN: Any = object()


@contextlib.contextmanager
def replay_disabled() -> Iterator[None]:
    """Record every call, repeated or not (the oracle of the replay's tests)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def replay_enabled() -> bool:
    return _enabled


class _Output(NamedTuple):
    """How to make one output of a replayed call."""

    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype


class _Template:
    """What a call left in the trace: its events (``parent`` relative to the call's first event, -1 for the call's
    own event, whose parent is the call open around it), the storage records it made in order (a temporary's with
    ``born``/``died`` relative to the call; an output's as (the output's index, ``born``)) and how to make its
    outputs (None for an output that was None)."""

    __slots__ = ("events", "outputs", "records", "sequence", "single")

    def __init__(self, events: list[OpEvent], start: int, records: list[Storage | tuple[int, int]],
                 outputs: list[_Output | None], single: bool, sequence: type) -> None:
        self.events = [(e.op, e.level, -1 if i == 0 else e.parent - start, e.inputs, e.outputs, e.kwargs, e.python)
                       for i, e in enumerate(events)]
        self.records = [r if isinstance(r, tuple) else Storage(r.nbytes, r.dtype, r.device, r.kind, r.born - start,
                                                             r.died - start) for r in records]
        self.outputs, self.single, self.sequence = outputs, single, sequence

    def replay(self, rec: Recorder) -> Any:
        """Append the template's record to ``rec``'s trace as a call made now, and return its new outputs."""
        events = rec.trace.events
        start = len(events)
        parent = rec.open_call()
        scope = rec.current_scope()
        for op, level, relative, inputs, outputs, kwargs, python in self.events:
            events.append(OpEvent(op, level, parent if relative < 0 else start + relative, scope, "forward",
                                  list(inputs), list(outputs), dict(kwargs), -1, python))
        with no_dispatch():  # the outputs are made unseen: the events say how they were made
            tensors = [None if o is None else torch.empty_strided(o.shape, o.stride, dtype=o.dtype, device="meta")
                       for o in self.outputs]
        storages = rec.storages
        for record in self.records:
            if isinstance(record, tuple):
                position, born = record
                storages.outputs(tensors[position], start + born)
            else:
                storages.records.append(Storage(record.nbytes, record.dtype, record.device, record.kind,
                                                start + record.born, start + record.died))
        if self.single:
            return tensors[0]
        return self.sequence(tensors)


class Mark(NamedTuple):
    """Where the run stood when a call that may become a template started."""

    events: int
    records: int
    unreplayable: int
    assumptions: int
    called: int
    scope: int
    parent: int
    imports: int


class CallMemo:
    """The templates of one run (a forward pass on meta tensors), by the key of the call that left each."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.templates: dict[tuple[Any, ...], _Template | None] = {}  # None: the call's record cannot be replayed
        self.replayed = 0  # calls replayed (what the tests check happens)

    def key(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
        """The call's key, or None when a call of these arguments is never replayed: a tensor that is not a plain
        meta tensor whose storage the run has seen, an argument that is neither a plain value nor a sequence of
        them and tensors, no tensor at all (made from nothing, its outputs may have known values), autocast on."""
        if not _enabled or any_autocast_enabled():
            return None
        parts = _Parts(self.rec.storages.knows)
        if not parts.add(args) or (kwargs and not parts.add(tuple(kwargs.values()))) or not parts.tensors:
            return None
        return (func, tuple(kwargs), torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                torch.get_default_dtype(), *parts.parts)

    def run(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], record: Callable[[], Any]) -> Any:
        """The result of the call ``func(*args, **kwargs)``: replayed from its template, or ``record()`` (kept as
        the template of calls like it when it can be one)."""
        key = self.key(func, args, kwargs)
        if key is None:
            return record()
        template = self.templates.get(key, _UNSEEN)
        if template is _UNSEEN:
            mark = self.mark()
            result = record()
            if self.rec.imports == mark.imports:  # a call that imported may not the next time: left unseen
                self.templates[key] = _template(self.rec, mark, result)
            return result
        if template is None:
            return record()
        self.replayed += 1
        return template.replay(self.rec)

    def mark(self) -> Mark:
        rec = self.rec
        return Mark(len(rec.trace.events), len(rec.storages.records), rec.unreplayable, len(rec.trace.assumptions),
                    len(rec.trace.called), rec.current_scope(), rec.open_call(), rec.imports)




class _Parts:
    """The parts of a call's key, one per argument: a tensor by its metadata (and whether its values are known:
    then an operator may compute values, engine/values.py), a float by its exact bits (``-0.0 == 0.0``), other
    plain values by type and value (``1 == 1.0 == True``), sequences item by item."""

    __slots__ = ("knows", "parts", "tensors")

    def __init__(self, knows: Callable[[torch.Tensor], bool]) -> None:
        self.knows = knows
        self.parts: list[Any] = []
        self.tensors = 0

    def add(self, items: tuple[Any, ...] | list[Any]) -> bool:
        """Add a key part per item; False when one of them cannot be keyed."""
        parts = self.parts
        for item in items:
            kind = type(item)
            if kind in _TENSORS:
                if not (item.is_meta and item.layout == torch.strided and self.knows(item)):
                    return False
                parts.append((kind, item.shape, item.stride(), item.storage_offset(), item.dtype,
                              item.requires_grad, hasattr(item, _VALUES)))
                self.tensors += 1
            elif kind is float:
                parts.append(item.hex())
            elif kind in _PLAIN:
                parts.append((kind, item))
            elif kind is tuple or kind is list or kind is torch.Size:
                parts.append((kind, len(item)))
                if not self.add(item):
                    return False
            else:
                return False
        return True


def _template(rec: Recorder, mark: Mark, result: Any) -> _Template | None:
    """The template of the call recorded since ``mark`` that returned ``result``, or None when a copy would not be
    the record a run makes."""
    trace, storages = rec.trace, rec.storages
    if (rec.unreplayable != mark.unreplayable or len(trace.assumptions) != mark.assumptions
            or len(trace.called) != mark.called or rec.current_scope() != mark.scope):
        return None  # an operator whose record is not the metadata's alone ran, something was assumed, a module ran
    events = trace.events[mark.events:]
    if not events or events[0].parent != mark.parent or events[0].level != "function":
        return None
    for event in events:
        if event.scope != mark.scope or event.phase != "forward" or event.origin != -1:
            return None
    single = isinstance(result, torch.Tensor)
    tensors = [result] if single else result
    if not single and not (type(result) is list or isinstance(result, tuple)):  # a tuple, or torch.return_types
        return None
    made = storages.records[mark.records:]
    outputs: list[_Output | None] = []
    positions: dict[int, int] = {}  # id(record) -> the output on its storage
    for tensor in tensors:
        if tensor is None and not single:  # an optional output not computed (attention's weights, say)
            outputs.append(None)
            continue
        record = _fresh_output(tensor, storages)
        if record is None or record.kind != "activation" or id(record) in positions \
                or not any(r is record for r in made):
            return None
        positions[id(record)] = len(outputs)
        outputs.append(_Output(tensor.shape, tensor.stride(), tensor.dtype))
    records: list[Storage | tuple[int, int]] = []
    for record in made:
        position = positions.get(id(record))
        if position is not None:
            records.append((position, record.born - mark.events))
        elif record.died >= 0 and record.saved < 0 and record.born >= mark.events:
            records.append(record)  # a temporary, freed inside the call
        else:
            return None  # something the call made lives on beyond its outputs (a cache, a cycle)
    return _Template(events, mark.events, records, outputs, single, type(result))


def _fresh_output(tensor: Any, storages: Any) -> Storage | None:
    """The record of ``tensor``'s storage when ``tensor`` is a plain meta tensor without autograd or known values
    that is the whole of its storage (what ``torch.empty_strided`` of its shape and strides makes); else None."""
    if type(tensor) is not torch.Tensor or not tensor.is_meta or tensor.layout != torch.strided:
        return None
    if tensor.requires_grad or hasattr(tensor, _VALUES) or tensor.storage_offset() != 0:
        return None
    needed = 0 if tensor.numel() == 0 else \
        (1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True)))
    if tensor.untyped_storage().nbytes() != needed * tensor.element_size():
        return None
    return storages.record_of(tensor)


def replayable(func: torch._ops.OpOverload, mutable: bool, collective: bool) -> bool:
    """Whether an aten operator's record depends on its arguments' metadata alone: it writes none of them, draws no
    random numbers, reads no value and communicates nothing."""
    return not (mutable or collective or torch.Tag.nondeterministic_seeded in func.tags
                or torch.Tag.data_dependent_output in func.tags or func is _ITEM)


_ITEM = torch.ops.aten._local_scalar_dense.default
