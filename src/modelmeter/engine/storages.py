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

from .metadata import device_name
from .trace import Storage, StorageKind


class StorageTracker:
    """Storages by identity while they live, and the :class:`Storage` records they leave.

    ``clock`` returns the number of events recorded so far: the time stamps of births, saves and deaths.
    """

    def __init__(self, clock: Callable[[], int]) -> None:
        self.clock = clock
        self._fields: list[dict[str, Any]] = []  # mutable fields of each record until close()
        self._live: dict[int, tuple[int, Any]] = {}  # id(storage object) -> (record index, weak reference)
        self.open = True
        self._gradients = 0

    def _index(self, tensor: torch.Tensor, kind: StorageKind, born: int) -> int | None:
        """The record index of ``tensor``'s storage, made now (born at ``born``) when it is new."""
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested and other storage-less layouts
            return None
        key = id(storage)
        known = self._live.get(key)
        if known is not None:
            fields = self._fields[known[0]]
            fields["nbytes"] = max(fields["nbytes"], storage.nbytes())  # resize_ grew it
            return known[0]
        index = len(self._fields)
        self._fields.append({"nbytes": storage.nbytes(), "dtype": str(tensor.dtype).removeprefix("torch."),
                             "device": device_name(tensor), "kind": kind, "born": born, "died": -1, "saved": -1,
                             "saved_scope": -1, "order": -1})
        self._live[key] = (index, weakref.ref(storage, self._finalizer(key, index)))
        return index

    def _finalizer(self, key: int, index: int) -> Callable[[Any], None]:
        def freed(_: Any) -> None:
            self._live.pop(key, None)
            if self.open:
                self._fields[index]["died"] = self.clock()

        return freed

    def existing(self, tensor: torch.Tensor, kind: StorageKind) -> None:
        """A storage that is there before the run starts (model state, inputs)."""
        self._index(tensor, kind, -1)

    def outputs(self, result: Any, event: int, kind: StorageKind = "activation") -> None:
        """The storages of an operator's outputs: new ones were allocated by event ``event``."""
        if isinstance(result, torch.Tensor):
            self._index(result, kind, event)
        elif isinstance(result, (tuple, list)):
            for item in result:
                self.outputs(item, event, kind)

    def saved(self, tensor: torch.Tensor, scope: int) -> None:
        """Autograd saved ``tensor`` for the backward pass, under module scope ``scope`` (a storage not seen
        before existed before the run)."""
        index = self._index(tensor, "input", -1)
        if index is not None and self._fields[index]["saved"] < 0:
            self._fields[index].update(saved=self.clock(), saved_scope=scope)

    def gradient(self, tensor: torch.Tensor) -> None:
        """``tensor`` is a parameter's gradient; call in the model's parameter order."""
        index = self._index(tensor, "gradient", -1)
        if index is not None:
            self._fields[index].update(kind="gradient", order=self._gradients)
            self._gradients += 1

    def close(self) -> list[Storage]:
        """Stop following: storages alive now outlive the run. Returns the records."""
        self.open = False
        return [Storage(**fields) for fields in self._fields]


def model_state(model: torch.nn.Module) -> list[tuple[torch.Tensor, StorageKind]]:
    """The model's parameters and buffers as (tensor, kind)."""
    return [*((p, "parameter") for p in model.parameters()), *((b, "buffer") for b in model.buffers())]

