"""``Checkpointer`` and ``PeriodicCheckpointer``: fvcore's names, file layout and messages, made crash-safe.

Layout of ``save_dir`` (as fvcore): ``<name>.pth`` per checkpoint and a ``last_checkpoint`` file holding the
basename of the newest one. With ``format="safetensors"`` the model weights go to ``<name>.safetensors`` and the rest
of the state stays in ``<name>.pth``; sharded (DTensor / FSDP2) models are saved with ``torch.distributed.checkpoint``
into a ``<name>/`` directory.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import sys
import urllib.parse
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from .._torch_compat import state_dict_metadata
from ..errors import InvalidNameError, InvalidTypeError, InvalidValueError
from ..io.atomic import atomic_write, exchange, fsync_dir, hidden_name, remove_stale_temp_files
from ..io.cache_dir import directory_lock
from ._keys import (
    clean_key_map,
    filter_reused_missing_keys,
    get_missing_parameters_message,
    get_unexpected_parameters_message,
    strip_wrapper_prefixes,
    unwrap_model,
    unwrap_state_dict,
)
from ._storage import (
    exception_chain,
    first_line,
    is_inside,
    load_safetensors,
    refused_import,
    safetensors_bytes,
    safetensors_save_id,
    torch_load,
    unsafe_error,
)
from .errors import CheckpointError

__all__ = ["Checkpointer", "PeriodicCheckpointer"]

logger = logging.getLogger("modelmeter.checkpoint")

LAST_CHECKPOINT = "last_checkpoint"
_MARKER = "__modelmeter_checkpoint__"
_SHARDED_EXTRA = "extra.pth"
_DCP_METADATA = ".metadata"
_FORMATS = ("pth", "safetensors")
_OWN_ENTRIES = ("model", _MARKER)  # keys of a checkpoint file that no checkpointable or extra data may take
_PARTIAL = ".partial"  # .<name>.partial/: a sharded checkpoint being written
_ASIDE = re.compile(r"\.old-[0-9a-f]{8}$")  # .<name>.old-<hex>/: a sharded checkpoint being replaced or removed
_PREVIOUS = ".prev"  # .<name>.safetensors.<save id>.prev: the weights an overwrite replaces, until its .pth is in
_SAVE_ID_CHARS = 32  # uuid4().hex


class _IncompatibleKeys(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]
    incorrect_shapes: list[tuple[str, tuple[int, ...], tuple[int, ...]]]


# --- distributed helpers ------------------------------------------------------------------------------------------


def _dist_state() -> tuple[bool, int, int]:
    """(process group initialized, rank, world size)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return True, dist.get_rank(), dist.get_world_size()
    return False, 0, 1


def _barrier() -> None:
    initialized, _, world = _dist_state()
    if initialized and world > 1:
        import torch.distributed as dist

        dist.barrier()


def _has_dtensor(model: nn.Module) -> bool:
    # A model cannot hold DTensors unless their module was imported; importing it just to look costs ~1 s.
    dtensor_module = sys.modules.get("torch.distributed.tensor")
    DTensor = getattr(dtensor_module, "DTensor", None)
    if DTensor is None:
        return False
    tensors: Iterable[torch.Tensor] = (*model.parameters(), *model.buffers())
    return any(isinstance(t, DTensor) for t in tensors)


# A scheme of two letters or more, then ":/" (``https://``, ``HTTP://``, ``s3://``, the short ``file:/abs``), as
# modelmeter.io's PathManager reads a path; ``C:/`` is a drive. PathManager serves it, or says no handler does.
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+:/")


def _is_url(path: str) -> bool:
    return _URL.match(path) is not None


def _is_dcp_checkpoint(path: str) -> bool:
    """A directory written by ``torch.distributed.checkpoint`` (it has a ``.metadata`` file)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, _DCP_METADATA))


def _name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a checkpoint directly inside ``save_dir`` (and read back unchanged from
    ``last_checkpoint``), or ``None``."""
    if not name.strip():
        return "is empty"
    if name != name.strip():
        return "starts or ends with whitespace"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "contains a control character (NUL, newline, ...)"
    if any(0xD800 <= ord(c) <= 0xDFFF for c in name):
        return "is not valid Unicode (a lone surrogate, e.g. undecodable bytes from os.listdir)"
    if name in (".", ".."):
        return "is a relative path"
    if "/" in name or "\\" in name or os.path.isabs(name):
        return "is a path; checkpoints are files directly in save_dir"
    if name.startswith("."):
        return "starts with '.' (hidden names are the checkpointer's temporary files)"
    return None


def _check_name(name: object, what: str = "Checkpoint name") -> None:
    if not isinstance(name, str):
        raise InvalidTypeError(f"{what} must be a str, got {type(name).__name__}")
    problem = _name_problem(name)
    if problem is not None:
        raise InvalidValueError(f"{what} {name!r} {problem}")


def _positive_int(value: object, what: str) -> int:
    """``value`` as an int if it is a whole number >= 1 (numpy integers and 1000.0 from a config are fine)."""
    try:
        number = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError):
        number = 0
    if isinstance(value, (bool, str, bytes)) or number != value or number < 1:
        raise InvalidValueError(f"{what} must be a positive whole number, got {value!r}")
    return number


def _is_no_space(exc: OSError) -> bool:
    return exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def _write_error(path: str, exc: BaseException) -> CheckpointError:
    """A failed save as one line naming the file; "no space left on device" when that is the cause."""
    os_errors = [e for e in exception_chain(exc) if isinstance(e, OSError)]
    no_space = next((e for e in os_errors if _is_no_space(e)), None)
    if no_space is not None:
        cause = "no space left on device" if no_space.errno == errno.ENOSPC else "no space left (disk quota exceeded)"
    else:
        first = os_errors[0] if os_errors else exc
        cause = (first.strerror if isinstance(first, OSError) else None) or f"{type(first).__name__}: {first}"
    return CheckpointError(
        f"Could not save checkpoint {path}: {cause}. Nothing partial was left behind; the previous checkpoint "
        f"and {LAST_CHECKPOINT} are as they were.",
        path,
        "write",
    )


