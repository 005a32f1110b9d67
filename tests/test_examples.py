"""The scripts in examples/ run as documented (each asserts its own numbers)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path: Path) -> None:
    runpy.run_path(str(path), run_name="__main__")


def test_examples_exist() -> None:
    assert len(EXAMPLES) >= 2
