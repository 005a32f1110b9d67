"""``modelmeter list``: the built-in models, their default inputs and what they are. Imports no torch."""

from __future__ import annotations

import argparse
import json
import textwrap

from ..zoo.catalog import CATALOG
from .options import subcommand_parser
from .output import add_output_options, emit, report_width

SUMMARY = "lists the built-in models"


def build_parser() -> argparse.ArgumentParser:
    parser = subcommand_parser("modelmeter list", "modelmeter list [--format {table,json}] [--output FILE]",
                               "The built-in models (random weights, nothing downloaded), the shape and dtype of "
                               "their default input (batch 1), and what they are.")
    add_output_options(parser, ("table", "json"), "the list")
    return parser


def run(args: argparse.Namespace) -> int:
    rows = [(e.name, "x".join(map(str, e.input_shape)) + " " + e.input_dtype, e.description) for e in CATALOG]
    if args.format == "json":
        text = json.dumps([{"name": n, "input": i, "description": d} for n, i, d in rows], indent=2)
    else:
        text = "\n".join(_table(rows, report_width(args.output)))
    emit(text, args.output)
    return 0


def _table(rows: list[tuple[str, str, str]], width: int) -> list[str]:
    """The list as text fitted to ``width``: each description wrapped under its own column (at least 20
    characters wide), the closing line wrapped too."""
    name_width = max(len(r[0]) for r in rows)
    in_width = max(len(r[1]) for r in rows)
    indent = " " * (2 + name_width + 2 + in_width + 2)
    lines = ["built-in models (random weights, nothing downloaded):"]
    for name, shape, description in rows:
        first = f"  {name:<{name_width}}  {shape:<{in_width}}  "
        lines += textwrap.wrap(description, max(width, len(indent) + 20), initial_indent=first,
                               subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)
    also = ("also: torchvision:NAME, timm:NAME, transformers:CONFIG [key=value ...], path/file.py:factory, "
            "package.module:factory")
    return [*lines, "", *textwrap.wrap(also, width, subsequent_indent="  ", break_long_words=False,
                                       break_on_hyphens=False)]
