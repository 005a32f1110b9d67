"""Recordings shared in-process: a second analysis of the same call takes the first one's trace.

fvcore's users write ``FlopCountAnalysis(model, x)`` and then ``ActivationCountAnalysis(model, x)`` (and feed both
to ``flop_count_table``): two analyses, one call. The first recording is kept under a key of everything the run
could depend on that can change between the two — so a later analysis reuses it only when running the model
again could not give another trace:

* the model: every module (by path, so a swapped submodule changes it), its class, ``forward`` and hooks, its
  ``training`` flag and its other attributes (plain values by value, objects walked, functions by code); every
  parameter and buffer by identity, version counter (an in-place change bumps it) and metadata;
* the code the model runs, walked by the persistent cache's own walk (:class:`~.fingerprint.CodeWalk`): its
  classes' methods and class attributes, the globals, helper functions and helper modules that code names, each
  value keyed as an attribute is (a tensor by identity and version counter), so a rebound or mutated global, a
  replaced helper or a changed class attribute changes the key;
* the inputs: their structure, every tensor by identity, version counter and metadata, other values by value;
* the run: execution, backward and loss function, grad and inference mode, autocast, default dtype and device,
  the attention backend switches (what the persistent cache's key covers, ``run_options``).
* the values a run read: a recording whose run read tensor values (a real run, or a fake one that read an input's
  or a buffer's) is kept with a digest of them and shared only while they are the same — a version counter misses
  ``buffer.data.fill_(3)`` and writes through ``.numpy()``.

Counting settings (handles, conventions, ancestor mode) are not part of it: they read the trace, not the run.
An entry also holds where disk caches keep its trace (:attr:`Shared.kept`), so an analysis that shares it keeps
its results beside the same disk entry.
The store holds no strong reference to a model, an input or a loss function (weak references; an entry whose
objects died is dropped, and identities are only trusted while those objects live) and a trace holds no tensors.
At most :data:`MAX_ENTRIES` traces are kept, the least recently used dropped first.
"""

from __future__ import annotations

import enum
import functools
import operator
import os
import threading
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._torch_compat import (
    GRADIENT_HOOKS,
    FakeTensor,
    backward_hooks,
    buffers_of,
    children_of,
    forward_hook_tables,
    parameters_of,
    version_counter,
)
from ..engine.exclusive import RECORDING
from ..engine.gc_pause import no_gc
from ..engine.spec import RunSpec
from ..engine.trace import Trace
from ..engine.values import DREW, index_bounds, watch_given_reads
from .fingerprint import (
    NOT_CODE,
    CodeWalk,
    Uncacheable,
    bytes_digest,
    is_module,
    library,
    namespace_record,
    object_state,
    own_attributes,
    run_options,
)

MAX_ENTRIES = 4
_MAX_DEPTH = 12
_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size, torch.layout,
          torch.memory_format)
# nn.Module's own bookkeeping: parameters, buffers, children and hooks are keyed on their own.
_MODULE_INTERNALS = frozenset(nn.Module().__dict__)
_PLAIN_TYPES = frozenset(_PLAIN)


# Classes found to be installed code through their whole MRO, with their bases in it (see :meth:`_State.klass`;
# the class itself left out, so that the entry does not keep it alive).
_INSTALLED_CLASSES: weakref.WeakKeyDictionary[type, tuple[type, ...]] = weakref.WeakKeyDictionary()


class _Unshareable(Exception):
    """Something in the call cannot be keyed safely (an object without weak references, say): record anew."""


