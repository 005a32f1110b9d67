"""The command's subcommands. Each is a module of this package with ``SUMMARY`` (one line for the help),
``build_parser()`` (its own parser, ``--help`` included) and ``run(args) -> exit status``; its module imports no
torch, so that every ``--help`` answers at once. A new subcommand is a new module and a line here."""

from __future__ import annotations

import importlib
from types import ModuleType

DEFAULT = "analyse"  # `modelmeter MODEL ...`: no subcommand named
# subcommand -> its module; `modelmeter NAME ...` runs it when NAME is the first argument (even if a file, or
# a module on the path, has that name: models are named by `NAME.py:factory` or `package.NAME:factory`)
COMMANDS = {"analyse": "analyse", "list": "listing", "cache": "cache", "diff": "diff", "report": "report",
            "devices": "devices"}


def command(name: str) -> ModuleType:
    """The module of the subcommand ``name``."""
    return importlib.import_module(f"{__package__}.{COMMANDS[name]}")


def overview() -> tuple[str, str]:
    """The usage lines of every subcommand, and a sentence naming each with its summary (for the help)."""
    usage = ["modelmeter [analyse] [MODEL] [key=value ...] [options]"]
    summaries = []
    for name in COMMANDS:
        module = command(name)
        summaries.append(f"`modelmeter {name}` {module.SUMMARY}")
        if name != DEFAULT:  # its usage is the first line
            usage.append(module.build_parser().format_usage().removeprefix("usage: ").strip())
    return "\n       ".join(usage), f"Commands: {'; '.join(summaries)} (each with its own --help). "
