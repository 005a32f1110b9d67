"""The allocator oracle: what the real CPU allocator does while a function runs, byte for byte.

``measure_peak`` runs a function once under ``torch.profiler`` with ``profile_memory=True``. Every
allocation and free of torch's CPU allocator (``c10::DefaultCPUAllocator``, which oneDNN's scratchpads
also use) is then reported as an ``Allocation`` event carrying the pointer, the signed byte count and the
allocator's running total. Sizes are the requested ``nbytes`` (no alignment rounding, no caching on CPU).

Exactness rests on three choices made here:

* intra-op threads are set to 1 while the function runs. OpenMP worker threads do not inherit the
  profiler's thread-local state, so an allocation made in a worker would go unreported; with one thread
  every kernel (and oneDNN) runs on the calling thread. CPU backward runs on the calling thread too.
* the Python garbage collector is off while the function runs, so frees happen at deterministic points
  (reference counting) and not when a collection happens to trigger.
* the events are replayed in time order and checked against the allocator's own running total, which
  is updated under a lock: a reordering, or an event the allocator counted but the profiler did not
  record, raises instead of giving a wrong peak.

Frees are matched to allocations by pointer; a free of a storage allocated before the function started
is not counted in the deltas (the allocator reports it only if that storage was allocated while some
earlier profiling session ran) but is counted in ``foreign_frees`` so a test can check there is none.

``inference``, ``training_step`` and ``warm_up`` build the functions whose peak modelmeter predicts, and
``resident_bytes`` gives the bytes alive before they start: predicted peak = resident + ``peak_delta``.
"""

from __future__ import annotations

import gc
import operator
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import reduce
from itertools import pairwise
from typing import Any

import torch
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile
from torch.utils._pytree import tree_leaves


@dataclass(frozen=True)
class Measurement:
    """Allocator activity of one run: ``events`` are the signed sizes in time order (+ alloc, - free)."""

    events: tuple[int, ...]
    foreign_frees: int

    @property
    def peak_delta(self) -> int:
        """Largest number of bytes allocated during the run and alive at one instant (>= 0)."""
        running, peak = 0, 0
        for size in self.events:
            running += size
            peak = max(peak, running)
        return peak

    @property
    def end_delta(self) -> int:
        """Bytes allocated during the run and still alive when it returned."""
        return sum(self.events)

    @property
    def allocs(self) -> int:
        return sum(1 for size in self.events if size > 0)

    @property
    def frees(self) -> int:
        return sum(1 for size in self.events if size < 0)


def _allocation_events(roots: Iterable[Any]) -> Iterator[Any]:
    """Every Allocation event of a profiler event tree, depth first (program order within a thread)."""
    for event in roots:
        if event.tag == _EventType.Allocation:
            yield event
        yield from _allocation_events(event.children)


def _check_order(events: list[Any]) -> None:
    """Each event must move the allocator's running total by exactly its own size: nothing missed or swapped."""
    for previous, event in pairwise(events):
        if event.extra_fields.total_allocated != previous.extra_fields.total_allocated + event.extra_fields.alloc_size:
            raise RuntimeError("allocation events out of order or missing: was there another allocating thread?")


def _replay(events: list[Any]) -> Measurement:
    """Signed sizes of the allocations and of the frees that match them by pointer, in time order."""
    events = sorted(events, key=lambda event: event.start_time_ns)
    _check_order(events)
    live: dict[int, int] = {}
    sizes: list[int] = []
    foreign = 0
    for event in events:
        ptr, size = event.extra_fields.ptr, event.extra_fields.alloc_size
        if size > 0:
            live[ptr] = size
            sizes.append(size)
        elif ptr in live:
            if live.pop(ptr) != -size:
                raise RuntimeError(f"free of {-size} bytes does not match its allocation")
            sizes.append(size)
        else:
            foreign += 1
    return Measurement(tuple(sizes), foreign)


def measure_peak(fn: Callable[[], Any]) -> Measurement:
    """Run ``fn()`` once and measure its allocations; its result stays alive until the measurement ends."""
    threads = torch.get_num_threads()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    torch.set_num_threads(1)
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            _alive = fn()  # held, so the storages of the result are alive at the end
    finally:
        torch.set_num_threads(threads)
        if gc_was_enabled:
            gc.enable()
    return _replay(list(_allocation_events(prof.profiler.kineto_results.experimental_event_tree())))


def inference(model: nn.Module, inputs: tuple[Any, ...]) -> Callable[[], Any]:
    """``model(*inputs)`` under ``no_grad``; the output is returned, so it is alive at the end."""

    def run() -> Any:
        with torch.no_grad():
            return model(*inputs)

    return run


def default_loss(output: Any) -> torch.Tensor:
    """Left-to-right sum of ``t.sum()`` over every floating-point tensor in the output, in pytree order."""
    sums = [leaf.sum() for leaf in tree_leaves(output) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()]
    return reduce(operator.add, sums)


def training_step(
    model: nn.Module,
    inputs: tuple[Any, ...],
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> Callable[[], None]:
    """Forward, loss, backward, ``optimizer.step()``, ``zero_grad(set_to_none=True)``; every local dies at return."""

    def run() -> None:
        output = model(*inputs)
        loss = loss_fn(output) if loss_fn is not None else default_loss(output)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return run


def warm_up(
    model: nn.Module,
    inputs: tuple[Any, ...],
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> None:
    """One training step, so the optimizer state exists and a measured step is a steady one."""
    training_step(model, inputs, optimizer, loss_fn)()


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    return (leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor))


def resident_bytes(model: nn.Module, inputs: Any, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes of the distinct storages alive before a run: parameters (and any grads), buffers, inputs, and the
    optimizer's state and tensor hyper-parameters (e.g. Adam's ``step``); a storage shared by several counts once."""
    tensors = [*model.parameters(), *model.buffers(), *_tensors(inputs)]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    if optimizer is not None:
        tensors += [*_tensors(list(optimizer.state.values())), *_tensors(optimizer.param_groups)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank's allocator holds); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def resident_on_this_rank(model: nn.Module, inputs: tuple[Any, ...], optimizer: torch.optim.Optimizer) -> int:
    """Bytes alive on this rank of a parallel plan before a step: the parameter shards, buffers, the inputs and the
    optimizer's state (a DTensor through its local shard; FSDP2's unsharded parameters are resized to nothing
    between steps)."""
    tensors = [*map(_local, model.parameters()), *map(_local, model.buffers()), *_tensors(inputs)]
    tensors += [_local(t) for t in _tensors(list(optimizer.state.values()))]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def steady_step_peak(model: nn.Module, inputs: tuple[Any, ...], optimizer: torch.optim.Optimizer,
                     steps: int) -> dict[str, int]:
    """This rank's allocator peak of a steady training step under a parallel plan, after a warm-up step: the bytes
    resident before it (:func:`resident_on_this_rank`) plus the lowest peak of ``steps`` identical steps — a buffer
    that a collective's asynchronous work (gloo's thread) frees a moment late can only add to a step's peak.
    ``foreign_frees`` sums the steps' (a test checks there is none)."""
    warm_up(model, inputs, optimizer)
    resident = resident_on_this_rank(model, inputs, optimizer)
    measured = [measure_peak(training_step(model, inputs, optimizer)) for _ in range(steps)]
    return {"resident": resident, "peak": resident + min(step.peak_delta for step in measured),
            "foreign_frees": sum(step.foreign_frees for step in measured)}
