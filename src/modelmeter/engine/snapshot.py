"""What a model holds, taken before a run and put back after it: analysing a model never changes it.

A forward may keep what it computes: a list of anchors, a cache keyed by the device (``'meta'`` during a fake
run), a buffer registered inside ``forward``, a tensor attribute replaced by a new one. During an analysis those
would be the run's stand-ins (meta or fake tensors) or values the run made, and the model's next real call would
trip over them. :class:`ModelSnapshot` remembers the contents of every table the model's modules hold — their
attribute dictionaries (parameters, buffers, submodules, hooks and plain attributes) and every list, dict and set
reachable from them through lists, tuples, dicts and sets nested to any depth — and puts the original objects
back in place afterwards. Nothing is copied but the tables' entries: the same tensors, lists and dicts are there
after the run as before it. Objects of other classes are not walked.

The snapshot is taken for every analysis, so it is kept cheap for plain models: a module's dozen hook tables,
nearly always all empty, are checked together in one call, and flags and sizes are skipped at once.
"""

from __future__ import annotations

import random
import sys
import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import cache
from itertools import chain
from operator import is_, itemgetter
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from .._torch_compat import MODULE_TABLES, TENSOR_HOOK_TABLES, FakeTensor, disable_current_modes
from ..errors import InvalidValueError

_Table = dict[Any, Any] | list[Any] | set[Any] | deque[Any]
Held = tuple[dict[str, Any], str, torch.Tensor]  # (the table that holds a tensor, its name there, the tensor)


