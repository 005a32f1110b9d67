"""Ctrl-C in the command's worker processes. Imports nothing heavy: a worker runs it before it imports torch."""

from __future__ import annotations

import os
import signal

INTERRUPTED = 130  # the shell's status for a command ended by SIGINT (128 + 2)


def quit_on_interrupt() -> None:
    """The start of the command's worker processes (``--sweep``, ``--check-baseline``), before they import torch:
    Ctrl-C, which the terminal sends to every process of the command, ends a worker at once and silently; the
    command itself prints the one line."""
    signal.signal(signal.SIGINT, lambda *_: os._exit(INTERRUPTED))
