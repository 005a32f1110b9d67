"""The module table fits a width (short headers, columns left out by rank, named under it), shows one unit per
column, and each module's output shapes (recorded in the trace, kept in the Result and its JSON)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import pytest
import torch
from torch import nn

import modelmeter
from modelmeter.cli import main
from modelmeter.devices import get_device
from modelmeter.engine import serialize
from modelmeter.reports import ModuleRow, Result, render
from modelmeter.reports.columns import column_keys, drop_rank, shorten


# a result with many columns: a training step with memory and a device ----------------------------------------
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.conv(x)).mean((2, 3)))


@pytest.fixture(scope="module")
def wide_result() -> Result:
    analysis = modelmeter.analyze(Block(), torch.randn(2, 3, 16, 16), backward=True, memory=True,
                                  optimizer="adamw", device=get_device("h100"))
    return analysis.result()


def _table_lines(text: str) -> tuple[list[str], list[str]]:
    """The table's lines and the notes under it."""
    table, _, notes = text.partition("\n\n")
    return table.splitlines(), notes.splitlines()


def _header(key: str) -> str:
    """A column's full header, written out here as the docs give it."""
    named = {"type": "type", "params": "#params", "intensity": "flops/byte", "compute_bound": "bound",
             "shapes": "output shapes"}
    return named.get(key, key if key.startswith("%") else f"#{key}")


def _dropped(notes: list[str]) -> list[str]:
    text = " ".join(line.strip() for line in notes)
    match = re.search(r"Left out to fit \d+ characters: (.*?) \(all columns", text)
    return match.group(1).split(", ") if match else []


def test_every_column_without_a_width(wide_result: Result) -> None:
    lines, notes = _table_lines(render(wide_result, depth=1))
    keys = column_keys(wide_result)
    headers = lines[0].split()
    assert headers == ["module", *map(_header, keys)]
    assert "forward_flops" in keys and "%saved_bytes" in keys and "intensity" in keys
    assert not _dropped(notes)
    assert len(lines[0]) > 200  # what the width fitting is for


@pytest.mark.parametrize("width", [40, 60, 80, 100, 120, 160])
def test_table_fits_the_width(wide_result: Result, width: int) -> None:
    text = render(wide_result, depth=2, width=width)
    lines, notes = _table_lines(text)
    assert max(map(len, lines)) <= width
    assert all(len(line) <= width for line in notes if " " in line.strip())  # a note wraps at its spaces
    dropped = _dropped(notes)
    keys = column_keys(wide_result)
    shown = lines[0].split()[1:]
    assert len(shown) + len(dropped) == len(keys)
    # what is shown is the short header of every key not left out, in table order
    short = width < len(render(wide_result, depth=2).splitlines()[0])
    assert shown == [shorten(_header(key)) if short else _header(key) for key in keys if key not in dropped]
    # nothing kept ranks below anything left out
    kept = [key for key in keys if key not in dropped]
    if dropped:
        assert max(map(drop_rank, dropped)) <= min(map(drop_rank, kept))
    # the widest table that fits leaves nothing out that would have fitted: one column more is too wide
    assert width >= 160 or dropped


def test_the_drop_order_is_the_documented_one() -> None:
    order = ["%forward_flops", "%saved_bytes", "%peak_memory", "backward_flops", "%activations", "%bytes",
             "intensity", "compute_bound", "activation_bytes", "bytes", "%flops", "%time", "type", "activations",
             "peak_memory", "params", "shapes", "time", "flops"]
    ranks = [drop_rank(key) for key in order]
    assert ranks == sorted(ranks)
    assert drop_rank("%forward_flops") < drop_rank("forward_flops") < drop_rank("%activations") < drop_rank("%flops")


def test_a_width_narrower_than_any_table_keeps_the_module_and_one_column(wide_result: Result) -> None:
    lines, notes = _table_lines(render(wide_result, depth=0, width=10))
    assert lines[0].split() == ["module", "#flops"]
    assert len(_dropped(notes)) == len(column_keys(wide_result)) - 1


