"""A saved result's roofline and parallel summaries are checked when read, and a meta model's repeated assumption is
listed once (docs/reports.md, "The result's schema"; docs/meta.md)."""

from __future__ import annotations

import copy
import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from modelmeter import ModelRunError, Result, analyze, load_trace, save_trace
from modelmeter.cli import main
from modelmeter.engine import recorder
from modelmeter.reports.html import render_html
from modelmeter.reports.render import FORMATS, render
from modelmeter.reports.saved import SavedTraceError, read_saved_trace


@pytest.fixture(scope="module")
def planned() -> Result:
    """A real result with a device, the memory and a pipelined, sharded parallel plan (every summary filled)."""
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    analysis = analyze(model, torch.randn(4, 8), parallel="pp=2,fsdp=2", device="h100", memory=True,
                       optimizer="adamw", backward=True, measured_time=1e-3, quiet=True)
    return analysis.result()


def _render_all(result: Result) -> None:
    for fmt in FORMATS:
        render(result, fmt)
    render_html(result)


def test_a_real_result_reads_back_and_prints(planned: Result) -> None:
    assert planned.roofline and planned.parallel and planned.parallel["pipeline"]
    again = Result.from_json(planned.to_json())
    assert again == planned
    _render_all(again)


def _paths(value: Any, prefix: tuple[Any, ...]) -> Iterator[tuple[Any, ...]]:
    """Every field's path in ``value`` (a list's first item only)."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*prefix, key))
    elif isinstance(value, list) and value:
        yield from _paths(value[0], (*prefix, 0))


_MISSING = object()
_WRONG = ["x", None, True, -1, 1e-320, 1e300, [], {}, {"x": 1}, [1], _MISSING]


def _mutated(data: dict[str, Any], path: tuple[Any, ...], value: object) -> dict[str, Any]:
    data = copy.deepcopy(data)
    inner = data
    for key in path[:-1]:
        inner = inner[key]
    if value is _MISSING:
        del inner[path[-1]]
    else:
        inner[path[-1]] = value
    return data


@pytest.mark.parametrize("summary", ["roofline", "parallel"])
def test_every_summary_a_result_accepts_prints_in_every_format(planned: Result, summary: str) -> None:
    # Each field (and each summary as a whole) of a wrong type, missing, out of range: refused with a ValueError
    # naming the summary, or, when no report reads it, printed by every renderer
    data = planned.to_dict()
    refused = 0
    for path in _paths(data[summary], (summary,)):
        for value in _WRONG:
            changed = _mutated(data, path, value)
            try:
                result = Result.from_json(json.dumps(changed))
            except ValueError as exc:
                assert f"the result's {summary}" in str(exc) or path == (summary,), (path, value, exc)
                refused += 1
                continue
            _render_all(result)
    assert refused > 100  # the checks ran


def test_nan_in_a_summary_is_refused(planned: Result) -> None:
    data = planned.to_dict()
    for path in [("roofline", "time", "total"), ("parallel", "ranks", 0, "flops", "total")]:
        with pytest.raises(ValueError, match=r"the result's .*total is nan"):
            Result.from_dict(_mutated(data, path, float("nan")))


def _saved(tmp_path: Path) -> Path:
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    analysis = analyze(model, torch.randn(4, 8), parallel="pp=2,fsdp=2", device="h100", quiet=True)
    path = tmp_path / "run.mmtrace"
    save_trace(analysis, path)
    return path


@pytest.mark.parametrize(("where", "value", "field"), [
    (("roofline",), {"x": 1}, "roofline lacks device"),
    (("parallel", "plan"), 3, "parallel.plan is 3, not text"),
    (("parallel", "ranks", 0, "communication"), {"sent": "1"}, "communication lacks received"),
])
def test_modelmeter_report_refuses_a_hand_edited_summary_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], where: tuple[Any, ...], value: object, field: str) -> None:
    path = _saved(tmp_path)
    data = json.loads(gzip.decompress(path.read_bytes()))
    data["result"] = _mutated(data["result"], where, value)
    path.write_bytes(gzip.compress(json.dumps(data).encode()))
    with pytest.raises(SavedTraceError, match=field):
        read_saved_trace(path)
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and field in err and "Traceback" not in err


class _Polls(nn.Module):
    """Reads the same value of a meta tensor at every step of a loop (``steps`` times)."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)
        self.steps = steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.steps):
            if self.layer.weight.sum() > 0:  # a meta tensor's value: assumed (True) each time
                x = self.layer(x)
        return x


def test_an_assumption_repeated_in_a_loop_is_listed_once(tmp_path: Path) -> None:
    with torch.device("meta"):
        model = _Polls(50)
    analysis = analyze(model, torch.randn(2, 4), quiet=True)
    assumed = [text for text in analysis.assumptions() if "assumed to be True" in text]
    assert len(assumed) == 1 and analysis.assumptions() == list(dict.fromkeys(analysis.assumptions()))
    assert analysis.flops.total() == 50 * 2 * 4 * 4  # every step still ran (the assumption held each time)
    assert analysis.result().assumptions == analysis.assumptions()
    path = tmp_path / "polls.mmtrace"
    save_trace(analysis, path)
    assert read_saved_trace(path).trace.assumptions == analysis.trace.assumptions
    assert load_trace(path).assumptions == analysis.assumptions()


def test_the_cap_on_guesses_counts_repeated_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recorder, "GUESSES", 50)
    with torch.device("meta"):
        model = _Polls(60)
    with pytest.raises(ModelRunError, match="read 50 values of meta tensors"):
        analyze(model, torch.randn(2, 4), quiet=True)
    with torch.device("meta"):
        model = _Polls(50)
    assert len(analyze(model, torch.randn(2, 4), quiet=True).assumptions()) >= 1