class _State(CodeWalk):
    """The key of one call's state, and the objects whose identities it names (held weakly).

    The user's code the model reaches — its classes' methods and class attributes, the functions, globals and
    helper modules they name — is walked by the persistent key's own walk (:class:`CodeWalk`), each class and
    function once; what that code refers to is keyed here by :meth:`value`, so a rebound global, a mutated
    global container or object, a changed helper or a global tensor changed in place changes the key."""

    def __init__(self, model: nn.Module | None) -> None:
        super().__init__()
        self.model = model
        self._module_ids: set[int] | None = None  # the model's modules' ids, made when a module turns up as a value
        self._refs: dict[int, weakref.ref[Any]] = {}  # id -> a weak reference to the object, one per object
        self._held: list[Any] = []  # every object named, alive for the walk: no id of it names another meanwhile
        self._seen: dict[int, int] = {}  # id -> index of its first appearance (shared objects, cycles)
        self._classes: dict[type, tuple[Any, ...]] = {}  # a module class -> its key (classes repeat)
        self._layouts: dict[type, _Layout] = {}  # a module class -> the layout of the last instance's __dict__

    @property
    def held(self) -> list[Any]:
        """Every object the key names by identity (held by the walk)."""
        return self._held

    @property
    def alive(self) -> list[weakref.ref[Any]]:
        """Weak references to every object the key names by identity."""
        return list(self._refs.values())

    def pack(self, kind: str, fp: Any) -> Any:
        """A function's or class's record as it is: hashing it whole costs less than digesting its text."""
        return (kind, fp)

    def klass(self, cls: type) -> Any:
        """A class as the persistent key walks it; one that is installed code through its whole MRO (torch's,
        transformers'...) by identity instead, which in-process says as much as its name and library versions —
        and costs a look-up, where walking its MRO costs more than the rest of a small model's key."""
        bases = cls.__mro__[1:]
        if _INSTALLED_CLASSES.get(cls) == bases:  # (a class whose bases were reassigned is looked at again)
            self.read_by(cls.__mro__)
            return ("installed class", cls, tuple(map(self.installed_class, cls.__mro__)))
        installed = [base for base in cls.__mro__ if library(base) is not None]
        self.read_by(installed)
        if len(installed) == len(cls.__mro__):
            _INSTALLED_CLASSES[cls] = bases
            return ("installed class", cls, tuple(map(self.installed_class, cls.__mro__)))
        return super().klass(cls)

    def namespaces(self) -> tuple[Any, list[tuple[str, str, Any]]]:
        """The installed modules whose code the call runs, each by its namespace's generation (:class:`_Namespaces`):
        a library function replaced by the user's (``F.linear = mine``) changes it; and the user's code found there
        (walked by :meth:`CodeWalk.reached`)."""
        return NAMESPACES.generations(list(self.libraries.values()))

    def identity(self, obj: Any) -> tuple[str, int]:
        """``obj`` by identity: trusted only while the weak reference taken here lives."""
        return ("id", self._named(obj))

    def _named(self, obj: Any) -> int:
        """``id(obj)``, with a weak reference to ``obj`` taken (:attr:`alive`) and ``obj`` held for the walk."""
        key = id(obj)
        if key not in self._refs:
            try:
                self._refs[key] = weakref.ref(obj)
            except TypeError as exc:
                raise _Unshareable(f"{type(obj).__name__} has no weak references") from exc
            self._held.append(obj)
        return key

    def tensor(self, t: torch.Tensor) -> tuple[Any, ...]:
        """A tensor by identity, version counter (in-place changes), metadata and where its data lives (``.data``
        replaced keeps the object and its version)."""
        if t.is_inference():  # changed in place inside inference_mode without a trace: nothing to key it by
            raise _Unshareable("an inference tensor tracks no version counter")
        try:
            # a FakeTensor's is 0, with a warning (an error under `python -W error`): none, as it has no data
            data = None if isinstance(t, FakeTensor) else t.data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, a subclass without storage
            data = None
        hooks = getattr(t, GRADIENT_HOOKS, None)  # run on its gradient (a parameter's: a fake run's stand-in too)
        ran = (tuple(map(self.value, hooks.values())),) if hooks else ()
        if t.layout == torch.strided:  # (nearly every tensor; the layout is then implied, and the length differs)
            return (self._named(t), version_counter(t), type(t), t.shape, t.stride(), t.storage_offset(), t.dtype,
                    t.device, t.requires_grad, data, *ran)
        return (self._named(t), version_counter(t), type(t), t.shape, t.dtype, t.device, t.layout, t.requires_grad,
                data, *ran)

    def value(self, obj: Any, depth: int = 0) -> Any:
        """A value's state: plain values by value, containers and objects walked, tensors by :meth:`tensor`, code
        by the code walk. Objects Python cannot see into (no ``__dict__``) make the call unshareable."""
        kind = type(obj)
        if kind in _PLAIN_TYPES:  # the exact types first: the common case, at once
            return (kind, obj)
        # Only objects that live through the walk are memoised (no temporaries), and an object met again takes the
        # checks below as it did the first time: looked up before them, as each isinstance() an object fails asks
        # for its __class__ (Python code, where a class overrides __getattribute__: transformers' configs).
        if id(obj) in self._seen:
            return ("seen", self._seen[id(obj)])
        if isinstance(obj, _PLAIN):
            return (kind, obj)
        if isinstance(obj, torch.Tensor):
            return ("tensor", self.tensor(obj))
        if isinstance(obj, enum.Enum):  # its class by its code: the members' values and methods
            return ("enum", self.klass(kind), obj.name)
        if kind is tuple and all(type(x) in _PLAIN_TYPES for x in obj):  # sizes, strides, paddings: at once
            return (kind, obj, tuple(map(type, obj)))  # the types too: 1 == True == 1.0
        code = self.code_value(obj, depth)
        if code is not NOT_CODE:  # (functions and classes are memoised by the code walk)
            return code
        self._seen[id(obj)] = len(self._seen)
        if depth > _MAX_DEPTH:
            raise _Unshareable("the inputs or attributes nest too deep to key")
        return self._compound(obj, kind, depth + 1)

    def _compound(self, obj: Any, kind: type, depth: int) -> Any:
        """A container by its elements, a module of the model by identity, another object by its class (its code,
        as the persistent key walks it) and attributes."""
        if isinstance(obj, (tuple, list)):
            return (kind, tuple(self.value(x, depth) for x in obj))
        if isinstance(obj, (dict, types.MappingProxyType)):  # (a class's __dict__, a dataclass field's metadata)
            return (kind, self.items(obj, depth))
        if isinstance(obj, (set, frozenset)):
            return (kind, frozenset(self.value(x, depth) for x in obj))
        if isinstance(obj, nn.Module) and self.in_model(obj):  # keyed as a child where it is one
            return self.identity(obj)
        if isinstance(obj, (types.MemberDescriptorType, types.GetSetDescriptorType)):  # a slot of a class walked
            return (kind, obj.__qualname__)
        if isinstance(obj, functools.partial):  # what it calls, with what
            return (kind, self.identity(obj), self.value(obj.func, depth), self.value(obj.args, depth),
                    self.value(obj.keywords, depth))
        attributes = object_state(obj)
        if attributes is None:
            raise _Unshareable(f"a {kind.__name__} cannot be looked into")
        weakly = hasattr(obj, "__weakref__")  # else (slots without it) by its attributes alone
        return (kind, self.klass(kind), self.identity(obj) if weakly else None, self.items(attributes, depth))

    def in_model(self, module: nn.Module) -> bool:
        if self._module_ids is None:
            self._module_ids = _module_ids(self.model)
        return id(module) in self._module_ids

    def items(self, mapping: Mapping[Any, Any], depth: int, skip: frozenset[str] = frozenset()) -> tuple[Any, ...]:
        pairs = mapping.items()
        return self.pairs(pairs if not skip else [(k, v) for k, v in pairs if k not in skip], depth)

    def pairs(self, pairs: Iterable[tuple[Any, Any]], depth: int) -> tuple[Any, ...]:
        """Keys and values, each by :meth:`value` (a string key as itself)."""
        value = self.value
        return tuple([((str, k) if type(k) is str else value(k, depth), value(v, depth)) for k, v in pairs])

    def modules(self) -> list[Any]:
        """Every module of the model in pre-order (a shared one under each of its paths), each as :meth:`module`'s
        record, an empty slot as None: the names of a module's children in its record make the list say the tree,
        paths included, as a list of (path, record) would."""
        records: list[Any] = []
        self._walk(self.model, records)
        return records

    def _walk(self, module: nn.Module | None, records: list[Any]) -> None:
        if module is None:
            records.append(None)
            return
        record, children = self.module(module)
        records.append(record)
        for child in children.values():
            self._walk(child, records)

    def module(self, module: nn.Module) -> tuple[tuple[Any, ...], dict[str, nn.Module | None]]:
        """A module's record — the names of its children, its identity, class, flag, hooks, tensors and attributes —
        and its children. Read in a few steps through its class's :class:`_Layout` where that fits (no hooks: nearly
        every module), else by :meth:`walked`, which gives the same record."""
        kind = type(module)
        klass = self._classes.get(kind)
        if klass is None:
            klass = self._classes[kind] = self.module_class(kind)
        attributes = module.__dict__
        layout = self._layouts.get(kind)
        if layout is None or len(attributes) != layout.size:
            layout = self._layouts[kind] = _Layout(kind, attributes)
        try:  # (a __dict__ of as many keys with all of the layout's has the layout's keys)
            training, children, parameters, buffers, pre_hooks, pre_kwargs, hooks, kwargs, always = layout.tables(
                attributes)
            own = layout.values(attributes)
            layout.rest(attributes)
        except KeyError:
            return self.walked(module, klass), children_of(module)
        if pre_hooks or pre_kwargs or hooks or kwargs or always or any(backward_hooks(module)[:2]):
            return self.walked(module, klass), children_of(module)
        return (tuple(children), self._named(module), klass, training, (),
                self.tensors(parameters) if parameters else (), self.tensors(buffers) if buffers else (),
                self.own_values(layout.own, own)), children

    def walked(self, module: nn.Module, klass: tuple[Any, ...]) -> tuple[Any, ...]:
        """:meth:`module`'s record of ``module``, every part read on its own (hooks, another layout)."""
        parameters = parameters_of(module)
        buffers = buffers_of(module)
        return (tuple(children_of(module)), self._named(module), klass, module.training, self.module_hooks(module),
                self.tensors(parameters) if parameters else (), self.tensors(buffers) if buffers else (),
                self.attributes(module.__dict__))

    def attributes(self, attributes: dict[str, Any]) -> tuple[Any, ...]:
        """A module's own attributes (its ``__dict__`` but for :data:`_MODULE_INTERNALS`), by :meth:`own_values`."""
        names = own_attributes(tuple(attributes))
        return self.own_values(names, tuple([attributes[name] for name in names]))

    def own_values(self, names: tuple[str, ...], values: tuple[Any, ...]) -> tuple[Any, ...]:
        """A module's own attributes ``names`` of ``values``: when every one is a plain value, their names, values and
        the values' types (1 == True == 1.0) as three tuples; else each walked by :meth:`value`."""
        if not names:
            return ()
        kinds = tuple(map(type, values))
        if _PLAIN_TYPES.issuperset(kinds):
            return ("plain", names, values, kinds)
        return ("walked", self.pairs(zip(names, values, strict=True), 1))

    def module_class(self, kind: type[nn.Module]) -> tuple[Any, ...]:
        """A module class by its code (:meth:`klass`; an installed one by identity) and its ``forward`` by identity
        (an installed class's ``forward`` replaced in this process)."""
        if issubclass(kind, torch.jit.ScriptModule):  # (its ``forward`` is compiled: the run refuses it, naming it)
            raise _Unshareable("a TorchScript module")
        forward = kind.forward
        code = getattr(forward, "__code__", None)
        return (kind, self.klass(kind), self.identity(forward), None if code is None else self.identity(code))

    def module_hooks(self, module: nn.Module) -> tuple[Any, ...]:
        """A module's forward and backward hooks and their flags (nearly always none: one check)."""
        tables = forward_hook_tables(module)
        if not any(tables[0]) and not any(tables[1]) and not any(backward_hooks(module)[:2]):
            return ()
        return self.hooks(module)

    def tensors(self, table: dict[str, Any]) -> tuple[Any, ...]:
        tensor = self.tensor
        return tuple([(name, None if t is None else tensor(t)) for name, t in table.items()])


