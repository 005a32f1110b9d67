"""What every subcommand shares: its parser's one-line usage errors, its report written to stdout or a file, its
error line, and the paths checked before anything runs. Imports no torch."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from .errors import ModelSpecError, one_line

if TYPE_CHECKING:
    from ..reports.result import Result

# The width a table is fitted to when the output is not a terminal (a pipe, a file) and COLUMNS is not set
DEFAULT_WIDTH = 120
STDOUT = "-"  # --output's name for stdout
# Every option of the command that names a file or folder
PATH_OPTIONS = ("--output", "--html", "--compare", "--save-baseline", "--check-baseline", "--cache-dir",
                "--save-trace", "--devices-file")
# The options whose file the command writes at the end: checked before any model is built
WRITTEN_PATHS = ("--output", "--html", "--save-baseline", "--save-trace")


class UsageParser(argparse.ArgumentParser):
    """argparse with usage errors on one line, ``modelmeter: argument --fit: ...`` (exit 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"modelmeter: {message} (`{self.prog} --help` lists the options)\n")


def add_output_options(parser: argparse.ArgumentParser, formats: Sequence[str], what: str) -> None:
    """``--format`` (``formats``, the first the default) and ``--output FILE``: where ``what`` goes."""
    parser.add_argument("--format", choices=formats, default=formats[0],
                        help=f"output format (default {formats[0]})")
    parser.add_argument("--output", "-o", metavar="FILE", help=f"write {what} to FILE instead of stdout")


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | int:
    """``argv`` parsed, or the exit status when argparse stopped (a usage error, or ``--help``)."""
    try:
        args = parser.parse_intermixed_args(attach_negative_values(parser, argv))
    except SystemExit as exc:  # argparse printed the usage error (or --help)
        return exc.code if isinstance(exc.code, int) else 2
    if getattr(args, "output", None) == STDOUT:  # `-o -`: stdout, as for most commands (it wrote a file named -)
        args.output = None
    return args


def attach_negative_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--input -1x3`` as ``--input=-1x3``: argparse takes a value that starts with ``-`` for an option and says
    only "expected one argument"; attached, the value reaches the option's own check, which says what is wrong."""
    takes_value = {flag for action in parser._actions if action.nargs is None for flag in action.option_strings}
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in takes_value and len(arg) > 1 and arg[0] == "-" and (arg[1].isdigit() or arg[1] == "."):
            flag = out.pop()
            arg = f"{flag}={arg}" if flag.startswith("--") else flag + arg
        out.append(arg)
    return out


def check_paths(args: argparse.Namespace) -> None:
    """Refuse, before any model is built, a path no file can have, a file the command could not write at the
    end, and a cache directory that is a file (for the path options ``args`` has)."""
    paths = {option: getattr(args, option[2:].replace("-", "_"), None) for option in PATH_OPTIONS}
    for option, path in paths.items():
        if path is not None and "\0" in path:
            raise ModelSpecError(f"{option} {path!r}: a path cannot hold a NUL character")
    written: dict[str, str] = {}
    for option in WRITTEN_PATHS:
        path = paths[option]
        if path is not None:
            _check_writable(option, path)
            written[option] = path
    _check_distinct(written)
    cache_dir = paths["--cache-dir"]
    if cache_dir is not None:
        folder = Path(cache_dir).expanduser()
        if folder.exists() and not folder.is_dir():
            raise ModelSpecError(f"--cache-dir {cache_dir} is not a directory")


def _check_distinct(written: dict[str, str]) -> None:
    """Two options that write the same file (``-o out --html out``): the second would overwrite the first, whose
    "wrote" line would still be printed."""
    seen: dict[Path, str] = {}
    for option, path in written.items():
        target = Path(path).expanduser().resolve()
        if target in seen:
            raise ModelSpecError(f"{seen[target]} and {option} both write {path}: the second would overwrite the "
                                 "first; give each its own file")
        seen[target] = option


def _check_writable(option: str, path: str) -> None:
    if not path:  # Path("") is the working directory: the error would say a folder is given
        raise ModelSpecError(f"{option} {path!r}: an empty path names no file")
    target = Path(path).expanduser()
    folder = target.parent
    if target.is_dir():
        raise ModelSpecError(f"{option} {path} is a directory: give a file name (e.g. {target / 'report'})")
    if not folder.is_dir():
        reason = "is not a directory" if folder.exists() else "does not exist: create it first"
        raise ModelSpecError(f"{option} {path}: the folder {folder} {reason}")
    # the HTML report and baselines are written next to their target, then renamed: the folder must be writable
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ModelSpecError(f"{option} {path}: no permission to write there")


