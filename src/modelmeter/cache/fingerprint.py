"""Cache keys: a sha256 of everything a recorded trace depends on, and nothing it does not.

The key covers

* **the model**: every module, by path (shared modules and tied tensors as such), with its class, its
  ``training`` flag, its parameters and buffers (name, shape, dtype, device — meta or real —, layout,
  strides, ``requires_grad``), its forward hooks, and the values of its other attributes (Conv2d ``stride``,
  Dropout ``p``, ``eps``, a config object's fields, ...: plain values, containers and objects are walked;
  tensors contribute their metadata, not their values);
* **the code**: a class or function of an installed library (a file under site-packages or the standard
  library; torch, torchvision, transformers, timm, ...) by its qualified name and the library's version;
  any other code — the user's own, a script, a helper module, an editable install, a class made by
  ``exec`` — by the code objects of every method and the class attributes of every class in its MRO, with
  the functions, classes and values that code refers to by name, in its own module and, through module
  objects (``helper.post(...)``), in every other module of the user's (followed recursively; values are
  hashed by content, a tensor by its bytes);
* **the inputs**: their structure (tuples, lists, dicts, named tuples, objects), tensor metadata and every
  non-tensor value;
* **the run**: ``execution``, grad and inference mode, default dtype and device, autocast, the attention
  backend switches, whether ``parametrize.cached()`` is open; and the versions of modelmeter (with a digest of the
  source that records: engine, parallel runner, torch internals), torch, Python and the trace format.

Code is fingerprinted from the code objects that actually run (byte code, constants, names, defaults,
closures) rather than from ``inspect.getsource``, which reads the file on disk — it may have been edited
since the class was imported, and classes made by ``exec`` have no file at all.

Parameter and input *values* are not part of the key, but for the least and greatest value of each tensor of ids
(a fake run checks the caller's token ids against an embedding's table, ``values.index_bounds``); a tensor's
gradient hooks are (a training step runs them). A fake run never reads a parameter's values; it may read a small
input's, buffer's or tensor attribute's (an attention mask, a counter: ``engine/values.py``), and a trace whose run
did is not stored (:func:`modelmeter.cache.cached_trace`). A run with real kernels (``execution="real"``) may read
any, so for it the bytes of every tensor are hashed too (see :func:`trace_key`).

Where the key cannot be sure — a function compiled from the user's own C extension, an object whose state
Python cannot see — :class:`Uncacheable` is raised and nothing is cached. What static reading cannot see
(a function found by ``getattr`` with a computed name, say) is caught when the trace is recorded:
:func:`watch_code` lists the code objects the run executed, and a trace whose run executed user code the key
does not cover is not stored (:meth:`Key.uncovered`).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
import logging
import os
import re
import site
import sys
import sysconfig
import threading
import time
import types
import weakref
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import _version as modelmeter_version
from .._torch_compat import (
    GRADIENT_HOOKS,
    backward_hooks,
    buffers_of,
    children_of,
    forward_hook_tables,
    global_backward_hooks,
    global_forward_hooks,
    non_persistent_buffers,
    parameters_of,
    parametrizations_cached,
)
from ..engine.naming import named_modules_with_dup
from ..engine.serialize import FORMAT_VERSION, schema_signature
from ..engine.spec import RunSpec
from ..engine.values import index_bounds
from ..errors import ModelMeterError
from ..io.atomic import atomic_write

KEY_VERSION = 2

logger = logging.getLogger("modelmeter.cache")

# Attributes every nn.Module has for its own bookkeeping; parameters, buffers, children and hooks are
# fingerprinted on their own.
_MODULE_INTERNALS = frozenset(nn.Module().__dict__)
_SKIPPED_CLASS_ATTRIBUTES = frozenset({"__dict__", "__weakref__", "__doc__", "__module__", "__qualname__",
                                       "__firstlineno__", "__static_attributes__", "_abc_impl",
                                       "__slotnames__"})  # (copyreg's cache, written by the first copy or pickle)
# Private attributes that record where or when an object was made rather than what it does (transformers'
# GenerationConfig keeps ``_original_object_hash = hash(self)``, torch.compile ``_torchdynamo_wrapper_id``):
# not keyed.
_VOLATILE = re.compile(r"_\w*(hash|uuid|session|timestamp|_time)\w*|_\w*_id", re.IGNORECASE)
_MAX_DEPTH = 6  # how deep attribute values are walked into objects
_MAX_ITEMS = 10_000  # elements of one container fingerprinted (its length always is)
_PLAIN = (type(None), bool, int, float, complex, str, bytes)
_TORCH_VALUES = (torch.dtype, torch.device, torch.layout, torch.memory_format)
_CODE_CACHE: dict[types.CodeType, tuple[str, frozenset[str]]] = {}
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
_MODELMETER_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "")
_TORCH_DIR = os.path.join(os.path.dirname(os.path.realpath(torch.__file__)), "")


class Uncacheable(ModelMeterError):
    """The key cannot be sure to cover what the run depends on (the message says what): nothing is cached."""


def _is_torch(module_name: str | None) -> bool:
    """Code that ships with torch: keyed by torch's version."""
    return module_name is not None and (module_name == "torch" or module_name.startswith("torch."))


def _digest(kind: str, fp: Any) -> str:
    """A compound fingerprint as a short string, so records that refer to it stay small."""
    return f"{kind}:{hashlib.sha256(repr(fp).encode('utf-8', 'backslashreplace')).hexdigest()[:40]}"


def _top(module_name: str | None) -> str:
    return (module_name or "").partition(".")[0]


