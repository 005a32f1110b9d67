"""Files a report, a diff or a guard reads whole: regular files only, found so without opening them."""

from __future__ import annotations

import os
import stat


def file_problem(path: str | os.PathLike[str], limit: int, what: str) -> str | None:
    """Why ``path`` is not a file of at most ``limit`` bytes to read whole as ``what`` ("a saved trace"), or None.
    Told from its status, never by opening it: opening a named pipe blocks until something writes to it, and a device
    (``/dev/zero``) never ends. FileNotFoundError passes through, for callers that say so in their own words."""
    where = repr(os.fspath(path))
    try:
        status = os.stat(path)
    except FileNotFoundError:
        raise
    except OSError as exc:
        return f"cannot read {where}: {exc.strerror or exc}"
    if stat.S_ISDIR(status.st_mode):
        return f"cannot read {where}: Is a directory"
    if not stat.S_ISREG(status.st_mode):
        return f"{where} is not a regular file (a device, a pipe or a socket): {what} is a file"
    if status.st_size > limit:
        return f"{where} is {status.st_size:,} bytes: too large for {what} (at most {limit // 2**20} MiB)"
    return None
