"""Devices of your own: a small JSON or TOML file with a table ``devices`` of devices by name
(docs/devices.md#your-own-devices). Every error names the file, the device and the field."""

from __future__ import annotations

import difflib
import json
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .device import Device, DeviceError, canonical_name

FILE_SUFFIXES = (".json", ".toml")
# field -> what it holds, for the messages
FIELDS = {"label": "a string", "memory": "bytes", "bandwidth": "bytes/s", "matrix": "a table of FLOP/s",
          "vector": "a table of FLOP/s", "aliases": "a list of names", "source": "a string", "notes": "a string"}
REQUIRED = ("memory", "bandwidth", "vector")


def is_device_file(name: str | os.PathLike[str]) -> bool:
    """Whether ``name`` names a device file (it ends in ``.json`` or ``.toml``) rather than a device."""
    return os.fspath(name).lower().endswith(FILE_SUFFIXES)


def load_devices(path: str | os.PathLike[str]) -> dict[str, Device]:
    """The devices the file ``path`` describes, by name, in the file's order; a :class:`DeviceError` naming the
    file, the device and the field for anything that does not describe a device."""
    where = os.fspath(path)
    data = _parse(where, _read(where))
    if not isinstance(data, dict) or "devices" not in data:
        raise DeviceError(f"{where}: expected a table 'devices' of devices by name (docs/devices.md)")
    extra = sorted(set(data) - {"devices"})
    if extra:
        raise DeviceError(f"{where}: unknown key {extra[0]!r} at the top (the file holds one table, 'devices')")
    entries = data["devices"]
    if not isinstance(entries, dict) or not entries:
        raise DeviceError(f"{where}: 'devices' must be a table of devices by name, and name one at least")
    devices: dict[str, Device] = {}
    owners: dict[str, str] = {}  # every name and alias -> the device that has it
    for key, entry in entries.items():
        device = _device(where, key, entry)
        for name in (device.name, *device.aliases):
            if name in owners:
                raise DeviceError(f"{where}: device {key!r}: the name {name!r} is also device "
                                  f"{owners[name]!r}'s")
            owners[name] = device.name
        devices[device.name] = device
    return devices


def device_to_dict(device: Device) -> dict[str, Any]:
    """A Device as plain JSON data: the fields of a device file's entry and the ``name`` (for a saved analysis
    that must name its device without the file; :func:`device_from_dict` reads it back)."""
    return {"name": device.name, "label": device.label, "memory": device.memory, "bandwidth": device.bandwidth,
            "matrix": dict(device.matrix), "vector": dict(device.vector), "aliases": list(device.aliases),
            "source": device.source, "notes": device.notes}


def device_from_dict(data: Mapping[str, Any], where: str = "device data") -> Device:
    """The Device ``data`` describes (the shape :func:`device_to_dict` writes, and ``dataclasses.asdict``),
    checked like a device file's entry; its errors start with ``where``."""
    if not isinstance(data, Mapping) or "name" not in data:
        raise DeviceError(f"{where}: expected a table of a device's fields and its 'name', not {data!r}")
    return _device(where, data["name"], {key: value for key, value in data.items() if key != "name"})


def _read(where: str) -> str:
    if not is_device_file(where):
        raise DeviceError(f"{where}: a device file is JSON (.json) or TOML (.toml)")
    try:
        return Path(where).expanduser().read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DeviceError(f"{where}: no such device file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DeviceError(f"{where}: cannot read the device file: {exc}") from None


def _parse(where: str, text: str) -> Any:
    if where.lower().endswith(".json"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise DeviceError(f"{where}: not valid JSON: {exc}") from None
    loads = _toml_loads(where)
    try:
        return loads(text)
    except ValueError as exc:  # tomllib.TOMLDecodeError (and tomli's) is a ValueError
        raise DeviceError(f"{where}: not valid TOML: {exc}") from None


def _toml_loads(where: str) -> Callable[[str], dict[str, Any]]:
    """tomllib's reader (Python 3.11+), else the ``tomli`` package's; a clear error when neither is there."""
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib.loads
    try:
        import tomli
    except ImportError:
        raise DeviceError(f"{where}: reading TOML needs Python 3.11 or the 'tomli' package "
                          "(pip install tomli); or write the devices as JSON") from None
    loads: Callable[[str], dict[str, Any]] = tomli.loads
    return loads


def _device(where: str, key: object, entry: object) -> Device:
    """The Device of one entry of the file's ``devices`` table."""
    if not isinstance(key, str) or not key.strip() or is_device_file(key):
        raise DeviceError(f"{where}: {key!r} cannot name a device (a name, not empty, not ending in .json/.toml)")
    if not isinstance(entry, Mapping):
        raise DeviceError(f"{where}: device {key!r}: expected a table of fields, not {entry!r}")
    for field in entry:
        if field not in FIELDS:
            close = difflib.get_close_matches(str(field), list(FIELDS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise DeviceError(f"{where}: device {key!r}: unknown field {field!r}{hint}; fields: {', '.join(FIELDS)}")
    for field in REQUIRED:
        if field not in entry:
            raise DeviceError(f"{where}: device {key!r}: the field {field!r} ({FIELDS[field]}) is missing")
    aliases = entry.get("aliases", [])  # a list in a file, a tuple in dataclasses.asdict(device)
    if not isinstance(aliases, list | tuple) or not all(isinstance(a, str) and a.strip() for a in aliases):
        raise DeviceError(f"{where}: device {key!r}: aliases must be a list of names, not {aliases!r}")
    for field in ("matrix", "vector"):
        if not isinstance(entry.get(field, {}), Mapping):
            raise DeviceError(f"{where}: device {key!r}: {field} must be a table of FLOP/s by precision, "
                              f"not {entry[field]!r}")
    for field in ("label", "source", "notes"):
        if not isinstance(entry.get(field, ""), str):
            raise DeviceError(f"{where}: device {key!r}: {field} must be a string, not {entry[field]!r}")
    name = canonical_name(key)
    try:
        return Device(name=name, label=entry.get("label", key), memory=_whole(entry["memory"]),
                      bandwidth=entry["bandwidth"], matrix=entry.get("matrix", {}), vector=entry["vector"],
                      aliases=tuple(dict.fromkeys(canonical_name(a) for a in aliases)),
                      source=entry.get("source", where), notes=entry.get("notes", ""))
    except DeviceError as exc:
        raise DeviceError(f"{where}: {exc}") from None


def _whole(value: Any) -> Any:
    """``24e9`` (a float in TOML and JSON) as the whole number of bytes it is; anything else as given (the
    Device's check says what is wrong with it)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value
