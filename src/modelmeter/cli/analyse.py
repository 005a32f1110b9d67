"""``modelmeter [analyse] MODEL [key=value ...] [options]``, the command's main job (and its default): one model's
costs by module, a ``--sweep``, a ``--fit`` or a check of every model of a baseline (:mod:`.run`). Its parser
imports no torch, so that ``modelmeter --help`` answers at once."""

from __future__ import annotations

import argparse
import warnings

from .commands import overview
from .options import build_parser as analysis_parser

SUMMARY = "shows what MODEL costs, by module (the default: `modelmeter MODEL` is the same)"


def build_parser() -> argparse.ArgumentParser:
    """The analysis's parser, its usage and help naming every other subcommand."""
    usage, commands = overview()
    return analysis_parser(usage, commands)


def run(args: argparse.Namespace) -> int:
    with warnings.catch_warnings():  # numpy is optional; torch's CPU wheel warns on import without it
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
        from .run import run_analysis  # the analysis layer and torch: imported once a model is to run

    return run_analysis(args)
