"""Real values of the small tensors a fake run computes from known values alone.

FakeTensors have no values, but some tensors of a model are fully determined without its weights: attention
masks built from ``arange``, the caller's token ids and padding mask, position indices. The fake run follows
them with real kernels on real copies (a *shadow* per fake tensor), so formulas can read what they need —
the attended pairs of a causal or sliding-window mask — and ``.item()`` on such a tensor needs no fallback to
real kernels. A tensor gets a shadow only when every tensor it was computed from has one and it has at most
:data:`LIMIT` elements; anything touched by parameters or activations stays value-free.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .._torch_compat import FakeTensor, OpOverload, disable_current_modes
from .inputs import map_tensors

LIMIT = 1 << 24  # elements: a (1, 1, 4096, 4096) boolean mask is 16 MiB
_CPU = torch.device("cpu")
_VALUES = "_modelmeter_values"  # the attribute of a fake tensor that holds its values
_GIVEN = "_modelmeter_given"  # marks a fake tensor whose values derive from the caller's (an input's, a buffer's)
# marks a fake tensor that holds exactly the values of one of the caller's tensors — its stand-in, or a view, reshape
# or copy of it —, whose least and greatest values the caches key (:func:`index_bounds`)
_WHOLE = "_modelmeter_whole"
#: The lists of the :func:`watch_given_reads` blocks open, in every thread (a run may read values in threads it
#: starts; a read in another analysis's thread marks this one too, which only costs a cache entry).
_WATCHERS: dict[int, list[str]] = {}  # id -> the list (lists compare by value)
READ = "read"  # what a watcher holds once the run read values derived from the caller's tensors
DREW = "drew"  # once the run drew random numbers from the caller's generators


@contextmanager
def watch_given_reads() -> Iterator[list[str]]:
    """A list that holds :data:`READ` once the run inside read (``.item()``, an attention mask's summary) values
    derived from the caller's tensors — inputs, buffers, tensor attributes —, and :data:`DREW` once it drew random
    numbers (``torch.rand``, ``random.random()``: :func:`note_random_draws`), either of which may then have steered
    the trace: the caches' keys cover the tensors' metadata, not their values, nor the generators' states. Blocks nest
    (the disk cache's in the shared one's)."""
    read: list[str] = []
    _WATCHERS[id(read)] = read
    try:
        yield read
    finally:
        del _WATCHERS[id(read)]


def _note_read(tensor: torch.Tensor) -> None:
    if getattr(tensor, _GIVEN, False):
        _note(READ)


def note_held_values_read(tensors: list[torch.Tensor]) -> None:
    """A fake run read values of real tensors it did not make from known values: those held in an object passed as
    input (a key-value cache's length or mask) or in the model's lists and dicts get no stand-in and run as they
    are, as does what is computed from them. The caches' keys cover their metadata, not their values: another
    length of the same shapes would be served this run's trace. (A real tensor the run made from shapes and
    constants — a CPU mask of a meta run — has a shadow: its values follow from the key.)"""
    for t in tensors:
        if not t.is_meta and not isinstance(t, FakeTensor) and (not hasattr(t, _VALUES) or getattr(t, _GIVEN, False)):
            _note(READ)
            return


def note_random_draws() -> None:
    """The run drew random numbers from the caller's generators (a LayerDrop's ``random.random()``)."""
    _note(DREW)


def _note(what: str) -> None:
    for read in list(_WATCHERS.values()):
        if what not in read:
            read.append(what)


class Shadows:
    """Fake tensor -> a real tensor with its values (on the CPU), for the tensors whose values are known.

    The values hang on the fake tensor itself (an attribute of the run's own stand-ins and outputs, never of the
    caller's tensors): they live exactly as long as it, and finding out that a tensor has none — the question
    asked of every operand of every operator — is one attribute lookup.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # seeds to copy (inside seeding())

    @contextmanager
    def seeding(self) -> Iterator[None]:
        """Seeds given inside are copied together when it ends: setting the modes aside costs more than copying a
        small tensor, and a model has hundreds of small buffers. Nothing may run the model inside."""
        self._pending = []
        try:
            yield
            _copy_values(self._pending)
        finally:
            self._pending = None

    def seed(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        """``fake`` stands for the real tensor ``real`` (an input, a buffer): its values are known."""
        if real.is_meta or real.numel() > LIMIT or isinstance(real, FakeTensor):
            return
        if self._pending is not None:
            self._pending.append((fake, real))
        else:
            _copy_values([(fake, real)])

    def get(self, tensor: Any) -> torch.Tensor | None:
        """The values of ``tensor`` when known."""
        if not isinstance(tensor, torch.Tensor):
            return None
        values = getattr(tensor, _VALUES, None)
        if values is None:
            return None
        if _overwritten(values):
            _forget([tensor])
            return None
        _note_read(tensor)
        return values

    def propagate(self, func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any,
                  schema: torch.FunctionSchema, mutable: bool, seeded: bool) -> None:
        """Give ``result`` values when every tensor ``func`` read has them; forget stale values otherwise.
        ``mutable``: ``func`` changes an argument in place (its ``schema`` says so); ``seeded``: it draws random
        numbers (torch's tag; the recorder knows both of every operator)."""
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and not hasattr(first, _VALUES) and not mutable:
            return  # the common case, decided at once: the first operand (an activation, a weight) has no values
        outputs = _tensors(result)
        if not outputs and not mutable:
            return
        # stops at the first tensor without values: most operators read an activation or a parameter first;
        # random numbers are unknown (computed again, they would be other numbers, and the caller's generator moved)
        if not all(map(has_values, _each_tensor((args, kwargs)))) or any(t.numel() > LIMIT for t in outputs) \
                or seeded:
            if mutable:  # an in-place update by unknown values: the old values are wrong now, in every view of them
                _invalidate([*outputs, *written_arguments(schema, args, kwargs)])
            return
        try:
            with disable_current_modes(), torch.no_grad():
                values = func(*_real(args), **_real(kwargs))
        except Exception:  # an operator without a CPU kernel, say: the values stay unknown
            if mutable:
                _invalidate([*outputs, *written_arguments(schema, args, kwargs)])
            else:
                _forget(outputs)
            return
        given = any(getattr(t, _GIVEN, False) for t in _each_tensor((args, kwargs)))
        whole = _whole_dtypes(func, first)
        for fake, real in zip(outputs, _tensors(values), strict=False):
            setattr(fake, _VALUES, real)
            if given:
                setattr(fake, _GIVEN, True)
            if real.dtype in whole:  # (int32 to int64 keeps the values)
                setattr(fake, _WHOLE, True)
            elif hasattr(fake, _WHOLE):  # the caller's ids written over in place: no longer what the caches key
                delattr(fake, _WHOLE)

    def answer(self, func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The result of an operator whose result is made of its operands' values — ``.item()``, ``nonzero``,
        ``unique``, ``masked_select``, indexing by a boolean mask, ``repeat_interleave`` by counts: no meta kernel
        can run them — when every operand's values are known: its tensors stand-ins on the operands' device (meta or
        fake), with the values; None otherwise (the run then assumes a value, or falls back to real kernels)."""
        if not _reads_values(func):
            return None
        tensors = _tensors((args, kwargs))
        note_held_values_read(tensors)  # real kernels read those: the run goes on with their values
        if not tensors or any(self.get(t) is None for t in tensors):  # (a read of the caller's values is noted)
            return None
        with disable_current_modes(), torch.no_grad():
            real = func(*_real(args), **_real(kwargs))
        given = any(getattr(t, _GIVEN, False) for t in tensors)
        return map_tensors(lambda values: _stand_in(values, tensors[0].device, given), real)


def made_bounds(tensor: Any) -> tuple[int | float, int | float] | None:
    """The least and the greatest of ``tensor``'s known values when the model made them from what the caches key —
    shapes and constants (``arange`` of a length) —, not from the caller's tensors; None otherwise, or when it is
    empty. Not noted as a read: such values follow from the key."""
    if not isinstance(tensor, torch.Tensor) or getattr(tensor, _GIVEN, False):
        return None
    return _bounds(tensor)


def _bounds(tensor: torch.Tensor) -> tuple[int | float, int | float] | None:
    """The least and the greatest of ``tensor``'s known values; None when unknown or empty. Read with the run's
    modes set aside (a fake run's FakeTensorMode would take the values for fake ones)."""
    values = getattr(tensor, _VALUES, None)
    if values is None or _overwritten(values) or values.numel() == 0:
        return None
    with disable_current_modes(), torch.no_grad():
        return values.min().item(), values.max().item()


def checked_values(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What a kernel check may read of a tensor whose values are known (engine/kernel_checks.py: the bounds of an
    embedding's indices, and whether they are the model's own, :func:`made_bounds`, or the caller's as given,
    :func:`caller_bounds`): part of a replayed call's key (engine/replay.py), as the same call on other such values
    may fail where the call its template was made of passed."""
    if tensor.dtype not in INDEX_DTYPES:  # (checks read indices only: a BatchNorm's statistics are known values too)
        return ()
    return getattr(tensor, _GIVEN, False), getattr(tensor, _WHOLE, False), _bounds(tensor)


def _whole_dtypes(func: OpOverload, first: Any) -> tuple[torch.dtype, ...]:
    """The dtypes in which ``func``'s outputs hold exactly the values of a caller's tensor ``first`` (a view, reshape
    or copy of it, int32 widened to int64 too); () when they do not."""
    if func not in _SAME_VALUES or not isinstance(first, torch.Tensor) or not getattr(first, _WHOLE, False):
        return ()
    return first.dtype, torch.int64


def caller_bounds(tensor: Any) -> tuple[int | float, int | float] | None:
    """The least and the greatest of ``tensor``'s values when they are exactly those of one of the caller's tensors
    (an input's, a buffer's: its stand-in, or a view, reshape or copy of it), which the caches key
    (:func:`index_bounds`): not noted as a read. None otherwise, or when it is empty."""
    if not isinstance(tensor, torch.Tensor) or not getattr(tensor, _WHOLE, False):
        return None
    return _bounds(tensor)


def index_bounds(tensors: list[Any]) -> tuple[tuple[int, int] | None, ...]:
    """The least and the greatest value of each tensor of ids among ``tensors`` that a fake run follows
    (:func:`_keyed_ids`, with values; None for an empty one), in order: part of the caches' keys,
    since a fake run refuses an embedding of the caller's ids past its table (:func:`caller_bounds`), which of them it
    refuses following from these alone. Other tensors are left out (their values are keyed, or never read)."""
    bounds: list[tuple[int, int] | None] = []
    with disable_current_modes(), torch.no_grad():
        for t in tensors:
            # (the dtype first: most tensors are no ids; a subclass may not take min())
            if type(t) in _PLAIN_TENSORS and t.dtype in INDEX_DTYPES and _keyed_ids(t) and not t.is_meta:
                bounds.append((int(t.min()), int(t.max())) if t.numel() else None)
    return tuple(bounds)


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _keyed_ids(t: torch.Tensor) -> bool:
    """Whether :func:`index_bounds` keys ``t``'s bounds: ids (int64, int32) of at least one dimension and at most
    :data:`LIMIT` elements. A scalar is left out: BatchNorm's ``num_batches_tracked`` counts training steps, and
    would change the key at each (a scalar's values are then not checked as ids either)."""
    return t.dtype in INDEX_DTYPES and t.dim() > 0 and t.layout == torch.strided and t.numel() <= LIMIT


def has_values(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s values are known (it has a shadow, not overwritten by unknown values since)."""
    values = getattr(tensor, _VALUES, None)
    return values is not None and not _overwritten(values)


def written_arguments(schema: torch.FunctionSchema, args: tuple[Any, ...], kwargs: dict[str, Any]
                      ) -> list[torch.Tensor]:
    """The arguments an operator's schema marks as written (``Tensor(a!)``)."""
    written = []
    for i, argument in enumerate(schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            written += _tensors(args[i] if i < len(args) else kwargs.get(argument.name))
    return written


def _copy_values(seeds: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Give each fake tensor a copy of its real tensor's values (on the CPU), with the modes set aside."""
    if not seeds:
        return
    with disable_current_modes(), torch.no_grad():
        for fake, real in seeds:
            setattr(fake, _VALUES, real.detach().to(_CPU, copy=True))
            setattr(fake, _GIVEN, True)
            if type(real) in _PLAIN_TENSORS and _keyed_ids(real):  # as index_bounds keys them
                setattr(fake, _WHOLE, True)


def _each_tensor(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in nested arguments, lazily, in order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _each_tensor(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _each_tensor(v)


def _tensors(value: Any) -> list[torch.Tensor]:
    return list(_each_tensor(value))


def _forget(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        t.__dict__.pop(_VALUES, None)


def _reads_values(func: OpOverload) -> bool:
    """Whether ``func``'s result, or its shape, is made of its operands' values (torch's tags say so)."""
    reads = _READS.get(func)
    if reads is None:
        tags = func.tags
        reads = _READS[func] = torch.Tag.data_dependent_output in tags or torch.Tag.dynamic_output_shape in tags
    return reads


_READS: dict[OpOverload, bool] = {}
INDEX_DTYPES = (torch.int64, torch.int32)  # what embeddings take as ids
_aten = torch.ops.aten
# operators whose output holds exactly the values of their first operand (views, reshapes, copies)
_SAME_VALUES = frozenset({
    _aten.view.default, _aten._unsafe_view.default, _aten.reshape.default, _aten.expand.default, _aten.clone.default,
    _aten.unsqueeze.default, _aten.squeeze.dim, _aten.squeeze.dims, _aten.squeeze.default, _aten.permute.default,
    _aten.t.default, _aten.transpose.int, _aten.alias.default, _aten.detach.default, _aten._to_copy.default,
    _aten.lift_fresh_copy.default})


def _stand_in(values: torch.Tensor, device: torch.device, given: bool) -> torch.Tensor:
    """A tensor without values on ``device`` (meta, or fake under the run's fake mode) as ``values``, which it holds
    as its shadow. Made by an aten call, which the function recorder does not see: it is no call of the model's."""
    stand_in = torch.ops.aten.empty_strided.default(values.shape, values.stride(), dtype=values.dtype, device=device)
    setattr(stand_in, _VALUES, values)
    if given:
        setattr(stand_in, _GIVEN, True)
    return stand_in




def _invalidate(written: list[torch.Tensor]) -> None:
    """Forget the values of tensors written with unknown values, and of every view of them: the shadows of views
    share their base's real storage (real kernels made them), which is emptied, so any shadow on it reads as
    overwritten (:func:`_overwritten`) — a mask changed through a slice must not keep the values it had."""
    for t in written:
        values = t.__dict__.pop(_VALUES, None)
        if values is not None:
            values.untyped_storage().resize_(0)  # a shadow's storage is the run's own (seeds are copies)


def _overwritten(values: torch.Tensor) -> bool:
    """Whether a shadow's storage was emptied by :func:`_invalidate` (its elements must not be read then: a kernel
    on a tensor without data crashes)."""
    return values.numel() > 0 and values.untyped_storage().nbytes() == 0


def _real(value: Any) -> Any:
    """Arguments with fake tensors replaced by their values and devices by the CPU."""
    if isinstance(value, torch.Tensor):
        return getattr(value, _VALUES)
    if isinstance(value, torch.device):
        return _CPU
    if isinstance(value, tuple):
        return tuple(_real(v) for v in value)
    if isinstance(value, list):
        return [_real(v) for v in value]
    if isinstance(value, dict):
        return {k: _real(v) for k, v in value.items()}
    return value
