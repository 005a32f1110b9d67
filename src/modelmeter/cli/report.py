"""``modelmeter report FILE``: a saved trace (``--save-trace``) rendered as the analysis printed it, with no model.

Rendering the result the file was saved with imports neither torch nor any model code; ``--convention``,
``--attention-kernel`` and ``--dense-attention`` recount it from the trace under other settings (that needs
torch, not the model). docs/reports.md, "Saved traces"."""

from __future__ import annotations

import argparse
import os
from typing import Any

from .errors import ModelSpecError
from .options import ATTENTION_KERNELS, CONVENTIONS, FORMATS, depth, layout_options, subcommand_parser, time_options
from .output import check_layout, emit, header_line, read_result, render_report, write_html_report

SUMMARY = "renders a saved trace (--save-trace FILE) without the model"


def build_parser() -> argparse.ArgumentParser:
    parser = subcommand_parser(
        "modelmeter report", "modelmeter report FILE [--format FORMAT] [--depth N] [--output FILE] [--html FILE] "
                             "[--compare RESULT] [--convention C] [--attention-kernel K] [--dense-attention]",
        "The report of a saved trace (`modelmeter MODEL --save-trace FILE`), as the analysis printed it, without "
        "building or running the model. Counting options recount it from the trace under other settings.")
    parser.add_argument("trace", metavar="FILE", help="a saved trace (.mmtrace)")
    out = parser.add_argument_group("output")
    out.add_argument("--format", choices=FORMATS, default="table", help="output format (default table)")
    out.add_argument("--output", "-o", metavar="FILE", help="write the report to FILE instead of stdout")
    out.add_argument("--depth", type=depth, default=2, metavar="N", help="module depth shown (default 2)")
    layout_options(out)
    out.add_argument("--html", metavar="FILE", help="also write the interactive HTML report to FILE")
    out.add_argument("--compare", metavar="RESULT",
                     help="with --html: show the difference per module to another analysis (a saved trace or a "
                          "result saved with --format json)")
    recount = parser.add_argument_group("recounting (from the trace, under other settings than it was saved with)")
    recount.add_argument("--convention", choices=CONVENTIONS, default=None, help="the FLOP convention")
    recount.add_argument("--attention-kernel", choices=ATTENTION_KERNELS, default=None,
                         help="the attention kernel whose cost attention is counted at")
    recount.add_argument("--dense-attention", action="store_true", default=None,
                         help="count masked attention as dense")
    time_options(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    check_layout(args)
    if args.compare and not args.html:
        raise ModelSpecError("--compare shows the difference in the HTML report: add --html FILE")
    from ..reports.saved import SavedTraceError, read_saved_trace

    try:
        saved = read_saved_trace(args.trace)
    except SavedTraceError as exc:
        raise ModelSpecError(str(exc)) from None
    other = read_result(args.compare, "--compare") if args.compare else None
    changes = {name: value for name, value in (("convention", args.convention),
                                                ("attention_kernel", args.attention_kernel),
                                                ("dense_attention", args.dense_attention)) if value is not None}
    changes.update(_time_changes(args, saved.settings))
    result = saved.result
    if any(saved.settings[name] != value for name, value in changes.items()):
        from ..devices import DeviceError
        from ..trace_files import recount

        try:
            result = recount(saved, **changes)
        except DeviceError as exc:  # the device lacks a rate the trace's work needs, or its numbers overflow
            where = f"--device {args.device}" if args.device else "the trace's device"
            raise ModelSpecError(f"{where}: {exc}") from None
    source = f", saved trace {os.path.basename(args.trace)}"
    plan = (saved.trace.parallel or {}).get("plan")
    text = render_report(result, args, header_line(result, backward=saved.trace.backward, source=source,
                                                    parallel=plan))
    emit(text, args.output)
    if args.html:
        write_html_report(args.html, result, other, saved.trace.versions.get("torch", "unknown"))
    return 0


def _time_changes(args: argparse.Namespace, settings: dict[str, Any]) -> dict[str, Any]:
    """The time settings the command line changes: a ``--device`` (the saved one when only its options are
    given), with every option of the time as given."""
    given = (args.devices_file, args.measured_time, args.efficiency != 1.0, args.launch_overhead, args.tf32)
    if args.device is None and not any(given):
        return {}
    device = settings["device"] if args.device is None else args.device
    if device is None:
        raise ModelSpecError("the trace was saved without a device: add --device NAME (`modelmeter devices`)")
    if args.device is not None:
        from ..devices import DeviceError, get_device

        try:
            device = get_device(args.device, devices_file=args.devices_file)
        except (DeviceError, OSError) as exc:
            raise ModelSpecError(str(exc)) from None
    return {"device": device, "efficiency": args.efficiency, "launch_overhead": args.launch_overhead,
            "tf32": args.tf32, "measured_time": args.measured_time}