class ModelSnapshot:
    """The contents of every table reachable from ``modules``, their classes, and the ``requires_grad`` and
    ``.grad`` of every leaf tensor there; :meth:`restore` puts them back (after each run, also one that raised).

    ``objects``: objects the run is given besides its tensors (an input's key-value cache): each one's attribute
    dictionary is a table too, and so are those of the objects reachable from it (of any class), with the values
    of the tensors there — a forward that appends to a cache it is passed must leave it as it was.

    Found on the way: where each parameter, buffer and plain tensor attribute of a module is held (what a run
    swaps for a stand-in), whether a module holds a script object (``packed``: a quantized layer's packed
    weights), and ``held_by_objects``: each tensor the objects hold, with the object given (the step's inputs too).
    """

    def __init__(self, modules: list[nn.Module], objects: Iterable[Any] = ()) -> None:
        self.dicts: list[tuple[dict[Any, Any], dict[Any, Any]]] = []  # (a dict, its entries as they were)
        self.sequences: list[tuple[list[Any] | deque[Any], list[Any]]] = []  # lists and deques
        self.sets: list[tuple[set[Any], set[Any]]] = []
        self.empty: list[_Table] = []  # emptied again if the run fills them
        self.hooks: list[tuple[_Table, ...]] = []  # a module's hook tables, all empty
        self.classes = [(module, type(module)) for module in modules]  # a lazy module changes class when called
        self.parameters: list[Held] = []
        self.buffers: list[Held] = []
        self.attributes: list[Held] = []  # tensors a module class keeps as plain attributes
        self.packed = False
        self._tensors: list[torch.Tensor] = []  # the others, in containers
        self._seen = {id(module) for module in modules}
        for module in modules:
            self._module(module)
        held_by_objects = []  # (an object the run is given, a tensor found from it): its input's bytes
        for given in objects:
            first = len(self._tensors)
            self._walk([given], into_objects=True)
            held_by_objects += [(given, t) for t in self._tensors[first:]]
        held = [t for _, _, t in (*self.parameters, *self.buffers, *self.attributes)]
        tensors = {id(t): t for t in (*held, *self._tensors)}.values()
        self.leaves = [(t, t.requires_grad, t.grad) for t in tensors if t.is_leaf]  # what a run may change of them
        self.tensor_hooks = TensorHooks([t for t, _, _ in self.leaves])
        # No run swaps the tensors kept in containers for stand-ins: their values are kept instead. Not those that
        # are parameters, buffers or attributes too (a list of the model's parameters): a copy of every one for
        # every analysis would double the model's memory, and real kernels copy a parameter when it is written
        swapped = {id(t) for t in held}
        self.held_by_objects = [(given, t) for given, t in held_by_objects if id(t) not in swapped]
        self.values = KeptValues(t for t in self._tensors if id(t) not in swapped)

    def _module(self, module: nn.Module) -> None:
        attributes = module.__dict__
        self.dicts.append((attributes, attributes.copy()))
        hooks, held = _hook_tables(attributes), _held_tables(attributes)
        if any(hooks):
            self._walk(hooks)
        else:
            self.hooks.append(hooks)
        for table in held:
            if table:
                self.dicts.append((table, table.copy()))
            else:
                self.empty.append(table)
        parameters, buffers, _ = held  # the submodules are in ``modules`` themselves
        if parameters:
            self.parameters += [(parameters, name, t) for name, t in parameters.items() if t is not None]
        if buffers:
            self.buffers += [(buffers, name, t) for name, t in buffers.items() if t is not None]
        added = attributes.keys() - _MODULE_KEYS  # what its class adds: mostly sizes and flags
        if not _ATOMS.issuperset(map(type, map(attributes.__getitem__, added))):  # a tensor, a cache, a helper module
            self.attributes += [(attributes, name, attributes[name]) for name in added
                                if isinstance(attributes[name], torch.Tensor)]
            self._walk([attributes[name] for name in added])

    def _walk(self, values: Iterable[Any], into_objects: bool = False) -> None:
        """Remember every table, every module kept outside the submodules, and every tensor among ``values`` and
        inside them; ``into_objects``: the attribute dictionaries of objects of other classes too."""
        pending = list(values)
        seen = self._seen
        while pending:
            value = pending.pop()
            kind = type(value)
            if kind in _ATOMS:
                continue
            if kind in _TABLES and not value:
                self.empty.append(value)  # nothing to copy or walk
                continue
            if id(value) in seen:
                continue
            seen.add(id(value))
            if isinstance(value, torch.Tensor):
                self._tensors.append(value)
            elif isinstance(value, nn.Module):  # one kept outside the submodules: its attributes are a table
                self.classes.append((value, kind))
                pending.append(value.__dict__)
            elif isinstance(value, dict):
                self.dicts.append((value, dict(value)))
                pending += value.values()
            elif isinstance(value, (list, deque)):
                self.sequences.append((value, list(value)))
                pending += value
            elif isinstance(value, set):
                self.sets.append((value, set(value)))
                pending += value
            elif isinstance(value, (tuple, frozenset)):  # cannot change, but may hold what can
                pending += value
            elif isinstance(value, torch.ScriptObject):
                self.packed = True
            elif into_objects and not isinstance(value, type) and isinstance(getattr(value, "__dict__", None), dict):
                pending.append(value.__dict__)

    def restore(self) -> None:
        """Put back every entry, class and tensor flag as it was when the snapshot was taken."""
        for table, entries in self.dicts:
            if len(table) != len(entries) or not all(map(is_, table, entries)) \
                    or not all(map(is_, table.values(), entries.values())):
                table.clear()
                table.update(entries)
        for items, saved in self.sequences:
            if len(items) != len(saved) or not all(map(is_, items, saved)):
                items.clear()
                items.extend(saved)
        for members, kept in self.sets:  # rare; put back unasked, so no element is compared with ==
            members.clear()
            members.update(kept)
        for container in self.empty:
            if container:
                container.clear()
        for hooks in self.hooks:
            if any(hooks):
                for container in hooks:
                    container.clear()
        for module, kind in self.classes:
            if type(module) is not kind:
                module.__class__ = kind
        for tensor, requires_grad, grad in self.leaves:
            if tensor.requires_grad != requires_grad:
                tensor.requires_grad_(requires_grad)
            if tensor.grad is not grad:
                tensor.grad = grad
        self.tensor_hooks.restore()
        self.values.restore()