@functools.lru_cache(maxsize=1)
def _installed_roots() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Directories installed code lives in: (every site-packages, the standard library)."""
    paths = sysconfig.get_paths()
    sites = {paths.get("purelib"), paths.get("platlib")}
    with suppress(Exception):
        sites.update(site.getsitepackages())
    with suppress(Exception):
        sites.add(site.getusersitepackages())
    stdlib = {paths.get("stdlib"), paths.get("platstdlib")}

    def norm(roots: set[str | None]) -> tuple[str, ...]:
        return tuple(sorted(os.path.join(os.path.realpath(r), "") for r in roots if r))

    return norm(sites), norm(stdlib)


@functools.lru_cache(maxsize=4096)
def _installed(path: str) -> str | None:
    """``"site"`` or ``"stdlib"`` for a file of installed code, else None."""
    real = os.path.realpath(path)
    sites, stdlib = _installed_roots()
    if real.startswith(sites):
        return "site"
    return "stdlib" if real.startswith(stdlib) else None


@functools.lru_cache(maxsize=256)
def _version(top: str, path: str) -> str:
    """The installed version of the distribution that provides the top-level package ``top``."""
    version = getattr(sys.modules.get(top), "__version__", None)
    if not isinstance(version, str):
        from importlib import metadata

        try:
            version = metadata.version(top)  # the distribution is usually named as its package
        except Exception:
            try:
                version = ",".join(metadata.version(d) for d in metadata.packages_distributions().get(top, []))
            except Exception:
                version = ""
    if not version:  # no version to go by: the file's size and time stand for its content
        with suppress(OSError):
            st = os.stat(path)
            version = f"{st.st_size}@{st.st_mtime_ns}"
    return f"{top} {version}"


def _code_file(obj: Any) -> str | None:
    """The file the Python code of a function, or of a class's own methods, was compiled from."""
    if isinstance(obj, types.FunctionType):
        return obj.__code__.co_filename
    if isinstance(obj, type):
        own = f"{obj.__qualname__}."
        for member in vars(obj).values():
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            elif isinstance(member, property):
                member = member.fget
            # only a function of the class's own body: an Enum's class holds enum's _generate_next_value_
            if isinstance(member, types.FunctionType) and member.__qualname__.startswith(own):
                return member.__code__.co_filename
    return None


def _owner_module(obj: Any) -> str | None:
    """The module a function or class belongs to; for a method of a built-in type, the type's module."""
    module = getattr(obj, "__module__", None)
    if isinstance(module, str):
        return module
    owner = getattr(obj, "__objclass__", None)
    if owner is None:
        bound = getattr(obj, "__self__", None)
        if isinstance(bound, types.ModuleType):
            return bound.__name__
        owner = None if bound is None else type(bound)
    module = getattr(owner, "__module__", None)
    return module if isinstance(module, str) else None


def _module_library(module: str | None, path: str | None) -> str | None:
    """``"package version"``, ``"stdlib"``, ``"builtin"`` or ``"torch"`` for installed code, None otherwise."""
    if _is_torch(module):
        return "torch"  # torch.__version__ is in every key
    if path is None:  # no Python code of its own: go by its module
        if module in sys.builtin_module_names:
            return "builtin"
        path = _module_file(sys.modules.get(module or ""))
        if not path:
            return None
    where = _installed(path)
    if where is None:
        return None
    return "stdlib" if where == "stdlib" else _version(_top(module), path)  # Python's version is in the key


def _module_file(module: types.ModuleType | None) -> str | None:
    try:
        path = getattr(module, "__file__", None)
    except Exception:  # a namespace that makes what it is asked for: torch.classes' raise RuntimeError for the rest
        return None
    return path if isinstance(path, str) else None


def library(obj: Any) -> str | None:
    """``"package version"`` for a function or class of an installed library (or the standard library, or
    torch), judged by the file its code was compiled from; ``None`` for the user's own code (a script, a
    project, an editable install, ``exec``), whose code objects are fingerprinted instead."""
    return _module_library(_owner_module(obj), _code_file(obj))


@functools.lru_cache(maxsize=4096)
def _user_file(path: str) -> bool:
    """Whether ``path`` holds the user's code: not installed, and neither torch's nor modelmeter's own."""
    return _installed(path) is None and not os.path.realpath(path).startswith((_MODELMETER_DIR, _TORCH_DIR))


def _user_frame(frame: types.FrameType) -> bool:
    """Whether the code a frame runs is the user's: by its file; code made by ``exec`` or ``eval`` by the
    file of the module whose namespace it runs in, else by the code that called it (unknown: the user's)."""
    filename = frame.f_code.co_filename
    if not filename.startswith("<"):
        return _user_file(filename)
    if filename.startswith("<frozen "):  # the standard library's frozen modules
        return False
    name = frame.f_globals.get("__name__")
    if not isinstance(name, str):
        name = ""
    module = sys.modules.get(name)
    if _is_torch(name) or name.startswith("namedtuple_"):  # torch's, or collections.namedtuple's own __new__
        return False
    path = _module_file(module) if isinstance(module, types.ModuleType) else None
    if path is not None:
        return _user_file(path)
    return frame.f_back is None or _user_frame(frame.f_back)  # a module without a file (torch makes some)


def _code(code: types.CodeType) -> tuple[str, frozenset[str]]:
    """A digest of a code object (ignoring file names and line numbers) and the names it may look up: its
    global and attribute names, and string constants that could name one (``getattr(helper, "post")``)."""
    cached = _CODE_CACHE.get(code)
    if cached is not None:
        return cached
    h = hashlib.sha256()
    names = set(code.co_names)
    parts: list[Any] = [code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags,
                        code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars]
    h.update(code.co_code)

    def const(value: Any) -> Any:
        if isinstance(value, types.CodeType):
            digest, inner = _code(value)
            names.update(inner)
            return ("code", digest)
        if isinstance(value, (tuple, list)):
            return tuple(const(v) for v in value)
        if isinstance(value, (frozenset, set)):  # iteration order depends on string hashing: sort
            return ("set", sorted(repr(const(v)) for v in value))
        if isinstance(value, str) and _IDENTIFIER.fullmatch(value):
            names.add(value)
        return repr(value)

    parts.append(tuple(const(c) for c in code.co_consts))
    h.update(repr(parts).encode("utf-8", "backslashreplace"))
    result = (h.hexdigest(), frozenset(names))
    if len(_CODE_CACHE) > 100_000:  # code made on the fly (exec in a loop) must not pile up
        _CODE_CACHE.clear()
    _CODE_CACHE[code] = result
    return result


def _with_nested(codes: set[types.CodeType]) -> frozenset[types.CodeType]:
    """``codes`` and the code objects defined inside them (nested functions, lambdas, comprehensions), which
    are part of their digest."""
    out: set[types.CodeType] = set()
    stack = list(codes)
    while stack:
        code = stack.pop()
        if code not in out:
            out.add(code)
            stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return frozenset(out)


