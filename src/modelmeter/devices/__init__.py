"""Accelerators by name: datasheet peaks and memory bandwidth, for the roofline time (docs/devices.md).

Plain data, without torch, so ``modelmeter devices`` lists them in an instant: the built-in datasheets
(datasheets.py), the Device and its peak rules (device.py), devices of your own from a JSON or TOML file
(files.py), lookups by name or alias (catalog.py), and the links between GPUs (interconnect.py).
"""

from .catalog import DEVICES, get_device, list_devices
from .device import Device, DeviceError, precision
from .files import device_from_dict, device_to_dict, load_devices
from .interconnect import INTERCONNECTS, Interconnect, get_interconnect

__all__ = ["DEVICES", "INTERCONNECTS", "Device", "DeviceError", "Interconnect", "device_from_dict", "device_to_dict",
           "get_device", "get_interconnect", "list_devices", "load_devices", "precision"]