@contextlib.contextmanager
def _writing(path: str) -> Iterator[None]:
    """Turn OS errors of a save (also inside DCP's collective report of them) into a CheckpointError naming
    ``path``."""
    try:
        yield
    except (CheckpointError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if not any(isinstance(e, OSError) for e in exception_chain(exc)):
            raise
        raise _write_error(path, exc) from exc


def _remove_if_present(path: str) -> None:
    """Remove a file that may not exist (nor could: ``<name>.safetensors`` is longer than a valid ``<name>.pth``)."""
    if os.path.lexists(path):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def _aside_path(path: str) -> str:
    """A fresh hidden name beside the directory ``path`` for moving it out of the way (``.<name>.old-<hex>``)."""
    return os.path.join(os.path.dirname(path), hidden_name(os.path.basename(path), f".old-{uuid.uuid4().hex[:8]}"))


def _remove_checkpoint(path: str) -> None:
    """Delete one checkpoint: a ``<name>/`` directory, or ``<name>.pth`` and its ``<name>.safetensors``.

    A directory is first renamed to a hidden name, so that a crash while deleting it never leaves a half-deleted
    directory under a checkpoint's name (the next save removes the hidden one)."""
    if os.path.isdir(path):
        aside = _aside_path(path)
        with contextlib.suppress(OSError):
            os.replace(path, aside)
            path = aside
        shutil.rmtree(path, ignore_errors=True)
        return
    _remove_if_present(path)
    if path.endswith(".pth"):
        weights = path[: -len(".pth")] + ".safetensors"
        _remove_if_present(weights)
        _remove_previous_weights(weights)


def _previous_weights(weights_file: str, save_id: str) -> str:
    """Where an overwrite keeps the weights of save ``save_id`` of ``weights_file`` until the new ``.pth`` is in."""
    directory, base = os.path.split(weights_file)
    return os.path.join(directory, hidden_name(base, f".{save_id}{_PREVIOUS}"))


def _keep_previous_weights(weights_file: str) -> str | None:
    """Before ``weights_file`` is overwritten: a hard link (or copy) of it under the save id its ``.pth`` names, so
    that a crash between the two files of a safetensors save still leaves the old pair loadable."""
    save_id = safetensors_save_id(weights_file) if os.path.isfile(weights_file) else None
    if save_id is None:
        return None
    backup = _previous_weights(weights_file, save_id)
    _remove_if_present(backup)
    try:
        os.link(weights_file, backup)
    except OSError:  # a file system without hard links
        with open(weights_file, "rb") as source:
            atomic_write(backup, lambda f: shutil.copyfileobj(source, f, 1 << 20))
    fsync_dir(os.path.dirname(weights_file))
    return backup


def _remove_previous_weights(weights_file: str) -> None:
    """Remove every kept copy of ``weights_file`` (all save ids): its ``.pth`` no longer needs them."""
    directory = os.path.dirname(weights_file) or "."
    template = os.path.basename(_previous_weights(weights_file, "0" * _SAVE_ID_CHARS))
    stem = template[: -(_SAVE_ID_CHARS + len(_PREVIOUS))]  # hidden_name shortens the base alike for every id
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if len(name) == len(template) and name.startswith(stem) and name.endswith(_PREVIOUS):
            _remove_if_present(os.path.join(directory, name))


def _partial_target(directory: str, entry: str) -> str | None:
    """The checkpoint name the complete sharded save ``<directory>/<entry>`` (``.<name>.partial/``, holding DCP's
    ``.metadata`` and, written last, ``extra.pth``) was meant for; ``None`` if it is incomplete or not ours."""
    name = entry[1 : -len(_PARTIAL)]
    path = os.path.join(directory, entry)
    complete = all(os.path.isfile(os.path.join(path, f)) for f in (_DCP_METADATA, _SHARDED_EXTRA))
    if complete and _name_problem(name) is None and hidden_name(name, _PARTIAL) == entry:
        return name
    return None


def _sharded_leftovers(directory: str) -> list[str]:
    """Hidden ``.<name>.partial/`` and ``.<name>.old-<hex>/`` directories of sharded saves in ``directory``."""
    try:
        names = os.listdir(directory or ".")
    except OSError:
        return []
    found = [n for n in names if n.startswith(".") and (n.endswith(_PARTIAL) or _ASIDE.search(n))]
    return sorted(n for n in found if os.path.isdir(os.path.join(directory, n)))


def _tidy_interrupted_saves(directory: str) -> None:
    """Finish or discard what killed saves left in ``directory``; the caller holds the save lock.

    A complete ``.<name>.partial/`` whose ``<name>`` is missing (the save was killed between moving the old
    checkpoint aside and renaming the new one into place) becomes ``<name>``; every other partial, every
    ``.old-`` directory and the temporary files of writers that have ended are removed. (Weights an overwrite kept,
    ``.<name>.safetensors.<id>.prev``, stay until the next save of that name: its ``.pth`` may still need them.)"""
    for entry in _sharded_leftovers(directory):
        path = os.path.join(directory, entry)
        target = _partial_target(directory, entry) if entry.endswith(_PARTIAL) else None
        if target is not None and not os.path.lexists(os.path.join(directory, target)):
            os.replace(path, os.path.join(directory, target))
            fsync_dir(directory)
            logger.warning(f"Completed the interrupted save of {os.path.join(directory, target)}")
            continue
        shutil.rmtree(path, ignore_errors=True)
    remove_stale_temp_files(directory)


def _safetensors_marker(info: object, file: str) -> tuple[str, str | None, dict[str, Any]]:
    """(weights file name, save id, non-tensor model state) of a ``.pth`` written with ``format="safetensors"``."""
    if isinstance(info, dict) and info.get("format") == "safetensors":
        weights, save_id, extra = info.get("weights"), info.get("save_id"), info.get("model_extra") or {}
        valid_id = save_id is None or isinstance(save_id, str)
        if isinstance(weights, str) and _name_problem(weights) is None and valid_id and isinstance(extra, dict):
            return weights, save_id, extra
    raise CheckpointError(
        f"Checkpoint file {file} holds a malformed safetensors marker (or the marker of another kind of checkpoint)",
        file,
        "corrupt",
    )


def _safetensors_can_hold(value: object) -> bool:
    """A dense tensor with data: what a safetensors file stores (sparse, quantized, nested and meta tensors go to
    the ``.pth`` with the non-tensor model state)."""
    if not isinstance(value, torch.Tensor):
        return False
    return value.layout == torch.strided and not (value.is_quantized or value.is_nested or value.is_meta)


def _numeric_array(value: object) -> bool:
    """A numpy array or scalar that converts to a tensor (numbers or booleans; not strings or objects)."""
    np = sys.modules.get("numpy")
    if np is None:
        return False
    if isinstance(value, np.ndarray):
        return value.dtype.kind in "biufc"
    return isinstance(value, (np.number, np.bool_))


def _valid_metadata(metadata: object) -> bool:
    """torch's per-module ``_metadata`` of a state dict: absent, or module path -> dict (e.g. ``{"version": 1}``)."""
    if metadata is None:
        return True
    return isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, dict) for k, v in metadata.items())


