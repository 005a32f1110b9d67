"""Follow every tensor storage of a run: when an operator made it, when autograd saved it, when it was freed.

A storage is seen through the tensors the recorded operators return; its end is observed with a weak
reference, whose callback runs the moment the storage is deallocated — on FakeTensors and meta tensors
exactly as it would for real ones, since Python frees them by the same reference counts. Nothing here keeps
a tensor or a storage alive.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from .._torch_compat import local_tensor
from .metadata import device_name, dtype_name
from .trace import Storage, StorageKind


class StorageTracker:
    """Storages by identity while they live, and the :class:`Storage` records they leave.

    ``clock`` returns the number of events recorded so far: the time stamps of births, saves and deaths.
    """

    def __init__(self, clock: Callable[[], int]) -> None:
        self.clock = clock
        self.records: list[Storage] = []
        self._live: dict[int, Storage] = {}  # id(storage object) -> its record, while it lives
        self._refs: dict[Any, int] = {}  # weak reference -> id(storage object)
        self.open = True
        self._gradients = 0
        self._on_free = self._freed  # one bound method for every weak reference

    def _record(self, tensor: torch.Tensor, kind: StorageKind, born: int) -> Storage | None:
        """The record of ``tensor``'s storage, made now (born at ``born``) when it is new; of a DTensor, its shard's
        on this rank (the storage it holds: FSDP2's padded one)."""
        if type(tensor) is not torch.Tensor:
            tensor = local_tensor(tensor)
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested and other storage-less layouts
            return None
        key = id(storage)
        record = self._live.get(key)
        if record is not None:
            record.nbytes = max(record.nbytes, storage.nbytes())  # resize_ grew it
            return record
        record = self._live[key] = Storage(storage.nbytes(), dtype_name(tensor.dtype), device_name(tensor), kind, born)
        self.records.append(record)
        self._refs[weakref.ref(storage, self._on_free)] = key
        return record

    def _freed(self, ref: Any) -> None:
        record = self._live.pop(self._refs.pop(ref), None)
        if record is not None and self.open:
            record.died = self.clock()

    def knows(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s storage has a record (it was seen, and lives)."""
        return id(tensor.untyped_storage()) in self._live

    def existing(self, tensor: torch.Tensor, kind: StorageKind) -> None:
        """A storage that is there before the run starts (model state, inputs)."""
        self._record(tensor, kind, -1)

    def outputs(self, result: Any, event: int, kind: StorageKind = "activation") -> None:
        """The storages of an operator's outputs: new ones were allocated by event ``event``."""
        if isinstance(result, torch.Tensor):
            self._record(result, kind, event)
        elif isinstance(result, (tuple, list)):
            for item in result:
                self.outputs(item, event, kind)

    def saved(self, tensor: torch.Tensor, scope: int) -> None:
        """Autograd saved ``tensor`` for the backward pass, under module scope ``scope`` (a storage not seen
        before existed before the run)."""
        record = self._record(tensor, "input", -1)
        if record is not None and record.saved < 0:
            record.saved, record.saved_scope = self.clock(), scope

    def gradient(self, tensor: torch.Tensor) -> None:
        """``tensor`` is a parameter's gradient; call in the model's parameter order."""
        record = self._record(tensor, "gradient", -1)
        if record is not None:
            record.kind, record.order = "gradient", self._gradients
            self._gradients += 1

    def close(self) -> list[Storage]:
        """Stop following: storages alive now outlive the run. Returns the records."""
        self.open = False
        self._live.clear()
        self._refs.clear()  # the weak references go, and their callbacks with them: tearing the run down is free
        return self.records