def emit(text: str, output: str | None) -> None:
    """The report: to stdout, or to the file ``output`` (with a line on stderr that says so)."""
    if not text.endswith("\n"):
        text += "\n"
    if output is None:
        sys.stdout.write(text)
        return
    try:
        with open(output, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        raise ModelSpecError(f"cannot write --output {output}: {exc.strerror or exc}") from None
    print(f"modelmeter: wrote {output}", file=sys.stderr)


def print_error(exc: BaseException) -> None:
    print(f"modelmeter: {one_line(exc, 600)}", file=sys.stderr)  # room for long paths and torch's own words


def read_result(path: str, option: str) -> Result:
    """The Result in ``path``, a saved trace's or one saved with ``--format json``; a usage error naming ``option``
    for anything else."""
    from ..engine.serialize import MAX_ENTRY_BYTES
    from ..reports.files import file_problem
    from ..reports.result import Result
    from ..reports.saved import SavedTraceError, is_saved_trace, read_saved_trace

    if is_saved_trace(path):
        try:
            return read_saved_trace(path).result
        except SavedTraceError as exc:
            raise ModelSpecError(f"{option}: {exc}") from None
    try:
        problem = file_problem(path, MAX_ENTRY_BYTES, "a saved analysis")  # before opening it: a pipe would block
    except OSError as exc:
        raise ModelSpecError(f"cannot read {option} {path}: {exc.strerror or exc}") from None
    if problem is not None:
        raise ModelSpecError(f"{option}: {problem}")
    try:
        with open(path, encoding="utf-8") as f:
            return Result.from_json(f.read())
    except OSError as exc:
        raise ModelSpecError(f"cannot read {option} {path}: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelSpecError(f"{option} {path}: not a saved analysis (--format json): {one_line(exc)}") from None


def write_html_report(path: str, result: Result, other: Result | None, torch_version: str | None = None) -> None:
    """The HTML report of ``result`` (compared with ``other``; recorded by ``torch_version``, by default this
    process's torch) written to ``path``, with a line on stderr."""
    from ..reports.html import write_html

    try:
        write_html(result, path, compare=other, torch_version=torch_version)
    except OSError as exc:
        raise ModelSpecError(f"cannot write --html {path}: {exc.strerror or exc}") from None
    print(f"modelmeter: wrote {path}", file=sys.stderr)


def report_width(output: str | None) -> int:
    """The width a table or tree is fitted to: COLUMNS when set, else the terminal's when the report goes to one,
    else :data:`DEFAULT_WIDTH`."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    if output is not None:
        return DEFAULT_WIDTH
    width = shutil.get_terminal_size(fallback=(DEFAULT_WIDTH, 24)).columns
    return width if width > 0 else DEFAULT_WIDTH


def check_layout(args: argparse.Namespace, runs: str | None = None) -> None:
    """``--columns`` and ``--shapes`` where no report shows them (``runs``: the option, --sweep or --fit, whose
    report is one row per run): a usage error rather than an option silently ignored."""
    chosen = args.columns not in (None, ("all",))
    given = [flag for flag, on in (("--columns", chosen), ("--shapes", args.shapes)) if on]
    if given and runs:
        raise ModelSpecError(f"{given[0]} chooses the module table's columns: {runs} prints one row per run")
    if chosen and args.format not in ("table", "markdown"):
        raise ModelSpecError(f"--columns chooses the columns of --format table or markdown; {args.format} gives every "
                             "metric")
    if args.shapes and args.format == "csv":
        raise ModelSpecError("--shapes adds the output shapes to --format table, markdown and tree; csv has none "
                             "(--format json has each module's output_shapes)")


def render_report(result: Result, args: argparse.Namespace, header: str) -> str:
    """The report of ``result`` as the options ask (``--format``, ``--depth``, ``--columns``/``--wide``,
    ``--shapes``), fitted to :func:`report_width` (chosen columns are all shown, only the notes are wrapped; every
    column, ``--wide``, is not fitted at all), a table or tree under ``header`` (wrapped to the width); a usage
    error for a column the result has not."""
    from ..reports.render import render

    width = None if args.columns == ("all",) else report_width(args.output)
    try:
        text = render(result, args.format, args.depth, width=width, columns=args.columns, shapes=args.shapes)
    except ValueError as exc:
        raise ModelSpecError(f"--columns: {exc}") from None
    if args.format not in ("table", "tree"):
        return text
    lines = [header] if width is None else textwrap.wrap(header, width, subsequent_indent="  ",
                                                         break_long_words=False, break_on_hyphens=False)
    return "\n".join([*lines, text])


def header_line(result: Result, *, backward: bool, source: str = "", seconds: float | None = None,
                parallel: str | None = None) -> str:
    """The line above a table: the model, its inputs (shape and dtype), how it ran (``source``: where the run came
    from, e.g. ``", from the cache"``; ``parallel``: the plan whose rank it was), what was counted, the seconds it
    took and the peak memory."""
    from ..parallel.plan import ParallelPlan
    from ..reports.format import format_bytes, printable

    inputs = ", ".join(f"{'x'.join(map(str, i['shape'])) or 'scalar'} {i['dtype']}" for i in result.inputs)
    passes = "forward + backward" if backward else "forward"
    optimizer = result.memory.get("optimizer") if result.memory else None
    if optimizer:
        passes += f" + {optimizer['name']} step"
    timing = f", {seconds:.2f} s" if seconds is not None else ""
    peak = f", peak memory {format_bytes(result.memory['peak'])}" if result.memory else ""
    on = f" on {result.device}" if result.device not in ("", "cpu", "meta") else ""  # where no one would assume it
    if parallel is not None:
        plan = ParallelPlan.parse(parallel)
        on += f", rank {plan.rank} of {plan.world_size:,} under {parallel}"
    return (f"{printable(result.model)} on input {inputs} ({result.execution} run{on}{source}, {passes}, "
            f"{result.convention} convention{timing}{peak})")