def _model_state_dict(checkpoint: dict[str, Any], file: str) -> dict[str, Any]:
    """``checkpoint.pop("model")`` once it is known to be a state dict: string keys, tensor (or numeric numpy)
    values except ``*_extra_state`` entries, which a module's ``set_extra_state`` receives as saved."""
    if "model" not in checkpoint:
        found = ", ".join(repr(k) for k in list(checkpoint)[:8]) or "nothing"
        raise CheckpointError(
            f"Checkpoint {file} holds no model state (no 'model' key; it holds {found})", file, "incompatible"
        )
    state = checkpoint.pop("model")
    problem = None
    if not isinstance(state, dict):
        problem = f"'model' is a {type(state).__name__} where a state dict belongs"
    elif not all(isinstance(k, str) for k in state):
        bad = next(k for k in state if not isinstance(k, str))
        problem = f"the model state dict has a {type(bad).__name__} key {bad!r} where names are strings"
    elif not _valid_metadata(state_dict_metadata(state)):
        problem = "the model state dict carries malformed _metadata"
    else:
        for key, value in state.items():
            if not (isinstance(value, torch.Tensor) or _numeric_array(value) or key.endswith("_extra_state")):
                problem = f"model state {key!r} is a {type(value).__name__} where a tensor belongs"
                break
    if problem is not None:
        raise CheckpointError(f"Checkpoint {file} is not a valid checkpoint: {problem}", file, "corrupt")
    return state


def _tensor_kind(t: torch.Tensor) -> str:
    if t.is_nested:
        return "nested"
    if t.is_quantized:
        return "quantized"
    if t.is_meta:
        return "meta (holds no data)"
    return str(t.layout).removeprefix("torch.")


def _tensor_kind_mismatch(model_tensor: torch.Tensor, saved: torch.Tensor) -> str | None:
    """Why ``saved`` cannot be copied into ``model_tensor`` whatever its shape (sparse, quantized, nested, meta)."""
    want, got = _tensor_kind(model_tensor), _tensor_kind(saved)
    if want == got:
        return None
    if model_tensor.is_meta:
        return (
            "would be copied into a tensor on the meta device, which holds no data (the copy does nothing); "
            "materialize the model first, e.g. model.to_empty(device='cpu')"
        )
    return f"is a {got} tensor where the model holds a {want} one"


