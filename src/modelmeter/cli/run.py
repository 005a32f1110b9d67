"""The analysis command once parsed: which job it is (one model, ``--sweep``, ``--fit``, every model of a
baseline), the run, and the report with its header line, the HTML report and the cost guard."""

from __future__ import annotations

import argparse

from ..zoo import ZOO
from .commands import COMMANDS
from .errors import ModelSpecError, suggest
from .fit import run_fit
from .guard import baseline_entry, check_all, guard
from .job import Job, job_from_args
from .output import emit, header_line, read_result, render_report, write_html_report
from .refusals import analyse_job
from .sweep import run_sweep


def run_analysis(args: argparse.Namespace) -> int:
    if args.model is None and args.check_baseline:
        return check_all(args)
    _check_command_typo(args.model)
    misplaced = [word for word in args.overrides if word in COMMANDS]
    if misplaced:  # `modelmeter resnet18 list`: read as a key=value, the error would be about its missing `=`
        raise ModelSpecError(f"{misplaced[0]!r} is a command, not a model's argument: give it first "
                             f"(`modelmeter {misplaced[0]} ...`)")
    job = job_from_args(args)
    if args.fit is not None:
        return run_fit(args, job)
    if args.sweep:
        return run_sweep(args, job)
    return _run_one(args, job)


def _check_command_typo(model: str | None) -> None:
    """``modelmeter cahce info`` names no model: say which command was meant (its arguments would otherwise be
    read as key=value overrides, and the error would be about them)."""
    if model is None or ":" in model or model in ZOO:
        return
    if model in COMMANDS:  # `modelmeter --depth 1 list`: a subcommand must be the first argument
        raise ModelSpecError(f"{model!r} is a command, not a model: give it first (`modelmeter {model} ...`)")
    close = suggest(model, list(COMMANDS), n=1)
    if close:
        raise ModelSpecError(f"unknown model or command {model!r}; did you mean `modelmeter {close[0]}`?")


def _run_one(args: argparse.Namespace, job: Job) -> int:
    expected = baseline_entry(args, job)  # a missing or broken baseline fails before the model runs
    # --compare is read before the run: a bad file wastes no time
    other = read_result(args.compare, "--compare") if args.compare else None
    result, _, seconds, cached = analyse_job(job, save_trace=args.save_trace)
    source = ", from the cache" if cached else ""
    header = header_line(result, backward=job.backward, source=source, seconds=seconds, parallel=job.parallel)
    text = render_report(result, args, header)
    emit(text, args.output)
    if args.html:
        write_html_report(args.html, result, other)
    return guard(args, job, result, expected)
