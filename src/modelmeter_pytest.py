"""pytest plugin (entry point ``modelmeter``): the ``assert_cost`` fixture and the ``--update-baselines`` flag.

Loaded in every pytest session where modelmeter is installed, so it imports nothing heavy itself: the analysis
(and torch) load when a test first calls the fixture.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from modelmeter.guard.baseline import Comparison

PYTEST_HINT = "run `pytest --update-baselines` to record it"

_updated = pytest.StashKey[list[str]]()
# The test that recorded each entry (baseline path, name) in this ``--update-baselines`` run. Two models sharing an
# entry (the class name by default: two ResNets), in two tests or in a loop of one, would overwrite each other, and
# the one recorded first would from then on be checked against the other's costs (a smaller one always passing): a
# second call may record it only with the same costs, compared instead. An entry is noted once recorded (a first
# recording that failed leaves it to the next call).
_recorders = pytest.StashKey[dict[tuple[str, str], str]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("modelmeter").addoption(
        "--update-baselines", action="store_true", default=False,
        help="write the costs that assert_cost checks into their baseline files instead of comparing them "
             "(the files' other entries are kept)")


@pytest.fixture
def assert_cost(request: pytest.FixtureRequest) -> Callable[..., Comparison | None]:
    """``assert_cost(model, inputs, baseline, *, name=None, tolerance=0.0, convention="fvcore", backward=False)``:
    fail the test when the model's costs grew beyond ``tolerance`` (a fraction) over the entry ``name`` (default:
    the model's class name) of the baseline file (a path relative to the test file), or when that entry is
    missing or was recorded for other inputs, convention or passes. With ``--update-baselines`` it records the
    entry instead and passes."""
    from modelmeter.errors import InvalidTypeError
    from modelmeter.guard.assertions import CostAssertionError, entry_name
    from modelmeter.guard.assertions import assert_cost as check

    update: bool = request.config.getoption("update_baselines")
    here = request.path.parent

    def assert_cost(model: Any, inputs: Any, baseline: str | Path, *, name: str | None = None,
                    tolerance: float = 0.0, convention: str = "fvcore", backward: bool = False) -> Comparison | None:
        __tracebackhide__ = True
        if not isinstance(baseline, (str, os.PathLike)):  # (pathlib's own TypeError names no argument)
            raise InvalidTypeError(f"baseline must be a path, got {type(baseline).__name__}")
        path = here / baseline
        recorders = request.config.stash.setdefault(_recorders, {})
        entry = (str(path.resolve()), entry_name(model, name))
        recorded_by = recorders.get(entry) if update else None
        try:
            # a second recording of one entry passes with the same costs only: within a tolerance, the entry would
            # keep the first's costs and check the second against them
            compared_at = tolerance if recorded_by is None else 0.0
            comparison = check(model, inputs, path, name=name, tolerance=compared_at, convention=convention,
                               backward=backward, update=update and recorded_by is None, hint=PYTEST_HINT)
        except CostAssertionError as exc:
            comparison, failure = None, str(exc)
        else:
            failure = ""
        if recorded_by:
            failure = _recorded_twice(request.node.nodeid, recorded_by, entry_name(model, name), path,
                                      failure or _differences(comparison))
        if failure:  # failed outside the except block, so that pytest shows the report alone, not a chain
            pytest.fail(failure, pytrace=False)
        if update:
            if recorded_by is None:  # recorded (a second recording, compared instead, wrote nothing)
                recorders[entry] = request.node.nodeid
                request.config.stash.setdefault(_updated, []).append(str(path))
            return None
        return comparison

    return assert_cost


def _differences(comparison: Comparison | None) -> str:
    """The report of a comparison that found any cost or module changed; "" when everything is the same."""
    if comparison is None or not (comparison.grew or comparison.shrank or comparison.added or comparison.removed):
        return ""
    return comparison.report()


def _recorded_twice(test: str, first: str, name: str, path: Path, differences: str) -> str:
    """The failure of a second test recording the entry that ``first`` recorded with other costs, or ""."""
    if not differences:
        return ""
    earlier = "an earlier call of the same test" if first == test else first
    return (f"{test} records the entry {name!r} of {path} with other costs or inputs than {earlier} did in this "
            f"run: one would be checked against the other's costs; give each its own name=\n{differences}")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """Say which baseline files ``--update-baselines`` wrote, so they are not forgotten in a commit."""
    paths = config.stash.get(_updated, [])
    if paths:
        entries = "1 baseline entry" if len(paths) == 1 else f"{len(paths)} baseline entries"
        terminalreporter.write_line(f"modelmeter: recorded {entries} in {', '.join(sorted(set(paths)))}")
