"""``--sweep AXIS=V1,V2,...``: one analysis per value (in worker processes), one row each, and how the cost grows."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..reports import jsontext
from ..reports.columns import Column, UnitKind, fit, format_bound, unit_column
from ..reports.format import format_rate, titled_table, wrapped
from .errors import ModelSpecError
from .job import Job, model_code
from .models import load_model
from .output import emit, report_width
from .parallel import in_parallel
from .refusals import worker_row


def run_sweep(args: argparse.Namespace, job: Job) -> int:
    if args.format == "tree":
        raise ModelSpecError("--sweep prints one row per value: use --format table, markdown, csv or json")
    axis, values = args.sweep
    jobs = [replace(job, **{axis: v}) for v in values]
    workers = min(args.jobs or os.cpu_count() or 1, len(values))
    if workers > 1:  # fail fast, before starting processes, on a spec or an axis that does not fit the model
        probe = replace(job, **{axis: values[0]})
        with model_code(probe.spec):
            loaded = load_model(probe.spec, probe.overrides, device="meta", resolution=probe.resolution)
        loaded.inputs(batch=probe.batch, resolution=probe.resolution, seq_len=probe.seq_len)
        del loaded, probe
    rows = in_parallel(sweep_point, dict(zip(values, jobs, strict=True)), workers, f"sweep {axis.replace('_', '-')}")
    failed = [(v, rows[v]) for v in values if "error" in rows[v]]
    if failed:
        value, row = failed[0]
        print(f"modelmeter: {axis.replace('_', '-')}={value}: {row['error']}", file=sys.stderr)
        return int(row["code"])
    width = None if args.columns == ("all",) else report_width(args.output)
    emit(_sweep_report(job, axis, values, [rows[v] for v in values], args.format, width), args.output)
    return 0


# The sweep table's columns in the order a narrow terminal leaves them out: the parameters (the same in every row
# but under a resolution a model is built for), the ratios, then the others; the flops last
_SWEEP_DROP_ORDER = {"params": 0, "intensity": 1, "compute_bound": 2, "activations": 3, "flops_ratio": 4,
                     "throughput": 5, "time": 6, "peak_memory": 7, "flops": 8}


def sweep_point(job: Job) -> dict[str, Any]:
    """The sweep's worker (top level, so spawned processes can import it): one row."""
    return worker_row(job, lambda result, seconds: {
        "params": result.root.params, "flops": result.total("flops"), "activations": result.total("activations"),
        "peak_memory": result.memory.get("peak"), "seconds": seconds, "execution": result.execution,
        "time": result.total("time"), "throughput": result.roofline.get("throughput"),
        "unit": (result.roofline.get("items") or {}).get("unit"), "intensity": result.total("intensity"),
        "compute_bound": result.total("compute_bound")})