def _table_names() -> tuple[str, ...]:
    """The names, in a module's ``__dict__``, of what the key reads of it besides its own attributes: ``training``,
    then its children, parameters and buffers, then its forward pre-hook and forward hook tables — those that
    :mod:`._torch_compat`'s readers return, found on a new module by identity."""
    probe = nn.Module()
    names = {id(value): name for name, value in vars(probe).items()}
    pre_hooks, hooks = forward_hook_tables(probe)
    tables = (children_of(probe), parameters_of(probe), buffers_of(probe), *pre_hooks, *hooks)
    return ("training", *(names[id(table)] for table in tables))


_TABLES = _table_names()  # (nine on every torch this supports: :meth:`_State.module` unpacks them so)


def _unreadable(attributes: dict[str, Any]) -> tuple[Any, ...]:
    raise KeyError("read attribute by attribute")


class _Layout:
    """The keys of a module class's instances' ``__dict__``: how many (``size``), which of them are the module's own
    attributes (``own``, in order), and three readers that take the values of :data:`_TABLES` (``tables``), of the
    own attributes (``values``) and of the other keys (``rest``: nn.Module's internals the key does not read) out of a
    ``__dict__`` of ``size`` keys, each in one step — raising KeyError where it lacks one: its keys are then not
    this layout's (with all of them and as many keys, they are). Remembered per class for one layout, and replaced by
    an instance with another."""

    __slots__ = ("own", "rest", "size", "tables", "values")

    def __init__(self, kind: type, attributes: dict[str, Any]) -> None:
        self.size = len(attributes)
        self.own = own_attributes(tuple(attributes))
        # A class that defines one of the tables' names (a property, say) is read attribute by attribute.
        shadowed = any(name in vars(base) for base in kind.__mro__ for name in _TABLES)
        self.tables: Callable[[dict[str, Any]], tuple[Any, ...]] = (
            _unreadable if shadowed or len(_TABLES) != 9 else operator.itemgetter(*_TABLES))
        self.values = _reader(self.own)
        self.rest = _reader(tuple([key for key in attributes if key not in _TABLES and key not in self.own]))