class TensorHooks:
    """The hook tables of some leaf tensors (``register_hook``, ``register_post_accumulate_grad_hook``), put back
    as they were by :meth:`restore`. A forward that sets hooks on the tensors it is given (its parameters under real
    kernels, a caller's input) would otherwise leave them there, to fire in the caller's next step."""

    def __init__(self, leaves: Iterable[torch.Tensor]) -> None:
        self.tables = [(t, name, getattr(t, name)) for t in leaves for name in TENSOR_HOOK_TABLES]
        self.entries = [(table, dict(table)) for _, _, table in self.tables if table is not None]

    def __enter__(self) -> TensorHooks:
        return self

    def __exit__(self, *_: object) -> None:
        self.restore()

    def restore(self) -> None:
        for table, entries in self.entries:
            if table != entries:  # (hook functions compare by identity)
                table.clear()
                table.update(entries)
        for tensor, name, table in self.tables:
            made = getattr(tensor, name)
            if made is not table:  # a table the run made: emptied, so the hook torch keeps for it does nothing
                made.clear()
                setattr(tensor, name, table)


class KeptValues:
    """The values of some tensors, put back after a run that updated them in place.

    For the tensors a run does not swap for stand-ins: those a model keeps in lists and dicts (a CPU operation on
    them runs for real even in a fake run, ``self.totals[0].add_(1)``), and under real kernels the caller's inputs
    and the model's parameters (passed as they are: their identity and aliasing are the model's to see, as in a
    plain call). Each storage is copied when this is made or, ``when_written``, only when :meth:`written` is told
    an operator is about to write it (parameters: copying them all would double a model's memory). :meth:`restore`
    copies the copies back (also a write through ``.data``, which moves no version counter), gives back a tensor's
    own data where ``.data`` was replaced, and a leaf's ``requires_grad``. Tensors without a storage of their own
    kind (meta, FakeTensor or other subclasses, sparse, quantized, inference tensors) are left out.
    """

    def __init__(self, tensors: Iterable[torch.Tensor], *, when_written: bool = False) -> None:
        kept = [t for t in {id(t): t for t in tensors}.values() if _has_values(t)]
        self.tensors = [(t, t.detach(), t.requires_grad) for t in kept]  # a detached alias: its data as it is now
        self.storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in kept}
        self.copies: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}
        if not when_written:
            self.written(kept)

    def __enter__(self) -> KeptValues:
        return self

    def __exit__(self, *_: object) -> None:
        self.restore()

    def written(self, tensors: Iterable[torch.Tensor]) -> None:
        """Copy the storages of ``tensors`` that are kept here and not copied yet (before an operator writes
        them)."""
        for tensor in tensors:
            # (a FakeTensor's storage has no address, and torch warns when asked: it cannot be one kept here)
            if tensor.layout != torch.strided or isinstance(tensor, FakeTensor):
                continue
            key = tensor.untyped_storage().data_ptr()
            if key in self.storages and key not in self.copies:
                storage = self.storages[key]
                self.copies[key] = storage, storage.clone()

    def restore(self) -> None:
        for storage, values in self.copies.values():
            if storage.nbytes() == values.nbytes():  # not resized (``resize_``)
                storage.copy_(values)
        for tensor, data, requires_grad in self.tensors:
            if not _same_view(tensor, data):  # ``.data`` replaced
                tensor.data = data
            if tensor.is_leaf and tensor.requires_grad != requires_grad:
                tensor.requires_grad_(requires_grad)


def _same_view(tensor: torch.Tensor, data: torch.Tensor) -> bool:
    """Whether ``tensor`` still views ``data``'s storage as ``data`` does."""
    return bool(tensor.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
                and tensor.dtype == data.dtype and tensor.shape == data.shape and tensor.stride() == data.stride()
                and tensor.storage_offset() == data.storage_offset())


def _has_values(tensor: torch.Tensor) -> bool:
    return (type(tensor) in (torch.Tensor, nn.Parameter) and tensor.layout == torch.strided and not tensor.is_meta
            and not tensor.is_quantized and not tensor.is_inference())


