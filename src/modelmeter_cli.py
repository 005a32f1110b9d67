"""The ``modelmeter`` command's entry point (:func:`modelmeter.cli.main` does the work).

A module of its own, outside the package, so that it imports nothing heavy: Ctrl-C while torch and the package
load (seconds, at start-up) ends with the one line ``modelmeter: interrupted`` and exit 130, as it does later,
instead of a traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

INTERRUPTED = 130  # the shell's status for a command ended by SIGINT (128 + 2), as modelmeter.cli.interrupt's


def main(argv: Sequence[str] | None = None) -> int:
    try:
        from modelmeter.cli import main as command
    except KeyboardInterrupt:
        print("modelmeter: interrupted", file=sys.stderr)
        return INTERRUPTED
    return command(argv)


if __name__ == "__main__":
    raise SystemExit(main())
