"""Files: safe ``torch.load`` and the safetensors half of a checkpoint (atomic writes live in ``modelmeter.io``)."""

from __future__ import annotations

import contextlib
import copyreg
import functools
import json
import os
import pickle
import pickletools
import re
import tarfile
import zipfile
from collections.abc import Iterator, Sequence
from typing import IO, Any

import torch

from .._torch_compat import WEIGHTS_ONLY_UNPICKLER, python2_pickle_mappings, weights_only_allowed_globals
from .errors import CheckpointError

__all__ = [
    "exception_chain",
    "first_line",
    "is_inside",
    "load_safetensors",
    "refused_import",
    "safe_globals",
    "safetensors_bytes",
    "safetensors_save_id",
    "torch_load",
    "torch_load_bytes",
]


@functools.lru_cache(maxsize=1)
def _numpy_globals() -> tuple[Any, ...]:
    """The numpy objects a pickled ndarray, numpy scalar or dtype needs; both numpy 2 and numpy 1 module names."""
    try:
        import numpy as np
    except ImportError:
        return ()
    core = getattr(np, "_core", None) or np.core
    multiarray = core.multiarray
    allowed: list[Any] = [np.ndarray, np.dtype]
    for fn_name in ("_reconstruct", "scalar"):
        fn = getattr(multiarray, fn_name, None)
        if fn is None:
            continue
        allowed.append(fn)
        # Files written under numpy 1.x name numpy.core.multiarray; numpy 2 only has numpy._core.
        allowed.append((fn, f"numpy.core.multiarray.{fn_name}"))
        allowed.append((fn, f"numpy._core.multiarray.{fn_name}"))
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        for name in dir(dtypes):
            cls = getattr(dtypes, name)
            # Object arrays would hand arbitrary (though still allow-listed) objects to ndarray.__setstate__.
            if isinstance(cls, type) and issubclass(cls, np.dtype) and name != "ObjectDType":
                allowed.append(cls)
    return tuple(allowed)


@contextlib.contextmanager
def safe_globals(extra: Sequence[Any] = ()) -> Iterator[None]:
    """Allow numpy arrays / scalars / dtypes (and ``extra``) for ``torch.load(weights_only=True)``, temporarily."""
    with torch.serialization.safe_globals([*_numpy_globals(), *extra]):
        yield


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# --- telling an unsafe file from a corrupt one ---------------------------------------------------------------------
#
# torch's weights-only unpickler raises pickle.UnpicklingError both for a file it refuses (a pickle that imports or
# calls something outside its allow-list) and for bytes that are no pickle at all, with wording that changes between
# releases. The verdict therefore never reads torch's message: the pickles in the file are disassembled here
# (pickletools, nothing is executed) and compared with the allow-list the refusal was made against.

_MAX_SCANNED_PICKLE = 256 * 1024 * 1024  # bytes of one zip member; torch's own data.pkl is a few KB to MB
_LEGACY_PICKLES = 5  # magic number, protocol, sys info, the object, the storage keys (then raw storage bytes)
_ZIP_MAGIC = b"PK\x03\x04"
_DOTTED_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def _global_name(module: str, name: str) -> str:
    """The name torch's unpickler looks up for ``GLOBAL module name`` (Python 2 names mapped as torch maps them)."""
    IMPORT_MAPPING, NAME_MAPPING = python2_pickle_mappings()
    if (module, name) in NAME_MAPPING:
        module, name = NAME_MAPPING[(module, name)]
    elif module in IMPORT_MAPPING:
        module = IMPORT_MAPPING[module]
    return f"{module}.{name}"


def _extension_registry() -> dict[int, tuple[str, str]]:
    """copyreg's code -> (module, name) table that the EXT opcodes look up (``copyreg.add_extension``)."""
    return getattr(copyreg, "_inverted_registry", {})


