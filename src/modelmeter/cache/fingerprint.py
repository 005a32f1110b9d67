"""Cache keys: a sha256 of everything a recorded trace depends on, and nothing it does not.

The key covers

* **the model**: every module, by path (shared modules and tied tensors as such), with its class, its
  ``training`` flag, its parameters and buffers (name, shape, dtype, device — meta or real —, layout,
  strides, ``requires_grad``), its forward hooks, and the values of its other attributes (Conv2d ``stride``,
  Dropout ``p``, ``eps``, a config object's fields, ...: plain values, containers and objects are walked;
  tensors contribute their metadata, not their values);
* **the code**: a class or function of an installed library (a file under site-packages or the standard
  library; torch, torchvision, transformers, timm, ...) by its qualified name and the library's version;
  any other code — the user's own, a script, an editable install, a class made by ``exec`` — by the code
  objects of every method and the class attributes of every class in its MRO, with the same-package helper
  functions, classes and constants that code refers to by name;
* **the inputs**: their structure (tuples, lists, dicts, named tuples, objects), tensor metadata and every
  non-tensor value;
* **the run**: ``execution``, grad and inference mode, default dtype and device, autocast, the attention
  backend switches; and the versions of modelmeter (with a digest of its recording engine's source), torch,
  Python and the trace format.

Code is fingerprinted from the code objects that actually run (byte code, constants, names, defaults,
closures) rather than from ``inspect.getsource``, which reads the file on disk — it may have been edited
since the class was imported, and classes made by ``exec`` have no file at all.

Parameter and input *values* are not part of the key: a fake run never reads them. A run with real kernels
(``execution="real"``) may, so for it the bytes of every tensor are hashed too (see :func:`trace_key`).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import os
import re
import site
import sys
import sysconfig
import types
from contextlib import suppress
from typing import Any

import torch
from torch import nn

from ..engine.naming import named_modules_with_dup
from .serialize import FORMAT_VERSION, schema_signature

KEY_VERSION = 1

# Attributes every nn.Module has for its own bookkeeping; parameters, buffers, children and hooks are
# fingerprinted on their own.
_MODULE_INTERNALS = frozenset(nn.Module().__dict__)
_SKIPPED_CLASS_ATTRIBUTES = frozenset({"__dict__", "__weakref__", "__doc__", "__module__", "__qualname__",
                                       "__firstlineno__", "__static_attributes__", "_abc_impl"})
# Private attributes that record where or when an object was made rather than what it does (transformers'
# GenerationConfig keeps ``_original_object_hash = hash(self)``, torch.compile ``_torchdynamo_wrapper_id``):
# not keyed.
_VOLATILE = re.compile(r"_\w*(hash|uuid|session|timestamp|_time)\w*|_\w*_id", re.IGNORECASE)
_MAX_DEPTH = 6  # how deep attribute values are walked into objects
_MAX_ITEMS = 10_000  # elements of one container fingerprinted (its length always is)
_PLAIN = (type(None), bool, int, float, complex, str, bytes)
_TORCH_VALUES = (torch.dtype, torch.device, torch.layout, torch.memory_format)
_CODE_CACHE: dict[types.CodeType, tuple[str, frozenset[str]]] = {}


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
        for member in vars(obj).values():
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            elif isinstance(member, property):
                member = member.fget
            if isinstance(member, types.FunctionType):
                return member.__code__.co_filename
    return None


def library(obj: Any) -> str | None:
    """``"package version"`` for a function or class of an installed library (or the standard library, or
    torch), judged by the file its code was compiled from; ``None`` for the user's own code (a script, a
    project, an editable install, ``exec``), whose code objects are fingerprinted instead."""
    module = getattr(obj, "__module__", None)
    if not isinstance(module, str):
        module = None
    if _is_torch(module):
        return "torch"  # torch.__version__ is in every key
    path = _code_file(obj)
    if path is None:  # no Python code of its own: go by its module
        if module in sys.builtin_module_names:
            return "builtin"
        path = getattr(sys.modules.get(module or ""), "__file__", None)
        if not path:
            return None
    where = _installed(path)
    if where is None:
        return None
    return "stdlib" if where == "stdlib" else _version(_top(module), path)  # Python's version is in the key


def _code(code: types.CodeType) -> tuple[str, frozenset[str]]:
    """A digest of a code object (ignoring file names and line numbers) and the global names it uses."""
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
        return repr(value)

    parts.append(tuple(const(c) for c in code.co_consts))
    h.update(repr(parts).encode("utf-8", "backslashreplace"))
    result = (h.hexdigest(), frozenset(names))
    if len(_CODE_CACHE) > 100_000:  # code made on the fly (exec in a loop) must not pile up
        _CODE_CACHE.clear()
    _CODE_CACHE[code] = result
    return result


class _Fingerprint:
    """Walks a model and its inputs, turning what matters into plain, deterministic records."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self.module_paths: dict[int, str] = {}
        self.tensors: list[torch.Tensor] = []
        self._tensor_index: dict[int, int] = {}
        self._memo: dict[int, tuple[Any, Any]] = {}  # id -> (object kept alive, fingerprint)
        self._active: set[int] = set()

    def add(self, *record: Any) -> None:
        self._hash.update(repr(record).encode("utf-8", "backslashreplace"))
        self._hash.update(b"\x00")

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    # tensors ------------------------------------------------------------------------------------
    def tensor(self, t: torch.Tensor) -> Any:
        index = self._tensor_index.get(id(t))
        if index is not None:
            return ("same tensor as", index)
        self._tensor_index[id(t)] = len(self.tensors)
        self.tensors.append(t)
        try:
            stride: Any = tuple(t.stride()) if t.layout == torch.strided else None
        except (RuntimeError, NotImplementedError):
            stride = None
        return (type(t).__qualname__, tuple(int(s) for s in t.shape), str(t.dtype), str(t.device), str(t.layout),
                stride, bool(t.requires_grad))

    # code ---------------------------------------------------------------------------------------
    def function(self, f: Any) -> Any:
        """A Python function (its code, defaults, closure and the same-package globals it uses)."""
        key = id(f)
        if key in self._memo:
            return self._memo[key][1]
        module = getattr(f, "__module__", None)
        name = f"{module}.{getattr(f, '__qualname__', getattr(f, '__name__', '?'))}"
        installed = library(f)
        if installed is not None or not isinstance(f, types.FunctionType):
            fp: Any = ("function", name, installed)
            self._memo[key] = (f, fp)
            return fp
        self._memo[key] = (f, ("recursive function", name))
        digest, global_names = _code(f.__code__)
        closure = []
        for cell in f.__closure__ or ():
            try:
                closure.append(self.value(cell.cell_contents, 1))
            except ValueError:  # an empty cell
                closure.append("<empty cell>")
        fp = _digest("function", (name, digest, self.value(f.__defaults__, 1), self.value(f.__kwdefaults__, 1),
                                  tuple(closure), self._globals(f.__globals__, global_names, _top(module))))
        self._memo[key] = (f, fp)
        return fp

    def _globals(self, namespace: dict[str, Any], names: frozenset[str], package: str) -> Any:
        """Module-level helpers, classes and constants a function refers to by name."""
        out: list[Any] = []
        for name in sorted(names):
            if name not in namespace:
                continue
            value = namespace[name]
            if isinstance(value, type(None) | bool | int | float | str):
                out.append((name, value))
            elif isinstance(value, (types.FunctionType, type)) and _top(value.__module__) == package:
                out.append((name, self.function(value) if isinstance(value, types.FunctionType)
                            else self.klass(value)))
            elif isinstance(value, (types.FunctionType, type)):
                out.append((name, f"{value.__module__}.{value.__qualname__}", library(value)))
        return tuple(out)

    def klass(self, cls: type) -> Any:
        """A class: for each class of its MRO outside torch, the code of its methods and its class attributes."""
        key = id(cls)
        if key in self._memo:
            return self._memo[key][1]
        name = f"{cls.__module__}.{cls.__qualname__}"
        self._memo[key] = (cls, ("recursive class", name))
        parts: list[Any] = []
        for base in cls.__mro__:
            base_name = f"{base.__module__}.{base.__qualname__}"
            installed = library(base)
            if installed is not None:
                parts.append((base_name, installed))
                continue
            body = []
            for attr, member in vars(base).items():
                if attr in _SKIPPED_CLASS_ATTRIBUTES:
                    continue
                body.append((attr, self._member(member)))
            parts.append((base_name, tuple(sorted(body, key=lambda item: item[0]))))
        fp = _digest("class", (name, tuple(parts)))
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
        return self.value(member, _MAX_DEPTH - 2)

    # values -------------------------------------------------------------------------------------
    def value(self, v: Any, depth: int = 0) -> Any:
        """Any value as plain nested tuples: tensors by metadata, containers by content, objects by state."""
        kind = type(v)
        if kind in _PLAIN:
            return v
        if isinstance(v, torch.Tensor):
            return ("tensor", self.tensor(v))
        if isinstance(v, torch.Size):
            return ("Size", tuple(v))
        if isinstance(v, _TORCH_VALUES):
            return (kind.__name__, str(v))
        if isinstance(v, enum.Enum):
            return ("enum", f"{kind.__module__}.{kind.__qualname__}", v.name)
        if isinstance(v, (types.FunctionType, types.BuiltinFunctionType, types.MethodWrapperType,
                          types.WrapperDescriptorType, types.MethodDescriptorType)):
            return self.function(v)
        if isinstance(v, types.MethodType):
            return ("method", self.function(v.__func__), self.value(v.__self__, depth + 1))
        if isinstance(v, type):
            return self.klass(v)
        if isinstance(v, types.ModuleType):
            return ("python module", v.__name__)
        if isinstance(v, nn.Module) and id(v) in self.module_paths:
            return ("submodule", self.module_paths[id(v)])
        key = id(v)
        if key in self._memo:
            return self._memo[key][1]
        if key in self._active:
            return ("cycle", f"{kind.__module__}.{kind.__qualname__}")
        self._active.add(key)
        try:
            fp = _digest("value", self._compound(v, depth))
        finally:
            self._active.discard(key)
        self._memo[key] = (v, fp)
        return fp

    def _compound(self, v: Any, depth: int) -> Any:
        kind = type(v)
        name = f"{kind.__module__}.{kind.__qualname__}"
        if isinstance(v, functools.partial):
            return ("partial", self.function(v.func), self.value(v.args, depth), self.value(v.keywords, depth))
        if kind in (list, tuple):
            return (kind.__name__, len(v), tuple(self.value(x, depth) for x in v[:_MAX_ITEMS]))
        if isinstance(v, dict):
            items = list(v.items())[:_MAX_ITEMS]
            return ("dict", name, len(v), tuple((self.value(k, depth), self.value(x, depth)) for k, x in items))
        if isinstance(v, (set, frozenset)):
            return ("set", name, len(v), tuple(sorted(repr(self.value(x, depth)) for x in list(v)[:_MAX_ITEMS])))
        if depth >= _MAX_DEPTH:
            return ("object", name)
        if isinstance(v, tuple):  # a named tuple
            return ("tuple", name, tuple(self.value(x, depth + 1) for x in v[:_MAX_ITEMS]))
        if isinstance(v, list):
            return ("list", name, tuple(self.value(x, depth + 1) for x in v[:_MAX_ITEMS]))
        return ("object", self.klass(kind), self._state(v, depth + 1))

    def _state(self, v: Any, depth: int) -> Any:
        try:
            state = dict(vars(v))
        except TypeError:  # no __dict__: slots, or an extension type
            state = {}
        for klass in type(v).__mro__:
            slots = klass.__dict__.get("__slots__", ())
            for slot in (slots,) if isinstance(slots, str) else slots:
                if slot not in ("__dict__", "__weakref__") and hasattr(v, slot):
                    state.setdefault(slot, getattr(v, slot))
        return tuple((k, self.value(x, depth)) for k, x in state.items() if not _VOLATILE.fullmatch(str(k)))

    # the model ----------------------------------------------------------------------------------
    def model(self, model: nn.Module) -> None:
        paths = list(named_modules_with_dup(model))
        for path, module in paths:
            self.module_paths.setdefault(id(module), path)
        for path, module in paths:
            canonical = self.module_paths[id(module)]
            if canonical != path:
                self.add("alias", path, canonical)
                continue
            self.add("module", path, self.klass(type(module)), module.training,
                     tuple((n, None if p is None else self.tensor(p)) for n, p in module._parameters.items()),
                     tuple((n, None if b is None else self.tensor(b), n in module._non_persistent_buffers_set)
                           for n, b in module._buffers.items()),
                     tuple((n, c is None) for n, c in module._modules.items()),
                     self._hooks(module),
                     tuple((k, self.value(v)) for k, v in module.__dict__.items()
                           if k not in _MODULE_INTERNALS and not _VOLATILE.fullmatch(k)))
        hooks = nn.modules.module
        self.add("global hooks", *(tuple(self.value(h) for h in getattr(hooks, table, {}).values())
                                   for table in ("_global_forward_pre_hooks", "_global_forward_hooks")))

    def _hooks(self, module: nn.Module) -> Any:
        def table(hooks: dict[int, Any], *flags: dict[int, Any]) -> Any:
            return tuple((self.value(h), *(i in f for f in flags)) for i, h in hooks.items())

        return (table(module._forward_pre_hooks, module._forward_pre_hooks_with_kwargs),
                table(module._forward_hooks, module._forward_hooks_with_kwargs, module._forward_hooks_always_called))

    def values_digest(self) -> str | None:
        """A sha256 of the bytes of every tensor seen (meta tensors have none); None if one cannot be read."""
        h = hashlib.sha256()
        for t in self.tensors:
            if t.is_meta:
                h.update(b"meta\x00")
                continue
            try:
                data = t.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1).view(torch.uint8)
                h.update(data.numpy().data)
            except Exception:  # sparse, quantized, no numpy...: no key
                return None
            h.update(b"\x00")
        return h.hexdigest()


