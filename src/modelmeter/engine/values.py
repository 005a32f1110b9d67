"""Real values of the small tensors a fake run computes from known values alone.

FakeTensors have no values, but some tensors of a model are fully determined without its weights: attention
masks built from ``arange``, the caller's token ids and padding mask, position indices. The fake run follows
them with real kernels on real copies (a *shadow* per fake tensor), so formulas can read what they need —
the attended pairs of a causal or sliding-window mask — and ``.item()`` on such a tensor needs no fallback to
real kernels. A tensor gets a shadow only when every tensor it was computed from has one and it has at most
:data:`LIMIT` elements; anything touched by parameters or activations stays value-free.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

LIMIT = 1 << 24  # elements: a (1, 1, 4096, 4096) boolean mask is 16 MiB
_CPU = torch.device("cpu")


class Shadows:
    """Fake tensor -> a real tensor with its values (on the CPU), for the tensors whose values are known."""

    def __init__(self) -> None:
        self._values: Any = WeakIdKeyDictionary()

    def seed(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        """``fake`` stands for the real tensor ``real`` (an input, a buffer): its values are known."""
        if real.is_meta or real.numel() > LIMIT or isinstance(real, torch._subclasses.FakeTensor):
            return
        with _disable_current_modes(), torch.no_grad():
            self._values[fake] = real.detach().to(_CPU, copy=True)

    def get(self, tensor: Any) -> torch.Tensor | None:
        """The values of ``tensor`` when known."""
        return self._values.get(tensor) if isinstance(tensor, torch.Tensor) else None

    def propagate(self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any],
                  result: Any) -> None:
        """Give ``result`` values when every tensor ``func`` read has them; forget stale values otherwise."""
        outputs = _tensors(result)
        if not outputs:
            return
        known = self._values
        # stops at the first tensor without values: most operators read an activation or a parameter first
        if not all(t in known for t in _each_tensor((args, kwargs))) or any(t.numel() > LIMIT for t in outputs):
            if func._schema.is_mutable:  # an in-place update by unknown values: the old values are wrong now
                for t in outputs:
                    known.pop(t, None)
            return
        try:
            with _disable_current_modes(), torch.no_grad():
                values = func(*_real(args, known), **_real(kwargs, known))
        except Exception:  # an operator without a CPU kernel, say: the values stay unknown
            for t in outputs:
                known.pop(t, None)
            return
        for fake, real in zip(outputs, _tensors(values), strict=False):
            known[fake] = real

    def item(self, tensor: torch.Tensor) -> Any:
        """``tensor.item()`` from its values, or None when they are unknown."""
        values = self.get(tensor)
        return None if values is None else values.item()


def _each_tensor(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in nested arguments, lazily, in order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _each_tensor(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _each_tensor(v)


def _tensors(value: Any) -> list[torch.Tensor]:
    return list(_each_tensor(value))


def _real(value: Any, known: Any) -> Any:
    """Arguments with fake tensors replaced by their values and devices by the CPU."""
    if isinstance(value, torch.Tensor):
        return known[value]
    if isinstance(value, torch.device):
        return _CPU
    if isinstance(value, tuple):
        return tuple(_real(v, known) for v in value)
    if isinstance(value, list):
        return [_real(v, known) for v in value]
    if isinstance(value, dict):
        return {k: _real(v, known) for k, v in value.items()}
    return value