def _scan_pickle(stream: IO[bytes], allowed: frozenset[str] | None) -> tuple[str | None, bool]:
    """Disassemble one pickle: (the first import the weights-only loader refuses, whether it parsed up to STOP).

    Imports are GLOBAL / INST and STACK_GLOBAL of a dotted module and name not in ``allowed`` (torch's unpickler
    never resolves STACK_GLOBAL at all), and copyreg extension codes (EXT1/2/4) registered in this process. An
    unregistered code or a STACK_GLOBAL without names imports nothing; they count only if the rest is well-formed.
    """
    strings: list[str] = []  # the last two strings pushed: STACK_GLOBAL takes its module and name from them
    try:
        for opcode, arg, _ in pickletools.genops(stream):
            target = None
            if opcode.name in ("GLOBAL", "INST"):
                module, _, name = str(arg).partition(" ")
                if not (_DOTTED_NAME.match(module) and _DOTTED_NAME.match(name)):
                    return None, False  # random bytes that happen to start like an import
                target = _global_name(module, name)
            elif opcode.name == "STACK_GLOBAL" and len(strings) == 2 and all(map(_DOTTED_NAME.match, strings)):
                target = _global_name(*strings)
            elif opcode.name in ("EXT1", "EXT2", "EXT4") and arg in _extension_registry():
                module, name = _extension_registry()[arg]
                return f"it imports {module}.{name} (copyreg extension code {arg})", True
            elif isinstance(arg, str):
                strings = [*strings[-1:], arg]
            if target is not None and allowed is not None and target not in allowed:
                return f"it imports {target}, which is not an allowed global", True
    except Exception:  # genops raises ValueError, UnicodeDecodeError, struct.error, ... on bytes that are no pickle
        return None, False
    return None, True


def _read_magic(source: str | IO[bytes]) -> bytes:
    if isinstance(source, str):
        with open(source, "rb") as f:
            return f.read(len(_ZIP_MAGIC))
    source.seek(0)
    return source.read(len(_ZIP_MAGIC))


def _pickle_streams(source: str | IO[bytes]) -> Iterator[IO[bytes] | None]:
    """The pickles torch.load would unpickle from ``source``; ``None`` marks a container that cannot be read."""
    if _read_magic(source) == _ZIP_MAGIC and not zipfile.is_zipfile(source):
        yield None  # a zip archive cut short: its directory, which lists data.pkl, is at the end
        return
    if zipfile.is_zipfile(source):
        try:
            with zipfile.ZipFile(source) as archive:
                for info in archive.infolist():
                    if info.filename.endswith(".pkl") and info.file_size <= _MAX_SCANNED_PICKLE:
                        with archive.open(info) as member:
                            yield member
        except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError):
            yield None
        return
    if isinstance(source, str):
        with open(source, "rb") as f:
            yield from _legacy_pickles(f)
    else:
        source.seek(0)
        yield from _legacy_pickles(source)


def _legacy_pickles(f: IO[bytes]) -> Iterator[IO[bytes]]:
    """The consecutive pickles at the start of a legacy (non-zip) file, as far as the file goes."""
    for _ in range(_LEGACY_PICKLES):
        position = f.tell()
        if not f.read(1):
            return
        f.seek(position)
        yield f


def _scan_checkpoint(source: str | IO[bytes]) -> tuple[str | None, bool]:
    """(the first refused import in any of the file's pickles, whether all of them are well-formed pickles)."""
    allowed = weights_only_allowed_globals()
    for stream in _pickle_streams(source):
        if stream is None:
            return None, False
        detail, well_formed = _scan_pickle(stream, allowed)
        if detail is not None or not well_formed:
            return detail, well_formed
    return None, True


# A GLOBAL or INST opcode and its "module\nname\n" argument; pickletools is ~10x slower than this search.
_IMPORT_BYTES = re.compile(rb"[ci]([A-Za-z_][\w.]*)\n([A-Za-z_][\w.]*)\n")


def _may_refuse(path: str, allowed: frozenset[str]) -> bool:
    """False when no byte sequence in the file's pickles even looks like an import outside ``allowed`` (and no
    copyreg extension code is registered): then the exact scan cannot find one either."""
    if _extension_registry():
        return True
    for stream in _pickle_streams(path):
        if stream is None:
            return True
        for module, name in _IMPORT_BYTES.findall(stream.read()):
            if _global_name(module.decode(), name.decode()) not in allowed:
                return True
    return False


