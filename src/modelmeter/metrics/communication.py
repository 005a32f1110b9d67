"""Communication of one rank: every collective a trace recorded, with the bytes it moves, by kind, module, phase
and process group (docs/parallel.md, "Communication").

A pure function of the trace: the collectives are the dispatch-level events of the operators
:mod:`modelmeter.handles.collectives` knows (what the run issued, as ``CommDebugMode`` counts them), each with its
group as the recorder described it (:class:`~modelmeter.engine.trace.GroupMeta`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from ..engine.trace import GroupMeta, Trace
from ..errors import InvalidValueError
from ..handles.collectives import BOOKKEEPING_OPS, collectives, group_of, rank_bytes
from .counting import Ancestors

# The namespaces of collective operators: one of them without an entry is reported, never counted as nothing
_NAMESPACES = ("c10d::", "_c10d_functional::", "_c10d_functional_autograd::")


@dataclass(frozen=True)
class CollectiveCall:
    """One collective the rank issued: the event's index and operator, its ``kind`` (all_gather, reduce_scatter,
    all_reduce, ...), the phase and the module whose scope issued it (canonical name, ``""`` for the model itself),
    its process ``group`` and the mesh dimension that group is (``dim``: the group's name where the trace names no
    mesh), its ``payload`` in bytes and the bytes this rank ``sent`` and ``received`` (bandwidth-optimal
    algorithms, :func:`~modelmeter.handles.collectives.rank_bytes`). ``modules`` are the module and every module
    that holds it (by name, ``""`` among them): those whose totals include the call."""

    event: int
    op: str
    kind: str
    phase: str
    module: str
    group: GroupMeta
    dim: str
    payload: int
    sent: float
    received: float
    modules: frozenset[str] = frozenset()


@dataclass
class Volume:
    """What a set of collectives moved: how many there were, their payload bytes, and the bytes the rank sent and
    received."""

    count: int = 0
    payload: int = 0
    sent: float = 0.0
    received: float = 0.0

    def add(self, call: CollectiveCall) -> None:
        self.count += 1
        self.payload += call.payload
        self.sent += call.sent
        self.received += call.received

    def to_dict(self) -> dict[str, Any]:
        return {"count": self.count, "payload": self.payload, "sent": self.sent, "received": self.received}


@dataclass
class Communication:
    """The collectives of one rank's run (:attr:`calls`, in run order) and their totals; ``unsupported`` counts the
    collective operators the handle table has no entry for (by operator), which are in no total."""

    calls: list[CollectiveCall]
    unsupported: Counter[str] = field(default_factory=Counter)

    def total(self) -> Volume:
        volume = Volume()
        for call in self.calls:
            volume.add(call)
        return volume

    def by_kind(self) -> dict[str, Volume]:
        return self._by(lambda call: (call.kind,))

    def by_phase(self) -> dict[str, Volume]:
        return self._by(lambda call: (call.phase,))

    def by_group(self) -> dict[str, Volume]:
        """By mesh dimension (the group's name where the trace names no mesh)."""
        return self._by(lambda call: (call.dim,))

    def by_module(self) -> dict[str, Volume]:
        """By module, each with what it and its submodules issued (``""``: the whole model)."""
        return self._by(lambda call: sorted(call.modules))

    def by_module_and_kind(self) -> dict[tuple[str, str], Volume]:
        """By (module, kind), inclusive as :meth:`by_module`."""
        return self._by(lambda call: [(module, call.kind) for module in sorted(call.modules)])

    def _by(self, keys: Callable[[CollectiveCall], Any]) -> dict[Any, Volume]:
        table: dict[Hashable, Volume] = {}
        for call in self.calls:
            for key in keys(call):
                table.setdefault(key, Volume()).add(call)
        return table

    def to_dict(self) -> dict[str, Any]:
        """Plain data: the totals by kind, phase, group and module, and the unsupported operators."""
        return {"total": self.total().to_dict(),
                **{name: {key: volume.to_dict() for key, volume in table.items()}
                   for name, table in (("by_kind", self.by_kind()), ("by_phase", self.by_phase()),
                                       ("by_group", self.by_group()), ("by_module", self.by_module()))},
                "unsupported": dict(self.unsupported)}


def mesh_dims(trace: Trace) -> dict[str, str]:
    """The mesh dimension of every process group the run's parallel plan made (group name -> dimension name):
    ``trace.parallel["groups"]``, empty for a trace recorded without a plan."""
    parallel = trace.parallel or {}
    groups = parallel.get("groups") if isinstance(parallel, dict) else None
    return dict(groups) if isinstance(groups, dict) else {}


def communication(trace: Trace) -> Communication:
    """Every collective of ``trace`` (see :class:`CollectiveCall`), attributed to the module that issued it."""
    table = collectives()
    dims = mesh_dims(trace)
    owners = Ancestors(trace, "owner")
    result = Communication([])
    for index, event in enumerate(trace.events):
        if event.level != "dispatch" or not event.op.startswith(_NAMESPACES):
            continue
        entry = table.get(event.op)
        if entry is None:
            if event.op not in BOOKKEEPING_OPS:
                result.unsupported[event.op] += 1
            continue
        group = group_of(event.inputs)
        if group is None:
            raise InvalidValueError(f"event {index} ({event.op}) names no process group the recorder could describe")
        payload = entry.payload(event.inputs, event.outputs)
        sent, received = rank_bytes(entry.kind, payload, group.size)
        scope = trace.scopes[event.scope]
        result.calls.append(CollectiveCall(index, event.op, entry.kind, event.phase, scope[-1] if scope else "",
                                           group, dims.get(group.name, group.name), payload, sent, received,
                                           owners(event.scope)))
    return result
