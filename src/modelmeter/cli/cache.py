"""``modelmeter cache info|clear``: where the trace cache is, how full, and emptying it (docs/caching.md)."""

from __future__ import annotations

import argparse
import json

from .errors import ModelSpecError
from .options import subcommand_parser
from .output import add_output_options, emit

SUMMARY = "shows (info) or empties (clear) the trace cache"
ACTIONS = ("info", "clear")


def build_parser() -> argparse.ArgumentParser:
    parser = subcommand_parser(
        "modelmeter cache", "modelmeter cache {info,clear} [--cache-dir DIR] [--format {table,json}] [--output FILE]",
        "The trace cache: traces of earlier runs, kept on disk so that an unchanged model is not run again "
        "(docs/caching.md).")
    parser.add_argument("action", nargs="?", metavar="{info,clear}",
                        help="info: the cache's folder, entries, size and size limit; clear: delete every cached "
                             "trace")
    parser.add_argument("--cache-dir", metavar="DIR",
                        help="the cache directory (default: $MODELMETER_CACHE, else the user cache directory)")
    add_output_options(parser, ("table", "json"), "the answer")
    return parser


def run(args: argparse.Namespace) -> int:
    from ..cache.store import SIZE_ENV, TraceCache

    if args.action not in ACTIONS:
        raise ModelSpecError("usage: modelmeter cache info|clear [--cache-dir DIR]")
    try:
        cache = TraceCache(args.cache_dir)
    except (OSError, ValueError) as exc:
        raise ModelSpecError(f"no usable trace cache: {exc}") from None
    if args.action == "clear":
        removed = cache.clear()
        text = (json.dumps({"removed": removed, "path": cache.path}, indent=2) if args.format == "json"
                else f"removed {removed} cached trace{'' if removed == 1 else 's'} from {cache.path}")
    else:
        info = cache.info()
        text = json.dumps(info, indent=2) if args.format == "json" else "\n".join([
            f"trace cache: {info['path']}",
            f"entries:     {info['entries']}",
            f"size:        {_exact_bytes(info['bytes'])}",
            f"limit:       {_exact_bytes(info['limit'])} (${SIZE_ENV})"])
    emit(text, args.output)
    return 0


def _exact_bytes(n: int) -> str:
    """``1GiB (1073741824 bytes)``: the reports' unit, and the exact count."""
    from ..reports.format import format_bytes

    return f"{format_bytes(n)} ({n} bytes)"