def test_chosen_columns_in_their_order_and_all(wide_result: Result) -> None:
    lines, _ = _table_lines(render(wide_result, depth=1, columns=["time", "flops", "%flops"]))
    assert lines[0].split() == ["module", "#time", "#flops", "%flops"]
    every = _table_lines(render(wide_result, depth=1, columns=["all"], width=40))[0]
    assert every == _table_lines(render(wide_result, depth=1))[0]  # "all": never left out to fit
    with pytest.raises(ValueError, match=r"no column 'walltime'.*its columns: type, params, flops"):
        render(wide_result, columns=["walltime"])
    with pytest.raises(ValueError, match="width"):
        render(wide_result, width=0)


def test_the_tree_fits_the_width(wide_result: Result) -> None:
    full = render(wide_result, "tree")
    assert max(map(len, full.splitlines())) > 100
    tree = render(wide_result, "tree", width=100)
    assert max(map(len, tree.splitlines())) <= 100
    assert tree.splitlines()[0].startswith("Left out to fit 100 characters: ")
    assert "#flops: " in tree and "#forward_flops" not in tree


# one unit per column ------------------------------------------------------------------------------------------
def _handmade(values: list[float], metric: str = "flops") -> Result:
    names = ["", "a", "b", "c"][:len(values)]
    return Result(model="Net", inputs=[], metrics=[metric],
                  modules=[ModuleRow(name, "M", 0, {metric: value}) for name, value in zip(names, values, strict=True)])


def _column(result: Result, header: str) -> list[str]:
    lines = render(result, columns=[header.lstrip("#")]).splitlines()
    return [line.split()[-1] for line in lines[2:]]


@pytest.mark.parametrize(("metric", "values", "cells"), [
    ("flops", [2_500_000, 1_500_000, 400, 0], ["2.5M", "1.5M", "<0.001M", "0"]),
    ("flops", [12_194_000_000, 236_000_000, 3_211_264, 0], ["12.194G", "0.236G", "0.003G", "0"]),
    ("flops", [90, 10, 0.5, 0], ["90", "10", "0.5", "0"]),
    ("activation_bytes", [3 << 30, 1536 << 20, 7 << 20, 0], ["3GiB", "1.5GiB", "0.007GiB", "0"]),
    ("activation_bytes", [900, 512, 1, 0], ["900B", "512B", "1B", "0"]),
    ("time", [0.00075, 0.0005, 3e-7, 4e-8], ["750µs", "500µs", "0.3µs", "<0.1µs"]),
])
def test_one_unit_per_column(metric: str, values: list[float], cells: list[str]) -> None:
    assert _column(_handmade(values, metric), metric) == cells


def test_every_numeric_column_has_one_unit(wide_result: Result) -> None:
    numeric = [key for key in column_keys(wide_result) if key not in ("type", "compute_bound")]
    lines, _ = _table_lines(render(wide_result, depth=3, columns=numeric))
    columns = list(zip(*(line.split() for line in lines[2:]), strict=True))
    for header, column in zip(lines[0].split(), columns, strict=True):
        if not header.startswith("#"):
            continue
        units = {re.sub(r"^<?[\d.]+", "", cell) for cell in column if cell not in ("0", "N/A")}
        assert len(units) == 1, (header, column)


# output shapes ------------------------------------------------------------------------------------------------
class Shapes(nn.Module):
    """A convolution, an LSTM (a tuple of tensors), a linear layer called twice on different shapes, an activation
    called twice on one shape, and a module that returns no tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2)
        self.lstm = nn.LSTM(8, 4, batch_first=True)
        self.fc = nn.Linear(4, 2)
        self.act = nn.ReLU()
        self.note = Nothing()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x).flatten(2).transpose(1, 2)
        out, (h, _) = self.lstm(y)
        self.note(out)
        return self.act(self.fc(out)).sum(1) + self.act(self.fc(h[-1]))


class Nothing(nn.Module):
    def forward(self, x: torch.Tensor) -> None:
        return None


def _real_shapes(model: nn.Module, x: torch.Tensor) -> dict[str, dict[str, int]]:
    """The oracle: each module's output shapes, from forward hooks on a real run."""
    seen: dict[str, dict[str, int]] = {}

    def flat(value: object) -> list[torch.Tensor]:
        if isinstance(value, torch.Tensor):
            return [value]
        return [t for item in value for t in flat(item)] if isinstance(value, tuple) else []

    def hook(name: str) -> Callable[[nn.Module, object, object], None]:
        def record(module: nn.Module, args: object, output: object) -> None:
            tensors = flat(output)
            if tensors:
                shape = ", ".join("x".join(map(str, t.shape)) for t in tensors)
                seen.setdefault(name, {}).setdefault(shape, 0)
                seen[name][shape] += 1
        return record

    handles = [m.register_forward_hook(hook(name)) for name, m in model.named_modules()]
    with torch.no_grad():
        model(x)
    for handle in handles:
        handle.remove()
    return seen


