"""``modelmeter devices``: the accelerators ``--device`` can name, with their datasheet peaks (docs/devices.md).
Imports no torch."""

from __future__ import annotations

import argparse
from typing import Any

from ..devices import Device, DeviceError, device_to_dict, list_devices, load_devices
from ..reports import jsontext
from ..reports.columns import Column, fit
from ..reports.format import Align, aligned_table, markdown_table, wrapped
from .errors import ModelSpecError
from .options import subcommand_parser
from .output import add_output_options, emit, report_width

SUMMARY = "lists the accelerators a roofline can run on, with their datasheet peaks"
HEADER = ["name", "device", "memory", "bandwidth", "bf16", "fp16", "fp32", "tf32", "fp8", "ridge"]
ALIGNS: list[Align] = ["left", "left", "right", "right", "right", "right", "right", "right", "right", "right"]
# The columns a narrow terminal leaves out first: the long label, the rarer peaks, then the others
_DROP_ORDER = {"device": 0, "fp8": 1, "tf32": 2, "fp16": 3, "ridge": 4, "fp32": 5, "bandwidth": 6, "memory": 7,
               "bf16": 8}


def build_parser() -> argparse.ArgumentParser:
    parser = subcommand_parser(
        "modelmeter devices", "modelmeter devices [--devices-file FILE] [--format {table,markdown,json}] "
                              "[--output FILE]",
        "The accelerators a device name can choose: memory, bandwidth and dense peaks (TFLOP/s, without "
        "structured sparsity) on the tensor cores for bf16, fp16, tf32 and fp8; fp32 as a float32 matrix "
        "product runs by default (without TF32); ridge: the FLOPs per byte where bf16 work turns compute-bound "
        "(docs/devices.md).")
    parser.add_argument("--devices-file", metavar="FILE",
                        help="a JSON or TOML file of devices of your own, listed first (docs/devices.md)")
    add_output_options(parser, ("table", "markdown", "json"), "the list")
    return parser


def run(args: argparse.Namespace) -> int:
    try:
        devices = list_devices(args.devices_file)
        mine = set(load_devices(args.devices_file)) if args.devices_file is not None else set()
    except DeviceError as exc:
        raise ModelSpecError(f"--devices-file: {exc}") from None
    if args.format == "json":
        text = jsontext.dumps([_as_json(d, args.devices_file if d.name in mine else None) for d in devices], indent=2)
    else:
        rows = [_row(d, d.name in mine) for d in devices]
        notes = ["-: no tensor-core rate of its own (docs/devices.md says where such work runs)"]
        if mine:
            notes.append(f"*: from {args.devices_file}")
        if args.format == "markdown":
            lines = [*markdown_table(HEADER, rows), "", *notes]
        else:
            lines = _table(rows, notes, report_width(args.output))
        text = "\n".join(lines)
    emit(text, args.output)
    return 0


def _table(rows: list[list[str]], notes: list[str], width: int) -> list[str]:
    """The terminal table fitted to ``width``: the label, then the rarer peaks, left out first (said under it),
    the title and notes wrapped."""
    columns = [Column(key, key, key, align, list(cells))
               for key, align, cells in zip(HEADER, ALIGNS, zip(*rows, strict=True), strict=True)]
    shown, _, dropped = fit(columns, width, rank=lambda key: _DROP_ORDER[key])
    table = aligned_table([[c.header for c in shown], *zip(*(c.cells for c in shown), strict=True)],
                          [c.align for c in shown], rule=True)
    if dropped:
        notes = [f"left out to fit {width} characters: {', '.join(dropped)} (--format json has every field)", *notes]
    title = "accelerators (dense peaks in TFLOP/s, without sparsity; ridge in FLOPs/byte at bf16):"
    return [*wrapped([title], width), *table, "", *wrapped(notes, width)]


def _row(device: Device, mine: bool) -> list[str]:
    return [device.name + ("*" if mine else ""), device.label, f"{device.memory / 1e9:g} GB",
            f"{device.bandwidth / 1e12:.3g} TB/s", _tflops(device.matrix.get("bf16")),
            _tflops(device.matrix.get("fp16")), _tflops(device.peak("float32", matrix=True)),
            _tflops(device.matrix.get("tf32")), _tflops(device.matrix.get("fp8")), f"{device.ridge():.0f}"]


def _tflops(rate: float | None) -> str:
    return "-" if rate is None else f"{rate / 1e12:.5g}"


def _as_json(device: Device, origin: str | None) -> dict[str, Any]:
    return {**device_to_dict(device), "ridge": device.ridge(), "origin": origin or "built-in"}