def _reader(names: tuple[str, ...]) -> Callable[[dict[str, Any]], tuple[Any, ...]]:
    """What takes the values of ``names`` out of a dictionary, as a tuple (KeyError where one is missing)."""
    if not names:
        return lambda attributes: ()
    if len(names) == 1:
        name = names[0]
        return lambda attributes: (attributes[name],)
    return operator.itemgetter(*names)


def _module_ids(model: nn.Module | None) -> set[int]:
    """The ids of every module of the model."""
    found: set[int] = set()
    pending = [model]
    while pending:
        module = pending.pop()
        if module is not None and id(module) not in found:
            found.add(id(module))
            pending.extend(children_of(module).values())
    return found


class _Key:
    """A call's state as a dictionary key: its (large, nested) tuple hashed once — a tuple does not keep its hash,
    and the store looks a key up more than once; equal keys are then compared in full."""

    __slots__ = ("hash", "parts")

    def __init__(self, parts: tuple[Any, ...]) -> None:
        self.parts = parts
        self.hash = hash(parts)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Key) and self.hash == other.hash and self.parts == other.parts


def call_state(spec: RunSpec) -> tuple[_Key, list[weakref.ref[Any]]] | None:
    """The key of running ``spec`` now, and weak references to the objects it names by identity; None when the
    call cannot be keyed safely."""
    state = _call_state(spec)
    return None if state is None else (state[0], state[1])


