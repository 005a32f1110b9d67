"""Collectives and their helpers: what each moves between ranks, and what they cost on one rank's device.

A collective's *payload* ``S`` is the size NCCL's performance notes measure an operation by (nccl-tests,
doc/PERFORMANCE.md): the whole buffer of the operation — for an all-gather the gathered output and for a
reduce-scatter the input being scattered (``n`` times one rank's shard), for an all-reduce, a broadcast, a send or a
receive the tensor, for an all-to-all the buffer a rank exchanges. The bytes one rank of a group of ``n`` sends and
receives under the bandwidth-optimal (ring) algorithms are ``S`` times the operation's bus factor
(:func:`rank_bytes`): all-gather, reduce-scatter and all-to-all ``(n-1)/n``, all-reduce ``2(n-1)/n`` (a
reduce-scatter then an all-gather), broadcast and reduce ``1`` (all the data leaves, or reaches, the root); a send
sends ``S`` and a receive receives it.

On the rank's own device (the FLOPs and bytes tables) a collective costs nothing: its time is the communication
metric's (:mod:`modelmeter.metrics.communication`), and the additions of a reduction are not counted. FSDP2's
helpers are copies — free of FLOPs as copies are, their bytes what they read and write (:func:`traffic`) — and the
profiler's record-function markers and ``wait_tensor`` are bookkeeping, free in every table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from ..engine.trace import GroupMeta
from .base import CountInside, Handle
from .binding import bind_all, by_name
from .sizes import all_bytes

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "reduce", "send", "recv")


@dataclass(frozen=True)
class Collective:
    """One collective operator: its ``kind`` (one of :data:`KINDS`) and the formula of its payload in bytes."""

    kind: str
    payload: Callable[[list[Any], list[Any]], int]


def _bytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (a tensor, or lists of them, walked)."""
    return all_bytes([value])


@by_name(output=("output_tensor", "output_tensors", "output_lists", "outputs"))
def gathered_bytes(output: Any) -> int:
    """The buffer an all-gather fills: every rank's shard."""
    return _bytes(output)


@by_name(tensors=("input_tensor", "input_tensors", "inputs", "input", "tensor"))
def buffer_bytes(tensors: Any) -> int:
    """The buffer a collective takes in: the tensor to reduce, scatter, exchange, broadcast, send or receive into."""
    return _bytes(tensors)


def result_bytes(inputs: list[Any], outputs: list[Any]) -> int:
    """The buffer a functional all-gather returns: every rank's shard."""
    return _bytes(outputs)


def _c10d(kind: str, payload: Any, *ops: str) -> dict[str, Collective]:
    return {f"c10d::{op}": Collective(kind, payload) for op in ops}


def _functional(kind: str, payload: Any, *ops: str, autograd: tuple[str, ...] = ()) -> dict[str, Collective]:
    """``ops`` of ``_c10d_functional``, and ``autograd`` of ``_c10d_functional_autograd`` (the differentiable ones)."""
    names = [f"_c10d_functional::{op}" for op in ops] + [f"_c10d_functional_autograd::{op}" for op in autograd]
    return {name: Collective(kind, payload) for name in names}


# One line per operator family: c10d's process-group operators (what FSDP2 and replicate issue), then the functional
# collectives (what DTensor issues).
_TABLE: dict[str, Collective] = {
    **_c10d("all_gather", gathered_bytes, "_allgather_base_", "allgather_", "allgather_coalesced_",
            "allgather_into_tensor_coalesced_"),
    **_c10d("reduce_scatter", buffer_bytes, "_reduce_scatter_base_", "reduce_scatter_",
            "reduce_scatter_tensor_coalesced_"),
    **_c10d("all_reduce", buffer_bytes, "allreduce_", "allreduce_coalesced_"),
    **_c10d("all_to_all", buffer_bytes, "alltoall_", "alltoall_base_"),
    **_c10d("broadcast", buffer_bytes, "broadcast_"),
    **_c10d("reduce", buffer_bytes, "reduce_"),
    **_c10d("send", buffer_bytes, "send"),
    **_c10d("recv", buffer_bytes, "recv_", "recv_any_source_"),
    **_functional("all_gather", result_bytes, "all_gather_into_tensor", "all_gather_into_tensor_out",
                  "all_gather_into_tensor_coalesced", autograd=("all_gather_into_tensor",)),
    **_functional("reduce_scatter", buffer_bytes, "reduce_scatter_tensor", "reduce_scatter_tensor_out",
                  "reduce_scatter_tensor_coalesced", autograd=("reduce_scatter_tensor",)),
    **_functional("all_reduce", buffer_bytes, "all_reduce", "all_reduce_", "all_reduce_coalesced",
                  "all_reduce_coalesced_"),
    **_functional("all_to_all", buffer_bytes, "all_to_all_single", autograd=("all_to_all_single",)),
    **_functional("broadcast", buffer_bytes, "broadcast", "broadcast_"),
    **_functional("send", buffer_bytes, "isend"),
    **_functional("recv", buffer_bytes, "irecv"),
}