def _run_options(execution: str) -> tuple[Any, ...]:
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
            str(torch.get_default_device()), tuple(autocast), tuple(switches), mha() if callable(mha) else None)


@functools.lru_cache(maxsize=1)
def _recorder_digest() -> str:
    """A digest of the source of modelmeter's engine (what records a trace) and of the trace format, so a
    development checkout that changes how traces are recorded does not read traces of its former self."""
    h = hashlib.sha256()
    here = os.path.dirname(os.path.abspath(__file__))
    engine = os.path.join(os.path.dirname(here), "engine")
    try:
        files = sorted(os.path.join(engine, n) for n in os.listdir(engine) if n.endswith(".py"))
        for path in [*files, os.path.join(here, "serialize.py")]:
            with open(path, "rb") as f:
                h.update(os.path.basename(path).encode() + b"\x00" + f.read() + b"\x00")
    except OSError:  # not installed as files (a zip, a frozen app): the version has to do
        return ""
    return h.hexdigest()


def _versions() -> tuple[Any, ...]:
    import modelmeter

    return (KEY_VERSION, FORMAT_VERSION, tuple(sorted(schema_signature().items())), modelmeter.__version__,
            _recorder_digest(), torch.__version__, sys.version)


def trace_key(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], execution: str, *,
              backward: bool = False, loss_fn: Any = None) -> str | None:
    """The cache key (64 hex digits) of running ``model(*args, **kwargs)`` with ``execution`` (and a backward
    pass of ``loss_fn``, when ``backward``).

    For ``execution="real"`` the values of every tensor (parameters, buffers, tensor attributes, inputs)
    are hashed as well, since real kernels may depend on them; ``None`` when such a run cannot be keyed.
    """
    fp = _Fingerprint()
    fp.model(model)
    fp.add("inputs", fp.value((args, kwargs)))
    fp.add("run", _run_options(execution))
    if backward:
        fp.add("backward", None if loss_fn is None else fp.value(loss_fn))
    if execution == "real":
        values = fp.values_digest()
        if values is None:
            return None
        fp.add("values", values)
    fp.add("versions", _versions())
    return fp.hexdigest()