def _call_state(spec: RunSpec) -> tuple[_Key, list[weakref.ref[Any]], list[Any]] | None:
    """:func:`call_state`, with the objects the key names (held: the caller digests their tensors' values where the
    recording read values, :func:`_values_digest`)."""
    try:
        with no_gc():  # thousands of small tuples, none in a cycle
            state = _State(spec.model)
            key = (run_options(spec.execution), spec.backward,
                   None if spec.loss_fn is None else state.value(spec.loss_fn), state.global_hooks(),
                   tuple(state.modules()),
                   state.value(spec.args), state.value(spec.kwargs),
                   None if spec.parallel is None else spec.parallel.key(),
                   state.reached())  # last: what every piece of code walked above may look up
            # the bounds of integer tensors: a fake run refuses ids past an embedding's table (engine/values.py)
            return _Key((*key, index_bounds(state.held))), state.alive, state.held
    except (_Unshareable, Uncacheable, TypeError):  # (TypeError: something in it cannot be hashed)
        return None


def _values_digest(spec: RunSpec, held: list[Any], real: bool) -> str | None:
    """A digest of the values a recording may have read, for one whose run read values (a real run, or a fake one
    that read an input's or a buffer's: an attention mask, ``.item()`` of a counter): the values of every tensor
    its key names — but the model's parameters for a fake run, which never gives them values (engine/values.py).
    A version counter misses some changes (``buffer.data.fill_(3)``, a write through ``.numpy()``); values do not.
    None when one cannot be read."""
    tensors = [obj for obj in held if isinstance(obj, torch.Tensor)]
    if not real:
        parameters = {id(p) for p in spec.model.parameters()}
        tensors = [t for t in tensors if id(t) not in parameters]
    return bytes_digest(tensors)


@dataclass(frozen=True)
class Shared:
    """A trace of :meth:`SharedRecordings.share`: whether this call ``recorded`` it (else it was shared), and
    ``kept``, what the analyses sharing it know of where disk caches keep it (cache path -> ``StoredTrace``, None
    where that cache does not keep it), one dictionary for all of them."""

    trace: Trace
    recorded: bool
    kept: dict[str, Any] = field(default_factory=dict)


