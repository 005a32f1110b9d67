"""The per-rank table of a parallel plan (``Result.parallel``, docs/parallel.md "The command"): one row per group
of ranks with identical cost — the ranks folded as ``0–1023 (×1024)`` —, its pipeline stage, FLOPs of the step,
parameters held, peak memory, bytes sent and received and the step's time, each column in one unit. Fitted to a
width as the module table is (:mod:`.columns`): headers shortened, then the least telling columns left out.

Plain data in, text out: the dict is read as it is, never recomputed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .columns import Column, fit, format_share, unit_column
from .format import aligned_table, wrapped
from .fvcore_tables import pipe_table

__all__ = ["folded_ranks", "plan_notes", "rank_columns", "rank_table"]

# What the numbers are per (``parallel["per"]``), as the title says it
_PER = {"micro_batch": "; numbers per micro-batch (the inputs given)", "step": "; numbers per step"}
# Which column a narrow table leaves out first (the lowest): received equals sent but for pipeline sends, the
# parameters held follow from the plan; the peak memory, the FLOPs and the step time are what a plan is judged by.
_DROP_ORDER = {"received": 0, "params": 1, "stage": 2, "sent": 3, "step": 4, "flops": 5, "peak": 6}


def folded_ranks(entry: Mapping[str, Any]) -> str:
    """The ranks of one row: ``"3"`` for one rank, ``"0–1023 (×1024)"`` for several (first–last, and how many:
    ranks of equal cost need not be contiguous)."""
    first, last = entry["ranks"]
    if entry["count"] == 1 and first == last:
        return str(first)
    # the coordinates a row is restricted to (an uneven tensor-parallel split): "0–6 (×6, tp 0–2)"
    where = "".join(f", {dim} {_span(values)}" for dim, values in (entry.get("coordinates") or {}).items())
    return f"{first}–{last} (×{entry['count']}{where})"


def _span(values: Sequence[int]) -> str:
    """``"0–2"`` for consecutive values, ``"0,1,3"`` for others, ``"3"`` for one."""
    if len(values) > 1 and list(values) == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}–{values[-1]}"
    return ",".join(str(value) for value in values)


def rank_columns(parallel: Mapping[str, Any]) -> list[Column]:
    """The table's columns: the ranks first, then the stage (under a pipeline), FLOPs, parameters held, peak
    memory (when the memory was analysed), sent, received and step time (when a device was chosen)."""
    entries = parallel["ranks"]
    columns = [Column("ranks", "ranks", "ranks", "left", [folded_ranks(entry) for entry in entries])]
    if any(entry.get("stage") is not None for entry in entries):
        stages = ["-" if entry.get("stage") is None else str(entry["stage"]) for entry in entries]
        columns.append(Column("stage", "stage", "stage", "right", stages))
    columns.append(unit_column("flops", "#flops", [entry["flops"]["total"] for entry in entries], "count"))
    columns.append(unit_column("params", "#params held", [entry["parameters"]["held"] for entry in entries],
                               "count", short="#params"))
    if any(entry.get("memory") for entry in entries):
        peaks = [entry["memory"]["peak"] if entry.get("memory") else None for entry in entries]
        columns.append(unit_column("peak", "peak memory", peaks, "bytes", short="peak"))
    columns.append(unit_column("sent", "sent", [entry["communication"]["sent"] for entry in entries], "bytes"))
    columns.append(unit_column("received", "received", [entry["communication"]["received"] for entry in entries],
                               "bytes", short="recv"))
    if any(entry.get("time") for entry in entries):
        steps = [entry["time"]["step"] if entry.get("time") else None for entry in entries]
        columns.append(unit_column("step", "step time", steps, "time", short="step"))
    return columns


def plan_notes(parallel: Mapping[str, Any]) -> list[str]:
    """The lines about the plan: the title (plan, world size, mesh, what the numbers are per), the pipeline's
    bubble, the step time's assumptions."""
    mesh = " × ".join(f"{dim}={size}" for dim, size in parallel["mesh"].items()) or "one rank"
    world = parallel["world_size"]
    per = _PER.get(str(parallel.get("per")), "")
    if parallel.get("per") == "step" and parallel.get("micro_batches"):
        per = f"; numbers per step of {parallel['micro_batches']} micro-batches"
    lines = [f"Per rank under {parallel['plan']}: {world:,} rank{'s' if world != 1 else ''} (mesh {mesh}), "
             f"ranks of equal cost in one row{per}"]
    shown = sum(entry["count"] for entry in parallel["ranks"])
    if any(entry.get("coordinates") for entry in parallel["ranks"]):
        simulated = "simulated" if shown == world else "the rank the trace records"
        lines.append("Uneven tensor-parallel split: tp does not divide a sharded dimension, so ranks hold shards of "
                     f"different sizes; each row is the ranks of the tensor-parallel coordinates it names, {simulated}")
    if shown < world:
        lines.append(f"Not shown: {world - shown:,} ranks holding other tensor-parallel shards (a trace records one "
                     "rank; an analysis simulates the others)")
    pipeline = parallel.get("pipeline")
    if pipeline:
        stages = f"Pipeline: {pipeline['stages']} stages, {pipeline['micro_batches']} micro-batches per step"
        if pipeline.get("bubble_fraction") is None:
            lines.append(f"{stages}, forward only: no schedule, no bubble")
        else:
            lines.append(f"{stages} ({pipeline.get('schedule') or '1F1B'}, derived from per-stage traces): the "
                         f"bubble is {format_share(pipeline['bubble_fraction'], 1.0)} of the step")
    assumptions = dict.fromkeys(entry["time"]["assumption"] for entry in parallel["ranks"] if entry.get("time"))
    lines += [f"Step time: {text}" for text in assumptions]
    return lines


def rank_table(parallel: Mapping[str, Any], fmt: str = "table", width: int | None = None) -> str:
    """The per-rank table as ``fmt`` says (``markdown``: a pipe table and its notes as a list; else a terminal
    table under its title), fitted to ``width`` (None: every column)."""
    columns = rank_columns(parallel)
    notes = plan_notes(parallel)
    if fmt == "markdown":
        headers = [column.header for column in columns]
        text = pipe_table(headers, _rows(columns), [column.align for column in columns])
        return "\n".join([f"**{notes[0]}**", "", text, "", *(f"- {note}" for note in notes[1:])]).rstrip()
    short = False
    dropped: list[str] = []
    if width is not None:
        columns, short, dropped = fit(columns, width, rank=lambda key: _DROP_ORDER[key])
    headers = [column.short if short else column.header for column in columns]
    table = aligned_table([headers, *_rows(columns)], [column.align for column in columns], rule=True)
    footer = notes[1:]
    if dropped:
        footer.insert(0, f"Left out to fit {width} characters: {', '.join(dropped)} (all columns: --wide)")
    return "\n".join([*wrapped([notes[0]], width), *table, *wrapped(footer, width)])


def _rows(columns: Sequence[Column]) -> list[list[str]]:
    return [list(cells) for cells in zip(*(column.cells for column in columns), strict=True)]
