"""Files: safe ``torch.load`` and the safetensors half of a checkpoint (atomic writes live in ``modelmeter.io``)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pickle
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .errors import CheckpointError

__all__ = [
    "load_safetensors",
    "safe_globals",
    "safetensors_bytes",
    "torch_load",
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


_REFUSALS = ("Unsupported global", "Can only build", "not an allowed global", "Unsupported class", "Trying to call")


def _is_refusal(exc: BaseException) -> bool:
    """The weights-only unpickler met a disallowed object (as opposed to bytes that are not a pickle at all)."""
    text = str(exc)
    return "Weights only load failed" in text and any(marker in text for marker in _REFUSALS)


def _unsafe_detail(exc: BaseException) -> str:
    text = str(exc)
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(("WeightsUnpickler error:", "Unsupported global", "Can only build")):
            detail = line.removeprefix("WeightsUnpickler error:").strip()
            return detail.split(". Please use", 1)[0].rstrip(".")
    return "it holds objects that are not plain tensors or containers"


def unsafe_error(path: str, detail: str) -> CheckpointError:
    return CheckpointError(
        f"Refused to load checkpoint {path}: {detail}. Loading it would run code stored in the file, so nothing "
        "from it was executed (torch.load(weights_only=True)). Only if you trust this file, load it with "
        "Checkpointer(..., weights_only=False) or checkpointer.load(path, weights_only=False).",
        path,
        "unsafe",
    )


def corrupt_error(path: str, exc: BaseException) -> CheckpointError:
    return CheckpointError(
        f"Checkpoint file {path} is truncated or corrupt and cannot be read ({type(exc).__name__}: {_first_line(exc)})",
        path,
        "corrupt",
    )


def missing_error(path: str) -> CheckpointError:
    return CheckpointError(f"Checkpoint {path} not found!", path, "missing")


def torch_load(path: str, *, weights_only: bool, extra_globals: Sequence[Any] = ()) -> Any:
    """``torch.load`` onto the CPU; every failure becomes a CheckpointError that names ``path``."""
    if not os.path.isfile(path):
        raise missing_error(path)
    try:
        if not weights_only:
            return torch.load(path, map_location="cpu", weights_only=False)
        with safe_globals(extra_globals):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if weights_only and _is_refusal(exc):
            raise unsafe_error(path, _unsafe_detail(exc)) from None
        raise corrupt_error(path, exc) from exc
    except Exception as exc:
        raise corrupt_error(path, exc) from exc


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