def refuse_uninitialised(model: nn.Module, failure: Exception) -> None:
    """Raise a ValueError that names the parameters and buffers of ``model`` a lazy module has not initialised yet
    (from ``failure``, torch's refusal to use one); return when there are none.

    A lazy module infers their shapes on its first call, which changes their class and the module's: that call is
    the user's to make, never an analysis's. Looked for only once something failed, so a plain analysis pays
    nothing for it.
    """
    tensors = chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))
    names = [name for name, tensor in tensors if is_lazy(tensor)]
    if names:
        uninitialised = ", ".join(names)
        raise InvalidValueError(f"the model has parameters or buffers that are not initialised yet ({uninitialised}): "
                                "a lazy module infers their shapes on its first call, which would change the model; "
                                "call the model once on a sample input before analysing it") from failure


class RandomStates:
    """The states of the random number generators a model's ``forward`` may draw from, taken when made;
    :meth:`restore` puts back those the run drew from.

    A run draws from them as the model's ``forward`` does (dropout in training mode under real kernels,
    ``torch.rand`` on the CPU under any execution, ``random.random()`` for a LayerDrop): without this, the caller's
    next random numbers after an analysis would differ from those it would have drawn, and a run after a failed one
    (the fallback to real kernels) would draw other numbers than the call it stands for, and take another path. The
    CPU generator of torch, Python's ``random`` and numpy's global generator (once numpy is imported) always; the CUDA
    ones only where CUDA was started (a run without it cannot have drawn from them, and starting it here would cost
    seconds).

    The generators are the process's: another thread draws from them meanwhile (a training loop's dropout), and its
    numbers must not be drawn again. So a generator is put back only when the run drew from it. Torch's: the
    recorder saw a seeded operator's real kernel draw from the default generator (it tells :meth:`restore`), or the
    recording thread called ``torch.manual_seed``, ``torch.seed`` or ``torch.set_rng_state``. Python's and numpy's:
    while :meth:`watched`, their module functions (bound methods of one hidden generator each) note the calling
    thread; one that moved with no call seen on another thread (the run drew through a function imported by name
    before) counts as the run's, as before. A generator left as it is becomes the state the next attempt starts from.
    """

    def __init__(self) -> None:
        self.cpu = torch.default_generator.get_state()  # not torch.get_rng_state: a run observes that one's calls
        self.seed = torch.default_generator.initial_seed()  # a seeding (manual_seed, however wrapped) changes it
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.python = _PYTHON_RANDOM.getstate()  # the generator itself: the module's functions may be watched
        numpy = sys.modules.get("numpy")
        self.numpy = None if numpy is None else (numpy, numpy.random.get_state())
        self.thread = threading.get_ident()
        self.drew: dict[bool, set[str]] = {True: set(), False: set()}  # on the recording thread? -> which generators

    def drawn(self) -> bool:
        """Whether a generator moved since the states were taken: random numbers were drawn (by any thread)."""
        if _PYTHON_RANDOM.getstate() != self.python:
            return True
        if self.numpy is not None:
            numpy, state = self.numpy
            if any(not numpy.array_equal(a, b) for a, b in zip(_numpy_random(numpy).get_state(), state, strict=True)):
                return True
        with disable_current_modes():  # the states are real tensors, also inside a fake mode (a parallel plan's)
            if not torch.equal(torch.default_generator.get_state(), self.cpu):
                return True
            return self.cuda is not None and not all(map(torch.equal, torch.cuda.get_rng_state_all(), self.cuda))

    def restore(self, torch_drawn: bool) -> None:
        """Put back the generators the run drew from (torch's: ``torch_drawn``, told by the recorder); take the
        others' states as they are now, for the next attempt."""
        seeded = torch.default_generator.initial_seed() != self.seed  # (torch._dynamo wraps torch.manual_seed)
        if torch_drawn or seeded or "torch" in self.drew[True]:  # an operator's kernel drew, or the forward seeded it
            torch.default_generator.set_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state_all(self.cuda)
        else:
            self.cpu = torch.default_generator.get_state()
            self.cuda = torch.cuda.get_rng_state_all() if self.cuda is not None else None
        if self._ran("random"):
            _PYTHON_RANDOM.setstate(self.python)
        else:
            self.python = _PYTHON_RANDOM.getstate()
        if self.numpy is not None:
            numpy, state = self.numpy
            if self._ran("numpy"):
                _numpy_random(numpy).set_state(state)
            else:
                self.numpy = numpy, _numpy_random(numpy).get_state()
        self.drew = {True: set(), False: set()}

    def _ran(self, generator: str) -> bool:
        """Whether the run drew from ``generator``: seen drawing on the recording thread, or not seen elsewhere."""
        return generator in self.drew[True] or generator not in self.drew[False]

    @contextmanager
    def watched(self) -> Iterator[None]:
        """While open, the module functions that draw from Python's ``random`` and numpy's global generator, and
        torch's seeding functions (not operators: no recorder sees them), note which thread calls them; replaced on
        their modules where they are the originals (not where the user replaced one), put back when it ends."""
        replaced = [(module, name, original, generator) for module, generator, originals in _watched_functions()
                    for name, original in originals.items() if getattr(module, name, None) is original]
        for module, name, original, generator in replaced:
            setattr(module, name, self._noting(original, generator))
        try:
            yield
        finally:
            for module, name, original, _ in replaced:
                setattr(module, name, original)

    def _noting(self, function: Any, generator: str) -> Any:
        def drawing(*args: Any, **kwargs: Any) -> Any:
            self.drew[threading.get_ident() == self.thread].add(generator)
            return function(*args, **kwargs)
        return drawing