class Checkpointer:
    """Save and load a model together with other objects that have ``state_dict()`` / ``load_state_dict()``.

    Args:
        model: the model; DataParallel / DistributedDataParallel wrappers (at the root or nested inside) are
            looked through, so saved keys never carry the wrappers' ``module.`` segments.
        save_dir: where checkpoints go; ``""`` disables saving.
        save_to_disk: ``False`` disables saving (fvcore's way to write only from the main process).
        weights_only: read checkpoints with ``torch.load(weights_only=True)`` (default): tensors, plain containers
            and numbers, numpy arrays / scalars / dtypes; anything else is refused with a :class:`CheckpointError`.
            ``False`` unpickles arbitrary objects and must only be used for trusted files.
        format: ``"pth"`` (default, fvcore's layout) or ``"safetensors"`` (model weights in ``<name>.safetensors``).
        sharded: save through ``torch.distributed.checkpoint`` into ``<name>/``; ``None`` (default) does so when
            the model has DTensor parameters (FSDP2 ``fully_shard``, tensor parallel).
        safe_globals: extra classes / functions allowed when reading with ``weights_only=True``.
        **checkpointables: objects saved and restored with the model, e.g. ``optimizer=opt, scheduler=sched``.
    """

    def __init__(
        self,
        model: nn.Module,
        save_dir: str | os.PathLike[str] = "",
        *,
        save_to_disk: bool = True,
        weights_only: bool = True,
        format: str = "pth",
        sharded: bool | None = None,
        safe_globals: Sequence[Any] = (),
        **checkpointables: Any,
    ) -> None:
        self.model = unwrap_model(model)
        self.checkpointables: dict[str, Any] = {}
        for key, obj in checkpointables.items():
            self.add_checkpointable(key, obj)
        self.logger = logger
        self.save_dir = os.fspath(save_dir)
        self.save_to_disk = save_to_disk
        self.weights_only = weights_only
        self.format = self._check_format(format)
        self.sharded = sharded
        self.safe_globals = list(safe_globals)
        self._load_weights_only = weights_only
        self._said_unloadable: set[str] = set()

    # --- registration ---------------------------------------------------------------------------------------------

    def add_checkpointable(self, key: str, checkpointable: Any) -> None:
        """Register another object to save and load under ``key``."""
        if key in self.checkpointables:
            raise InvalidNameError(f"Key {key} already used in the Checkpointer")
        if key in _OWN_ENTRIES:
            raise InvalidNameError(f"Key {key} is the checkpoint's own entry (the model state); register it under "
                                   "another name")
        if not hasattr(checkpointable, "state_dict"):
            raise InvalidTypeError("add_checkpointable needs an object with 'state_dict()' method.")
        self.checkpointables[key] = checkpointable

    # --- saving ---------------------------------------------------------------------------------------------------

    def save(self, name: str, format: str | None = None, **kwargs: Any) -> None:
        """Save model and checkpointables (plus ``kwargs``) as ``<save_dir>/<name>.pth`` and tag it as the last one.

        Under an initialized process group this is a collective: call it on every rank. Plain checkpoints are
        written by rank 0 only and every rank waits for it; sharded ones are written by all ranks.
        The write is atomic: a crash at any moment leaves the previous checkpoint and ``last_checkpoint`` valid.
        """
        _check_name(name)
        fmt = self._check_format(format if format is not None else self.format)
        self._check_extra_keys(kwargs)
        if self._is_sharded():
            self._save_sharded(name, kwargs)
            return
        try:
            if self.is_writer():
                self._save_plain(name, fmt, kwargs)
        finally:
            if self.save_dir:
                _barrier()

    def _check_extra_keys(self, kwargs: dict[str, Any]) -> None:
        """Extra data stored next to the model may not take the place of what the checkpointer stores itself."""
        for key in kwargs:
            if key in _OWN_ENTRIES or key in self.checkpointables:
                raise InvalidValueError(
                    f"save(): extra data {key!r} would replace the checkpoint's own {key!r} entry; use another name"
                )

    def _save_plain(self, name: str, fmt: str, kwargs: dict[str, Any]) -> None:
        basename = f"{name}.pth"
        save_file = os.path.join(self.save_dir, basename)
        model_state = unwrap_state_dict(self.model, self.model.state_dict())
        data: dict[str, Any] = {}
        weights_file = os.path.join(self.save_dir, f"{name}.safetensors")
        tensors: dict[str, torch.Tensor] = {}
        save_id = uuid.uuid4().hex
        if fmt == "safetensors":
            tensors = {k: v for k, v in model_state.items() if _safetensors_can_hold(v)}
            others = {k: v for k, v in model_state.items() if k not in tensors}
            data[_MARKER] = {
                "format": "safetensors",
                "weights": os.path.basename(weights_file),
                "save_id": save_id,
                "model_extra": others,
            }
        else:
            data["model"] = model_state
        for key, obj in self.checkpointables.items():
            data[key] = obj.state_dict()
        data.update(kwargs)
        self.logger.info(f"Saving checkpoint to {save_file}")
        with _writing(save_file):
            os.makedirs(self.save_dir, exist_ok=True)
            with self._save_lock():
                _tidy_interrupted_saves(self.save_dir)
                if fmt == "safetensors":
                    self._write_pair(weights_file, safetensors_bytes(tensors, save_id), save_file, data)
                else:
                    atomic_write(save_file, lambda f: torch.save(data, f))
                    _remove_if_present(weights_file)  # from an earlier save of the same name in the other format
                    _remove_previous_weights(weights_file)
                self.tag_last_checkpoint(basename)
        self._check_loadable(save_file, kwargs)

    def _check_loadable(self, file: str, extra: dict[str, Any]) -> None:
        """Warn (once per kind of object) when this checkpointer's weights-only loading will refuse ``file``: then
        resuming fails, and it is better to learn that at the first save than at the restart."""
        if not self.weights_only:
            return
        detail = refused_import(file, self.safe_globals)
        if detail is None or detail in self._said_unloadable:
            return
        self._said_unloadable.add(detail)
        self.logger.warning(
            f"Saved {file}, but this Checkpointer will refuse to load it: {detail} (weights_only=True). Store plain "
            f"data in the extra state ({', '.join(map(repr, extra)) or 'none'}; e.g. str(path), vars(namespace)) "
            "or the checkpointables, or pass Checkpointer(..., safe_globals=[...]) with the classes it needs."
        )

    def _save_lock(self) -> Any:
        """The lock every save into ``save_dir`` holds while it changes files there: ``flock`` on the directory."""
        return directory_lock(self.save_dir or ".")

    @staticmethod
    def _write_pair(weights_file: str, blob: bytes, save_file: str, data: dict[str, Any]) -> None:
        """Weights first, then the ``.pth`` that names them. The weights being replaced are kept under their save
        id until the new ``.pth`` is in place, so that the old ``.pth`` still finds them after a crash in between;
        if the ``.pth`` cannot be written, the old weights are put back (or a weights file new to this save goes)."""
        new_name = not os.path.exists(weights_file)
        backup = _keep_previous_weights(weights_file)
        atomic_write(weights_file, lambda f: f.write(blob))
        try:
            atomic_write(save_file, lambda f: torch.save(data, f))
        except BaseException:
            with contextlib.suppress(OSError):
                if backup is not None:
                    os.replace(backup, weights_file)
                elif new_name:
                    os.remove(weights_file)
            raise
        _remove_previous_weights(weights_file)

    def _save_sharded(self, name: str, kwargs: dict[str, Any]) -> None:
        if name == LAST_CHECKPOINT:
            raise InvalidValueError(f"Checkpoint name {name!r} is the file that names the newest checkpoint")
        if not self.save_dir or not self.save_to_disk:
            return
        _, rank, _ = _dist_state()
        final = os.path.join(self.save_dir, name)
        partial = os.path.join(self.save_dir, hidden_name(name, _PARTIAL))
        with contextlib.ExitStack() as lock:
            if rank == 0:  # holds the save lock until every rank is done
                with _writing(final):
                    os.makedirs(self.save_dir, exist_ok=True)
                    lock.enter_context(self._save_lock())
                    _tidy_interrupted_saves(self.save_dir)  # also what a killed save of this name left
                    os.makedirs(partial)
                self.logger.info(f"Saving checkpoint to {final}")
            self._write_sharded(name, final, partial, rank, kwargs)

    def _write_sharded(self, name: str, final: str, partial: str, rank: int, kwargs: dict[str, Any]) -> None:
        """Every rank writes its shards into ``partial``; rank 0 adds ``extra.pth`` (the partial is complete once
        it is there), renames ``partial`` to ``final`` and tags it."""
        from ._dcp import save_sharded

        _barrier()
        optimizers = {k: v for k, v in self.checkpointables.items() if isinstance(v, torch.optim.Optimizer)}
        done = False
        try:
            with _writing(final):
                save_sharded(partial, self.model, optimizers)
                if rank == 0:
                    data: dict[str, Any] = {_MARKER: {"format": "dcp", "optimizers": list(optimizers)}}
                    for key, obj in self.checkpointables.items():
                        if key not in optimizers:
                            data[key] = obj.state_dict()
                    data.update(kwargs)
                    atomic_write(os.path.join(partial, _SHARDED_EXTRA), lambda f: torch.save(data, f))
                    self._replace_dir(partial, final)
                    self.tag_last_checkpoint(name)
                    self._check_loadable(os.path.join(final, _SHARDED_EXTRA), kwargs)
            done = True
        finally:
            _barrier()
            if rank == 0 and not done:
                shutil.rmtree(partial, ignore_errors=True)  # the shards written so far (a full disk stays full)

    @staticmethod
    def _replace_dir(src: str, dst: str) -> None:
        """Rename the complete ``src`` to ``dst``. An existing ``dst`` is swapped with ``src`` in one step where the
        platform can (Linux), else moved aside first: a crash between those two renames leaves ``dst`` missing and
        ``src`` complete, and the next save or resume renames it into place."""
        old = None
        if os.path.exists(dst):
            old = _aside_path(dst)
            if exchange(src, dst):
                os.replace(src, old)  # src now holds the old checkpoint
            else:
                os.replace(dst, old)
                os.replace(src, dst)
        else:
            os.replace(src, dst)
        fsync_dir(os.path.dirname(dst))
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def tag_last_checkpoint(self, last_filename_basename: str) -> None:
        """Atomically write ``last_filename_basename`` (no newline) to ``<save_dir>/last_checkpoint``."""
        _check_name(last_filename_basename, "last_checkpoint entry")
        os.makedirs(self.save_dir or ".", exist_ok=True)
        data = last_filename_basename.encode("utf-8")
        atomic_write(os.path.join(self.save_dir, LAST_CHECKPOINT), lambda f: f.write(data))

    # --- finding checkpoints --------------------------------------------------------------------------------------

    def has_checkpoint(self) -> bool:
        """Whether ``save_dir`` has a ``last_checkpoint`` file."""
        return os.path.exists(os.path.join(self.save_dir, LAST_CHECKPOINT))

    def get_checkpoint_file(self) -> str:
        """The checkpoint ``last_checkpoint`` names, joined with ``save_dir``; ``""`` if there is none.

        Raises :class:`CheckpointError` if ``last_checkpoint`` cannot be read or is empty (``reason="corrupt"``),
        or names anything but a file or directory inside ``save_dir`` — a path, ``..``, an absolute path, a
        symlink that leads out (``reason="unsafe"``).
        """
        pointer = os.path.join(self.save_dir, LAST_CHECKPOINT)
        try:
            with open(pointer, "rb") as f:
                raw = f.read(4096)
        except FileNotFoundError:
            return ""
        except OSError as exc:
            raise CheckpointError(f"{pointer} cannot be read ({exc.strerror or exc})", pointer, "corrupt") from exc
        try:
            last_saved = raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            last_saved = ""
        if not last_saved or any(ord(c) < 32 for c in last_saved):
            raise CheckpointError(f"{pointer} does not name a checkpoint (it holds {raw[:80]!r})", pointer, "corrupt")
        path = os.path.join(self.save_dir, last_saved)
        problem = _name_problem(last_saved)
        if problem is not None:
            raise self._outside_error(path, f"{pointer} names {last_saved!r}, which {problem}")
        if not is_inside(self.save_dir, last_saved):
            raise self._outside_error(path, f"{pointer} names a symlink that leads out of the directory")
        return path

    def _outside_error(self, path: str, why: str) -> CheckpointError:
        return CheckpointError(
            f"Refused to load {path}: {why}. Resuming loads only checkpoints inside {self.save_dir or '.'}; "
            "nothing was loaded (check who wrote these files).",
            path,
            "unsafe",
        )

    def get_all_checkpoint_files(self) -> list[str]:
        """Every ``*.pth`` file in ``save_dir``, plus sharded ``<name>/`` checkpoint directories."""
        try:
            names = sorted(os.listdir(self.save_dir or "."))
        except OSError:
            return []
        result = []
        for name in names:
            path = os.path.join(self.save_dir, name)
            is_file = name.endswith(".pth") and os.path.isfile(path)
            if is_file or (not name.startswith(".") and _is_dcp_checkpoint(path)):
                result.append(path)
        return result

    # --- loading --------------------------------------------------------------------------------------------------

    def resume_or_load(self, path: str | os.PathLike[str], *, resume: bool = True) -> dict[str, Any]:
        """Resume from ``last_checkpoint`` (model and every checkpointable) if ``resume`` and there is one;
        otherwise load only the model from ``path``.

        If the last checkpoint is missing, truncated or corrupt, falls back — with a warning — to the newest
        checkpoint in ``save_dir`` that loads. A checkpoint refused as unsafe is never skipped silently.
        """
        if resume:
            self._settle_leftovers()
        if not (resume and self.has_checkpoint()):
            return self.load(path, checkpointables=[])
        last = os.path.join(self.save_dir, LAST_CHECKPOINT)  # named in errors until it names a checkpoint
        try:
            last = self.get_checkpoint_file()
            return self.load(last)
        except CheckpointError as exc:
            if exc.reason == "unsafe":
                raise
            first_error = exc
        self.logger.warning(
            f"Could not resume from the last checkpoint: {first_error} — "
            f"falling back to the newest checkpoint in {self.save_dir} that loads."
        )
        for candidate in self._fallback_candidates(exclude=last):
            if not is_inside(self.save_dir, os.path.basename(candidate)):
                raise self._outside_error(candidate, "it is a symlink that leads out of the directory")
            try:
                result = self.load(candidate)
            except CheckpointError as exc:
                if exc.reason == "unsafe":
                    raise
                self.logger.warning(f"Skipping {candidate}: {exc}")
                continue
            self.logger.warning(f"Resumed from {candidate} instead of {last}.")
            return result
        raise CheckpointError(
            f"No checkpoint in {self.save_dir} could be loaded (the last one, {last}, failed: {first_error})",
            last,
            first_error.reason,
        )

    def _settle_leftovers(self) -> None:
        """Complete or remove what killed sharded saves left in ``save_dir``, waiting for a save in progress."""
        if not (self.save_dir and _sharded_leftovers(self.save_dir)):
            return
        try:
            with self._save_lock():
                _tidy_interrupted_saves(self.save_dir)
        except OSError as exc:  # e.g. a read-only save_dir: resume from what is there
            self.logger.warning(f"Could not tidy up interrupted saves in {self.save_dir}: {exc}")

    def _fallback_candidates(self, exclude: str) -> list[str]:
        excluded = os.path.abspath(exclude)
        found = []
        for path in self.get_all_checkpoint_files():
            if os.path.abspath(path) == excluded:
                continue
            try:
                mtime = os.stat(path).st_mtime_ns
            except OSError:
                continue
            found.append((mtime, path))
        return [p for _, p in sorted(found, reverse=True)]

    def load(
        self,
        path: str | os.PathLike[str],
        checkpointables: list[str] | None = None,
        *,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load the model and the given checkpointables (all if ``None``) from ``path``.

        ``path`` may be a ``.pth`` / ``.safetensors`` file, a sharded checkpoint directory, or an ``http(s)://``
        URL (downloaded once into the cache). Returns what was not consumed (e.g. ``{"iteration": 5}``).
        """
        path = os.fspath(path)
        if not path:
            self.logger.info("No checkpoint found. Initializing model from scratch")
            return {}
        keys = list(self.checkpointables) if checkpointables is None else list(checkpointables)
        unknown = [k for k in keys if k not in self.checkpointables]
        if unknown:
            raise InvalidNameError(
                f"load(checkpointables=...) names {unknown}, which are not registered with this Checkpointer"
            )
        self.logger.info(f"[Checkpointer] Loading from {path} ...")
        self._load_weights_only = self.weights_only if weights_only is None else weights_only
        try:
            local = self._local_path(path)
            if _is_dcp_checkpoint(local):
                return self._load_sharded(path, local, keys)
            checkpoint = self._read_checkpoint(path, local)
            incompatible = self._load_model(checkpoint, file=local)
            if incompatible is not None:
                self._log_incompatible_keys(incompatible)
            for key in keys:
                if key in checkpoint:
                    self.logger.info(f"Loading {key} from {path} ...")
                    self._load_checkpointable(key, checkpoint.pop(key), local)
            return checkpoint
        finally:
            self._load_weights_only = self.weights_only

    def _load_checkpointable(self, key: str, state: Any, file: str) -> None:
        obj = self.checkpointables[key]
        try:
            obj.load_state_dict(state)
        except Exception as exc:
            raise CheckpointError(
                f"Checkpoint {file}: the saved {key!r} state cannot be loaded into the {type(obj).__name__} "
                f"({type(exc).__name__}: {first_line(exc)})",
                file,
                "incompatible",
            ) from exc

    def _local_path(self, path: str) -> str:
        if not _is_url(path):
            return path
        try:
            from modelmeter.io import PathManager
        except ImportError as exc:  # pragma: no cover - modelmeter.io ships with the package
            raise CheckpointError(
                f"Loading {path} needs modelmeter.io, which is not available", path, "missing"
            ) from exc
        try:
            return str(PathManager.get_local_path(path))
        except Exception as exc:
            raise CheckpointError(
                f"Checkpoint {path} could not be downloaded ({type(exc).__name__}: {exc})", path, "missing"
            ) from exc

    def _load_file(self, f: str) -> dict[str, Any]:
        """Read one checkpoint file into a dict (subclasses may override, as with fvcore)."""
        data = torch_load(f, weights_only=self._load_weights_only, extra_globals=self.safe_globals)
        if not isinstance(data, dict):
            raise CheckpointError(
                f"Checkpoint file {f} does not hold a dict (found {type(data).__name__})", f, "corrupt"
            )
        return data

    def _read_checkpoint(self, path: str, local: str) -> dict[str, Any]:
        """The checkpoint dict with the model state under ``"model"``, whatever the format."""
        if local.endswith(".safetensors"):
            companion = local[: -len(".safetensors")] + ".pth"
            if not os.path.isfile(companion):
                return {"model": OrderedDict(load_safetensors(local, None))}
            path, local = path[: -len(".safetensors")] + ".pth", companion
        checkpoint = self._load_file(local)
        info = checkpoint.pop(_MARKER, None)
        if info is not None:
            weights_name, save_id, model_extra = _safetensors_marker(info, local)
            if _is_url(path):
                weights_local = self._local_path(urllib.parse.urljoin(path, urllib.parse.quote(weights_name)))
            else:
                weights_local = self._local_weights(os.path.join(os.path.dirname(local), weights_name), save_id)
            model_state: dict[str, Any] = OrderedDict(load_safetensors(weights_local, save_id))
            model_state.update(model_extra)
            checkpoint = {"model": model_state, **checkpoint}
        elif "model" not in checkpoint and checkpoint and all(isinstance(v, torch.Tensor) for v in checkpoint.values()):
            self.logger.info(f"{path} holds a bare state dict; loading it as the model state")
            checkpoint = {"model": checkpoint}
        return checkpoint

    @staticmethod
    def _local_weights(weights_file: str, save_id: str | None) -> str:
        """``weights_file``, or the copy of it an overwrite kept under ``save_id`` (the overwrite was killed after
        replacing the weights but before replacing the ``.pth`` that names them)."""
        kept = _previous_weights(weights_file, save_id) if save_id and save_id.isalnum() else ""
        return kept if kept and os.path.isfile(kept) else weights_file

    def _load_sharded(self, path: str, local: str, keys: list[str]) -> dict[str, Any]:
        from ._dcp import load_sharded

        extra_file = os.path.join(local, _SHARDED_EXTRA)
        if os.path.lexists(extra_file) and not is_inside(local, _SHARDED_EXTRA):
            raise unsafe_error(extra_file, "it is a symlink that leads out of the checkpoint directory")
        extra = self._load_file(extra_file) if os.path.isfile(extra_file) else {}
        info = extra.pop(_MARKER, None) or {}
        saved = info.get("optimizers", []) if isinstance(info, dict) else None
        if not isinstance(saved, list) or not all(isinstance(k, str) for k in saved):
            raise CheckpointError(
                f"Checkpoint file {extra_file} holds a malformed sharded-checkpoint marker", extra_file, "corrupt"
            )
        saved_optimizers = set(saved)
        optimizers = {
            k: self.checkpointables[k]
            for k in keys
            if k in saved_optimizers and isinstance(self.checkpointables[k], torch.optim.Optimizer)
        }
        missing, unexpected, incorrect = load_sharded(
            local, self.model, optimizers, weights_only=self._load_weights_only
        )
        for key in optimizers:
            self.logger.info(f"Loading {key} from {path} ...")
        self._log_incompatible_keys(_IncompatibleKeys(missing, unexpected, incorrect))
        for key in keys:
            if key in extra:
                self.logger.info(f"Loading {key} from {path} ...")
                self._load_checkpointable(key, extra.pop(key), extra_file)
        return extra

    def _load_model(self, checkpoint: dict[str, Any], file: str = "") -> _IncompatibleKeys:
        """Load ``checkpoint.pop("model")`` into the model, skipping tensors whose shapes differ.

        The whole state is checked before anything is copied: content that cannot be a state dict of tensors
        (``reason="corrupt"``) or tensors of another kind than the model's (``reason="incompatible"``) raise a
        :class:`CheckpointError` naming ``file`` and leave the model unchanged.
        """
        checkpoint_state_dict = _model_state_dict(checkpoint, file)
        self._convert_ndarray_to_tensor(checkpoint_state_dict)
        model_state_dict = self.model.state_dict()
        # Checkpoints written from a DataParallel / DDP model by other code carry a uniform "module." prefix.
        strip_wrapper_prefixes(checkpoint_state_dict, model_state_dict)
        # Wrappers nested inside this model: map the unwrapped names the checkpoint uses to the model's names.
        clean = clean_key_map(self.model, model_state_dict)
        if clean:
            actual_of = {c: a for a, c in clean.items()}
            for key in list(checkpoint_state_dict):
                if key not in model_state_dict and key in actual_of:
                    checkpoint_state_dict[actual_of[key]] = checkpoint_state_dict.pop(key)

        incorrect_shapes: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
        for key in list(checkpoint_state_dict):
            if key not in model_state_dict:
                continue
            model_param = model_state_dict[key]
            ckpt_param = checkpoint_state_dict[key]
            if isinstance(model_param, nn.parameter.UninitializedParameter):
                continue  # lazy modules take whatever shape the checkpoint has
            if not isinstance(model_param, torch.Tensor) or not isinstance(ckpt_param, torch.Tensor):
                continue
            mismatch = _tensor_kind_mismatch(model_param, ckpt_param)
            if mismatch is not None:
                raise CheckpointError(
                    f"Checkpoint {file}: model state {key!r} {mismatch}; nothing was loaded", file, "incompatible"
                )
            shape_model, shape_checkpoint = tuple(model_param.shape), tuple(ckpt_param.shape)
            if shape_model != shape_checkpoint:
                if self._is_quantization_observer(key):
                    continue  # per-channel observers resize themselves
                incorrect_shapes.append((key, shape_checkpoint, shape_model))
                checkpoint_state_dict.pop(key)
        try:
            incompatible = self.model.load_state_dict(checkpoint_state_dict, strict=False)
        except Exception as exc:  # e.g. a module's set_extra_state refusing its saved extra state
            raise CheckpointError(
                f"Checkpoint {file}: the model state cannot be loaded into the model "
                f"({type(exc).__name__}: {first_line(exc)})",
                file,
                "incompatible",
            ) from exc
        return _IncompatibleKeys(
            missing_keys=list(incompatible.missing_keys),
            unexpected_keys=list(incompatible.unexpected_keys),
            incorrect_shapes=incorrect_shapes,
        )

    def _is_quantization_observer(self, key: str) -> bool:
        module_path = key.rpartition(".")[0]
        try:
            module = self.model.get_submodule(module_path)
            from torch.ao.quantization import FakeQuantizeBase, ObserverBase
        except (AttributeError, ImportError):
            return False
        return isinstance(module, (ObserverBase, FakeQuantizeBase))

    def _log_incompatible_keys(self, incompatible: _IncompatibleKeys) -> None:
        """Warn about mis-shaped, missing (not counting shared tensors loaded under another name) and unused keys."""
        names = clean_key_map(
            self.model,
            [
                *incompatible.missing_keys,
                *incompatible.unexpected_keys,
                *(k for k, _, _ in incompatible.incorrect_shapes),
            ],
        )
        for key, shape_checkpoint, shape_model in incompatible.incorrect_shapes:
            self.logger.warning(
                f"Skip loading parameter '{names.get(key, key)}' to the model due to incompatible shapes: "
                f"{shape_checkpoint} in the checkpoint but {shape_model} in the model! "
                "You might want to double check if this is expected."
            )
        if incompatible.missing_keys:
            missing_keys = filter_reused_missing_keys(self.model, incompatible.missing_keys)
            if missing_keys:
                self.logger.warning(get_missing_parameters_message(names.get(k, k) for k in missing_keys))
        if incompatible.unexpected_keys:
            self.logger.warning(
                get_unexpected_parameters_message(names.get(k, k) for k in incompatible.unexpected_keys)
            )

    @staticmethod
    def _convert_ndarray_to_tensor(state_dict: dict[str, Any]) -> None:
        """In place: numpy arrays (and numpy scalars) in a model state dict become tensors."""
        try:
            import numpy as np
        except ImportError:  # pragma: no cover
            np = None  # type: ignore[assignment]
        for key in list(state_dict):
            value = state_dict[key]
            if isinstance(value, torch.Tensor) or key.endswith("_extra_state"):
                continue
            if np is not None and isinstance(value, np.ndarray):
                state_dict[key] = torch.from_numpy(value)
            elif np is not None and isinstance(value, np.generic):
                state_dict[key] = torch.as_tensor(np.asarray(value))
            else:
                raise InvalidValueError(f"Unsupported type found in checkpoint! {key}: {type(value)}")

    # --- where and who --------------------------------------------------------------------------------------------

    def is_writer(self) -> bool:
        """Whether this process writes plain checkpoints and ``last_checkpoint`` (and deletes old ones): rank 0,
        with a ``save_dir`` and ``save_to_disk``."""
        _, rank, _ = _dist_state()
        return bool(self.save_dir) and self.save_to_disk and rank == 0

    def path_for(self, name: str) -> str:
        """Where ``save(name)`` puts the checkpoint: ``<save_dir>/<name>.pth``, or the directory ``<save_dir>/<name>``
        of a sharded one."""
        return os.path.join(self.save_dir, name if self._is_sharded() else f"{name}.pth")

    # --- helpers --------------------------------------------------------------------------------------------------

    def _is_sharded(self) -> bool:
        return self.sharded if self.sharded is not None else _has_dtensor(self.model)

    @staticmethod
    def _check_format(fmt: str) -> str:
        if fmt not in _FORMATS:
            raise InvalidValueError(f"Unknown checkpoint format {fmt!r}; expected one of {', '.join(_FORMATS)}")
        return fmt


class PeriodicCheckpointer:
    """Save every ``period`` iterations as ``<file_prefix>_<iteration:07d>`` and at ``max_iter - 1`` as
    ``<file_prefix>_final``, keeping at most ``max_to_keep`` periodic checkpoints.

    Retention also covers checkpoints an earlier run of the same job left in ``save_dir`` (same prefix, lower
    iteration number, oldest first); it never deletes the checkpoint ``last_checkpoint`` names nor the final one.
    """

    def __init__(
        self,
        checkpointer: Checkpointer,
        period: int,
        max_iter: int | None = None,
        max_to_keep: int | None = None,
        file_prefix: str = "model",
    ) -> None:
        self.checkpointer = checkpointer
        self.period = _positive_int(period, "period")
        self.max_iter = max_iter
        if max_to_keep is not None and max_to_keep <= 0:
            raise InvalidValueError(f"max_to_keep must be positive, got {max_to_keep}")
        _check_name(file_prefix, "file_prefix")
        self.max_to_keep = max_to_keep
        self.recent_checkpoints: list[str] = []
        self.file_prefix = file_prefix
        self._pattern = re.compile(rf"^{re.escape(file_prefix)}_(\d{{7,}})(\.pth|\.safetensors)?$")
        self._adopted_earlier_run = False

    def step(self, iteration: int, **kwargs: Any) -> None:
        """Save if ``iteration`` is at the end of a period, and the final checkpoint at the last iteration."""
        iteration = int(iteration)
        additional_state = {"iteration": iteration, **kwargs}
        if (iteration + 1) % self.period == 0:
            name = f"{self.file_prefix}_{iteration:07d}"
            self.checkpointer.save(name, **additional_state)
            if self.max_to_keep is not None:
                self._retain(self.checkpointer.path_for(name), iteration)
        if self.max_iter is not None and iteration >= self.max_iter - 1:
            self.checkpointer.save(f"{self.file_prefix}_final", **additional_state)

    def save(self, name: str, **kwargs: Any) -> None:
        """Same as ``checkpointer.save(name, **kwargs)``."""
        self.checkpointer.save(name, **kwargs)

    def _earlier_run_files(self, iteration: int) -> Iterator[str]:
        save_dir = self.checkpointer.save_dir
        try:
            names = os.listdir(save_dir)
        except OSError:
            return
        found = []
        for name in names:
            match = self._pattern.match(name)
            if not match or int(match.group(1)) >= iteration:
                continue
            path = os.path.join(save_dir, name)
            suffix = match.group(2)
            if suffix == ".safetensors" and os.path.exists(path[: -len(suffix)] + ".pth"):
                continue  # removed together with its .pth; only weights whose save never finished count alone
            if suffix or os.path.isdir(path):
                found.append((int(match.group(1)), path))
        yield from (p for _, p in sorted(found))

    def _retain(self, current: str, iteration: int) -> None:
        if not self._adopted_earlier_run:
            self._adopted_earlier_run = True
            earlier = [p for p in self._earlier_run_files(iteration) if p not in self.recent_checkpoints]
            self.recent_checkpoints[:0] = earlier
        if current in self.recent_checkpoints:
            self.recent_checkpoints.remove(current)
        self.recent_checkpoints.append(current)
        assert self.max_to_keep is not None
        while len(self.recent_checkpoints) > self.max_to_keep:
            to_delete = self.recent_checkpoints.pop(0)
            if self.checkpointer.is_writer():  # under the saves' lock: another process may be naming it
                with directory_lock(self.checkpointer.save_dir or "."):
                    self._delete_unless_protected(to_delete)

    def _delete_unless_protected(self, to_delete: str) -> None:
        """Delete an old checkpoint unless ``last_checkpoint`` names it or it is the final one."""
        try:
            protected = os.path.abspath(self.checkpointer.get_checkpoint_file() or os.devnull)
        except CheckpointError:
            protected = os.devnull  # last_checkpoint does not name a checkpoint in save_dir: nothing to spare
        stem = os.path.basename(to_delete)
        for suffix in (".pth", ".safetensors"):
            stem = stem.removesuffix(suffix)
        if os.path.abspath(to_delete) == protected or stem == f"{self.file_prefix}_final":
            return
        if os.path.exists(to_delete):
            _remove_checkpoint(to_delete)
