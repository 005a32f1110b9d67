"""Shared test setup: every test run gets its own cache directory, never the user's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _private_cache_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELMETER_CACHE", str(tmp_path_factory.mktemp("modelmeter_cache")))


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
