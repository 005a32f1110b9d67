"""The analysis command once parsed: which job it is (one model, ``--sweep``, ``--fit``, every model of a
baseline), the run, and the report with its header line, the HTML report and the cost guard."""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from ..engine.tracer import NEEDS_VALUES
from ..errors import ModelMeterError, ModelRunError
from ..zoo import ZOO
from .commands import COMMANDS
from .errors import ModelSpecError, one_line, suggest
from .fit import run_fit
from .guard import baseline_entry, check_all, guard
from .job import Job, analyse, job_from_args
from .output import emit, header_line, read_result, render_report, write_html_report
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
    try:
        result, _, seconds, cached = analyse(job, save_trace=args.save_trace)
    except ModelRunError as exc:
        usage = needs_real_run(job, exc) or given_inputs_misfit(job, exc)
        if usage is None:
            raise
        raise usage from exc
    source = ", from the cache" if cached else ""
    header = header_line(result, backward=job.backward, source=source, seconds=seconds, parallel=job.parallel)
    text = render_report(result, args, header)
    emit(text, args.output)
    if args.html:
        write_html_report(args.html, result, other)
    return guard(args, job, result, expected)


def needs_real_run(job: Job, exc: ModelRunError) -> ModelSpecError | None:
    """A usage error when the model needs values a fake run has none of — shapes that depend on them (a detection
    model's boxes past a score threshold, the classes ``unique`` finds), beyond the placeholders assumed on the
    meta device (docs/guide.md) —: the command's inputs, and the models it builds, are on the meta device unless
    ``--real``, so execution 'auto' has no values to fall back on, and ``--real`` is what runs it."""
    if job.execution == "real" or job.parallel is not None or not isinstance(exc.__cause__, NEEDS_VALUES):
        return None  # (under a plan, --real is refused: the plan's own message says why)
    where = f" in module {exc.module!r}" if exc.module else ""
    return ModelSpecError(f"the model needs tensor values{where} at operator {exc.operator or '(unknown)'} (what it "
                          "computes there depends on them), which the command's fake run has none of (its inputs, "
                          "and the models it builds, are on the meta device): run it with --real (on the CPU, real "
                          "kernels)")


def given_inputs_misfit(job: Job, exc: ModelRunError) -> ModelSpecError | None:
    """A usage error when the inputs the command line chose (``--input``, ``--batch``, ``--resolution``,
    ``--seq-len``) made the model fail where its default inputs run: the model's own code refused them (a
    BatchNorm2d's ``expected 4D input``, a ViT's image size, a sequence past GPT's block), before any operator whose
    parameters :mod:`~modelmeter.engine.expectations` reads could. None when no input was chosen, or when the
    defaults fail too: the model itself is at fault then. The default run is the oracle, not the error's wording."""
    given = _given_inputs(job)
    if not given:
        return None
    defaults = replace(job, shapes=(), batch=None, resolution=None, seq_len=None, device=None)
    try:
        _, loaded, _, _ = analyse(defaults)
    except ModelMeterError:
        return None
    return ModelSpecError(f"{one_line(exc)}; the input given ({given}) does not fit the model, which runs on its "
                          f"default input ({loaded.describe_default_input()})")


def _given_inputs(job: Job) -> str:
    """The input options of ``job``, as the command line gave them; "" for none."""
    words = [f"--input {'x'.join(map(str, shape))}{_dtype_suffix(dtype)}" for shape, dtype in job.shapes]
    words += [f"{flag} {value}" for flag, value in (("--batch", job.batch), ("--resolution", job.resolution),
                                                     ("--seq-len", job.seq_len)) if value is not None]
    return " ".join(words)


def _dtype_suffix(dtype: torch.dtype | None) -> str:
    return "" if dtype is None else ":" + str(dtype).removeprefix("torch.")