def bytes_digest(tensors: list[torch.Tensor]) -> str | None:
    """A sha256 of the bytes of ``tensors`` (meta tensors have none); None if one cannot be read."""
    h = hashlib.sha256()
    for t in tensors:
        if t.is_meta:
            h.update(b"meta\x00")
            continue
        try:
            data = t.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1).view(torch.uint8)
            h.update(data.numpy().data)
        except Exception:  # sparse, quantized, fake, no numpy...: no key
            return None
        h.update(b"\x00")
    return h.hexdigest()


def object_state(v: Any) -> dict[str, Any] | None:
    """An object's attributes: its ``__dict__`` and the slots of its classes that are set; None for an object
    Python cannot look into (an extension type's)."""
    try:
        state = dict(vars(v))
        has_state = True
    except TypeError:  # no __dict__: slots, or an extension type
        state, has_state = {}, False
    for klass in type(v).__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            has_state = True
            if slot not in ("__dict__", "__weakref__") and hasattr(v, slot):
                state.setdefault(slot, getattr(v, slot))
    return state if has_state else None


def is_module(value: Any) -> bool:
    """By its type: ``isinstance`` would ask a value for its ``__class__`` (a deprecated torch name warns then)."""
    return issubclass(type(value), types.ModuleType)


def _unwrapped(value: Any) -> Any:
    """``value`` without the wrappers torch's own code puts around functions (importing ``torch._dynamo`` wraps
    ``torch.manual_seed``): a process that imported more of torch names the same function."""
    for _ in range(8):
        if not (isinstance(value, types.FunctionType) and value.__code__.co_filename.startswith(_TORCH_DIR)):
            break
        inner = vars(value).get("__wrapped__")
        if inner is None:
            break
        value = inner
    return value


def _users(value: Any) -> bool:
    """Whether a callable found in an installed module's or class's namespace is the user's (put there by the user:
    ``F.gelu = my_gelu``): a function of a user file, or a class or an instance of a class of a module of the user's
    (``__main__``, a script's, a project's). Compiled code (no such module) is the library's."""
    kind = type(value)
    if kind is types.FunctionType:
        return _user_file(value.__code__.co_filename) and _module_library(value.__module__, None) is None
    module = (value if issubclass(kind, type) else kind).__module__
    return isinstance(module, str) and module in sys.modules and _module_library(module, None) is None


@dataclass
class _NamespaceRecord:
    """An installed module's or class's namespace as the keys say it, with the identities of the values it was made
    from (a record is made again when one changed)."""

    names: list[str]
    #: a digest of (name, owner module, qualified name) of each installed callable, a module by its name
    record: str
    users: tuple[tuple[str, Any], ...]  #: the user's code under its names, walked as code by each key
    named: tuple[types.ModuleType, ...]  #: the modules of torch or of its own package it names
    ids: list[int] = field(default_factory=list)  #: the values' ids, trusted while :attr:`held` are alive
    held: list[Any] = field(default_factory=list)  #: the values: weakly where they can be, plain values as such
    died: bool = False  #: whether a value held weakly died (its id may name another object now)

    def hold(self, values: Iterable[Any]) -> None:
        """Keep ``values``' ids, and the values: weakly where they can be (a method's ``__class__`` cell would keep
        its class alive), each weak reference marking the record when its value dies."""
        def died(_: Any) -> None:
            self.died = True

        for value in values:
            self.ids.append(id(value))
            try:
                self.held.append(weakref.ref(value, died))
            except TypeError:  # a plain value held; a descriptor (the class's __dict__ names the class) is not:
                if type(value) in _PLAIN or type(value) is tuple:  # it lives while its class does
                    self.held.append(value)

    def same(self, namespace: Mapping[str, Any]) -> bool:
        return not self.died and list(map(id, namespace.values())) == self.ids and list(namespace) == self.names


#: An installed module's name -> its namespace's record, as last made.
_NAMESPACE_RECORDS: dict[str, _NamespaceRecord] = {}
#: An installed class -> its own namespace's record, as last made (the class not kept alive).
_CLASS_RECORDS: weakref.WeakKeyDictionary[type, _NamespaceRecord] = weakref.WeakKeyDictionary()


def namespace_record(module: types.ModuleType) -> _NamespaceRecord:
    """The record of ``module``'s namespace: what each name holds that the library's code may call — a function
    or class by where it comes from, so ``F.gelu = F.relu`` shows in the name's record, and the user's code
    (``F.gelu = my_gelu``) apart, for the key to walk. Submodules are left out (a process that imported more of a
    package has more of them), and so are plain values. Made once per state of the namespace."""
    kept = _NAMESPACE_RECORDS.get(module.__name__)
    if kept is None or not kept.same(vars(module)):
        kept = _NAMESPACE_RECORDS[module.__name__] = _described(module.__name__, vars(module))
    return kept


def class_record(cls: type) -> _NamespaceRecord:
    """:func:`namespace_record` of an installed class's own namespace: a method the user replaced
    (``nn.Linear.forward = mine``, ``nn.Module._call_impl = ...``) is walked as code, one of the library's put in
    its place named."""
    kept = _CLASS_RECORDS.get(cls)
    if kept is None or not kept.same(vars(cls)):
        kept = _CLASS_RECORDS[cls] = _described(f"{cls.__module__}.{cls.__qualname__}", vars(cls))
    return kept


def _function_of(member: Any) -> Any:
    """The function a class member runs: a static or class method's, a property's getter; else the member."""
    kind = type(member)  # (not isinstance: it asks a deprecated torch name for its __class__, which warns)
    if issubclass(kind, (staticmethod, classmethod)):
        return member.__func__
    if issubclass(kind, property):
        return member.fget
    return member


def _described(name: str, namespace: Mapping[str, Any]) -> _NamespaceRecord:
    """The :class:`_NamespaceRecord` of the namespace ``namespace`` of the module or class ``name``."""
    top = name.partition(".")[0]
    records: list[tuple[Any, ...]] = []
    users: list[tuple[str, Any]] = []
    named: list[types.ModuleType] = []
    for key, member in namespace.items():
        value = _function_of(member)
        if is_module(value):
            if value.__name__ == f"{name}.{key}":
                continue
            if _module_library(value.__name__, _module_file(value)) is None:
                users.append((key, value))
                continue
            records.append((key, "module", value.__name__))
            if value.__name__.partition(".")[0] in (top, "torch"):
                named.append(value)
        elif callable(value):
            target = _unwrapped(value)
            if _users(target):
                users.append((key, target))
            elif issubclass(type(target), (type, types.FunctionType, types.BuiltinFunctionType)):
                records.append((key, _owner_module(target), getattr(target, "__qualname__", None)))
            else:  # an instance: by its class (asking it for names could run its __getattr__: torch.ops)
                records.append((key, "instance", type(target).__module__, type(target).__qualname__))
    made = _NamespaceRecord(list(namespace), _digest("namespace", sorted(records, key=repr)),
                            tuple(sorted(users, key=lambda item: item[0])), tuple(named))
    made.hold(namespace.values())
    return made


