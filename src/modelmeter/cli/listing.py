"""``modelmeter list``: the built-in models, their default inputs and what they are. Imports no torch."""

from __future__ import annotations

import argparse
import json

from ..zoo.catalog import CATALOG
from .options import subcommand_parser
from .output import add_output_options, emit

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
        width = max(len(r[0]) for r in rows)
        in_width = max(len(r[1]) for r in rows)
        lines = ["built-in models (random weights, nothing downloaded):",
                 *(f"  {n:<{width}}  {i:<{in_width}}  {d}" for n, i, d in rows),
                 "",
                 "also: torchvision:NAME, timm:NAME, transformers:CONFIG [key=value ...], "
                 "path/file.py:factory, package.module:factory"]
        text = "\n".join(lines)
    emit(text, args.output)
    return 0
