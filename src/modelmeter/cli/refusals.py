"""A run that failed because of what the command chose for it — inputs the model's code refuses, a fake run of a
model that needs values —: a usage error (exit 2), alike for one run and each row of ``--sweep``; any other failure
stays the model's (exit 1). An entry of ``--check-baseline FILE`` chose its run when it was saved, so a refusal
there is the model's failure too (exit 1, naming the entry; :func:`~modelmeter.cli.guard.baseline_point`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..engine.tracer import NEEDS_VALUES
from ..errors import ModelMeterError, ModelRunError
from ..reports.result import Result
from .errors import ModelSpecError, one_line
from .job import Job, analyse, input_argv
from .models import LoadedModel


class RefusedRunError(ModelSpecError):
    """The model refused the run the command chose for it (its inputs, a fake run): a usage error on the command
    line, a failure where the run came from a baseline entry."""


def analyse_job(job: Job, save_trace: str | None = None) -> tuple[Result, LoadedModel, float, bool]:
    """:func:`~modelmeter.cli.job.analyse`, a failure the command's choices caused raised as a usage error."""
    try:
        return analyse(job, save_trace=save_trace)
    except ModelRunError as exc:
        usage = needs_real_run(job, exc) or given_inputs_misfit(job, exc)
        if usage is None:
            raise
        raise usage from exc


def worker_row(job: Job, row: Callable[[Result, float], dict[str, Any]], refused: int = 2) -> dict[str, Any]:
    """What a worker process sends back: ``row(result, seconds)``, or the error as data, with the exit status a
    single run of ``job`` would have (some exceptions, ModelRunError among them, do not survive pickling); a run
    the model refused (:class:`RefusedRunError`) has status ``refused``."""
    try:
        result, _, seconds, _ = analyse_job(job)
    except RefusedRunError as exc:
        return {"error": one_line(exc), "code": refused}
    except ModelSpecError as exc:
        return {"error": one_line(exc), "code": 2}
    except ModelMeterError as exc:
        return {"error": one_line(exc), "code": 1}
    return row(result, seconds)


def needs_real_run(job: Job, exc: ModelRunError) -> RefusedRunError | None:
    """A usage error when the model needs values a fake run has none of — shapes that depend on them (a detection
    model's boxes past a score threshold, the classes ``unique`` finds), beyond the placeholders assumed on the
    meta device (docs/guide.md) —: the command's inputs, and the models it builds, are on the meta device unless
    ``--real``, so execution 'auto' has no values to fall back on, and ``--real`` is what runs it."""
    if job.execution == "real" or job.parallel is not None or not isinstance(exc.__cause__, NEEDS_VALUES):
        return None  # (under a plan, --real is refused: the plan's own message says why)
    where = f" in module {exc.module!r}" if exc.module else ""
    return RefusedRunError(f"the model needs tensor values{where} at operator {exc.operator or '(unknown)'} (what it "
                          "computes there depends on them), which the command's fake run has none of (its inputs, "
                          "and the models it builds, are on the meta device): run it with --real (on the CPU, real "
                          "kernels)")


def given_inputs_misfit(job: Job, exc: ModelRunError) -> RefusedRunError | None:
    """A usage error when the inputs the command line chose (``--input``, ``--batch``, ``--resolution``,
    ``--seq-len``, a ``--sweep`` row's value) made the model fail where its default inputs run: the model's own code
    refused them (a BatchNorm2d's ``expected 4D input``, a ViT's image size, a sequence past GPT's block), before any
    operator whose parameters :mod:`~modelmeter.engine.expectations` reads could. None when no input was chosen, or
    when the defaults fail too: the model itself is at fault then. The default run is the oracle, not the error's
    wording."""
    given = " ".join(input_argv(job))
    if not given:
        return None
    defaults = replace(job, shapes=(), batch=None, resolution=None, seq_len=None, device=None)
    try:
        _, loaded, _, _ = analyse(defaults)
    except ModelMeterError:
        return None
    return RefusedRunError(f"{one_line(exc)}; the input given ({given}) does not fit the model, which runs on its "
                          f"default input ({loaded.describe_default_input()})")