def refused_import(path: str, extra_globals: Sequence[Any] = ()) -> str | None:
    """What in the zip checkpoint ``path`` (as ``torch.save`` writes it) ``torch.load(weights_only=True)`` with
    ``extra_globals`` allowed would refuse to import (e.g. ``"it imports argparse.Namespace, ..."``), or ``None``.
    Only the pickles are read, never tensor data."""
    with safe_globals(extra_globals):
        allowed = weights_only_allowed_globals()
        if allowed is not None and not _may_refuse(path, allowed):
            return None
        detail, _ = _scan_checkpoint(path)
    return detail


def _raised_in(exc: BaseException, module: str) -> bool:
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_globals.get("__name__") == module:
            return True
        tb = tb.tb_next
    return False


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and every exception inside it: causes, contexts, and the per-rank failures DCP collects."""
    seen: set[int] = set()
    pending: list[Any] = [exc]
    while pending:
        current = pending.pop()
        if not isinstance(current, BaseException) or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        failures = getattr(current, "failures", None)  # torch.distributed.checkpoint.CheckpointException
        if isinstance(failures, dict):
            pending += [f[0] if isinstance(f, tuple) and f else f for f in failures.values()]
        pending += [current.__cause__, current.__context__]


def _weights_only_refusal(exc: BaseException) -> BaseException | None:
    """The UnpicklingError torch's weights-only unpickler raised, wherever in ``exc``'s chain torch re-raised it."""
    for inner in exception_chain(exc):
        if isinstance(inner, pickle.UnpicklingError) and _raised_in(inner, WEIGHTS_ONLY_UNPICKLER):
            return inner
    return None


def is_inside(root: str, relative: str) -> bool:
    """Whether ``root/relative``, symlinks resolved, lies strictly inside the directory ``root``."""
    if not relative or os.path.isabs(relative) or "\0" in relative:
        return False
    base = os.path.realpath(root or ".")
    target = os.path.realpath(os.path.join(base, relative))
    return target != base and os.path.commonpath([base, target]) == base


def _is_uncompressed_tar(path: str) -> bool:
    """What torch.load tries first: a plain (uncompressed) tar archive, torch's oldest checkpoint format."""
    try:
        with tarfile.open(path, mode="r:"):
            return True
    except (tarfile.TarError, OSError):
        return False


def _refusal_detail(source: str | IO[bytes], exc: BaseException) -> str | None:
    """Why ``source`` is unsafe to unpickle, or ``None`` if the failure means a truncated or corrupt file.

    Unsafe: a pickle in it imports something outside the allow-list (wherever the pickle breaks off later), or all
    its pickles are well-formed and torch's weights-only unpickler refused one of them. A legacy ``.tar`` checkpoint
    is unsafe too: torch reads that format only with the full unpickler.
    """
    if isinstance(source, str) and _is_uncompressed_tar(source):
        return "it is in torch's legacy .tar format, which only the full unpickler reads"
    detail, well_formed = _scan_checkpoint(source)
    if detail is not None:
        return detail
    refusal = _weights_only_refusal(exc)
    if well_formed and refusal is not None:
        return f"the weights-only unpickler refused it ({first_line(refusal)})"
    return None


def unsafe_error(path: str, detail: str) -> CheckpointError:
    return CheckpointError(
        f"Refused to load checkpoint {path}: {detail}. Unpickling it in full could run code stored in the file, "
        "so nothing from it was executed (torch.load(weights_only=True)). Only if you trust this file, load it with "
        "Checkpointer(..., weights_only=False) or checkpointer.load(path, weights_only=False), or allow the classes "
        "it needs with Checkpointer(..., safe_globals=[...]).",
        path,
        "unsafe",
    )


def corrupt_error(path: str, exc: BaseException) -> CheckpointError:
    return CheckpointError(
        f"Checkpoint file {path} is truncated or corrupt and cannot be read ({type(exc).__name__}: {first_line(exc)})",
        path,
        "corrupt",
    )


def missing_error(path: str) -> CheckpointError:
    return CheckpointError(f"Checkpoint {path} not found!", path, "missing")


