"""Accelerators by name: datasheet peaks and memory bandwidth, for the roofline time (docs/devices.md).

Plain data, without torch, so ``modelmeter devices`` lists them in an instant.
"""

from .catalog import DEVICES, Device, DeviceError, device_from_dict, get_device

__all__ = ["DEVICES", "Device", "DeviceError", "device_from_dict", "get_device"]
