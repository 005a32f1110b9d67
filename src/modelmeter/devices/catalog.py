"""The device catalog: what an accelerator can do per second, from its datasheet.

SKELETON (issue 18): the devices helper fills in the catalog, user files and the listing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import ModelMeterError


class DeviceError(ModelMeterError, ValueError):
    """An unknown device name, or a device file that does not describe devices."""


@dataclass(frozen=True)
class Device:
    """One accelerator: dense peaks in FLOP/s by dtype key (``"fp64"``, ``"fp32"``, ``"tf32"``, ``"bf16"``,
    ``"fp16"``, ``"fp8"``, ``"int8"``) on its matrix units (``matrix``: tensor cores) and its vector units
    (``vector``: element-wise work), memory ``bandwidth`` in bytes/s and ``memory`` in bytes."""

    name: str
    label: str
    memory: int
    bandwidth: float
    matrix: Mapping[str, float]
    vector: Mapping[str, float]
    aliases: tuple[str, ...] = ()
    source: str = ""
    notes: str = field(default="", compare=False)

    def peak(self, dtype: str, *, matrix: bool, tf32: bool = False) -> float:
        """FLOP/s for work in ``dtype`` (as a trace names it: ``"float32"``, ``"bfloat16"``) on the matrix or the
        vector units."""
        key = _DTYPE_KEYS.get(dtype, "fp32")
        if matrix:
            if key == "fp32" and tf32 and "tf32" in self.matrix:
                return self.matrix["tf32"]
            if key != "fp32" and key in self.matrix:
                return self.matrix[key]
        return self.vector.get(key, self.vector["fp32"])

    def ridge(self, dtype: str = "bfloat16", *, matrix: bool = True, tf32: bool = False) -> float:
        """FLOPs per byte where the roofline turns from memory- to compute-bound."""
        return self.peak(dtype, matrix=matrix, tf32=tf32) / self.bandwidth


_DTYPE_KEYS = {"float64": "fp64", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int8": "int8",
               "uint8": "int8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8"}

DEVICES: dict[str, Device] = {
    "h100": Device("h100", "NVIDIA H100 SXM5 80GB", 80 * 10**9, 3.35e12,
                   {"fp64": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12,
                    "int8": 1978.9e12},
                   {"fp64": 33.5e12, "fp32": 66.9e12, "bf16": 133.8e12, "fp16": 133.8e12}),
}


def get_device(name: str, devices_file: str | None = None) -> Device:
    """The device called ``name`` (or one of its aliases, any case)."""
    if devices_file is not None:
        raise NotImplementedError("skeleton")
    found = DEVICES.get(name.lower())
    if found is None:
        raise DeviceError(f"unknown device {name!r}; known: {', '.join(DEVICES)}")
    return found


def device_from_dict(data: Mapping[str, object]) -> Device:
    """A device from its fields (as ``dataclasses.asdict`` gives them, and a saved trace keeps a user's device)."""
    return Device(**data)  # type: ignore[arg-type]