def _load(source: str | IO[bytes], name: str, weights_only: bool, extra_globals: Sequence[Any]) -> Any:
    if not weights_only:
        try:
            return torch.load(source, map_location="cpu", weights_only=False)
        except Exception as exc:
            raise corrupt_error(name, exc) from exc
    with safe_globals(extra_globals):
        try:
            return torch.load(source, map_location="cpu", weights_only=True)
        except Exception as exc:
            # Classified inside the context, so that the extra globals count as allowed.
            detail = _refusal_detail(source, exc)
            if detail is None:
                raise corrupt_error(name, exc) from exc
    raise unsafe_error(name, detail) from None


def torch_load(path: str, *, weights_only: bool, extra_globals: Sequence[Any] = ()) -> Any:
    """``torch.load`` onto the CPU; every failure becomes a CheckpointError that names ``path``.

    With ``weights_only`` a file the weights-only unpickler refuses is ``reason="unsafe"``, a file that is not a
    readable checkpoint ``reason="corrupt"``; the verdict depends on the file's contents, not on torch's wording.
    """
    if not os.path.isfile(path):
        raise missing_error(path)
    return _load(path, path, weights_only, extra_globals)


def torch_load_bytes(data: IO[bytes], name: str) -> Any:
    """``torch.load(weights_only=True)`` of an in-memory object (a DCP value); errors as :func:`torch_load`."""
    return _load(data, name, True, ())


# --- safetensors --------------------------------------------------------------------------------------------------

_ALIASES_KEY = "modelmeter.aliases"
_SAVE_ID_KEY = "modelmeter.save_id"
_ORDER_KEY = "modelmeter.order"


def safetensors_bytes(tensors: dict[str, torch.Tensor], save_id: str) -> bytes:
    """Serialise ``tensors``; a tensor stored under several names (tied weights) is written once plus an alias."""
    from safetensors.torch import save

    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen_views: dict[tuple[Any, ...], str] = {}
    seen_storages: set[tuple[str, int]] = set()
    for name, tensor in tensors.items():
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        storage = (t.device.type, t.untyped_storage().data_ptr()) if t.numel() else None
        view = (*storage, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype) if storage else None
        if view is not None and view in seen_views:
            aliases[name] = seen_views[view]
            continue
        if (storage is not None and storage in seen_storages) or not t.is_contiguous():
            t = t.clone(memory_format=torch.contiguous_format)
        elif storage is not None:
            seen_storages.add(storage)
        if view is not None:
            seen_views[view] = name
        unique[name] = t
    metadata = {_SAVE_ID_KEY: save_id, _ALIASES_KEY: json.dumps(aliases), _ORDER_KEY: json.dumps(list(tensors))}
    return bytes(save(unique, metadata=metadata))


def safetensors_save_id(path: str) -> str | None:
    """The save id in the header of the safetensors file ``path`` (only the header is read); ``None`` if unreadable."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            save_id = (f.metadata() or {}).get(_SAVE_ID_KEY)
    except Exception:
        return None
    return save_id if isinstance(save_id, str) and save_id.isalnum() else None


def load_safetensors(path: str, expected_save_id: str | None) -> dict[str, torch.Tensor]:
    """Read a safetensors file (weights only, never code); check it belongs to the ``.pth`` that names it."""
    from safetensors import safe_open

    if not os.path.isfile(path):
        raise missing_error(path)
    tensors: dict[str, torch.Tensor] = {}
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            for key in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                tensors[key] = f.get_tensor(key)
    except Exception as exc:
        raise corrupt_error(path, exc) from exc
    if expected_save_id is not None and metadata.get(_SAVE_ID_KEY) != expected_save_id:
        raise CheckpointError(
            f"Checkpoint file {path} does not belong to the .pth file that refers to it (a save of the same name "
            "was interrupted between its two files); it is treated as corrupt",
            path,
            "corrupt",
        )
    try:
        aliases: dict[str, str] = json.loads(metadata.get(_ALIASES_KEY, "{}"))
        order: list[str] = json.loads(metadata.get(_ORDER_KEY, "[]"))
        result: dict[str, torch.Tensor] = {}
        for key in [*order, *tensors, *aliases]:
            if key not in result:
                result[key] = tensors[key] if key in tensors else tensors[aliases[key]]
    except (ValueError, KeyError, TypeError) as exc:
        raise corrupt_error(path, exc) from exc
    return result
