"""The device catalog: the built-in accelerators (datasheets.py) and yours (files.py), found by name or alias."""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable

from .datasheets import BUILT_IN
from .device import Device, DeviceError, canonical_name
from .files import is_device_file, load_devices

# The built-in devices by name (their aliases are looked up too); a Device added here is found like the others
DEVICES: dict[str, Device] = {device.name: device for device in BUILT_IN}


def get_device(name: str | Device, devices_file: str | os.PathLike[str] | None = None) -> Device:
    """The device called ``name`` or one of its aliases (any case; ``_`` or a space for ``-``): first among
    the devices of ``devices_file`` (a JSON or TOML file, docs/devices.md), then the built-in ones. ``name``
    may also be the path of a device file (``.json``/``.toml``) that describes one device, or a Device (returned
    as it is)."""
    if isinstance(name, Device):
        return name
    if not isinstance(name, str):
        raise DeviceError(f"a device is a name (such as 'h100'), a device file or a Device, not {name!r}")
    if is_device_file(name):
        return _only_device(name)
    user = load_devices(devices_file) if devices_file is not None else {}
    found = _find(user.values(), name) or _find(DEVICES.values(), name)
    if found is None:
        raise DeviceError(_unknown(name, user, devices_file))
    return found


def list_devices(devices_file: str | os.PathLike[str] | None = None) -> list[Device]:
    """Every device a name can choose: those of ``devices_file`` first, then the built-in ones whose name no
    device of the file takes."""
    user = load_devices(devices_file) if devices_file is not None else {}
    return [*user.values(), *(device for name, device in DEVICES.items() if name not in user)]


def _find(devices: Iterable[Device], name: str) -> Device | None:
    wanted = canonical_name(name)
    for device in devices:  # a Device made in code may spell its names in any case
        if wanted in (canonical_name(n) for n in (device.name, *device.aliases)):
            return device
    return None


def _only_device(path: str) -> Device:
    devices = load_devices(path)
    if len(devices) != 1:
        raise DeviceError(f"{path} describes {len(devices)} devices ({', '.join(devices)}): name one, with the "
                          "file as the devices file (--devices-file, devices_file=)")
    return next(iter(devices.values()))


def _unknown(name: str, user: dict[str, Device], devices_file: str | os.PathLike[str] | None) -> str:
    """The message for a name no device has: the known names, a close match, and where devices come from."""
    names = [*user, *(n for n in DEVICES if n not in user)]
    every = names + [alias for device in [*user.values(), *DEVICES.values()] for alias in device.aliases]
    close = difflib.get_close_matches(canonical_name(name), every, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    mine = f" ({len(user)} from {os.fspath(devices_file)})" if devices_file is not None else ""
    return (f"unknown device {name!r}{hint}; known{mine}: {', '.join(names)}; or the path of a .json/.toml "
            "device file (docs/devices.md)")
