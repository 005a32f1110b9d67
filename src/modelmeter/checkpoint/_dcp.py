"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), readable without executing pickled code.

DCP itself unpickles its ``.metadata`` file and every non-tensor value with plain ``pickle``; here the metadata goes
through an unpickler that only knows DCP's own metadata classes, and non-tensor values go through
``torch.load(weights_only=True)``, unless the caller opts out with ``weights_only=False``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import io
import os
import pickle
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import default_planner as _default_planner
from torch.distributed.checkpoint import metadata as _dcp_metadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from .._torch_compat import flat_dcp_state
from ._storage import corrupt_error, exception_chain, is_inside, missing_error, torch_load_bytes, unsafe_error
from .errors import CheckpointError

__all__ = ["METADATA_FILE", "is_dcp_checkpoint", "load_sharded", "read_tensor_shapes", "save_sharded"]

METADATA_FILE = ".metadata"
_MODEL = "model"
_OPTIM_PREFIX = "optimizer:"


def is_dcp_checkpoint(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, METADATA_FILE))


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _single_process_ok() -> Iterator[None]:
    """DCP warns on every single-process call; loading a sharded checkpoint on one process is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled|unavailable)")
        yield


def save_sharded(directory: str, model: nn.Module, optimizers: Mapping[str, torch.optim.Optimizer]) -> None:
    """Collective: every rank writes its shards of the model and optimizer states into ``directory``."""
    state: dict[str, Any] = {_MODEL: get_model_state_dict(model)}
    for key, optimizer in optimizers.items():
        state[_OPTIM_PREFIX + key] = get_optimizer_state_dict(model, optimizer)
    with _single_process_ok():
        dcp.save(state, checkpoint_id=directory, no_dist=_no_dist())


# --- safe reading -------------------------------------------------------------------------------------------------


def _allowed_metadata_global(module: str, name: str) -> bool:
    if module == _dcp_metadata.__name__:
        obj = getattr(_dcp_metadata, name, None)
        return isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))
    if module == "torch.distributed.checkpoint.filesystem":
        return name == "_StorageInfo"
    if module in ("pathlib", "pathlib._local"):
        return name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
    if module == "torch":
        return name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
    if module == "torch.serialization":
        return name == "_get_layout"
    return (module, name) == ("collections", "OrderedDict")


class _RefusedGlobal(pickle.UnpicklingError):
    """Raised by our metadata unpickler (never by a broken file): the pickle imports something not allowed."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if _allowed_metadata_global(module, name):
            return super().find_class(module, name)
        raise _RefusedGlobal(f"it imports {module}.{name}, which is not a DCP metadata class")


def _read_metadata_file(path: str, weights_only: bool) -> Any:
    if not os.path.isfile(path):
        raise missing_error(path)
    if not is_inside(os.path.dirname(path), os.path.basename(path)):
        raise unsafe_error(path, "it is a symlink that leads out of the checkpoint directory")
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load() if weights_only else pickle.load(f)
    except _RefusedGlobal as exc:
        raise unsafe_error(path, str(exc)) from None
    except Exception as exc:
        raise corrupt_error(path, exc) from exc
    if not isinstance(metadata, _dcp_metadata.Metadata):
        raise corrupt_error(path, TypeError(f"expected DCP Metadata, found {type(metadata).__name__}"))
    root = os.path.realpath(os.path.dirname(path))
    storage_data = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    for info in storage_data.values():
        relative = str(getattr(info, "relative_path", ""))
        if not is_inside(root, relative):
            raise unsafe_error(path, f"it names the storage file {relative!r}, which lies outside the checkpoint")
    return metadata


class _SafeReader(dcp.FileSystemReader):
    """FileSystemReader whose metadata is unpickled with an allow-list (or, opted out, with plain pickle)."""

    def __init__(self, path: str, weights_only: bool) -> None:
        super().__init__(path)
        self._root = path
        self._weights_only = weights_only

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        metadata = _read_metadata_file(os.path.join(self._root, name), self._weights_only)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = _dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


class _SafePlanner(_default_planner.DefaultLoadPlanner):
    """Non-tensor values (optimizer hyper-parameters, ...) are read with ``torch.load(weights_only=True)``."""

    def __init__(self, checkpoint: str) -> None:
        super().__init__()
        self._checkpoint = checkpoint

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch_load_bytes(value, self._checkpoint)
        if self.flatten_state_dict:
            _default_planner.set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def read_tensor_shapes(directory: str, weights_only: bool) -> dict[str, tuple[int, ...] | None]:
    """Flattened key → global tensor shape (``None`` for non-tensor values) of a DCP checkpoint."""
    metadata = _read_metadata_file(os.path.join(directory, METADATA_FILE), weights_only)
    shapes: dict[str, tuple[int, ...] | None] = {}
    for key, item in metadata.state_dict_metadata.items():
        size = getattr(item, "size", None)
        shapes[key] = tuple(size) if size is not None else None
    return shapes


def _dot_prefixes(keys: Iterable[str]) -> set[str]:
    """Every key and each of its leading dotted parts: ``"a.b.c"`` gives ``"a"``, ``"a.b"``, ``"a.b.c"``."""
    prefixes: set[str] = set()
    for key in keys:
        parts = key.split(".")
        prefixes.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return prefixes