NOT_CODE = object()  # what :meth:`CodeWalk.code_value` returns for a value that is not code


class CodeWalk:
    """The walk of the user's code a model reaches, shared by the persistent key (:class:`_Fingerprint`) and the
    in-process one (:mod:`modelmeter.cache.shared`): classes by the members of their MRO, functions by their
    code, defaults, closures and the globals they name, user modules by the names any of that code may look up —
    followed until nothing new turns up. Installed code is named by its library's version instead.

    What the walk reaches that is not code (a constant, a default, a class attribute) is keyed by :meth:`value`,
    which each key defines: by content for the persistent key, by identity and version counter (tensors) or
    content for the in-process one; :meth:`pack` turns a compound record into what the key keeps of it.
    """

    def __init__(self) -> None:
        self.code: set[types.CodeType] = set()  # the user's code objects the key covers
        self._names: set[str] = set()  # every name that code may look up
        self._user_modules: dict[str, types.ModuleType] = {}
        self._memo: dict[Any, tuple[Any, Any]] = {}  # id (with the mode, for values) -> (object kept alive, fp)
        self._as_code = 0
        self.libraries: dict[int, types.ModuleType] = {}  # installed modules whose code the walk reaches, by id
        self._namespaces: dict[str, _NamespaceRecord] = {}  # their records, and those of the modules they name

    def value(self, v: Any, depth: int = 0) -> Any:
        """The key of a value the code refers to (or a model attribute, an input...)."""
        raise NotImplementedError

    def pack(self, kind: str, fp: Any) -> Any:
        """A compound record (a function's, a class's) as the key keeps it: a short digest."""
        return _digest(kind, fp)

    @contextmanager
    def _code_constants(self) -> Iterator[None]:
        self._as_code += 1
        try:
            yield
        finally:
            self._as_code -= 1

    # code ---------------------------------------------------------------------------------------
    def function(self, f: Any) -> Any:
        """A function: by name and version if installed, else its code, defaults, closure and the globals
        it uses."""
        key = id(f)
        if key in self._memo:
            return self._memo[key][1]
        name = f"{_owner_module(f)}.{getattr(f, '__qualname__', getattr(f, '__name__', '?'))}"
        installed = library(f)
        if installed is not None:
            fp: Any = ("function", name, installed)
            self._memo[key] = (f, fp)
            return fp
        if not isinstance(f, types.FunctionType):
            raise Uncacheable(f"{name} is compiled code outside the installed packages (a C extension of your "
                              "own?): the cache key cannot see what it does")
        self._memo[key] = (f, ("recursive function", name))
        self.code.add(f.__code__)
        digest, names = _code(f.__code__)
        self._names.update(names)
        with self._code_constants():
            closure = []
            for cell in f.__closure__ or ():
                try:
                    closure.append(self.value(cell.cell_contents))
                except ValueError:  # an empty cell
                    closure.append("<empty cell>")
            fp = self.pack("function", (name, digest, self.value(f.__defaults__), self.value(f.__kwdefaults__),
                                         tuple(closure), self._globals(f.__globals__, names)))
        self._memo[key] = (f, fp)
        return fp

    def _globals(self, namespace: dict[str, Any], names: frozenset[str]) -> Any:
        """What a function's names refer to in its module (functions, classes, modules, values); a user module
        imported inside the function is found in ``sys.modules``."""
        out: list[Any] = []
        for name in sorted(names):
            if name in namespace:
                out.append((name, self.value(namespace[name])))
                continue
            module = sys.modules.get(name)
            if isinstance(module, types.ModuleType) and _module_library(name, _module_file(module)) is None:
                out.append((name, self.python_module(module)))
        return tuple(out)

    def python_module(self, module: types.ModuleType) -> Any:
        """An installed module by name and version; a user module by name, its contents being keyed at the end
        (:meth:`user_modules`) for every name any code refers to."""
        installed = _module_library(module.__name__, _module_file(module))
        if installed is None:
            self._user_modules.setdefault(module.__name__, module)
        else:
            self.libraries[id(module)] = module
        return ("python module", module.__name__, installed)

    def read_by(self, classes: Iterable[type]) -> None:
        """Note the modules installed ``classes`` are defined in: their code reads those modules' globals
        (``F.linear`` in ``nn.Linear.forward``), which the user may have replaced."""
        modules = sys.modules
        for cls in classes:
            module = modules.get(cls.__module__)
            if module is not None and cls is not object:
                self.libraries[id(module)] = module

    def user_modules(self) -> tuple[Any, ...]:
        """The values, in every user module reached, of every name the user's code may look up — until no
        walked value brings a new module or name (``helper.sub.post(...)``)."""
        done: dict[tuple[str, str], Any] = {}
        while True:
            pending = [(module_name, name) for module_name, module in sorted(self._user_modules.items())
                       for name in sorted(self._names & set(vars(module))) if (module_name, name) not in done]
            if not pending:
                break
            with self._code_constants():
                for module_name, name in pending:
                    done[module_name, name] = self.value(vars(self._user_modules[module_name])[name])
        return tuple(sorted(done.items()))

    def library_namespaces(self) -> dict[str, _NamespaceRecord]:
        """The installed modules the walk reached (:meth:`read_by`, :meth:`python_module`) and the modules of torch
        or of the same package those name (``torch.nn.modules.linear`` -> ``torch.nn.functional``), each by name and
        :func:`namespace_record`: their code looks names up in these namespaces at run time, where the user may have
        put a function of theirs."""
        records = self._namespaces
        for module in list(self.libraries.values()):
            if module.__name__ not in records:
                records[module.__name__] = namespace_record(module)
            for named in records[module.__name__].named:
                if named.__name__ not in records:
                    records[named.__name__] = namespace_record(named)
        return dict(sorted(records.items()))

    def namespaces(self) -> tuple[Any, list[tuple[str, str, Any]]]:
        """The key of :meth:`library_namespaces` (each module's record), and the user's code found there, each as
        (module, name, value)."""
        records = self.library_namespaces()
        return (tuple((name, record.record) for name, record in records.items()),
                [(name, user, value) for name, record in records.items() for user, value in record.users])

    def reached(self) -> tuple[tuple[Any, ...], Any, tuple[Any, ...]]:
        """:meth:`user_modules`, :meth:`namespaces` and the user's code found in those (``F.gelu = my_gelu``: walked
        as code, each by its module and name) — until that code brings no new module or name."""
        while True:
            users = self.user_modules()
            reached = (len(self.libraries), len(self._user_modules), len(self._names))
            namespaces, found = self.namespaces()
            with self._code_constants():
                code = tuple((module, name, self.value(value)) for module, name, value in found)
            if reached == (len(self.libraries), len(self._user_modules), len(self._names)):
                return users, namespaces, code

    def klass(self, cls: type) -> Any:
        """A class: for each class of its MRO outside torch, the code of its methods and its class attributes."""
        key = id(cls)
        if key in self._memo:
            return self._memo[key][1]
        name = f"{cls.__module__}.{cls.__qualname__}"
        self._memo[key] = (cls, ("recursive class", name))
        parts: list[Any] = []
        with self._code_constants():
            for base in cls.__mro__:
                base_name = f"{base.__module__}.{base.__qualname__}"
                installed = library(base)
                if installed is not None:
                    self.read_by((base,))
                    parts.append((base_name, installed, self.installed_class(base)))
                    continue
                body = []
                for attr, member in vars(base).items():
                    if attr in _SKIPPED_CLASS_ATTRIBUTES:
                        continue
                    body.append((attr, self._member(member)))
                parts.append((base_name, tuple(sorted(body, key=lambda item: item[0]))))
        fp = self.pack("class", (name, tuple(parts)))
        self._memo[key] = (cls, fp)
        return fp

    def installed_class(self, cls: type) -> Any:
        """An installed class's own namespace, by :func:`class_record`: the user's code put there walked as code."""
        if cls is object:
            return None
        key = ("installed class", id(cls))
        if key in self._memo:  # (each class once per key: nn.Module is in every module's MRO)
            return self._memo[key][1]
        made = class_record(cls)
        with self._code_constants():
            fp = (made.record, tuple((name, self.value(value)) for name, value in made.users))
        self._memo[key] = (cls, fp)
        return fp

    def _member(self, member: Any) -> Any:
        if isinstance(member, (staticmethod, classmethod)):
            return (type(member).__name__, self.function(member.__func__))
        if isinstance(member, property):
            return ("property", *(self.function(f) if f is not None else None
                                  for f in (member.fget, member.fset, member.fdel)))
        if isinstance(member, functools.cached_property):
            return ("cached_property", self.function(member.func))
        if isinstance(member, types.FunctionType):
            return self.function(member)
        return self.value(member)

    def code_value(self, v: Any, depth: int) -> Any:
        """``v`` keyed as code when it is code — a function, a method (with what it is bound to), a class, a Python
        module, a logger —, else :data:`NOT_CODE`."""
        if isinstance(v, types.FunctionType):
            return self.function(v)
        if isinstance(v, (types.BuiltinFunctionType, types.MethodWrapperType, types.WrapperDescriptorType,
                          types.MethodDescriptorType)):
            bound = getattr(v, "__self__", None)
            if bound is None or isinstance(bound, types.ModuleType):
                return self.function(v)
            return ("method", self.function(v), self.value(bound, depth + 1))  # `table.get` reads `table`
        if isinstance(v, types.MethodType):
            return ("method", self.function(v.__func__), self.value(v.__self__, depth + 1))
        if isinstance(v, type):
            return self.klass(v)
        if isinstance(v, types.ModuleType):
            return self.python_module(v)
        if isinstance(v, logging.Logger):  # its state is the whole logging tree: where messages go, not counts
            return ("logger", v.name)
        return NOT_CODE

    def hooks(self, module: nn.Module) -> Any:
        """A module's forward pre-hooks and hooks, each with its flags, and its backward hooks (:meth:`backward`)."""
        def table(hooks: dict[int, Any], *flags: dict[int, Any]) -> Any:
            return tuple((self.value(h), *(i in f for f in flags)) for i, h in hooks.items())

        return (*(table(*tables) for tables in forward_hook_tables(module)), self.backward(*backward_hooks(module)))

    def backward(self, pre: dict[int, Any], hooks: dict[int, Any], full: bool | None) -> Any:
        """Backward pre-hooks and hooks, and whether they are full ones; None where there are none."""
        if not pre and not hooks:
            return None
        return (tuple(map(self.value, pre.values())), tuple(map(self.value, hooks.values())), full)

    def global_hooks(self) -> tuple[Any, ...]:
        """The forward pre-hooks and hooks, and the backward ones, registered for every module."""
        return (*(tuple(self.value(h) for h in table.values()) for table in global_forward_hooks()),
                self.backward(*global_backward_hooks()))


