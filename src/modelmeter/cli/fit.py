"""``--fit SIZE``: the largest batch whose predicted peak memory fits in SIZE (docs/memory.md); under a parallel
plan, the largest micro-batch per rank of a training step whose worst rank fits (docs/parallel.md, "The
command")."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..errors import ModelMeterError
from ..reports import jsontext
from ..reports.columns import unit_column
from ..reports.format import format_bytes, titled_table
from .errors import ModelSpecError
from .job import Job, analyse
from .options import FIT_DEVICE
from .output import emit

FIT_CAP = 1 << 20  # --fit tries no batch larger than this


def largest_fitting(fits: Callable[[int], bool], cap: int) -> int:
    """The largest ``n`` in 1..``cap`` with ``fits(n)``, for a ``fits`` true up to some size and false above:
    doubling from 1 until one does not fit (or ``cap`` is reached), then bisection. 0 when 1 does not fit."""
    if not fits(1):
        return 0
    low, high = 1, 0  # low fits; high (once found) does not
    while not high:
        if low >= cap:
            return cap
        trial = min(2 * low, cap)
        if fits(trial):
            low = trial
        else:
            high = trial
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


class DoesNotFit(ModelMeterError):
    """Batch 1 is already over the --fit size (exit 1)."""


def run_fit(args: argparse.Namespace, job: Job) -> int:
    """``--fit SIZE``: one analysis per batch tried; the batches tried, and the largest whose peak <= SIZE (under
    a plan: the micro-batches per rank, and the peak of the plan's worst rank)."""
    if args.format == "tree":
        raise ModelSpecError("--fit prints the batches it tried: use --format table, markdown, csv or json")
    limit = _limit(args.fit, job)
    what = "batch" if job.parallel is None else "micro-batch"
    peaks: dict[int, int] = {}
    memory: dict[str, Any] = {}

    def fits(batch: int) -> bool:
        # the device gave the limit: its time is not wanted, each batch's peak is
        result, _, seconds, _ = analyse(replace(job, batch=batch, device=None))
        memory.update(result.memory)
        peaks[batch] = rank_peak(result.memory, result.parallel)
        print(f"fit: {what} {batch}: peak {format_bytes(peaks[batch])} ({seconds:.1f} s)", file=sys.stderr)
        return peaks[batch] <= limit

    largest = largest_fitting(fits, FIT_CAP)
    step = _step_phrase(memory)
    if not largest:
        raise DoesNotFit(f"{what} 1 does not fit in {format_bytes(limit)}: its {step} peaks at "
                         f"{format_bytes(peaks[1])} ({peaks[1]:,} bytes)")
    emit(_fit_report(job, limit, step, peaks, largest, args.format), args.output)
    return 0


def _limit(fit: float | str, job: Job) -> int:
    """The bytes to fit in: ``--fit``'s size, or the memory of ``--device`` (``--fit device``)."""
    if fit != FIT_DEVICE:
        return int(fit)  # peaks are whole bytes
    from ..devices import get_device

    assert job.device is not None  # job_from_args refuses --fit device without --device
    return get_device(job.device.name, devices_file=job.device.devices_file).memory


def rank_peak(memory: dict[str, Any], parallel: dict[str, Any] | None) -> int:
    """The peak that must fit: under a plan, the highest of its ranks' (with a pipeline, the worst stage's), else
    the run's own (one device, or the simulated rank when the result has no per-rank memory)."""
    peaks = [entry["memory"]["peak"] for entry in (parallel or {}).get("ranks", ()) if entry.get("memory")]
    return int(max(peaks, default=memory["peak"]))


def _step_phrase(memory: dict[str, Any]) -> str:
    """``"inference"``, ``"training step"`` or ``"training step with adamw (bfloat16 state, foreach)"``."""
    if not memory.get("training"):
        return "inference"
    optimizer = memory.get("optimizer")
    if not optimizer:
        return "training step"
    details = [f"{optimizer['state_dtype']} state" if optimizer.get("state_dtype") else "",
               "foreach" if optimizer.get("foreach") else ""]
    notes = ", ".join(filter(None, details))
    return f"training step with {optimizer['name']}" + (f" ({notes})" if notes else "")


def _fit_report(job: Job, limit: int, step: str, peaks: dict[int, int], largest: int, fmt: str) -> str:
    tried = sorted(peaks)
    above = largest + 1 if largest + 1 in peaks else None
    if fmt == "json":
        return jsontext.dumps({"model": job.model, "limit": limit, "step": step, "parallel": job.parallel,
                           "tried": [{"batch": b, "peak": peaks[b], "fits": peaks[b] <= limit} for b in tried],
                           "largest": largest, "peak": peaks[largest],
                           "next": None if above is None else {"batch": above, "peak": peaks[above]},
                           "capped": above is None}, indent=2)
    what = "batch" if job.parallel is None else "micro-batch"
    if fmt == "csv":
        return "\n".join([f"{what},peak,fits", *(f"{b},{peaks[b]},{peaks[b] <= limit}" for b in tried)])
    # one unit down the column, as the module table's: the rows are compared with each other and the limit
    shown = unit_column("peak", "peak", [peaks[b] for b in tried], "bytes").cells
    table = [[str(b), cell, "yes" if peaks[b] <= limit else "no"] for b, cell in zip(tried, shown, strict=True)]
    title = f"{job.model}: the largest batch in {format_bytes(limit)} ({step})"
    if job.parallel is not None:
        title = (f"{job.model}: the largest micro-batch per rank in {format_bytes(limit)} under {job.parallel} "
                 f"({step}; the peak of its worst rank)")
    lines = titled_table([what, "peak", "fits"], table, fmt, title)
    if above is None:
        final = (f"{what} {largest} fits in {format_bytes(limit)} (peak {format_bytes(peaks[largest])}): the search "
                 f"stops at {what} {FIT_CAP}, larger ones were not tried")
    else:
        size, fitting, failing = distinct_bytes([limit, peaks[largest], peaks[above]])
        per_rank = "" if job.parallel is None else " per rank"
        final = (f"largest {what}{per_rank} that fits in {size}: {largest} (peak {fitting}; {what} {above} needs "
                 f"{failing})")
    return "\n".join([*lines, "", final])


def distinct_bytes(amounts: list[int]) -> list[str]:
    """``amounts`` as :func:`format_bytes` writes them, with as many significant figures as it takes for different
    amounts to read differently (rounding keeps their order): a batch over the limit never reads as the limit."""
    for digits in range(3, 17):
        shown = [format_bytes(amount, digits) for amount in amounts]
        if len(set(shown)) == len(set(amounts)):
            return shown
    return [f"{amount}B" for amount in amounts]
