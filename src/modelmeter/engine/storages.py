"""Follow every tensor storage of a run: when an operator made it, when autograd saved it, when it was freed.

A storage is seen through the tensors the recorded operators return; its end is observed with a weak
reference, whose callback runs the moment the storage is deallocated — on FakeTensors and meta tensors
exactly as it would for real ones, since Python frees them by the same reference counts. Nothing here keeps
a tensor or a storage alive.

A storage can also be freed and allocated again while its object lives, by hand: ``UntypedStorage.resize_(0)``
and ``resize_(n)`` (FSDP2's unsharded parameters, see :func:`~modelmeter._torch_compat.observed_storage_resizes`).
Each lifetime gets a record of its own, kind ``"unsharded"``. A DTensor is followed through its local shard.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from .._torch_compat import local_tensor
from .metadata import describe, device_name, dtype_name, sparse_parts, storage_device_name
from .trace import Storage, StorageKind, TensorMeta


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
        self._emptied: dict[int, Storage] = {}  # id(storage object) -> its last record, while resized to nothing
        self.gradients: list[TensorMeta] = []  # every parameter's gradient, in the order given
        self._on_free = self._freed  # one bound method for every weak reference
        self.deaths = 0  # storages freed so far (engine/replay.py)

    def _record(self, tensor: torch.Tensor, kind: StorageKind, born: int) -> Storage | None:
        """The record of ``tensor``'s storage (a DTensor's: its local shard's), made now (born at ``born``) when it
        is new; None for a tensor without one, or whose storage was freed by hand."""
        if type(tensor) is not torch.Tensor:  # a DTensor's bytes on this rank are its shard's
            tensor = local_tensor(tensor)
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested and other storage-less layouts
            for part in sparse_parts(tensor):  # a sparse tensor's bytes: the storages of its values and indices
                self._record(part, kind, born)
            return None
        key = id(storage)
        record = self._live.get(key)
        if record is not None:
            record.nbytes = max(record.nbytes, storage.nbytes())  # resize_ grew it
            return record
        if key in self._emptied:  # a view of a storage resized to nothing: it holds no bytes
            return None
        record = self._live[key] = Storage(storage.nbytes(), dtype_name(tensor.dtype), device_name(tensor), kind, born)
        self.records.append(record)
        self._refs[weakref.ref(storage, self._on_free)] = key
        return record

    def _freed(self, ref: Any) -> None:
        key = self._refs.pop(ref)
        self._emptied.pop(key, None)
        record = self._live.pop(key, None)
        if record is not None and self.open:
            record.died = self.clock()
            self.deaths += 1

    def resized(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """``storage.resize_(nbytes)`` ran: ``0`` frees the bytes of the lifetime that ends now (the storage
        object lives on), more allocates a new lifetime (from the next event on) — the unsharded parameters FSDP2
        frees after a module's forward and backward and gathers again before the next. A live storage that
        changes size keeps its record, at its largest size."""
        if not self.open:
            return
        key = id(storage)
        record = self._live.get(key)
        if record is not None and nbytes > 0:
            record.nbytes = max(record.nbytes, nbytes)
        elif record is not None:  # freed by hand: a storage the model's own code did not make is an unsharded one
            del self._live[key]
            self._emptied[key] = record
            record.died = self.clock()
            if record.kind in ("activation", "communication", "other"):
                record.kind = "unsharded"
        elif nbytes > 0:
            self._allocated_again(storage, key, nbytes)

    def _allocated_again(self, storage: torch.UntypedStorage, key: int, nbytes: int) -> None:
        """A new lifetime of a storage freed by hand (or first seen now, as FSDP2's buffers of an earlier step)."""
        last = self._emptied.pop(key, None)
        if last is None:  # a storage has no dtype: its bytes are what counts
            last = Storage(0, "uint8", storage_device_name(storage), "unsharded")
            self._refs[weakref.ref(storage, self._on_free)] = key
        record = self._live[key] = Storage(nbytes, last.dtype, last.device, last.kind, self.clock())
        self.records.append(record)

    def knows(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s storage has a record (it was seen, and lives)."""
        return id(tensor.untyped_storage()) in self._live

    def record_of(self, tensor: torch.Tensor) -> Storage | None:
        """The record of ``tensor``'s live storage, None when it has none."""
        return self._live.get(id(tensor.untyped_storage()))

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

    def gradient(self, tensor: torch.Tensor, parameter: torch.Tensor) -> None:
        """``tensor`` is ``parameter``'s gradient; call in the model's parameter order. Its storage is a gradient
        (several gradients may share one: FSDP2's reduce-scatter output), ordered by the first parameter it
        serves. :attr:`gradients` describes what the optimizer updates and keeps state for: the parameter's local
        shard, which a tensor-parallel gradient may exceed (DTensor leaves a row-sharded embedding's gradient
        replicated, whole on every rank, while the optimizer's state follows the parameter's shard)."""
        record = self._record(tensor, "gradient", -1)
        if record is not None and record.kind != "gradient":
            record.kind, record.order = "gradient", len(self.gradients)
        self.gradients.append(describe(local_tensor(parameter)))

    def parameters_at_end(self, parameters: list[torch.Tensor]) -> None:
        """The model's parameters as the run leaves them. A storage the run made for one is the model's state, there
        from the start as in every later step (FSDP2's first forward pads a shard that does not divide evenly into a
        new storage); a parameter's storage the run freed was replaced, and is gone from the start (``died`` 0)."""
        for tensor in parameters:
            record = self._record(tensor, "parameter", -1)
            if record is not None and record.born >= 0 and record.kind == "activation":
                record.kind, record.born = "parameter", -1
        for record in self.records:
            if record.kind == "parameter" and record.born < 0 and record.died > 0:
                record.died = 0

    def communication(self, tensors: list[torch.Tensor]) -> None:
        """``tensors`` were written by a collective: the storages an operator made for them are communication
        buffers (the model's state, inputs and gradients stay what they are)."""
        for tensor in tensors:
            record = self._live.get(id(local_tensor(tensor).untyped_storage()))
            if record is not None and record.kind == "activation":
                record.kind = "communication"

    def close(self) -> list[Storage]:
        """Stop following: storages alive now outlive the run. Returns the records."""
        self.open = False
        self._live.clear()
        self._emptied.clear()
        self._refs.clear()  # the weak references go, and their callbacks with them: tearing the run down is free
        return self.records