class SharedRecordings:
    """The last few traces recorded in this process, each under the state of the call that made it."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self._entries: OrderedDict[_Key, tuple[list[weakref.ref[Any]], tuple[Shared, str | None, bool]]] = OrderedDict()
        self._max = max_entries
        self._lock = threading.Lock()
        self._aside = threading.local()  # .depth: how many set_aside() blocks this thread is in

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    @contextmanager
    def set_aside(self) -> Iterator[None]:
        """Analyses of this thread inside the block neither take nor keep a shared recording: a cost guard judges
        the model as it runs now, also where the key cannot see a change (a data file, an environment variable)."""
        self._aside.depth = getattr(self._aside, "depth", 0) + 1
        try:
            yield
        finally:
            self._aside.depth -= 1

    def get_or_record(self, spec: RunSpec, record: Callable[[], Trace]) -> Trace:
        """The trace of ``spec``'s call in its state now (see :meth:`share`)."""
        return self.share(spec, record).trace

    def share(self, spec: RunSpec, record: Callable[[], Trace]) -> Shared:
        """The trace of ``spec``'s call in its state now: shared when one was recorded in that state, else
        ``record()``, kept under the state before it ran (a run puts the model back as it found it, and a call
        in another state does not match). A recording whose run read values is kept with a digest of them, and
        shared only while they are the same (:func:`_values_digest`). Keyed, recorded and kept with no other
        thread's run between (engine/exclusive.py)."""
        with RECORDING:
            return self._share(spec, record)

    def _share(self, spec: RunSpec, record: Callable[[], Trace]) -> Shared:
        if getattr(self._aside, "depth", 0):
            return Shared(record(), recorded=True)
        before = _call_state(spec)
        if before is None:
            return Shared(record(), recorded=True)
        key, alive, held = before
        found = self._find(key)
        if found is not None and (found[1] is None or found[1] == _values_digest(spec, held, found[2])):
            return Shared(found[0].trace, recorded=False, kept=found[0].kept)
        with watch_given_reads() as read:
            shared = Shared(record(), recorded=True)
        if DREW in read:  # a run that drew random numbers: the next call draws others
            return shared
        real = shared.trace.execution != "fake"
        values = _values_digest(spec, held, real) if read or real else None
        if values is not None or not (read or real):
            self._keep(key, alive, (shared, values, real))
        return shared

    def _find(self, key: _Key) -> tuple[Shared, str | None, bool] | None:
        """The entry of ``key`` — its recording, the digest of the values it read (None when it read none) and
        whether its run was real — while every object its key names lives (else it is dropped: its identities may
        now name other objects). Only that entry is looked at: another one with dead objects cannot match, and is
        dropped by the next :meth:`_keep`."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if _any_dead(entry[0]):
                del self._entries[key]
                return None
            self._entries.move_to_end(key)
            return entry[1]

    def _keep(self, key: _Key, alive: list[weakref.ref[Any]], entry: tuple[Shared, str | None, bool]) -> None:
        with self._lock:
            self._drop_dead()  # (before the new entry, whose objects the caller holds)
            self._entries[key] = (alive, entry)
            self._entries.move_to_end(key)
            while len(self._entries) > self._max:
                self._entries.popitem(last=False)

    def _drop_dead(self) -> None:
        """Entries whose objects died: their identities may now name other objects."""
        for key in [k for k, (alive, _) in self._entries.items() if _any_dead(alive)]:
            del self._entries[key]


class _Namespace:
    """A module's namespace as last seen: its names and values (held: compared by identity, so an object that
    replaced one cannot be taken for it), its generation, and the installed modules it names (:meth:`_Namespaces.
    generations` reads those too)."""

    __slots__ = ("generation", "module", "named", "names", "users", "values")

    def __init__(self, module: types.ModuleType, generation: int) -> None:
        namespace = vars(module)
        self.module, self.generation = module, generation
        self.names, self.values = list(namespace), list(namespace.values())
        top = module.__name__.partition(".")[0]
        self.named = [value for value in self.values
                      if is_module(value) and value.__name__.partition(".")[0] in (top, "torch")]
        # the user's functions and classes put there (made once per state); a module is a lookup like any other here
        # (one added under a new name, as importing a submodule adds one, changes none)
        self.users = [(name, value) for name, value in namespace_record(module).users if not is_module(value)]

    def same(self, module: types.ModuleType) -> bool | None:
        """Whether ``module`` holds the same objects under the same names as when seen: True; else None where what
        changed changes no lookup — a name bound to a module added (a submodule imported since), a function wrapped
        by torch's own code (importing ``torch._dynamo`` wraps ``torch.manual_seed``) —; else False."""
        namespace = vars(module)
        size = len(self.values)
        if module is not self.module or len(namespace) < size:
            return False
        kept = all(map(operator.is_, namespace.values(), self.values))  # (map stops at the shorter)
        if kept and len(namespace) == size and list(namespace) == self.names:
            return True  # (nearly always: one pass over the values, one over the names)
        names, values = list(namespace), list(namespace.values())
        if names[:size] != self.names:
            return False  # (a name removed: removing one moves every later one up)
        if not kept and not all(map(_rewrapped, values, self.values)):
            return False
        return None if all(map(is_module, values[size:])) else False