_PYTHON_RANDOM: random.Random = random.random.__self__  # type: ignore[attr-defined]  # the module's generator
_READS = frozenset({"getstate", "get_state"})  # functions of a generator that do not move it
_TORCH_SEEDING = {name: getattr(torch.random, name) for name in ("manual_seed", "seed", "set_rng_state")}


def _numpy_random(numpy: Any) -> Any:
    """numpy's global generator: the one its module functions (``numpy.random.rand``) are bound methods of."""
    return numpy.random.mtrand._rand


def _bound_functions(module: Any, generator: Any) -> dict[str, Any]:
    """The functions of ``module`` that are bound methods of ``generator`` but only read its state."""
    return {name: value for name, value in vars(module).items()
            if getattr(value, "__self__", None) is generator and name not in _READS}


_WATCHED: list[tuple[Any, str, dict[str, Any]]] = [
    (random, "random", _bound_functions(random, _PYTHON_RANDOM)),
    (torch, "torch", _TORCH_SEEDING), (torch.random, "torch", _TORCH_SEEDING)]


def _watched_functions() -> list[tuple[Any, str, dict[str, Any]]]:
    """(module, generator, its original functions by name) for each module :meth:`RandomStates.watched` watches:
    numpy's too once it is imported."""
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return _WATCHED
    return [*_WATCHED, (numpy.random, "numpy", _numpy_functions(numpy.random))]


@cache
def _numpy_functions(module: Any) -> dict[str, Any]:
    """The functions of ``numpy.random`` that move its global generator: its bound methods, and ``seed``."""
    return {**_bound_functions(module, module.mtrand._rand), "seed": module.seed}


@contextmanager
def kept_random_states() -> Iterator[RandomStates]:
    """The random number generators' states (:class:`RandomStates`) as the block began, watched while it runs; the
    Python and numpy ones the block drew from are put back when it ends, also when it raises (a run puts back
    torch's itself: only its recorder sees torch's draws)."""
    states = RandomStates()
    try:
        with states.watched():
            yield states
    finally:
        states.restore(torch_drawn=False)


# Values that hold nothing to walk: skipped at once (most of a module's attributes are flags and sizes).
_ATOMS = frozenset({bool, int, float, complex, str, bytes, type(None), type, torch.dtype, torch.device})
_TABLES = frozenset({dict, OrderedDict, list, set, deque})
# The attributes every nn.Module has; its tables of parameters, buffers and submodules, and of hooks.
_MODULE_KEYS = frozenset(nn.Module().__dict__)
_HELD_KEYS = MODULE_TABLES
_held_tables = itemgetter(*_HELD_KEYS)
_hook_tables = itemgetter(*[name for name, value in nn.Module().__dict__.items()
                            if type(value) in _TABLES and name not in _HELD_KEYS])