class _Fingerprint(CodeWalk):
    """Walks a model and its inputs, turning what matters into plain, deterministic records.

    What code refers to (function defaults, closures, globals, class attributes) is walked "as code": there
    tensors count by value, containers are walked whole, and what cannot be walked raises
    :class:`Uncacheable` rather than being summarised by its type.
    """

    def __init__(self) -> None:
        super().__init__()
        self._hash = hashlib.sha256()
        self.module_paths: dict[int, str] = {}
        self.tensors: list[torch.Tensor] = []
        self._tensor_index: dict[int, int] = {}
        self._storage_index: dict[tuple[str, int], int] = {}  # (device, address) -> order of first appearance
        self.constant_tensors: dict[int, torch.Tensor] = {}  # tensors code refers to: keyed by value
        self._active: set[int] = set()

    def add(self, *record: Any) -> None:
        self._hash.update(repr(record).encode("utf-8", "backslashreplace"))
        self._hash.update(b"\x00")

    def add_all(self, records: list[tuple[Any, ...]]) -> None:
        """:meth:`add` of each record, in one update of the digest (the same bytes)."""
        if records:
            self._hash.update("\x00".join(map(repr, records)).encode("utf-8", "backslashreplace") + b"\x00")

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    # tensors ------------------------------------------------------------------------------------
    def tensor(self, t: torch.Tensor) -> Any:
        if self._as_code:
            self.constant_tensors.setdefault(id(t), t)
        index = self._tensor_index.get(id(t))
        if index is not None:
            return ("same tensor as", index)
        self._tensor_index[id(t)] = len(self.tensors)
        self.tensors.append(t)
        try:
            stride: Any = tuple(t.stride()) if t.layout == torch.strided else None
        except (RuntimeError, NotImplementedError):
            stride = None
        kind = type(t)
        subclass = None if kind in _TORCH_TENSOR_TYPES or _is_torch(kind.__module__) else self.klass(kind)
        record = (kind.__qualname__, subclass, tuple(map(int, t.shape)), _text(t.dtype), _text(t.device),
                  _text(t.layout), stride, bool(t.requires_grad), self.storage(t))
        hooks = getattr(t, GRADIENT_HOOKS, None)  # run on its gradient (a parameter's: a fake run's stand-in too)
        return (*record, tuple(map(self.value, hooks.values()))) if hooks else record

    def storage(self, t: torch.Tensor) -> Any:
        """Where a tensor lies in its storage — which of the storages met (views of one base share it, as the run's
        stand-ins do), its size and the tensor's offset —, for a tensor with an address; else None. Two views of a
        large base are one large storage to the run, two tensors of their size two small ones (the peak differs)."""
        try:  # (a wrapper subclass, jagged or a DTensor, has a storage whose address raises)
            storage = t.untyped_storage()
            offset = t.storage_offset()
            nbytes = storage.nbytes()
            if nbytes == 0 or storage.device.type == "meta":  # no address to tell storages apart by
                return None
            address = storage.data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):  # sparse, quantized, a subclass without storage
            return None
        index = self._storage_index.setdefault((_text(storage.device), address), len(self._storage_index))
        return (index, nbytes, offset)

    # values -------------------------------------------------------------------------------------
    def value(self, v: Any, depth: int = 0) -> Any:
        """Any value as plain nested tuples: tensors by metadata (by value as code constants), containers by
        content, objects by state."""
        kind = type(v)
        if kind in _PLAIN:
            return v
        key = (id(v), bool(self._as_code))
        found = self._memo.get(key)
        if found is not None:  # before the checks below, which an object met again takes as it did the first time:
            return found[1]  # each isinstance() it fails asks for its __class__ (Python code in transformers' configs)
        if isinstance(v, torch.Tensor):
            return ("tensor", self.tensor(v))
        if isinstance(v, torch.Size):
            return ("Size", tuple(v))
        if isinstance(v, _TORCH_VALUES):
            return (kind.__name__, str(v))
        if isinstance(v, enum.Enum):
            return ("enum", self.klass(kind), v.name)  # its class by its code: the members' values and methods
        code = self.code_value(v, depth)
        if code is not NOT_CODE:
            return code
        if isinstance(v, nn.Module) and id(v) in self.module_paths:
            return ("submodule", self.module_paths[id(v)])
        if id(v) in self._active:
            return ("cycle", f"{kind.__module__}.{kind.__qualname__}")
        self._active.add(id(v))
        try:
            fp = _digest("value", self._compound(v, depth))
        finally:
            self._active.discard(id(v))
        self._memo[key] = (v, fp)
        return fp

    def _compound(self, v: Any, depth: int) -> Any:
        kind = type(v)
        name = f"{kind.__module__}.{kind.__qualname__}"
        limit = None if self._as_code else _MAX_ITEMS  # a constant is keyed whole
        if isinstance(v, functools.partial):
            return ("partial", self.value(v.func), self.value(v.args, depth), self.value(v.keywords, depth))
        if kind in (list, tuple):
            return (kind.__name__, len(v), tuple(self.value(x, depth) for x in v[:limit]))
        if isinstance(v, dict):
            items = list(v.items())[:limit]
            return ("dict", name, len(v), tuple((self.value(k, depth), self.value(x, depth)) for k, x in items))
        if isinstance(v, (set, frozenset)):
            return ("set", name, len(v), tuple(sorted(repr(self.value(x, depth)) for x in list(v)[:limit])))
        if depth >= _MAX_DEPTH:
            if self._as_code:
                raise Uncacheable(f"a {name} that code refers to is nested more than {_MAX_DEPTH} objects deep")
            return ("object", name)
        if isinstance(v, tuple):  # a named tuple
            return ("tuple", name, tuple(self.value(x, depth + 1) for x in v[:limit]))
        if isinstance(v, list):
            return ("list", name, tuple(self.value(x, depth + 1) for x in v[:limit]))
        return ("object", self.klass(kind), self._state(v, depth + 1))

    def _state(self, v: Any, depth: int) -> Any:
        state = object_state(v)
        if state is None:  # an extension type (a numpy scalar, a compiled regex...): what pickling would keep
            return self._reduced(v, depth)
        return tuple((k, self.value(x, depth)) for k, x in state.items() if not _VOLATILE.fullmatch(str(k)))

    def _reduced(self, v: Any, depth: int) -> Any:
        """An object Python cannot look into, by what its ``__reduce_ex__`` returns (how pickle rebuilds it)."""
        kind = type(v)
        try:
            reduced = v.__reduce_ex__(4)
        except Exception:
            if library(kind) is None:
                raise Uncacheable(f"a {kind.__module__}.{kind.__qualname__} object (an extension type of your "
                                  "own?) has no state the cache key can read") from None
            return ("opaque", library(kind))  # a lock, a file...: an installed type's own business
        if isinstance(reduced, str):
            return ("global", reduced)
        return ("reduced", self.value(tuple(reduced[:3]), depth))

    # the model ----------------------------------------------------------------------------------
    def model(self, model: nn.Module) -> None:
        paths = list(named_modules_with_dup(model))
        for path, module in paths:
            self.module_paths.setdefault(id(module), path)
        records: list[tuple[Any, ...]] = []
        for path, module in paths:
            canonical = self.module_paths[id(module)]
            if canonical != path:
                records.append(("alias", path, canonical))
                continue
            records.append(("module", path, self.klass(type(module)), module.training,
                            self.parameter_records(parameters_of(module)), self.buffer_records(module),
                            tuple([(n, c is None) for n, c in children_of(module).items()]),
                            self.module_hooks(module), self.attribute_records(module.__dict__)))
        self.add_all(records)
        self.add("global hooks", *self.global_hooks())

    def parameter_records(self, table: dict[str, Any]) -> tuple[Any, ...]:
        """A module's parameters: (name, :meth:`tensor` or None) each."""
        tensor = self.tensor
        return tuple([(n, None if p is None else tensor(p)) for n, p in table.items()])

    def buffer_records(self, module: nn.Module) -> tuple[Any, ...]:
        """A module's buffers: (name, :meth:`tensor` or None, whether it is left out of the state dict) each."""
        table = buffers_of(module)
        if not table:
            return ()
        tensor, unsaved = self.tensor, non_persistent_buffers(module)
        return tuple([(n, None if b is None else tensor(b), n in unsaved) for n, b in table.items()])

    def attribute_records(self, attributes: dict[str, Any]) -> tuple[Any, ...]:
        """A module's own attributes but volatile ones (:data:`_VOLATILE`), each by :meth:`value`."""
        value = self.value
        return tuple([(k, value(attributes[k])) for k in own_attributes(tuple(attributes)) if not _volatile(k)])

    def module_hooks(self, module: nn.Module) -> Any:
        """:meth:`hooks`, at once for a module without forward hooks (nearly every one)."""
        pre, hooks = forward_hook_tables(module)
        backward_pre, backward, _ = backward_hooks(module)
        if not pre[0] and not hooks[0] and not backward_pre and not backward:
            return _NO_HOOKS
        return self.hooks(module)


