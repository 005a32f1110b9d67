"""Shared test setup: every test run gets its own cache directory, never the user's."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _private_cache_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELMETER_CACHE", str(tmp_path_factory.mktemp("modelmeter_cache")))