def _saved_entries_only(request: dict[str, Any], name: str, saved_keys: Iterable[str]) -> dict[str, Any]:
    """An optimizer state dict to load into, without the per-parameter entries the checkpoint does not hold.

    A parameter that had no state when the checkpoint was saved (frozen, or never given a gradient) has no keys
    in it, and DCP refuses to load a requested key it lacks; ``optimizer.load_state_dict`` leaves such a
    parameter without state, and so does this.
    """
    state = request.get("state")
    if not isinstance(state, dict):
        return request
    saved = _dot_prefixes(saved_keys)
    kept: dict[str, Any] = {}
    for fqn, entries in state.items():
        present = {k: v for k, v in entries.items() if f"{name}.state.{fqn}.{k}" in saved}
        if present:
            kept[fqn] = present
    return {**request, "state": kept}


def _mismatch(state: dict[str, Any], shapes: Mapping[str, tuple[int, ...] | None]) -> str | None:
    """Why the checkpoint cannot fill ``state`` (a key it lacks, a tensor of another shape), before DCP tries.

    The keys are DCP's flattened ones (``optimizer:<name>.state.<param>.exp_avg``), as its metadata lists them.
    """
    for key, value in flat_dcp_state(state).items():
        if key not in shapes:
            return f"it holds no {key!r}"
        saved = shapes[key]
        if isinstance(value, torch.Tensor) and saved is not None and tuple(value.shape) != saved:
            return f"{key!r} has shape {saved} in the checkpoint but {tuple(value.shape)} here"
    return None


def load_sharded(
    directory: str,
    model: nn.Module,
    optimizers: Mapping[str, torch.optim.Optimizer],
    *,
    weights_only: bool,
) -> tuple[list[str], list[str], list[tuple[str, tuple[int, ...], tuple[int, ...]]]]:
    """Collective when a process group is up: load into ``model`` (sharded or not) and ``optimizers``.

    The number of ranks may differ from the one that saved. Returns fvcore-style
    ``(missing_keys, unexpected_keys, incorrect_shapes)`` for the model; optimizer states must match exactly.
    """
    shapes = read_tensor_shapes(directory, weights_only)
    prefix = _MODEL + "."
    saved = {k[len(prefix) :]: v for k, v in shapes.items() if k.startswith(prefix)}
    model_sd = get_model_state_dict(model)
    missing: list[str] = []
    incorrect: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    request: dict[str, Any] = {}
    for key, value in model_sd.items():
        if key not in saved:
            missing.append(key)
            continue
        saved_shape = saved[key]
        if isinstance(value, torch.Tensor) and saved_shape is not None and tuple(value.shape) != saved_shape:
            incorrect.append((key, saved_shape, tuple(value.shape)))
            missing.append(key)  # as with plain checkpoints, a skipped tensor is also reported missing
            continue
        request[key] = value
    # Keys of a flattened model state dict may belong to nested non-tensor values; keep only top-level names.
    unexpected = [k for k in saved if k not in model_sd and not any(k.startswith(m + ".") for m in model_sd)]
    state: dict[str, Any] = {_MODEL: request}
    for key, optimizer in optimizers.items():
        name = _OPTIM_PREFIX + key
        if not any(k.startswith(name + ".") for k in shapes):
            raise CheckpointError(
                f"Checkpoint {directory} holds no state for optimizer {key!r}", directory, "incompatible"
            )
        state[name] = _saved_entries_only(get_optimizer_state_dict(model, optimizer), name, shapes)
        mismatch = _mismatch({name: state[name]}, shapes)
        if mismatch is not None:
            raise CheckpointError(
                f"Checkpoint {directory}: the saved state of optimizer {key!r} does not fit it ({mismatch}; another "
                "optimizer class or other parameters?); nothing was loaded",
                directory,
                "incompatible",
            )
    reader = _SafeReader(directory, weights_only)
    planner = _SafePlanner(directory) if weights_only else _default_planner.DefaultLoadPlanner()
    try:
        with _single_process_ok():
            dcp.load(state, checkpoint_id=directory, storage_reader=reader, planner=planner, no_dist=_no_dist())
    except (Exception, dcp.CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        # Our own refusal (an unsafe value, a storage file outside the checkpoint), as DCP collected it.
        own = next((e for e in exception_chain(exc) if isinstance(e, CheckpointError)), None)
        if own is not None:
            raise own from None
        raise CheckpointError(
            f"Sharded checkpoint {directory} could not be loaded ({type(exc).__name__}: {str(exc).strip()[:500]})",
            directory,
            "corrupt",
        ) from exc
    try:
        set_model_state_dict(model, state[_MODEL], options=StateDictOptions(strict=False))
        lenient = StateDictOptions(strict=False)  # parameters without saved state stay without, as load_state_dict
        for key, optimizer in optimizers.items():
            set_optimizer_state_dict(model, optimizer, state[_OPTIM_PREFIX + key], options=lenient)
    except Exception as exc:
        raise CheckpointError(
            f"Sharded checkpoint {directory} was read but does not fit the model or optimizer "
            f"({type(exc).__name__}: {str(exc).strip()[:500]})",
            directory,
            "incompatible",
        ) from exc
    return missing, unexpected, incorrect
