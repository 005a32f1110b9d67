"""Many analyses at once (``--sweep``, a check of every model of a baseline): spawned worker processes and a
progress line on stderr."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TextIO, TypeVar

from .interrupt import quit_on_interrupt
from .job import Job

K = TypeVar("K")


def in_parallel(work: Callable[[Job], dict[str, Any]], jobs: dict[K, Job], workers: int | None,
                label: str) -> dict[K, dict[str, Any]]:
    """``work(job)`` for every job, in spawned worker processes when there are several (one per job, at most
    the CPU count or ``workers``), with a progress line; results in the order of ``jobs``."""
    count = min(workers or os.cpu_count() or 1, len(jobs))
    progress = Progress(len(jobs), label)
    done: dict[K, dict[str, Any]] = {}
    try:
        if count <= 1:
            for key, job in jobs.items():
                done[key] = work(job)
                progress.step(f"{key}")
        else:
            context = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(max_workers=count, mp_context=context, initializer=quit_on_interrupt) as pool:
                futures: dict[Future[dict[str, Any]], K] = {pool.submit(work, job): key for key, job in jobs.items()}
                try:
                    for future in as_completed(futures):
                        done[futures[future]] = _outcome(future)
                        progress.step(f"{futures[future]}")
                except KeyboardInterrupt:  # start no more work; the workers themselves quit on the same Ctrl-C
                    pool.shutdown(wait=False, cancel_futures=True)
                    raise
    finally:
        progress.close()
    return {key: done[key] for key in jobs}


def _outcome(future: Future[dict[str, Any]]) -> dict[str, Any]:
    """A worker's row, or a failure (exit 1) when its process died: the model's code called ``os._exit``, or
    the process crashed or was killed."""
    try:
        return future.result()
    except BrokenProcessPool:
        return {"error": "its worker process died before the analysis finished (the model's code called "
                         "os._exit, or the process crashed or ran out of memory)", "code": 1}


class Progress:
    """A one-line progress bar on stderr (redrawn in place on a terminal, one line per step otherwise)."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None) -> None:
        self.total, self.done, self.label = total, 0, label
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.start = time.perf_counter()
        self._draw("")

    def step(self, what: str) -> None:
        self.done += 1
        self._draw(f"{what} done")

    def _draw(self, what: str) -> None:
        filled = round(20 * self.done / self.total)
        line = (f"{self.label} [{'#' * filled}{'.' * (20 - filled)}] {self.done}/{self.total} "
                f"{time.perf_counter() - self.start:.1f}s {what}").rstrip()
        if self.tty:
            self.stream.write("\r" + line.ljust(79))
        elif self.done:  # not a terminal: no empty starting bar, one line per finished value
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