#: The keys of modules' ``__dict__`` met -> those that are not :data:`_MODULE_INTERNALS` (the module's own
#: attributes): keys repeat from module to module.
_OWN_ATTRIBUTES: dict[tuple[Any, ...], tuple[Any, ...]] = {}


def own_attributes(keys: tuple[Any, ...]) -> tuple[Any, ...]:
    """Those of a module's ``__dict__``'s ``keys`` that are its own attributes, in order (remembered)."""
    own = _OWN_ATTRIBUTES.get(keys)
    if own is None:
        if len(_OWN_ATTRIBUTES) >= 4096:  # modules made with attributes named on the fly must not pile up
            _OWN_ATTRIBUTES.clear()
        own = _OWN_ATTRIBUTES[keys] = tuple([key for key in keys if key not in _MODULE_INTERNALS])
    return own


_NO_HOOKS = ((), (), None)  # what :meth:`CodeWalk.hooks` gives for a module without hooks
#: Tensor classes of torch itself (a subclass of another package is keyed by its code): met once per tensor.
_TORCH_TENSOR_TYPES = frozenset({torch.Tensor, nn.Parameter})
_TEXTS: dict[Any, str] = {}  # dtypes, devices and layouts met -> their str(): met once per tensor
#: Attribute names met -> whether they are :data:`_VOLATILE`.
_VOLATILE_NAMES: dict[str, bool] = {}