def test_output_shapes_match_a_real_run() -> None:
    model, x = Shapes(), torch.randn(2, 3, 9, 9)
    expected = _real_shapes(model, x)
    assert expected == {"": {"2x2": 1}, "conv": {"2x8x4x4": 1}, "lstm": {"2x16x4, 1x2x4, 1x2x4": 1},
                        "fc": {"2x16x2": 1, "2x2": 1}, "act": {"2x16x2": 1, "2x2": 1}}  # by hand too
    for options in ({}, {"execution": "real"}, {"backward": True, "memory": True}):
        result = modelmeter.analyze(model, x, **options).result()
        assert {row.name: row.output_shapes for row in result.modules if row.output_shapes} == expected, options
        assert result.row("note").output_shapes == {}


def test_a_checkpointed_block_re_run_in_the_backward_pass_adds_no_call() -> None:
    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(4, 6), nn.GELU())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False).sum()

    analysis = modelmeter.analyze(Checkpointed(), torch.randn(3, 4), backward=True)
    assert "recompute" in analysis.trace.phases()  # the block did run again
    result = analysis.result()
    assert result.row("block").output_shapes == {"3x6": 1} and result.row("block.0").output_shapes == {"3x6": 1}
    assert result.root.output_shapes == {"scalar": 1}


def test_repeated_calls_are_counted_once_per_call() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    shared = nn.ReLU()

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.act = model, shared

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(3):
                x = self.act(self.body(x))
            return x

    result = modelmeter.analyze(Twice(), torch.randn(5, 4)).result()
    assert result.row("act").output_shapes == {"5x4": 3}
    lines = render(result, columns=["shapes"]).splitlines()
    assert lines[0].split() == ["module", "output", "shapes"]
    assert [line.split() for line in lines[2:]] == [["model", "5x4"], ["body", "5x4", "(3", "calls)"],
                                                    ["body.0", "5x4", "(3", "calls)"], ["act", "5x4", "(3", "calls)"]]


def test_shapes_column_and_tree() -> None:
    result = modelmeter.analyze(Shapes(), torch.randn(2, 3, 9, 9)).result()
    table = render(result, shapes=True).splitlines()
    assert table[0].endswith("output shapes")
    rows = {line.split()[0]: line for line in table[2:]}
    assert rows["conv"].endswith("  2x8x4x4") and rows["note"].endswith("  -")
    assert rows["fc"].endswith("  2x16x2; 2x2")
    assert rows["lstm"].endswith("  2x16x4, 1x2x4, 1x2x4")
    tree = render(result, "tree", shapes=True)
    # by hand: 8 x (3x3x3 + 1) parameters; 2 images x 8 x 4x4 outputs x 27 multiply-adds; 2 x 8 x 4x4 outputs
    assert "(conv): Conv2d(#params: 0.224K, #flops: 6.912K, #activations: 0.256K, output: 2x8x4x4)" in tree
    assert "output shapes" not in render(result)


