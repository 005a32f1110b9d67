"""``assert_cost``: check a model's costs against its entry in a baseline file, or record them there.

Usable in any test runner (a failure is a :class:`CostAssertionError`, an ``AssertionError``); the pytest plugin's
``assert_cost`` fixture calls it with paths relative to the test file and ``update`` set by ``--update-baselines``.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

from torch import nn

from ..analysis import analyze
from ..cache.shared import SHARED
from ..errors import InvalidTypeError, InvalidValueError, ModelExitError, ModelMeterError, check_flag
from .baseline import BaselineFile, BaselineMismatch, Comparison, compare, entry_from_result, record, training_mode
from .values import GuardFileError, check_tolerance, is_printable_name, shorten

UPDATE_HINT = "call assert_cost(..., update=True) once to record it"


class CostAssertionError(ModelMeterError, AssertionError):
    """The model's costs grew beyond the tolerance, its baseline is missing, or the runs are not comparable."""


def entry_name(model: nn.Module, name: str | None) -> str:
    """The baseline entry ``assert_cost`` uses: ``name``, else the model's class name. A ``TypeError`` /
    ``ValueError`` for a name no baseline can hold (not a string: the file's names are sorted; empty; control
    characters or over 1000 characters), before the model runs."""
    if name is None:
        return type(model).__name__
    if not isinstance(name, str):
        raise InvalidTypeError(f"name must be a string (the baseline entry's), got {type(name).__name__} "
                               f"{shorten(name)}")
    if not name or not is_printable_name(name):
        raise InvalidValueError(f"name must be a printable name of 1 to 1000 characters (None: the model's class "
                                f"name), got {shorten(name)}")
    return name


def assert_cost(model: nn.Module, inputs: Any, baseline: str | os.PathLike[str], *, name: str | None = None,
                tolerance: float = 0.0, convention: str = "fvcore", backward: bool = False, update: bool = False,
                hint: str = UPDATE_HINT) -> Comparison | None:
    """Analyse ``model`` on ``inputs`` and compare its costs, per metric and module, with the entry ``name``
    (default: the model's class name) of the baseline file ``baseline``; ``tolerance`` is a fraction (0.01: 1%).

    Returns the :class:`Comparison` (what shrank is a note in it), or ``None`` with ``update=True``, which
    writes the entry instead (the file's other entries are kept). Raises :class:`CostAssertionError` when a
    cost grew (the report names the module), when the file or entry is missing (with ``hint``), when the file
    cannot be read (with ``update``: before the model runs) or written, or when the
    inputs, convention, backward pass or the model's training mode (``model.train()`` / ``.eval()``, module by
    module) differ from the baseline's, or when the model's code calls ``sys.exit``. A check that passes with a
    note (an entry saved before entries kept the training mode) warns with it. ``TypeError`` / ``ValueError``
    naming ``tolerance`` unless it is a finite number >= 0.
    """
    tolerance = check_tolerance(tolerance)  # before the run: a NaN tolerance would pass every comparison
    check_flag("update", update)  # update=os.getenv("UPDATE"), "0", recorded instead of checking: a pass, always
    if not isinstance(baseline, str | os.PathLike):
        raise InvalidTypeError(f"baseline must be a path (str or os.PathLike), got {type(baseline).__name__}")
    name = entry_name(model, name)
    path = os.fspath(baseline)
    if update and os.path.exists(path):  # a file it could not record into fails before the run (--save-baseline's)
        _load(path)
    try:
        with SHARED.set_aside():  # the model as it runs now: no recording of this process's, no cache entry
            result = analyze(model, inputs, convention=convention, backward=backward, cache=False,
                             quiet=True).result()
    except (Exception, KeyboardInterrupt):
        raise
    except BaseException as exc:  # sys.exit() in forward(): the costs were not checked, which is a failure
        raise CostAssertionError(str(ModelExitError(name, exc))) from None
    current = entry_from_result(result, mode=training_mode(model))  # (analyze left the flags as they were)
    if update:
        with _file_failures():
            record(path, name, current)
        return None
    if not os.path.exists(path):
        raise CostAssertionError(f"no baseline file {path!r} for {name!r}; {hint}")
    entries = _load(path).entries
    if name not in entries:
        known = ", ".join(sorted(entries)) or "none"
        raise CostAssertionError(f"the baseline {path!r} has no entry {name!r} (entries: {known}); {hint}")
    try:
        comparison = compare(name, entries[name], current, tolerance, hint=hint)
    except BaselineMismatch as exc:
        raise CostAssertionError(str(exc)) from None
    if not comparison.ok:
        raise CostAssertionError(comparison.report())
    for note in comparison.notes:
        warnings.warn(f"{name}: {note}", stacklevel=2)
    return comparison


def _load(path: str) -> BaselineFile:
    """The baseline file ``path``, read."""
    with _file_failures():
        return BaselineFile.load(path)


@contextlib.contextmanager
def _file_failures() -> Iterator[None]:
    """A baseline file that cannot be read or written fails the check in one line, recording or checking."""
    try:
        yield
    except GuardFileError as exc:
        raise CostAssertionError(str(exc)) from None
