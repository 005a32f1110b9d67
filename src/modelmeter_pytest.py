"""pytest plugin (entry point ``modelmeter``): the ``assert_cost`` fixture and the ``--update-baselines`` flag.

Loaded in every pytest session where modelmeter is installed, so it imports nothing heavy itself: the analysis
(and torch) load when a test first calls the fixture.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from modelmeter.guard.baseline import Comparison

PYTEST_HINT = "run `pytest --update-baselines` to record it"

_updated = pytest.StashKey[list[str]]()


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
    from modelmeter.guard.assertions import CostAssertionError
    from modelmeter.guard.assertions import assert_cost as check

    update: bool = request.config.getoption("update_baselines")
    here = request.path.parent

    def assert_cost(model: Any, inputs: Any, baseline: str | Path, *, name: str | None = None,
                    tolerance: float = 0.0, convention: str = "fvcore", backward: bool = False) -> Comparison | None:
        __tracebackhide__ = True
        path = here / baseline
        try:
            comparison = check(model, inputs, path, name=name, tolerance=tolerance, convention=convention,
                               backward=backward, update=update, hint=PYTEST_HINT)
        except CostAssertionError as exc:
            failure = str(exc)
        else:
            failure = ""
        if failure:  # failed outside the except block, so that pytest shows the report alone, not a chain
            pytest.fail(failure, pytrace=False)
        if update:
            request.config.stash.setdefault(_updated, []).append(str(path))
        return comparison

    return assert_cost


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """Say which baseline files ``--update-baselines`` wrote, so they are not forgotten in a commit."""
    paths = config.stash.get(_updated, [])
    if paths:
        entries = "1 baseline entry" if len(paths) == 1 else f"{len(paths)} baseline entries"
        terminalreporter.write_line(f"modelmeter: recorded {entries} in {', '.join(sorted(set(paths)))}")
