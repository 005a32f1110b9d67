"""One accelerator's datasheet, and the rule that picks the peak a piece of work runs at (docs/devices.md).

Plain data, without torch: dtypes are the names a trace records (``"float32"``, ``"bfloat16"``, ...).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import ModelMeterError


class DeviceError(ModelMeterError, ValueError):
    """An unknown device name, a device without a rate some work needs, or a device file that does not describe
    devices."""


# The precisions a peak is given for; ``tf32`` only on matrix units (it is a tensor-core format)
MATRIX_KEYS = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "fp4", "int8")
VECTOR_KEYS = ("fp64", "fp32", "bf16", "fp16", "fp8", "fp4", "int8")

# Where matrix work in a precision the device has no matrix rate for runs: the next wider format with one (the
# work is upcast to it, as software does on such a device); anything else runs on the vector units
_MATRIX_FALLBACK = {"fp4": "fp8", "fp8": "fp16"}


@dataclass(frozen=True)
class Device:
    """One accelerator: dense peaks (without structured sparsity) in FLOP/s by precision key (``"fp64"``,
    ``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"``, ``"fp8"``, ``"fp4"``, ``"int8"``; int8 in OP/s) on its matrix
    units (``matrix``: tensor cores) and its vector units (``vector``: element-wise work; ``fp32`` is required),
    memory ``bandwidth`` in bytes/s and ``memory`` in bytes. ``aliases`` are other names it answers to,
    ``source`` the documents its numbers come from, ``notes`` the rules used where a document gives no number."""

    name: str
    label: str
    memory: int
    bandwidth: float
    matrix: Mapping[str, float] = field(hash=False)
    vector: Mapping[str, float] = field(hash=False)
    aliases: tuple[str, ...] = ()
    source: str = field(default="", repr=False)
    notes: str = field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        _check(self)
        # its own copies (plain dicts: a Device pickles, for the command's parallel sweeps)
        object.__setattr__(self, "matrix", dict(self.matrix))
        object.__setattr__(self, "vector", dict(self.vector))
        object.__setattr__(self, "aliases", tuple(self.aliases))

    def peak(self, dtype: str, *, matrix: bool, tf32: bool = False) -> float:
        """FLOP/s for work in ``dtype`` (as a trace names it: ``"float32"``, ``"bfloat16"``, ``"int64"``...) on
        the matrix units (``matrix=True``: products, convolutions, attention) or the vector units.

        float32 matrix work runs at the vector fp32 rate (PyTorch's default: no TF32) unless ``tf32=True``, or
        on matrix units that take fp32 itself (AMD's); fp4/fp8 matrix work without a rate of its own runs at
        the next wider format's (fp4 -> fp8 -> fp16); other matrix work without a matrix rate, and every
        integer or bool dtype but int8, runs on the vector units. Vector work runs at its precision's vector
        rate, else at the fp32 rate (PyTorch computes element-wise half, fp8 and integer math in 32 bits); a
        device without an fp64 rate raises :class:`DeviceError` for float64 work rather than guess."""
        key = precision(dtype)
        if matrix:
            found = self._matrix_peak(key, tf32)
            if found is not None:
                return found
        return self._vector_peak(key, dtype)

    def ridge(self, dtype: str = "bfloat16", *, matrix: bool = True, tf32: bool = False) -> float:
        """FLOPs per byte where the roofline turns from memory- to compute-bound."""
        return self.peak(dtype, matrix=matrix, tf32=tf32) / self.bandwidth

    def _matrix_peak(self, key: str, tf32: bool) -> float | None:
        if key == "fp32" and tf32 and "tf32" in self.matrix:
            return self.matrix["tf32"]
        while key not in self.matrix and key in _MATRIX_FALLBACK:
            key = _MATRIX_FALLBACK[key]
        return self.matrix.get(key)

    def _vector_peak(self, key: str, dtype: str) -> float:
        if key in self.vector:
            return self.vector[key]
        if key == "fp64":
            raise DeviceError(f"device {self.name!r} has no fp64 rate for {dtype} work: give it one "
                              "(vector.fp64, and matrix.fp64 for its tensor cores)")
        return self.vector["fp32"]


def canonical_name(name: str) -> str:
    """A device name as lookups compare it: lower case, surrounding spaces dropped, ``_`` and inner spaces as
    ``-`` (``"H100 SXM"`` and ``"h100_sxm"`` are ``"h100-sxm"``)."""
    return "-".join(name.strip().lower().replace("_", " ").split())


def precision(dtype: str) -> str:
    """The precision key whose peaks ``dtype`` (a trace's dtype name) runs at: ``"fp64"``, ``"fp32"``,
    ``"bf16"``, ``"fp16"``, ``"fp8"``, ``"fp4"``, ``"int8"``, or ``"int"`` for every other integer type, bool
    and the counting's ``"other"`` (work without a floating-point tensor). Complex types count as their real
    parts' precision."""
    key = _PRECISIONS.get(dtype)
    if key is not None:
        return key
    for prefix, family in _FAMILIES:
        if dtype.startswith(prefix):
            return family
    raise DeviceError(f"no peak rule for dtype {dtype!r}: expected a torch dtype name such as 'float32', "
                      "'bfloat16', 'float8_e4m3fn' or 'int64'")


_PRECISIONS = {"float64": "fp64", "complex128": "fp64", "float32": "fp32", "complex64": "fp32",
               "bfloat16": "bf16", "bcomplex32": "bf16", "float16": "fp16", "complex32": "fp16",
               "int8": "int8", "uint8": "int8", "qint8": "int8", "quint8": "int8", "bool": "int", "other": "int"}
# every float8_* and float4_* format (e4m3fn, e5m2, their fnuz variants, e8m0fnu scales, e2m1fn_x2); the other
# integer, quantized and raw-bits types run at the integer rule
_FAMILIES = (("float8_", "fp8"), ("float4_", "fp4"), ("int", "int"), ("uint", "int"), ("qint", "int"),
             ("quint", "int"), ("bits", "int"))


def _check(device: Device) -> None:
    """Refuse a Device whose numbers could not be a device's: each error names the device and the field."""
    where = f"device {device.name!r}"
    if not isinstance(device.name, str) or not device.name.strip():
        raise DeviceError(f"device name must be a non-empty string, not {device.name!r}")
    if not isinstance(device.label, str):
        raise DeviceError(f"{where}: label must be a string, not {device.label!r}")
    if isinstance(device.memory, bool) or not isinstance(device.memory, int) or device.memory <= 0:
        raise DeviceError(f"{where}: memory must be a positive whole number of bytes, not {device.memory!r}")
    _check_rate(where, "bandwidth", device.bandwidth, "bytes/s")
    for part, table, keys in (("matrix", device.matrix, MATRIX_KEYS), ("vector", device.vector, VECTOR_KEYS)):
        if not isinstance(table, Mapping):
            raise DeviceError(f"{where}: {part} must be a table of peaks by precision, not {table!r}")
        for key, value in table.items():
            if key not in keys:
                hint = " (a tensor-core format: put it under matrix)" if key == "tf32" else ""
                raise DeviceError(f"{where}: {part}.{key} is not a precision{hint}; known: {', '.join(keys)}")
            _check_rate(where, f"{part}.{key}", value, "FLOP/s")
    if "fp32" not in device.vector:
        raise DeviceError(f"{where}: vector.fp32 is missing (the rate of element-wise work, and the fallback of "
                          "every precision without one)")
    if isinstance(device.aliases, str) or not all(isinstance(a, str) and a.strip() for a in device.aliases):
        raise DeviceError(f"{where}: aliases must be a list of names, not {device.aliases!r}")
    # Names and the label are printed in every report: a control character (a terminal escape, a newline)
    # would rewrite the terminal or break a table's line. Any printable text, unicode included, is fine.
    for what, text in (("name", device.name), ("label", device.label), *(("aliases", a) for a in device.aliases)):
        if not text.isprintable():
            raise DeviceError(f"{where}: {what} {text!r} holds a control character (a terminal escape, a tab or "
                              "a line break): use printable text")


def _check_rate(where: str, what: str, value: object, unit: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        raise DeviceError(f"{where}: {what} must be a positive, finite number of {unit}, not {value!r}")
