"""Shared test setup: every test run gets its own cache directory, never the user's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def _private_cache_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELMETER_CACHE", str(tmp_path_factory.mktemp("modelmeter_cache")))


@pytest.fixture(autouse=True)
def _no_terminal_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reports are fitted to COLUMNS when it is set: a test sees the width of a pipe (120), not the one the shell
    or a pytest-xdist worker (80) exported. Tests of the width set it themselves."""
    monkeypatch.delenv("COLUMNS", raising=False)


@pytest.fixture(autouse=True)
def _distributed_globals_kept(request: pytest.FixtureRequest) -> Iterator[None]:
    """A parallel test that sets up a process group of its own leaves what torch keeps globally after one (the
    backend's name, the traceback prefix, DTensor's caches keyed by mesh layout) as it found it, so no later test
    sees its groups — as a simulated rank of modelmeter's does."""
    if not request.node.module.__name__.startswith("test_parallel"):
        yield
        return
    from modelmeter._torch_compat import kept_distributed_globals

    with kept_distributed_globals():
        yield


@pytest.fixture
def recordings(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The spec of every recording an analysis makes from now on. (Counting a model's runs with a hook that appends
    to a list would not do: the in-process shared recording's key covers what a hook's code reads, so a run that
    changes it changes the call's state, and the next analysis records anew.)"""
    import modelmeter.session

    specs: list[Any] = []
    record = modelmeter.session.record_trace

    def counted(spec: Any) -> Any:
        specs.append(spec)
        return record(spec)

    monkeypatch.setattr(modelmeter.session, "record_trace", counted)
    return specs