def _sweep_report(job: Job, axis: str, values: list[int], rows: list[dict[str, Any]], fmt: str,
                  width: int | None = None) -> str:
    label = axis.replace("_", "-")
    base = rows[0]["flops"]
    for row in rows:
        row["flops_ratio"] = row["flops"] / base if base else math.nan
    # (table header, key, how its cells are written: a unit kind, one unit per column, or a cell per value)
    columns: list[tuple[str, str, UnitKind | Callable[[Any], str]]] = [
        ("#params", "params", "count"), ("flops", "flops", "count"), ("activations", "activations", "count")]
    if job.memory:
        columns.append(("peak memory", "peak_memory", "bytes"))
    if job.device is not None:
        columns += [("time", "time", "time"), (f"{rows[0]['unit']}/s", "throughput", _rate),
                    ("flops/byte", "intensity", lambda n: f"{n:.3g}"), ("bound", "compute_bound", format_bound)]
    columns.append(("flops ratio", "flops_ratio", lambda ratio: f"{ratio:.2f}x"))
    if fmt == "json":
        return jsontext.dumps({"model": job.model, "axis": label, "execution": rows[0]["execution"],
                           "parallel": job.parallel,
                           "rows": [{label: v, **{key: r[key] for _, key, _ in columns}}
                                    for v, r in zip(values, rows, strict=True)]}, indent=2)
    if fmt == "csv":
        lines = [",".join([label, *(key for _, key, _ in columns)])]
        lines += [",".join([str(v), *(f"{r[key]:.6g}" if key == "flops_ratio" else str(r[key])
                                      for _, key, _ in columns)])
                  for v, r in zip(values, rows, strict=True)]
        return "\n".join(lines)
    shown = [Column(label, label, label, "left", [str(v) for v in values]),
             *(Column(key, title, title, "right", _cells(key, [r[key] for r in rows], how))
               for title, key, how in columns)]
    dropped: list[str] = []
    if fmt == "table" and width is not None:  # as the module table: the least telling columns go first
        shown, _, dropped = fit(shown, width, rank=lambda key: _SWEEP_DROP_ORDER[key])
    table = [list(row) for row in zip(*(column.cells for column in shown), strict=True)]
    run = f"{rows[0]['execution']} run" + (f", one rank under {job.parallel}" if job.parallel else "")
    lines = titled_table([column.header for column in shown], table, fmt, f"{job.model}: sweep of {label} ({run})")
    notes = [f"Left out to fit {width} characters: {', '.join(title for title, key, _ in columns if key in dropped)} "
             "(all columns: --wide)"] if dropped else []
    growth = [_growth("flops", label, values, [r["flops"] for r in rows])]
    if job.memory:
        growth.append(_growth("peak memory", label, values, [r["peak_memory"] for r in rows]))
    if job.device is not None:
        growth.append(_turn(label, values, [r["compute_bound"] for r in rows]))
    if any(growth):
        notes += ["", *filter(None, growth)]
    lines += notes
    if fmt == "table" and width is not None:  # the title and the notes wrapped to the width too
        lines = [*wrapped(lines[:1], width), *lines[1:len(table) + 2], *wrapped(lines[len(table) + 2:], width)]
    return "\n".join(lines)


def _cells(key: str, amounts: list[Any], how: UnitKind | Callable[[Any], str]) -> list[str]:
    """A column's cells: amounts of a unit kind in the one unit of the largest (as the module table prints them:
    rows of a sweep are compared down the column), any other value by its own function."""
    if callable(how):
        return [how(amount) for amount in amounts]
    return unit_column(key, key, amounts, how).cells


def _rate(per_second: float | None) -> str:
    """Items per second; "-" for a run of no predicted time (nothing computed or moved)."""
    return "-" if per_second is None else format_rate(per_second)


def _turn(label: str, values: list[int], shares: list[float]) -> str:
    """Where the model turns compute-bound (most of its time in compute-bound operators), if it does."""
    bound = [share >= 0.5 for share in shares]
    if all(bound):
        return f"compute-bound at every {label} swept"
    if not any(bound):
        return f"memory-bound at every {label} swept"
    first = bound.index(True)
    if first and all(bound[first:]):
        return f"turns compute-bound between {label} {values[first - 1]} and {values[first]}"
    return f"compute-bound at {label} " + ", ".join(str(v) for v, b in zip(values, bound, strict=True) if b)


def _growth(what: str, label: str, values: list[int], amounts: list[float]) -> str:
    """``flops grow 2.94x from resolution 224 to 384, about resolution^2.00`` (first to last value)."""
    if len(values) < 2 or values[0] == values[-1] or not amounts[0] or not amounts[-1]:
        return ""
    ratio = amounts[-1] / amounts[0]
    exponent = math.log(ratio) / math.log(values[-1] / values[0])
    verb = "grow" if what.endswith("s") else "grows"
    return f"{what} {verb} {ratio:.2f}x from {label} {values[0]} to {values[-1]}, about {label}^{exponent:.2f}"
