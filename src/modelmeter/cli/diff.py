"""``modelmeter diff BEFORE AFTER``: what changed between two saved analyses or baselines, module by module, the
largest change first (docs/guard.md)."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import ModelMeterError
from .errors import ModelSpecError
from .options import subcommand_parser
from .output import add_output_options, emit, report_width

SUMMARY = "compares two saved analyses or baselines, module by module"


def build_parser() -> argparse.ArgumentParser:
    parser = subcommand_parser(
        "modelmeter diff", "modelmeter diff BEFORE AFTER [--format {table,json}] [--output FILE]",
        "The differences between two saved analyses (`modelmeter MODEL --format json --output FILE`) or baseline "
        "files (--save-baseline), per module and metric, the largest change first.")
    parser.add_argument("before", metavar="BEFORE", help="the earlier analysis or baseline (a JSON file)")
    parser.add_argument("after", metavar="AFTER", help="the later analysis or baseline (a JSON file)")
    add_output_options(parser, ("table", "json"), "the differences")
    return parser


def run(args: argparse.Namespace) -> int:
    from ..guard import diff, load_costs, render_diff
    from ..guard.diff import device_of

    try:
        differences = diff(load_costs(args.before), load_costs(args.after))
        devices = device_of(args.before), device_of(args.after)
    except ModelMeterError as exc:
        raise ModelSpecError(str(exc)) from None
    if None not in devices and devices[0] != devices[1]:  # a time on another device is no change of the model
        print(f"modelmeter: note: the times are predicted on different devices ({devices[0]} before, {devices[1]} "
              "after): their changes compare the devices, not the models", file=sys.stderr)
    if args.format == "json":
        text = json.dumps([{"module": d.module, "metric": d.metric, "before": d.before, "after": d.after,
                            "change": d.change} for d in differences], indent=2)
    else:
        text = render_diff(differences, width=report_width(args.output))
    emit(text, args.output)
    return 0
