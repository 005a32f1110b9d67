"""A rank's step time: its compute time (the roofline) combined with its communication time under a stated
assumption of how the two overlap (docs/parallel.md, "Step time").

A collective takes ``latency + max(bytes sent, bytes received) / bandwidth`` of the link its group spans: NVLink
when all its ranks are in one node, the network adapter otherwise (:class:`~modelmeter.devices.Interconnect`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..devices.interconnect import Interconnect
from .communication import CollectiveCall, Communication

OVERLAP = ("collectives issued through c10d's process-group operators (FSDP2's all-gathers and reduce-scatters, "
           "replicate's and DDP's gradient all-reduces: asynchronous, on their own stream, prefetched) run behind "
           "the same phase's compute and are hidden up to that compute time; functional collectives (DTensor's: "
           "tensor and sequence parallelism, whose result the next operator waits for) are exposed")


def collective_time(call: CollectiveCall, interconnect: Interconnect) -> float:
    """Seconds one collective takes on the link its group spans (0 for a group of one: nothing moves)."""
    if not call.sent and not call.received:
        return 0.0
    link = interconnect.link(call.group.ranks, call.group.size)
    return interconnect.latency(link) + max(call.sent, call.received) / interconnect.bandwidth(link)


def overlaps_compute(call: CollectiveCall) -> bool:
    """True for a collective the :data:`OVERLAP` assumption hides behind compute (a process-group operator)."""
    return call.op.startswith("c10d::")


@dataclass
class StepTime:
    """Seconds of one rank's step, by phase: ``compute`` (the roofline's), the communication that may run behind
    it (``overlapped``) and the communication that cannot (``exposed``); ``total`` is the step under
    :attr:`assumption`: per phase, compute + exposed + whatever of the overlapped communication outlasts the
    compute. ``by_link`` is the communication time on each link (``intra_node``, ``inter_node``)."""

    compute: dict[str, float]
    overlapped: dict[str, float]
    exposed: dict[str, float]
    by_link: dict[str, float]
    interconnect: str
    assumption: str = field(default=OVERLAP)

    def phase(self, name: str) -> float:
        """Seconds of phase ``name`` under the assumption."""
        compute = self.compute.get(name, 0.0)
        return compute + self.exposed.get(name, 0.0) + max(0.0, self.overlapped.get(name, 0.0) - compute)

    @property
    def total(self) -> float:
        return sum(self.phase(name) for name in self.phases())

    @property
    def communication(self) -> float:
        """Seconds of all the collectives, overlapped or not."""
        return sum(self.overlapped.values()) + sum(self.exposed.values())

    def phases(self) -> list[str]:
        return list(dict.fromkeys([*self.compute, *self.overlapped, *self.exposed]))

    def to_dict(self) -> dict[str, Any]:
        """Plain data, the assumption among it."""
        return {"compute": dict(self.compute), "overlapped": dict(self.overlapped), "exposed": dict(self.exposed),
                "phases": {name: self.phase(name) for name in self.phases()}, "by_link": dict(self.by_link),
                "communication": self.communication, "total": self.total, "interconnect": self.interconnect,
                "assumption": self.assumption}


def step_time(communication: Communication, compute: Mapping[str, float], interconnect: Interconnect) -> StepTime:
    """The step of one rank: ``compute`` seconds by phase (a roofline's ``summary["time"]``; its ``"total"`` is
    left out) and the collectives of ``communication`` timed on ``interconnect``."""
    overlapped: dict[str, float] = {}
    exposed: dict[str, float] = {}
    by_link: dict[str, float] = {}
    for call in communication.calls:
        seconds = collective_time(call, interconnect)
        table = overlapped if overlaps_compute(call) else exposed
        table[call.phase] = table.get(call.phase, 0.0) + seconds
        link = interconnect.link(call.group.ranks, call.group.size)
        by_link[link] = by_link.get(link, 0.0) + seconds
    phases = {name: float(seconds) for name, seconds in compute.items() if name != "total"}
    return StepTime(phases, overlapped, exposed, by_link, interconnect.name)
