"""Saved traces (.mmtrace): written whole, read strictly, rendered and diffed without the model."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from modelmeter import analyze
from modelmeter.guard import load_costs
from modelmeter.guard.values import GuardFileError
from modelmeter.reports.saved import SavedTrace, SavedTraceError, read_saved_trace, write_saved_trace


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).mean((2, 3)))


def saved(tmp_path: Path) -> tuple[Path, SavedTrace]:
    analysis = analyze(Net(), torch.randn(2, 3, 16, 16))
    path = tmp_path / "run.mmtrace"
    original = SavedTrace(analysis.trace, analysis.result(), {"convention": "fvcore"}, {"modelmeter": "test"})
    write_saved_trace(original, path)
    return path, original


def test_a_saved_trace_reads_back_equal(tmp_path: Path) -> None:
    path, original = saved(tmp_path)
    back = read_saved_trace(path)
    assert back.trace == original.trace
    assert back.result == original.result
    assert back.settings["convention"] == "fvcore" and back.settings["attention_kernel"] == "fused"
    assert back.saved_by == {"modelmeter": "test"}
    # conv: 8*3*9 multiply-adds at each of 2*14*14 positions; fc: 2*8*4
    assert back.result.total("flops") == 8 * 3 * 9 * 2 * 14 * 14 + 2 * 8 * 4


def test_unknown_settings_are_refused(tmp_path: Path) -> None:
    _, original = saved(tmp_path)
    original.settings["colour"] = "red"
    with pytest.raises(ValueError, match="unknown saved-trace settings: colour"):
        write_saved_trace(original, tmp_path / "other.mmtrace")


def _rewrite(path: Path, change: object) -> None:
    data = json.loads(gzip.decompress(path.read_bytes()))
    change(data)  # type: ignore[operator]
    path.write_bytes(gzip.compress(json.dumps(data).encode()))


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d.update(version=99), "format version 99"),
    (lambda d: d.update(format="other"), "its format is not"),
    (lambda d: d.update(result=[]), "it holds no result"),
    (lambda d: d["trace"]["fields"].update(model=3), "malformed trace fields"),
    (lambda d: d["trace"]["fields"]["aliases"]["$d"].append(["ghost", "nowhere"]), "aliases in the trace lead"),
    (lambda d: d.update(settings={"convention": "fvcore", "evil": 1}), "unknown saved-trace settings"),
])
def test_a_damaged_file_is_one_clear_error_naming_it(tmp_path: Path, change: object, message: str) -> None:
    path, _ = saved(tmp_path)
    _rewrite(path, change)
    with pytest.raises(SavedTraceError, match=message) as info:
        read_saved_trace(path)
    assert "run.mmtrace" in str(info.value)


def test_truncated_and_foreign_files(tmp_path: Path) -> None:
    path, _ = saved(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(SavedTraceError, match="truncated"):
        read_saved_trace(path)
    path.write_text("{}")
    with pytest.raises(SavedTraceError, match="not gzip data"):
        read_saved_trace(path)
    with pytest.raises(SavedTraceError, match="cannot read"):
        read_saved_trace(tmp_path / "missing.mmtrace")


def test_diff_reads_saved_traces_beside_json_results(tmp_path: Path) -> None:
    path, original = saved(tmp_path)
    (tmp_path / "r.json").write_text(original.result.to_json())
    assert load_costs(path) == load_costs(tmp_path / "r.json")
    assert load_costs(path)["conv"]["flops"] == 8 * 3 * 9 * 2 * 14 * 14
    _rewrite(path, lambda d: d.update(version=2))
    with pytest.raises(GuardFileError, match="format version 2"):
        load_costs(path)
