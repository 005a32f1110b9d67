"""The ``modelmeter`` command's entry point (:func:`modelmeter.cli.main` does the work).

A module of its own, outside the package, so that it imports nothing heavy: Ctrl-C while torch and the package
load (seconds, at start-up) ends with the one line ``modelmeter: interrupted`` and exit 130, as it does later,
instead of a traceback.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

INTERRUPTED = 130  # the shell's status for a command ended by SIGINT (128 + 2)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        from modelmeter.cli import main as command
    except KeyboardInterrupt:
        print("modelmeter: interrupted", file=sys.stderr)
        return INTERRUPTED
    return command(argv)


def quit_on_interrupt() -> None:
    """The start of the command's worker processes (``--sweep``, ``--check-baseline``), before they import torch:
    Ctrl-C, which the terminal sends to every process of the command, ends a worker at once and silently; the
    command itself prints the one line."""
    signal.signal(signal.SIGINT, lambda *_: os._exit(INTERRUPTED))


if __name__ == "__main__":
    raise SystemExit(main())
