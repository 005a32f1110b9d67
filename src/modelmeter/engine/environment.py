"""Torch's process-wide settings a model's ``forward`` may change, put back after every run.

A model may set torch's global settings as it runs — ``torch.set_default_dtype(torch.float64)``,
``torch.use_deterministic_algorithms(True)``, ``torch.set_num_threads(1)`` — and leave them so. A plain call of it
would too, but an analysis runs the model on stand-ins, perhaps several times (a meta run, a fake one, real kernels),
and perhaps not at all (a cached trace): left changed, the settings would leak into the next run of the same analysis
(a fallback counting float64 tensors where the first run had float32 ones) and into the caller's program, depending
on the route the analysis took. So each run starts from the caller's settings and gives them back (docs/torch.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._torch_compat import default_device_set, torch_stacks_kept


def _deterministic() -> tuple[bool, bool]:
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


def _set_deterministic(value: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(value[0], warn_only=value[1])


def _anomaly() -> tuple[bool, bool]:
    return torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()


def _set_anomaly(value: tuple[bool, bool]) -> None:
    torch.set_anomaly_enabled(*value)


def _autocast(device: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """Getter and setter of autocast's state (on, and to which dtype) for ``device``."""
    def get() -> tuple[bool, torch.dtype]:
        return torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)

    def put(value: tuple[bool, torch.dtype]) -> None:
        torch.set_autocast_enabled(device, value[0])
        torch.set_autocast_dtype(device, value[1])

    return get, put


def _fp32_precision(owner: Any) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """Getter and setter of ``owner.fp32_precision``, torch's newer TF32 switch (2.9), per backend and operator."""
    def get() -> str:
        return str(owner.fp32_precision)

    def put(value: str) -> None:
        owner.fp32_precision = value

    return get, put


def _fp32_precisions() -> list[tuple[Callable[[], Any], Callable[[Any], None]]]:
    """The ``fp32_precision`` switches this torch has, each backend's before its operators' (an operator's switch
    left at "none" reads its backend's: put back first, it makes them equal again and they are not written)."""
    backends = torch.backends
    owners = [backends, backends.cuda.matmul]
    for backend in (backends.cudnn, backends.mkldnn):
        owners += [backend, *(getattr(backend, op, None) for op in ("matmul", "conv", "rnn"))]
    return [_fp32_precision(owner) for owner in owners if owner is not None and hasattr(owner, "fp32_precision")]


#: (getter, setter) of each setting kept; the grad and inference modes are the run's own contexts (engine/tracer.py)
SETTINGS: tuple[tuple[Callable[[], Any], Callable[[Any], None]], ...] = (
    (torch.get_default_dtype, torch.set_default_dtype),
    (default_device_set, torch.set_default_device),
    (_deterministic, _set_deterministic),
    (torch.get_num_threads, torch.set_num_threads),
    # the older switch first: a caller who only used it still can read it (one new switch written and it raises)
    (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    *_fp32_precisions(),
    (_anomaly, _set_anomaly),
    _autocast("cpu"),
    _autocast("cuda"),
    (torch.is_autocast_cache_enabled, torch.set_autocast_cache_enabled),
)


class KeptSettings:
    """Torch's settings of :data:`SETTINGS` as found on entry, put back on exit where the run changed them (also
    when it raises); the mode stacks and the global module hooks too (a mode or hook the forward left behind:
    :func:`~modelmeter._torch_compat.torch_stacks_kept`). A setting torch refuses to read or write is left alone,
    never a failure of the run: ``torch.get_float32_matmul_precision`` raises once the newer ``fp32_precision``
    switches were written (by the caller or the forward), and those switches are kept in its place."""

    def __init__(self) -> None:
        self.found: list[tuple[Callable[[], Any], Callable[[Any], None], Any]] = []
        self.stacks = torch_stacks_kept()

    def __enter__(self) -> KeptSettings:
        self.found = []
        for get, put in SETTINGS:
            try:
                self.found.append((get, put, get()))
            except Exception:  # (torch refuses to read it: not kept)
                continue
        self.stacks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        # the settings first: a default device is a mode at the bottom of the function-mode stack, which
        # set_default_device takes off as it puts the caller's back; the stacks are cut to their depth after,
        # whatever a setting does (a recorder left on the dispatch stack would record the rest of the process)
        try:
            for get, put, value in self.found:
                _put_back(get, put, value)
        finally:
            self.stacks.__exit__(*exc)


def _put_back(get: Callable[[], Any], put: Callable[[Any], None], value: Any) -> None:
    """``put(value)`` where ``get()`` differs; a refusal of either is skipped (the run's own outcome stands)."""
    try:
        if get() != value:
            put(value)
    except Exception:  # (torch refuses to read or write it)
        return