def _rewrapped(new: Any, old: Any) -> bool:
    """Whether ``new`` is ``old``, or ``old`` wrapped (``__wrapped__``) by functions of torch's own files only."""
    for _ in range(8):
        if new is old:
            return True
        code = getattr(new, "__code__", None)
        if code is None or not code.co_filename.startswith(_TORCH_DIR):
            return False
        new = getattr(new, "__wrapped__", None)
    return False


_TORCH_DIR = os.path.join(os.path.dirname(torch.__file__), "")  # (as code objects name their files)


class _Namespaces:
    """A generation for each state of every installed module's namespace the in-process key has named: the module
    holding another object under a name, or a name less or more (but a submodule's: importing one adds its name to
    its package), is another state, with a generation of its own; a state seen before (a function the user replaced,
    then put back; ``torch.Storage`` rebound by ``set_default_dtype`` and back) has its generation again.

    An installed class is keyed by identity, not walked (:meth:`_State.klass`), and an installed module the user's
    code names by name: what their code looks up at run time — ``F.linear`` in ``nn.Linear.forward``, ``torch.relu``
    in ``F.relu`` — is read from module namespaces the key did not cover, so a library function the user replaced
    (``torch.nn.functional.linear = mine``) or put back went unseen. The key names the generations of the modules
    those classes are defined in and that the user's code names, and of the modules of torch or of the same package
    those name in turn (``torch.nn.modules.linear`` -> ``torch.nn.functional``, ``torch``): a few thousand
    identity comparisons per key. A replacement deeper than that (a module those reach only through another one:
    ``torch._C._nn``) is not seen. The last :data:`_STATES` states of a module are remembered."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, list[_Namespace]] = {}  # a module's name -> its states, the latest first
        self._made: dict[str, int] = {}  # a module's name -> how many generations it was given

    def generations(self, modules: list[types.ModuleType]) -> tuple[tuple[tuple[str, int], ...],
                                                                      list[tuple[str, str, Any]]]:
        """The generation of each of ``modules`` and of the modules they name, by name; and the user's code found in
        them, each as (module, name, value)."""
        found: dict[str, _Namespace] = {}
        with self._lock:
            for module in modules:
                namespace = found[module.__name__] = self._state_of(module)
                for named in namespace.named:
                    if named.__name__ not in found:
                        found[named.__name__] = self._state_of(named)
        states = sorted(found.items())
        return (tuple((name, state.generation) for name, state in states),
                [(name, user, value) for name, state in states for user, value in state.users])

    def _state_of(self, module: types.ModuleType) -> _Namespace:
        """The state ``module`` is in, the latest first among the states seen."""
        name = module.__name__
        states = self._seen.setdefault(name, [])
        for i, state in enumerate(states):
            same = state.same(module)
            if same is not False:
                if same is None:  # (the same lookups, other contents: seen as they are now)
                    state = _Namespace(module, state.generation)
                del states[i]
                states.insert(0, state)
                return state
        generation = self._made[name] = self._made.get(name, -1) + 1
        states.insert(0, _Namespace(module, generation))
        del states[_STATES:]
        return states[0]


_STATES = 4
#: The namespaces of the installed modules the in-process keys have named.
NAMESPACES = _Namespaces()


def _any_dead(alive: list[weakref.ref[Any]]) -> bool:
    """Whether an object of ``alive`` died; the last first: the call's arguments, walked after the model, are what
    dies first (a new input tensor per call)."""
    return any(ref() is None for ref in reversed(alive))


#: The process's shared recordings (what every :class:`~modelmeter.Session` without a trace of its own asks).
SHARED = SharedRecordings()