# Bookkeeping: no data moves, nothing is computed (the end of an asynchronous collective; the profiler's markers)
BOOKKEEPING_OPS = ("_c10d_functional::wait_tensor", "profiler::_record_function_enter",
                   "profiler::_record_function_enter_new", "profiler::_record_function_exit")
# FSDP2's copies into and out of its communication buffers
FSDP_COPIES = ("fsdp::all_gather_copy_in", "fsdp::split_with_sizes_copy", "fsdp::chunk_cat")
# DTensor's own autograd functions (prim::PythonOp.<class>): a redistribution, and the hand-overs between a DTensor
# and its local shard. What they run is recorded inside them (collectives, local splits and copies) and counted there.
DTENSOR_FUNCTIONS = ("Redistribute", "NestedRedistribute", "_FromTorchTensor", "_ToTorchTensor")


@cache
def collectives() -> dict[str, Collective]:
    """Every collective operator with its kind and payload formula (bound to the operator's schema; made once:
    treat it as read-only)."""
    payloads = bind_all({op: entry.payload for op, entry in _TABLE.items()})
    return {op: Collective(entry.kind, payloads[op]) for op, entry in _TABLE.items()}


def group_of(inputs: list[Any]) -> GroupMeta | None:
    """The process group a collective's event names (the recorder puts a :class:`GroupMeta` in its place)."""
    return next((value for value in inputs if isinstance(value, GroupMeta)), None)


# The share of the payload one rank sends and receives, by kind, for a group of n ranks (bandwidth-optimal
# algorithms: nccl-tests' bus-bandwidth factors)
_SHARES: dict[str, Callable[[int], tuple[float, float]]] = {
    "all_gather": lambda n: ((n - 1) / n, (n - 1) / n),
    "reduce_scatter": lambda n: ((n - 1) / n, (n - 1) / n),
    "all_reduce": lambda n: (2 * (n - 1) / n, 2 * (n - 1) / n),
    "all_to_all": lambda n: ((n - 1) / n, (n - 1) / n),
    "broadcast": lambda n: (1.0, 1.0),
    "reduce": lambda n: (1.0, 1.0),
    "send": lambda n: (1.0, 0.0),
    "recv": lambda n: (0.0, 1.0),
}


def rank_bytes(kind: str, payload: int, size: int) -> tuple[float, float]:
    """(bytes sent, bytes received) by one rank of a group of ``size`` ranks in a collective of ``kind`` whose
    payload is ``payload`` bytes; nothing in a group of one (no peer: torch copies locally)."""
    if size <= 1 and kind not in ("send", "recv"):
        return 0.0, 0.0
    sent, received = _SHARES[kind](size)
    return payload * sent, payload * received


# --- the FLOPs and bytes tables ------------------------------------------------------------------------
def handles(convention: str) -> dict[str, Handle | CountInside | None]:
    """The FLOPs table's entries (every convention): collectives, FSDP2's copies and bookkeeping are known and
    free on the rank's device (a collective's cost is its communication time); DTensor's functions count what they
    ran, as ``redistribute``."""
    table: dict[str, Handle | CountInside | None] = dict.fromkeys((*_TABLE, *FSDP_COPIES, *BOOKKEEPING_OPS))
    table.update({f"prim::PythonOp.{name}": CountInside("redistribute") for name in DTENSOR_FUNCTIONS})
    return table


@by_name
def all_gather_copy_in_bytes(all_gather_inputs: Any) -> int:
    """``fsdp::all_gather_copy_in``: the rank's shards read and copied into its slice of the all-gather buffer."""
    return 2 * _bytes(all_gather_inputs)


@by_name
def split_copy_bytes(out: Any) -> int:
    """``fsdp::split_with_sizes_copy``: the gathered buffer read once and copied out into the parameters."""
    return 2 * _bytes(out)


@by_name
def chunk_cat_bytes(tensors: Any, out: Any) -> int:
    """``fsdp::chunk_cat``: the gradients read and written, padded, into the reduce-scatter buffer."""
    return _bytes(tensors) + _bytes(out)


def traffic() -> dict[str, Handle | None]:
    """The bytes table's entries: FSDP2's copies move what they copy; collectives and bookkeeping move nothing on
    the device's memory as the roofline counts it (a collective's time is the communication metric's)."""
    return {**dict.fromkeys((*_TABLE, *BOOKKEEPING_OPS)),
            **bind_all({"fsdp::all_gather_copy_in": all_gather_copy_in_bytes,
                        "fsdp::split_with_sizes_copy": split_copy_bytes,
                        "fsdp::chunk_cat": chunk_cat_bytes})}