def test_many_outputs_are_summarised() -> None:
    class Many(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return (*(x + i for i in range(7)), x.sum())

    result = modelmeter.analyze(Many(), torch.randn(3)).result()
    assert result.root.output_shapes == {"3, 3, 3, 3, +4 more": 1}
    scalar = modelmeter.analyze(nn.Flatten(0), torch.randn(())).result()
    assert scalar.root.output_shapes == {"1": 1}


def test_output_shapes_in_json_and_back() -> None:
    result = modelmeter.analyze(Shapes(), torch.randn(2, 3, 9, 9)).result()
    data = json.loads(result.to_json())
    assert data["modules"][2]["name"] == "lstm"
    assert data["modules"][2]["output_shapes"] == {"2x16x4, 1x2x4, 1x2x4": 1}
    assert Result.from_json(result.to_json()) == result
    for row in data["modules"]:  # a result saved before output shapes were recorded still reads
        del row["output_shapes"]
    assert Result.from_dict(data).root.output_shapes == {}


def test_output_shapes_in_the_trace_round_trip() -> None:
    trace = modelmeter.analyze(Shapes(), torch.randn(2, 3, 9, 9)).trace
    assert trace.output_shapes["fc"] == {"2x16x2": 1, "2x2": 1}
    back = serialize.loads(serialize.dumps(trace))
    assert back.output_shapes == trace.output_shapes
    assert list(back.output_shapes["fc"]) == ["2x16x2", "2x2"]  # the order first seen
    data = serialize.trace_to_dict(trace)
    assert data["version"] == serialize.FORMAT_VERSION == 8
    data["fields"]["output_shapes"] = {"fc": {"2x2": "one"}}
    with pytest.raises(ValueError, match="output shapes"):
        serialize.trace_from_dict(data)
    data["version"] = 3
    with pytest.raises(ValueError, match="older modelmeter"):
        serialize.trace_from_dict(data)


# the command --------------------------------------------------------------------------------------------------
def _run(capsys: pytest.CaptureFixture[str], *argv: str, code: int = 0) -> tuple[str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    assert status == code, err
    return out, err


TRAINING = ("gpt2_tiny", "--seq-len", "8", "--optimizer", "adamw", "--device", "h100", "--depth", "1")


@pytest.mark.parametrize("columns", ["60", "80", "120"])
def test_the_command_fits_columns(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                  columns: str) -> None:
    monkeypatch.setenv("COLUMNS", columns)
    out, _ = _run(capsys, *TRAINING)
    assert max(map(len, out.splitlines())) <= int(columns)
    assert "Left out to fit " + columns + " characters: " in out.replace("\n  ", " ")
    assert out.startswith("gpt2_tiny on input 1x8 int64 (fake run")


def test_the_command_fits_120_without_a_terminal(capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    out, _ = _run(capsys, *TRAINING)  # captured: stdout is no terminal
    assert max(map(len, out.splitlines())) <= 120 and "Left out to fit 120 characters" in out


def test_wide_shows_every_column(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    out, _ = _run(capsys, *TRAINING, "--wide")
    header = out.splitlines()[1].split()
    for column in ("#forward_flops", "%backward_flops", "#activation_bytes", "%saved_bytes", "flops/byte", "bound",
                   "%peak_memory"):
        assert column in header
    assert "Left out" not in out


def test_columns_option(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "40")
    out, _ = _run(capsys, *TRAINING, "--columns", "flops,time,%time,shapes")
    header = next(line for line in out.splitlines() if line.startswith("module"))
    assert header.split() == ["module", "#flops", "#time", "%time", "output", "shapes"]
    assert next(line for line in out.splitlines() if line.startswith("  lm_head ")).endswith("  1x8x1000")
    lines = out.splitlines()
    table_starts, table_ends = lines.index(header), lines.index("")
    assert len(lines[table_starts]) > 40  # the chosen columns are all shown, however wide
    assert all(len(line) <= 40 for line in lines[:table_starts] + lines[table_ends:])  # the rest is wrapped
    _, err = _run(capsys, "resnet18", "--resolution", "32", "--columns", "flops,time", code=2)
    assert "--columns: no column 'time' in this result" in err
    _, err = _run(capsys, "resnet18", "--wide", "--columns", "flops", code=2)
    assert "not allowed with argument" in err


def test_shapes_option(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    out, _ = _run(capsys, "resnet18", "--resolution", "64", "--shapes", "--depth", "1")
    rows = {line.split()[0]: line for line in out.splitlines()[3:]}
    assert rows["conv1"].endswith("  1x64x32x32") and rows["layer4"].endswith("  1x512x2x2")
    assert rows["fc"].endswith("  1x1000") and rows["model"].endswith("  1x1000")
    data = json.loads(_run(capsys, "resnet18", "--resolution", "64", "--format", "json")[0])
    assert [m["output_shapes"] for m in data["modules"] if m["name"] == "layer1"] == [{"1x64x16x16": 1}]
