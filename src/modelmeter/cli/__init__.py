"""The ``modelmeter`` command: FLOPs, activations and parameters of a model, by module.

``modelmeter`` alone analyses the built-in ResNet-50 at 224x224; ``modelmeter MODEL`` (or ``modelmeter analyse
MODEL``) another model: a zoo name (``modelmeter list``), ``torchvision:NAME``, ``timm:NAME``,
``transformers:CONFIG [key=value ...]``, ``path/file.py:factory`` or ``package.module:factory`` (see
:mod:`modelmeter.cli.models`). Models are built on the meta device and run on FakeTensors: no weights, no
kernels, nothing downloaded. ``--sweep`` shows how the cost grows with the resolution, batch or sequence length.
``--memory`` predicts the memory of inference or, with ``--backward`` / ``--optimizer``, of a training step;
``--fit 24GiB`` finds the largest batch that fits (docs/memory.md). Traces are cached on disk (``--no-cache`` to
skip, ``--cache-dir`` to choose where; ``modelmeter cache info`` / ``modelmeter cache clear``). ``modelmeter diff
A.json B.json`` compares two saved analyses. Each subcommand is a module of this package (:mod:`.commands`).

Exit status: 0 success, 2 usage error (bad option, shape, path or model name, found before the model runs; or
inputs a layer of the model cannot take, found when it fails there), 1 the model failed to build or run (or a
cost guard failed: over --budget, grown over --check-baseline; or batch 1 does not fit --fit SIZE), 130
interrupted (Ctrl-C), 141 the reader of the output left before it was written (``| head -1``: nothing more is
printed, no traceback). Each error is one line on stderr. Inputs the
command makes are meta tensors (no memory) unless ``--real``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from ..errors import ModelMeterError
from .commands import COMMANDS, DEFAULT, command
from .errors import ModelSpecError
from .output import check_paths, parse, print_error

__all__ = ["main"]

BROKEN_PIPE = 141  # the shell's status for a command ended by SIGPIPE (128 + 13), as `yes | head -1` leaves it


def main(argv: Sequence[str] | None = None) -> int:
    """The command: its exit status. A mistake on the command line is one line on stderr and exit 2, a model
    that fails one line and exit 1, Ctrl-C the line ``modelmeter: interrupted`` and exit 130, a reader of the
    output that left early (``| head -1``) nothing more and exit 141."""
    try:
        status = _main(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()  # a reader gone is found here, not by the interpreter's last flush (a traceback)
        return status
    except KeyboardInterrupt:
        print("modelmeter: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _drop_stdout()
        return BROKEN_PIPE


def _drop_stdout() -> None:
    """Point stdout at /dev/null: what is still buffered for the reader that left would raise BrokenPipeError
    again when the interpreter flushes it at exit (a stdout with no file descriptor, as under pytest, has none to
    flush)."""
    try:
        descriptor = sys.stdout.fileno()
    except (OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, descriptor)
    os.close(devnull)


def _main(argv: list[str]) -> int:
    """The subcommand named by the first argument (the analysis when none is), run on the others."""
    name = argv[0] if argv and argv[0] in COMMANDS else DEFAULT
    if argv and argv[0] == name:
        argv = argv[1:]
    try:
        subcommand = command(name)
        args = parse(subcommand.build_parser(), argv)
        if isinstance(args, int):  # a usage error argparse printed, or --help
            return args
        check_paths(args)
        status: int = subcommand.run(args)
        return status
    except ModelSpecError as exc:
        print_error(exc)
        return 2
    except ModelMeterError as exc:
        print_error(exc)
        return 1
