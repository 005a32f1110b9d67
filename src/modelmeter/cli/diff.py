"""``modelmeter diff BEFORE AFTER``: what changed between two saved analyses or baselines, module by module, the
largest change first (docs/guard.md)."""

from __future__ import annotations

import argparse
import sys

from ..errors import ModelMeterError
from ..reports import jsontext
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
    from ..guard.diff import diff_notes

    try:
        before, after = load_costs(args.before), load_costs(args.after)
        notes = diff_notes(args.before, args.after, before, after)
    except ModelMeterError as exc:
        raise ModelSpecError(str(exc)) from None
    differences = diff(before, after)
    for note in notes:
        print(f"modelmeter: note: {note}", file=sys.stderr)
    if args.format == "json":
        text = jsontext.dumps([{"module": d.module, "metric": d.metric, "before": d.before, "after": d.after,
                            "change": d.change} for d in differences], indent=2)
    else:
        text = render_diff(differences, width=report_width(args.output))
    emit(text, args.output)
    return 0