def _text(value: Any) -> str:
    """``str(value)`` of a dtype, device or layout, remembered."""
    text = _TEXTS.get(value)
    if text is None:
        text = str(value)
        if len(_TEXTS) < 1024:
            _TEXTS[value] = text
    return text


def _volatile(name: str) -> bool:
    """Whether an attribute named ``name`` is volatile (:data:`_VOLATILE`), remembered."""
    volatile = _VOLATILE_NAMES.get(name)
    if volatile is None:
        volatile = _VOLATILE.fullmatch(name) is not None
        if len(_VOLATILE_NAMES) < 65536:  # attributes named on the fly must not pile up
            _VOLATILE_NAMES[name] = volatile
    return volatile


def run_options(execution: str) -> tuple[Any, ...]:
    autocast = []
    for device in ("cpu", "cuda"):
        with suppress(AttributeError, RuntimeError, TypeError):
            autocast.append((device, torch.is_autocast_enabled(device), str(torch.get_autocast_dtype(device))))
    switches = []
    for name in ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled", "cudnn_sdp_enabled"):
        check = getattr(torch.backends.cuda, name, None)
        switches.append((name, check() if callable(check) else None))
    mha = getattr(getattr(torch.backends, "mha", None), "get_fastpath_enabled", None)
    return (execution, torch.is_grad_enabled(), torch.is_inference_mode_enabled(), str(torch.get_default_dtype()),
            str(torch.get_default_device()), tuple(autocast), tuple(switches), mha() if callable(mha) else None,
            parametrizations_cached())


@functools.lru_cache(maxsize=8)
def _recorder_digest(memo_dir: str | None = None) -> str:
    """A digest of the source of what records a trace — modelmeter's engine, the trace format (serialize.py) among
    it, the parallel runner, which writes a plan's part of the trace, and the torch internals both run on — so a
    development checkout that changes how traces are recorded does not read traces of its former self
    (``memo_dir``: see :func:`package_digest`)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        parts = [_source_digest(os.path.join(package, part), memo_dir) for part in _RECORDING_SOURCES]
    except OSError:  # not installed as files (a zip, a frozen app): the version has to do
        return ""
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


_RECORDING_SOURCES = ("engine", "parallel", "_torch_compat.py")  # (the torch internals a recording runs on)


@functools.lru_cache(maxsize=8)
def package_digest(memo_dir: str | None = None) -> str:
    """A digest of the source of the whole modelmeter package, so a result counted by a development checkout is
    not read by another state of it (handles, metrics and reports change counts without changing the version);
    ``""`` where the package is not installed as files.

    Reading the whole source costs a few milliseconds, as much as analysing a small model: with ``memo_dir``
    (a cache directory), the digest is kept there under the files' stats and read back while they match
    (see :func:`_source_digest`)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isdir(root):
        return ""
    try:
        return _source_digest(root, memo_dir)
    except OSError:
        return ""


_SOURCE_MEMO = "modelmeter-source-digest"
_HEX64 = re.compile("[0-9a-f]{64}")
#: Seconds every source file must be old before its digest is kept under its stats: a file's timestamps come
#: from a coarse clock, so a file written in the tick its stats were read could otherwise keep the same stats.
SETTLED_SECONDS = 2.0


