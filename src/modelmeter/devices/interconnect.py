"""How one GPU reaches the others: NVLink inside its node, its network adapter (InfiniBand/RoCE) beyond
(docs/devices.md, "Interconnects"). Plain data, without torch.

Bandwidths are per GPU and per direction, in bytes/s: a datasheet's "900 GB/s" of NVLink is bidirectional, 450 GB/s
each way; a NIC's "400 Gb/s" is per direction in bits, 50 GB/s. The latencies are not datasheet figures but an
assumption, of the order NCCL's small-message times show, and a setting.
"""

from __future__ import annotations

from dataclasses import dataclass

from .catalog import get_device
from .device import Device, DeviceError, canonical_name

G = 10**9


@dataclass(frozen=True)
class Interconnect:
    """The links of one GPU: ``intra_node`` bytes/s each way over NVLink to the other GPUs of its node (``node_size``
    GPUs, fully connected through NVSwitch), ``inter_node`` bytes/s each way over its own network adapter to GPUs of
    other nodes, and the fixed cost in seconds of one collective over each (``intra_latency``, ``inter_latency``)."""

    name: str
    intra_node: float
    inter_node: float
    node_size: int = 8
    intra_latency: float = 5e-6
    inter_latency: float = 10e-6
    source: str = ""

    def __post_init__(self) -> None:
        where = f"interconnect {self.name!r}"
        for what in ("intra_node", "inter_node", "intra_latency", "inter_latency"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise DeviceError(f"{where}: {what} must be a finite number >= 0, not {value!r}")
        if self.intra_node <= 0 or self.inter_node <= 0:
            raise DeviceError(f"{where}: bandwidths must be positive")
        if isinstance(self.node_size, bool) or not isinstance(self.node_size, int) or self.node_size < 1:
            raise DeviceError(f"{where}: node_size must be a whole number of GPUs >= 1, not {self.node_size!r}")

    def link(self, ranks: tuple[int, ...], size: int) -> str:
        """``"intra_node"`` when a group of these global ``ranks`` (``size`` of them) lies within one node (ranks
        are laid out node by node, ``node_size`` to a node), else ``"inter_node"``; a group whose ranks are not
        known is taken to lie within one node when it fits in one."""
        if not ranks:
            return "intra_node" if size <= self.node_size else "inter_node"
        nodes = {rank // self.node_size for rank in ranks}
        return "intra_node" if len(nodes) == 1 else "inter_node"

    def bandwidth(self, link: str) -> float:
        return self.intra_node if link == "intra_node" else self.inter_node

    def latency(self, link: str) -> float:
        return self.intra_latency if link == "intra_node" else self.inter_latency


_NDR = ("one ConnectX-7 adapter per GPU at 400 Gb/s (NDR InfiniBand), as in NVIDIA's DGX systems "
        "(NVIDIA DGX H100/H200 User Guide, 'Network Ports'; DGX B200 datasheet)")

# The built-in interconnects, by the device name they belong to: the 8-GPU NVLink baseboards (HGX/DGX) of each GPU
INTERCONNECTS: dict[str, Interconnect] = {
    "a100": Interconnect(
        "nvlink3+hdr", intra_node=600 * G / 2, inter_node=200 * G / 8,
        source="NVLink 600 GB/s bidirectional: NVIDIA A100 Tensor Core GPU datasheet (SXM); one ConnectX-6 adapter "
               "per GPU at 200 Gb/s (HDR InfiniBand): NVIDIA DGX A100 datasheet"),
    "h100": Interconnect(
        "nvlink4+ndr", intra_node=900 * G / 2, inter_node=400 * G / 8,
        source=f"NVLink 900 GB/s bidirectional: NVIDIA H100 Tensor Core GPU datasheet (SXM); {_NDR}"),
    "h200": Interconnect(
        "nvlink4+ndr", intra_node=900 * G / 2, inter_node=400 * G / 8,
        source=f"NVLink 900 GB/s bidirectional: NVIDIA H200 Tensor Core GPU datasheet (SXM); {_NDR}"),
    "b200": Interconnect(
        "nvlink5+ndr", intra_node=1800 * G / 2, inter_node=400 * G / 8,
        source=f"NVLink 1.8 TB/s bidirectional: NVIDIA HGX platform specifications, HGX B200; {_NDR}"),
}


def get_interconnect(device: str | Device | Interconnect) -> Interconnect:
    """The interconnect of ``device`` (a built-in device's name or the Device), or ``device`` itself when it is an
    :class:`Interconnect`; a :class:`DeviceError` naming the devices that have one otherwise."""
    if isinstance(device, Interconnect):
        return device
    name = device.name if isinstance(device, Device) else get_device(device).name  # (an alias: its device's name)
    found = INTERCONNECTS.get(canonical_name(name))
    if found is None:
        raise DeviceError(f"no interconnect is known for device {name!r} (known: {', '.join(INTERCONNECTS)}): give "
                          "one, e.g. Interconnect('mine', intra_node=450e9, inter_node=50e9)")
    return found
