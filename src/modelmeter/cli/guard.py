"""The cost guard on the command line (docs/guard.md): ``--budget``, ``--check-baseline`` and ``--save-baseline``
for one model, and ``--check-baseline FILE`` without a model: every model of FILE, in parallel."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import asdict, replace
from typing import Any

from ..guard import (
    BaselineFile,
    BaselineMismatch,
    Entry,
    check_budget,
    compare,
    entry_from_result,
    record,
)
from ..guard.baseline import COMMAND_MODE
from ..guard.budget import within_budget
from ..guard.specs import ENTRY_OPTIONS, check_spec, project_of
from ..guard.values import GuardFileError
from ..reports.result import Result
from .errors import ModelSpecError
from .job import Job, job_argv, job_from_args
from .options import ONE_RUN_OPTIONS, build_parser, options_given
from .parallel import in_parallel
from .refusals import worker_row


@contextlib.contextmanager
def usage_errors() -> Iterator[None]:
    """A baseline or saved analysis that cannot be used, or runs that cannot be compared: a usage error (exit
    2), one line."""
    try:
        yield
    except (BaselineMismatch, GuardFileError) as exc:
        raise ModelSpecError(str(exc)) from None


def _entry_name(args: argparse.Namespace, job: Job) -> str:
    return args.name or job.model


def baseline_entry(args: argparse.Namespace, job: Job) -> Entry | None:
    """The entry --check-baseline compares with, read (and the file --save-baseline will write, if there is one,
    checked) before the model runs."""
    with usage_errors():
        if args.save_baseline and os.path.exists(args.save_baseline):
            BaselineFile.load(args.save_baseline)
        if not args.check_baseline:
            return None
        return BaselineFile.load(args.check_baseline).entry(_entry_name(args, job), args.check_baseline)


def guard(args: argparse.Namespace, job: Job, result: Result, expected: Entry | None) -> int:
    """--budget, --check-baseline (against ``expected``) and then --save-baseline for one analysed model: 0, or
    1 when a cost is too high. The baseline is saved only when every check passed, so a failed check never
    overwrites the baseline it failed against."""
    status = 0
    name = _entry_name(args, job)
    if args.budget:
        try:
            over = check_budget(result, args.budget)
        except ValueError as exc:
            raise ModelSpecError(str(exc)) from None
        for item in over:
            print(f"modelmeter: over budget: {name}: {item}", file=sys.stderr)
        if not over:  # say what was checked: a silent pass cannot be told from a budget that was never read
            print(f"modelmeter: within budget: {name}: {within_budget(result, args.budget)}", file=sys.stderr)
        status = 1 if over else status
    entry = _entry(result, job)
    if expected is not None:
        with usage_errors():
            comparison = compare(name, expected, entry, args.tolerance)
        print(comparison.report(), file=sys.stderr)
        status = 1 if not comparison.ok else status
    if args.save_baseline and status:
        print(f"modelmeter: did not save the baseline of {name} in {args.save_baseline}: a check failed",
              file=sys.stderr)
    elif args.save_baseline:
        with usage_errors():
            record(args.save_baseline, name, entry)
        print(f"modelmeter: saved the baseline of {name} in {args.save_baseline}", file=sys.stderr)
    return status


def baseline_point(job: Job) -> dict[str, Any]:
    """Worker of a baseline check (top level, for spawned processes): the entry as data. A run the model now
    refuses (the entry's inputs, a fake run) is a failure, 1, as growth is: the entry chose it, not the command
    line."""
    return worker_row(job, lambda result, _: {"entry": asdict(_entry(result, job))}, refused=1)


def _entry(result: Result, job: Job) -> Entry:
    """The baseline entry of ``job``'s run: the arguments that run it again, and the command's mode (it puts every
    model in eval mode; see :data:`~modelmeter.guard.baseline.COMMAND_MODE` for torch.export's modules)."""
    return entry_from_result(result, spec=job_argv(job), mode=COMMAND_MODE)


# What acts on one model's run or report: a check of every model takes none (nor the options each entry holds,
# ENTRY_OPTIONS), and giving one on its command line is a mistake (--format: the reports are text)
_ONE_MODEL = (*(option for option in ONE_RUN_OPTIONS if option != "--check-baseline"), "--name", "--sweep", "--fit",
              "--real", "--compare", "--output", "--format")


def check_all(args: argparse.Namespace) -> int:
    """``modelmeter --check-baseline FILE``: every model of FILE analysed again (in parallel) and compared. What
    an entry may run is checked for every entry before any model is built (modelmeter.guard.specs)."""
    ignored = options_given(args, (*_ONE_MODEL, *ENTRY_OPTIONS))
    if ignored:
        raise ModelSpecError(f"{', '.join(ignored)}: a check of every model of {args.check_baseline} runs each "
                             "entry as it was saved; name a MODEL to check one model with other options")
    with usage_errors():
        baselines = BaselineFile.load(args.check_baseline)
    if not baselines.entries:
        raise ModelSpecError(f"the baseline {args.check_baseline!r} holds no models")
    project = str(project_of(args.check_baseline))
    jobs = {}
    for name, entry in baselines.entries.items():
        parsed = check_spec(entry.spec, name, args.check_baseline, build_parser())
        try:
            job = job_from_args(parsed)
        except ModelSpecError as exc:
            raise ModelSpecError(f"the baseline entry {name!r}: {exc}") from None
        jobs[name] = replace(job, cache=False, project=project)  # guards run the model
    outcomes = in_parallel(baseline_point, jobs, args.jobs, "baselines")
    codes = [_report_check(name, baselines.entries[name], outcome, args.tolerance)
             for name, outcome in outcomes.items()]
    print(f"modelmeter: checked {len(codes)} model{'s' * (len(codes) != 1)} of {args.check_baseline}: "
          f"{codes.count(0)} within the baseline, {codes.count(1)} over it or failed, {codes.count(2)} not "
          "comparable or refused", file=sys.stderr)
    return max(codes)


def _report_check(name: str, expected: Entry, outcome: dict[str, Any], tolerance: float) -> int:
    """Print the comparison of one entry of a check of every model; its exit status."""
    if "error" in outcome:
        print(f"modelmeter: {name}: {outcome['error']}", file=sys.stderr)
        return int(outcome["code"])
    try:
        comparison = compare(name, expected, Entry(**outcome["entry"]), tolerance)
    except BaselineMismatch as exc:
        print(f"modelmeter: {exc}", file=sys.stderr)
        return 2
    print(comparison.report())
    return 0 if comparison.ok else 1
