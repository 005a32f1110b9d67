"""A training step of a model written for GPUs, counted without one.

A forward pass that puts tensors on CUDA runs as FakeTensors on ``cuda:0`` (no GPU needed), but its backward pass
cannot: torch's autograd engine starts the CUDA device of a graph with CUDA tensors, fake or not (on a machine
without a GPU, ``hasPrimaryContext expects a valid device index``). So a step with a backward pass runs as the same
model's step on the CPU would — the model's tensors as CPU stand-ins, every request for CUDA (``.cuda()``,
``.to("cuda")``, ``device="cuda"``) sent to the stand-ins' device by :class:`CudaRequests` — and the record is then
written as the model meant it (:func:`on_device`): its tensors and storages on ``cuda:0``. Its counts are the CPU
step's, which a GPU's step shares (the same operators on the same shapes); what the model's code does on asking
``x.is_cuda`` is the CPU's branch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .trace import TensorMeta, Trace


class CudaRequests(TorchFunctionMode):
    """Send every request for a CUDA device to ``device``: ``device=`` arguments, ``Tensor.to``'s device and
    ``Tensor.cuda()``. Entered below the function recorder, which records the call as the model made it."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(self, func: Any, types_: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": self.device}
        if func is torch.Tensor.cuda:
            return args[0].to(self.device)
        if func is torch.Tensor.to:
            args = tuple(self.device if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


def _is_cuda(value: Any) -> bool:
    """A CUDA device: ``torch.device("cuda")``, ``"cuda:1"``, or a bare index (``.to(0)``, ``device=0``)."""
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, int) and not isinstance(value, bool):
        return True
    return isinstance(value, str) and value.split(":")[0] == "cuda"


def on_device(trace: Trace, device: str, stood_for: tuple[str, ...] = ("cpu", "meta")) -> None:
    """Write ``trace``'s tensors, storages and device arguments that are on a device of ``stood_for`` as on
    ``device``."""
    def moved(value: Any) -> Any:
        if isinstance(value, TensorMeta):
            return replace(value, device=device) if value.device in stood_for else value
        if isinstance(value, list):
            return [moved(v) for v in value]
        if isinstance(value, str) and value in stood_for:
            return device
        return value

    for event in trace.events:
        event.inputs = moved(event.inputs)
        event.outputs = moved(event.outputs)
        event.kwargs = {key: moved(value) for key, value in event.kwargs.items()}
    trace.inputs = moved(trace.inputs)
    for storage in trace.storages:
        if storage.device in stood_for:
            storage.device = device