def _source_digest(root: str, memo_dir: str | None) -> str:
    """The digest of the ``.py`` files under ``root`` (their paths and contents).

    With ``memo_dir``, the digest of their stats — path, device, inode, size, modification and change times, which
    any write to a file, a rename or a replacement changes (the change time cannot be set back) — is looked up
    first in ``memo_dir``'s memo of ``root``; on a miss the contents are read, and the memo rewritten when every
    file is older than :data:`SETTLED_SECONDS`. A memo that cannot be read or written is ignored."""
    paths = _source_files(root)
    if memo_dir is None:
        return _contents_digest(root, paths)
    stats, newest_ns = _stats_digest(root, paths)
    memo = os.path.join(memo_dir, f"source-digest-{hashlib.sha256(root.encode()).hexdigest()[:16]}.json")
    kept = _read_memo(memo)
    if kept is not None and kept.get("root") == root and kept.get("stats") == stats:
        return str(kept["digest"])
    digest = _contents_digest(root, paths)
    if newest_ns < (time.time() - SETTLED_SECONDS) * 1e9:
        text = json.dumps({"format": _SOURCE_MEMO, "root": root, "stats": stats, "digest": digest})
        with suppress(OSError):
            atomic_write(memo, lambda f: f.write(text.encode()))
    return digest


def _contents_digest(root: str, paths: list[str]) -> str:
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            h.update(path[len(root) + 1:].encode() + b"\x00" + f.read() + b"\x00")
    return h.hexdigest()


def _stats_digest(root: str, paths: list[str]) -> tuple[str, int]:
    """A digest of the stats of ``paths`` (see :func:`_source_digest`), and the latest time one was changed (ns)."""
    h = hashlib.sha256()
    newest_ns = 0
    for path in paths:
        st = os.stat(path)
        newest_ns = max(newest_ns, st.st_ctime_ns, st.st_mtime_ns)
        h.update(f"{path[len(root) + 1:]}\x00{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:"
                 f"{st.st_ctime_ns}\x00".encode())
    return h.hexdigest(), newest_ns


def _source_files(root: str) -> list[str]:
    """The ``.py`` files under ``root`` (or ``root`` itself, a file), in a fixed order, ``__pycache__`` left out."""
    if os.path.isfile(root):
        return [root]
    found = []
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = sorted(d for d in subdirectories if d != "__pycache__")
        found += [os.path.join(directory, name) for name in sorted(n for n in files if n.endswith(".py"))]
    return found


def _read_memo(path: str) -> dict[str, Any] | None:
    """The source digest memo at ``path``; None when there is none or it is not one."""
    try:
        with open(path, "rb") as f:
            kept = json.loads(f.read())
    except (OSError, ValueError):
        return None
    if type(kept) is not dict or kept.get("format") != _SOURCE_MEMO or not _HEX64.fullmatch(str(kept.get("digest"))):
        return None
    return kept


def _versions(memo_dir: str | None) -> tuple[Any, ...]:
    return (KEY_VERSION, FORMAT_VERSION, tuple(sorted(schema_signature().items())), modelmeter_version.__version__,
            _recorder_digest(memo_dir), torch.__version__, sys.version)


@dataclass(frozen=True)
class Key:
    """A cache key and the user code it covers."""

    digest: str  #: 64 hex digits
    code: frozenset[types.CodeType] = field(repr=False)  #: the user's code objects fingerprinted, nested ones too

    def uncovered(self, executed: dict[types.CodeType, bool]) -> list[str]:
        """The user code among ``executed`` (what :func:`watch_code` saw) that the key does not cover, as
        ``file:line qualified name``, sorted."""
        return sorted(f"{code.co_filename}:{code.co_firstlineno} {getattr(code, 'co_qualname', code.co_name)}"
                      for code, user in executed.items() if user and code not in self.code)


def cache_key(spec: RunSpec, memo_dir: str | None = None) -> Key:
    """The cache key of running ``spec`` — ``model(*args, **kwargs)`` with ``execution`` (and a backward pass of
    ``loss_fn``, when ``backward``) — with the code it covers; :class:`Uncacheable` when it cannot be sure.
    ``memo_dir``: where the digest of modelmeter's engine source may be kept (see :func:`package_digest`).

    For ``execution="real"`` the values of every tensor (parameters, buffers, tensor attributes, inputs)
    are hashed as well, since real kernels may depend on them.
    """
    execution = spec.execution
    fp = _Fingerprint()
    fp.model(spec.model)
    fp.add("inputs", fp.value((spec.args, spec.kwargs)))
    fp.add("run", run_options(execution))
    if spec.parallel is not None:
        fp.add("parallel", spec.parallel.key())
    if spec.backward:
        fp.add("backward", None if spec.loss_fn is None else fp.value(spec.loss_fn))
    users, namespaces, code = fp.reached()
    fp.add("user modules", users)
    fp.add("library namespaces", namespaces, code)
    constants = list(fp.constant_tensors.values())
    constant_values = bytes_digest(constants)
    if constant_values is None:
        raise Uncacheable("a tensor that the code refers to (a module-level constant, a default, a closure "
                          "variable) has values that cannot be read")
    fp.add("constant values", constant_values)
    fp.add("index bounds", index_bounds(fp.tensors))  # a fake run refuses ids past a table (engine/values.py)
    if execution == "real":
        values = bytes_digest(fp.tensors)
        if values is None:
            raise Uncacheable("a real run may depend on tensor values, and one tensor's values cannot be read")
        fp.add("values", values)
    fp.add("versions", _versions(memo_dir))
    return Key(fp.hexdigest(), _with_nested(fp.code))


def trace_key(spec: RunSpec) -> str | None:
    """The cache key (64 hex digits) of :func:`cache_key`; ``None`` when the run cannot be keyed (the reason
    is logged)."""
    try:
        return cache_key(spec).digest
    except Uncacheable as exc:
        logger.info("Not caching: %s.", exc)
        return None


@contextmanager
def watch_code() -> Iterator[dict[types.CodeType, bool] | None]:
    """Collect the Python code objects that run inside the block (each with whether it is the user's), for
    :meth:`Key.uncovered`; ``None`` when another profiler is active (nothing then can be checked).

    A profile function sees every Python call, in this thread and in threads started inside the block.
    """
    if sys.getprofile() is not None or threading.getprofile() is not None:
        yield None
        return
    seen: dict[types.CodeType, bool] = {}

    def profile(frame: types.FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code not in seen:
            try:
                seen[frame.f_code] = _user_frame(frame)
            except Exception:  # never into the model's run; unsure means the user's (so: not stored)
                seen[frame.f_code] = True

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        yield seen
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
