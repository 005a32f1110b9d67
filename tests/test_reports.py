"""Reports: fvcore's printed tables (golden outputs from the reference doc), the renderers, the JSON schema."""

from __future__ import annotations

import csv
import importlib
import io
import json
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import modelmeter
from modelmeter import (
    ActivationCountAnalysis,
    FlopCountAnalysis,
    build_result,
    flop_count_str,
    flop_count_table,
    parameter_count_table,
)
from modelmeter.reports import FORMATS, ModuleRow, Result, format_size, fvcore_tables, render
from modelmeter.reports.format import text_width
from opaque_ops import blur

render_module = importlib.import_module("modelmeter.reports.render")  # the package attribute is the function


class TestModel(nn.Module):
    """fvcore's docstring model. On 1x3x10x10: conv 10*3*100 = 3000 flops (1000 activations),
    fc 1000*10 = 10000 flops (10 activations); parameters fc 10010 + conv 40 = 10050."""

    __test__ = False

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(1000, 10)
        self.conv = nn.Conv2d(3, 10, 1)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.act(self.conv(x)).flatten(1))


# fvcore's tests/test_print_model_statistics.py model: every Linear(10, 10) on (1, 10) is 100 flops,
# 10 activations, 110 parameters; A1B1 calls ``self.c1.forward(x)``, so A1B1C1 is never called itself.
class A2B1(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Linear(10, 10)
        self.c2 = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c1(self.c2(x))


class A2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b1 = A2B1()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b1(x)


class A1B1C1(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.d1 = nn.Linear(10, 10)
        self.d2 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d1(self.d2(x))


class A1B1(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = A1B1C1()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c1.forward(x)


class A1(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b1 = A1B1()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b1(x)


class TestNet(nn.Module):
    __test__ = False

    def __init__(self) -> None:
        super().__init__()
        self.a1 = A1()
        self.a2 = A2()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a1(self.a2(x))


class InnerNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(10, 10)
        self.fc2 = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(self.fc2(x))


class DocNet(nn.Module):
    """flop_count_str's docstring ``TestNet``: 4 x Linear(10, 10)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(10, 10)
        self.fc2 = nn.Linear(10, 10)
        self.inner = InnerNet()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(self.fc2(self.inner(x)))


class WithMean(nn.Module):
    """``modelmeter_test::blur`` has no flop handle: an unsupported operator."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + blur(x)


def _image() -> torch.Tensor:
    return torch.randn(1, 3, 10, 10)


def _row() -> tuple[torch.Tensor]:
    return (torch.randn(1, 10),)


def _test_model_result() -> Result:
    model, x = TestModel(), _image()
    flops = FlopCountAnalysis(model, x)
    return build_result(model, {"flops": flops, "activations": ActivationCountAnalysis(model, x, trace=flops.trace)})


def _caller_result() -> Result:
    model, x = TestNet(), _row()
    flops = FlopCountAnalysis(model, x).ancestor_mode("caller").uncalled_modules_warnings(False)
    acts = ActivationCountAnalysis(model, x, trace=flops.trace).ancestor_mode("caller").uncalled_modules_warnings(False)
    return build_result(model, {"flops": flops, "activations": acts})


# format_size -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "text"), [
    (4000, "4K"), (600000, "0.6M"), (123456, "0.123M"), (654321, "0.654M"), (200, "0.2K"), (100, "100"),
    (101, "0.101K"), (100_000, "100K"), (20, "20"), (0, "0"), (13000, "13K"), (10050, "10.05K"), (1010, "1.01K"),
    (72.0, "72"), (4.8436, "4.844"), (3e9, "3G"), (1.5e12, "1.5T"), (2e15, "2P"), (-5000, "-5K"),
])
def test_format_size(value: float, text: str) -> None:
    assert format_size(value) == text


def test_format_size_sig_figs() -> None:
    assert format_size(123456, sig_figs=2) == "0.12M"
    assert format_size(440, sig_figs=2) == "0.44K"
    assert format_size(123456, sig_figs=4) == "0.1235M"
    assert format_size(100, sig_figs=0) == "100"


def test_one_format_size_everywhere() -> None:
    assert render_module.format_size is fvcore_tables.format_size is format_size


# parameter_count_table -------------------------------------------------------------------------
def test_parameter_count_table_golden() -> None:
    assert parameter_count_table(TestModel()) == (
        "| name          | #elements or shape   |\n"
        "|:--------------|:---------------------|\n"
        "| model         | 10.1K                |\n"
        "|  fc           |  10.0K               |\n"
        "|   fc.weight   |   (10, 1000)         |\n"
        "|   fc.bias     |   (10,)              |\n"
        "|  conv         |  40                  |\n"
        "|   conv.weight |   (10, 3, 1, 1)      |\n"
        "|   conv.bias   |   (10,)              |"
    )


def test_parameter_count_table_depth() -> None:
    assert parameter_count_table(TestModel(), max_depth=1) == (
        "| name   | #elements or shape   |\n"
        "|:-------|:---------------------|\n"
        "| model  | 10.1K                |\n"
        "|  fc    |  10.0K               |\n"
        "|  conv  |  40                  |"
    )
    # one numeric cell: tabulate right-aligns a column of numbers
    assert parameter_count_table(nn.Linear(3, 2), max_depth=0) == (
        "| name   |   #elements or shape |\n"
        "|:-------|---------------------:|\n"
        "| model  |                    8 |"
    )


# flop_count_table ------------------------------------------------------------------------------
def test_flop_count_table_golden() -> None:
    model, x = TestModel(), _image()
    assert flop_count_table(FlopCountAnalysis(model, x)) == (
        "| module        | #parameters or shape   | #flops   |\n"
        "|:--------------|:-----------------------|:---------|\n"
        "| model         | 10.05K                 | 13K      |\n"
        "|  fc           |  10.01K                |  10K     |\n"
        "|   fc.weight   |   (10, 1000)           |          |\n"
        "|   fc.bias     |   (10,)                |          |\n"
        "|  conv         |  40                    |  3K      |\n"
        "|   conv.weight |   (10, 3, 1, 1)        |          |\n"
        "|   conv.bias   |   (10,)                |          |"
    )


def test_flop_count_table_activations_golden() -> None:
    model, x = TestModel(), _image()
    table = flop_count_table(FlopCountAnalysis(model, x), activations=ActivationCountAnalysis(model, x),
                             show_param_shapes=False)
    assert table == (
        "| module   | #parameters   | #flops   | #activations   |\n"
        "|:---------|:--------------|:---------|:---------------|\n"
        "| model    | 10.05K        | 13K      | 1.01K          |\n"
        "|  fc      |  10.01K       |  10K     |  10            |\n"
        "|  conv    |  40           |  3K      |  1K            |"
    )


def test_flop_count_table_collapses_single_child_chains() -> None:
    model, x = TestNet(), _row()
    assert flop_count_table(FlopCountAnalysis(model, x)) == (
        "| module               | #parameters or shape   | #flops   |\n"
        "|:---------------------|:-----------------------|:---------|\n"
        "| model                | 0.33K                  | 0.3K     |\n"
        "|  a1.b1.c1.d1         |  0.11K                 |  100     |\n"
        "|   a1.b1.c1.d1.weight |   (10, 10)             |          |\n"
        "|   a1.b1.c1.d1.bias   |   (10,)                |          |\n"
        "|  a2.b1               |  0.22K                 |  0.2K    |\n"
        "|   a2.b1.c1           |   0.11K                |   100    |\n"
        "|    a2.b1.c1.weight   |    (10, 10)            |          |\n"
        "|    a2.b1.c1.bias     |    (10,)               |          |\n"
        "|   a2.b1.c2           |   0.11K                |   100    |\n"
        "|    a2.b1.c2.weight   |    (10, 10)            |          |\n"
        "|    a2.b1.c2.bias     |    (10,)               |          |"
    )


def test_flop_count_table_caller_mode_numeric_column() -> None:
    # the uncalled a1.b1.c1 gets "" and merges into its only child; #activations is all numbers
    model, x = TestNet(), _row()
    flops = FlopCountAnalysis(model, x).ancestor_mode("caller")
    acts = ActivationCountAnalysis(model, x).ancestor_mode("caller")
    assert flop_count_table(flops, activations=acts, show_param_shapes=False) == (
        "| module       | #parameters   | #flops   |   #activations |\n"
        "|:-------------|:--------------|:---------|---------------:|\n"
        "| model        | 0.33K         | 0.3K     |             30 |\n"
        "|  a1.b1.c1.d1 |  0.11K        |  100     |             10 |\n"
        "|  a2.b1       |  0.22K        |  0.2K    |             20 |\n"
        "|   a2.b1.c1   |   0.11K       |   100    |             10 |\n"
        "|   a2.b1.c2   |   0.11K       |   100    |             10 |"
    )


def test_flop_count_table_depth_and_zero_rows() -> None:
    # depth 1 after collapsing; the ReLU (no parameters, no flops) never gets a row
    model, x = TestNet(), _row()
    assert flop_count_table(FlopCountAnalysis(model, x), max_depth=1, show_param_shapes=False) == (
        "| module       | #parameters   | #flops   |\n"
        "|:-------------|:--------------|:---------|\n"
        "| model        | 0.33K         | 0.3K     |\n"
        "|  a1.b1.c1.d1 |  0.11K        |  100     |\n"
        "|  a2.b1       |  0.22K        |  0.2K    |"
    )


def test_pipe_table_alignment() -> None:
    # as tabulate 0.9: numbers right-aligned, decimal points lined up; an empty cell makes a column text
    rows = [["1.5", " 7", "x"], ["10", "  8", ""], ["0.25", "9", "y"]]
    assert fvcore_tables.pipe_table(["a", "b", "c"], rows) == (
        "|     a |   b | c   |\n"
        "|------:|----:|:----|\n"
        "|  1.5  |   7 | x   |\n"
        "| 10    |   8 |     |\n"
        "|  0.25 |   9 | y   |"
    )


def test_pipe_table_matches_tabulate_with_whitespace_kept() -> None:
    # tabulate >= 0.10 keeps whitespace only when asked; where no cell is empty it must agree with us
    tabulate = pytest.importorskip("tabulate")
    if "preserve_whitespace" not in tabulate.tabulate.__code__.co_varnames:
        pytest.skip("this tabulate has no preserve_whitespace keyword")
    headers = ["module", "#flops", "#acts", "x"]
    rows = [["model", "1.5K", "30", "0.5"], [" a", " 0.5K", " 10", "12"], ["  a.b", "  100", "  20", "1e-05"]]
    expected = tabulate.tabulate(rows, headers=headers, tablefmt="pipe", preserve_whitespace=True)
    assert fvcore_tables.pipe_table(headers, rows) == expected


def test_flop_count_table_matches_fvcore() -> None:
    # fvcore's own output, with its lost indentation restored (tabulate 0.10 ignores PRESERVE_WHITESPACE)
    fvcore_nn = pytest.importorskip("fvcore.nn")
    tabulate = pytest.importorskip("tabulate")
    if "preserve_whitespace" not in tabulate.tabulate.__code__.co_varnames:
        pytest.skip("this tabulate has no preserve_whitespace keyword")
    original = tabulate.tabulate

    def keep_whitespace(*args: Any, **kwargs: Any) -> str:
        return original(*args, preserve_whitespace=tabulate.PRESERVE_WHITESPACE, **kwargs)

    model, x = TestNet(), _row()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tabulate, "tabulate", keep_whitespace)
        for depth in (1, 2, 3):
            theirs = fvcore_nn.flop_count_table(fvcore_nn.FlopCountAnalysis(model, x).ancestor_mode("caller"), depth)
            ours = flop_count_table(FlopCountAnalysis(model, x).ancestor_mode("caller"), depth)
            assert ours == theirs
        theirs = fvcore_nn.flop_count_str(fvcore_nn.FlopCountAnalysis(model, x).ancestor_mode("caller"))
        assert flop_count_str(FlopCountAnalysis(model, x).ancestor_mode("caller")) == theirs
        assert parameter_count_table(model, 2) == fvcore_nn.parameter_count_table(model, 2)


# flop_count_str --------------------------------------------------------------------------------
def test_flop_count_str_golden() -> None:
    model = DocNet()
    assert flop_count_str(FlopCountAnalysis(model, _row())) == (
        "DocNet(\n"
        "  #params: 0.44K, #flops: 0.4K\n"
        "  (fc1): Linear(\n"
        "    in_features=10, out_features=10, bias=True\n"
        "    #params: 0.11K, #flops: 100\n"
        "  )\n"
        "  (fc2): Linear(\n"
        "    in_features=10, out_features=10, bias=True\n"
        "    #params: 0.11K, #flops: 100\n"
        "  )\n"
        "  (inner): InnerNet(\n"
        "    #params: 0.22K, #flops: 0.2K\n"
        "    (fc1): Linear(\n"
        "      in_features=10, out_features=10, bias=True\n"
        "      #params: 0.11K, #flops: 100\n"
        "    )\n"
        "    (fc2): Linear(\n"
        "      in_features=10, out_features=10, bias=True\n"
        "      #params: 0.11K, #flops: 100\n"
        "    )\n"
        "  )\n"
        ")"
    )


def test_flop_count_str_uncalled_is_na() -> None:
    model, x = TestNet(), _row()
    flops = FlopCountAnalysis(model, x).ancestor_mode("caller")
    acts = ActivationCountAnalysis(model, x).ancestor_mode("caller")
    assert flop_count_str(flops, acts) == (
        "N/A indicates a possibly missing statistic due to how the module was called. "
        "Missing values are still included in the parent's total.\n"
        "TestNet(\n"
        "  #params: 0.33K, #flops: 0.3K, #acts: 30\n"
        "  (a1): A1(\n"
        "    #params: 0.11K, #flops: 100, #acts: 10\n"
        "    (b1): A1B1(\n"
        "      #params: 0.11K, #flops: 100, #acts: 10\n"
        "      (c1): A1B1C1(\n"
        "        #params: 0.11K, #flops: N/A, #acts: N/A\n"
        "        (d1): Linear(\n"
        "          in_features=10, out_features=10, bias=True\n"
        "          #params: 0.11K, #flops: 100, #acts: 10\n"
        "        )\n"
        "        (d2): ReLU()\n"
        "      )\n"
        "    )\n"
        "  )\n"
        "  (a2): A2(\n"
        "    #params: 0.22K, #flops: 0.2K, #acts: 20\n"
        "    (b1): A2B1(\n"
        "      #params: 0.22K, #flops: 0.2K, #acts: 20\n"
        "      (c1): Linear(\n"
        "        in_features=10, out_features=10, bias=True\n"
        "        #params: 0.11K, #flops: 100, #acts: 10\n"
        "      )\n"
        "      (c2): Linear(\n"
        "        in_features=10, out_features=10, bias=True\n"
        "        #params: 0.11K, #flops: 100, #acts: 10\n"
        "      )\n"
        "    )\n"
        "  )\n"
        ")"
    )
    # in the default "owner" mode A1B1C1 owns d1's flops: no N/A
    assert "N/A" not in flop_count_str(FlopCountAnalysis(model, x))


# the analyses passed in ------------------------------------------------------------------------
def _settings(analysis: modelmeter.ModelAnalysis) -> tuple[bool, bool, str]:
    return analysis._warn_unsupported, analysis._warn_uncalled, analysis.session.tracer_warnings_mode


@pytest.mark.parametrize("printer", [flop_count_table, flop_count_str])
def test_printers_leave_warning_settings_alone(printer: Callable[..., str], caplog: pytest.LogCaptureFixture) -> None:
    model, x = WithMean(), torch.randn(2, 4)
    flops = FlopCountAnalysis(model, x).tracer_warnings("all")
    acts = ActivationCountAnalysis(model, x)
    before = _settings(flops), _settings(acts)
    with caplog.at_level(logging.WARNING, logger="modelmeter"):
        printer(flops, activations=acts)
    assert caplog.records == []  # the printers themselves are quiet
    assert (_settings(flops), _settings(acts)) == before
    with caplog.at_level(logging.WARNING, logger="modelmeter"):
        assert flops.total() == 32  # Linear(4, 4) on 2 rows: 2 * 4 * 4
    assert "Unsupported operator modelmeter_test::blur encountered 1 time(s)" in caplog.text


def test_flop_count_table_runs_the_model_once(recordings: list[Any]) -> None:
    model, x = TestModel(), _image()
    flops, acts = FlopCountAnalysis(model, x), ActivationCountAnalysis(model, x)
    flop_count_table(flops, activations=acts)
    flop_count_str(flops, activations=acts)
    assert acts.total() == 1010 and flops.total() == 13000
    assert len(recordings) == 1
    assert acts.trace is flops.trace


def test_other_inputs_get_their_own_run() -> None:
    model = TestModel()
    flops, acts = FlopCountAnalysis(model, _image()), ActivationCountAnalysis(model, torch.randn(2, 3, 10, 10))
    assert flop_count_table(flops, activations=acts, show_param_shapes=False).splitlines()[2:] == [
        "| model    | 10.05K        | 13K      | 2.02K          |",  # two images: twice the activations
        "|  fc      |  10.01K       |  10K     |  20            |",
        "|  conv    |  40           |  3K      |  2K            |",
    ]
    assert acts.trace is not flops.trace


# render ----------------------------------------------------------------------------------------
def test_formats() -> None:
    assert FORMATS == ("table", "markdown", "json", "csv", "tree")
    result = _test_model_result()
    with pytest.raises(ValueError, match="table, markdown, json, csv, tree"):
        render(result, "html")
    with pytest.raises(ValueError, match="depth"):
        render(result, "table", depth=-1)


def test_render_table_golden() -> None:
    assert render(_test_model_result()) == (
        "module  type       #params  #flops  %flops  #activations  %activations\n"
        "------  ---------  -------  ------  ------  ------------  ------------\n"
        "model   TestModel   10.05K     13K  100.0%         1.01K        100.0%\n"
        "  fc    Linear      10.01K     10K   76.9%         0.01K          1.0%\n"
        "  conv  Conv2d       0.04K      3K   23.1%            1K         99.0%\n"
        "  act   ReLU             0       0    0.0%             0          0.0%"
    )


def test_render_markdown_golden() -> None:
    assert render(_test_model_result(), "markdown") == (
        "| module   | type      |   #params |   #flops |   %flops |   #activations |   %activations |\n"
        "|:---------|:----------|----------:|---------:|---------:|---------------:|---------------:|\n"
        "| model    | TestModel |    10.05K |      13K |   100.0% |          1.01K |         100.0% |\n"
        "|   fc     | Linear    |    10.01K |      10K |    76.9% |          0.01K |           1.0% |\n"
        "|   conv   | Conv2d    |     0.04K |       3K |    23.1% |             1K |          99.0% |\n"
        "|   act    | ReLU      |         0 |        0 |     0.0% |              0 |           0.0% |"
    )


def test_render_tree_golden() -> None:
    assert render(_test_model_result(), "tree") == (
        "TestModel(\n"
        "  #params: 10.05K, #flops: 13K, #activations: 1.01K\n"
        "  (fc): Linear(#params: 10.01K, #flops: 10K, #activations: 10)\n"
        "  (conv): Conv2d(#params: 40, #flops: 3K, #activations: 1K)\n"
        "  (act): ReLU()\n"
        ")"
    )


def test_render_csv_golden_and_sums() -> None:
    text = render(_test_model_result(), "csv")
    assert text == (
        "name,type,depth,params,flops,activations,flops_share,activations_share\n"
        ",TestModel,0,10050,13000,1010,1.000000,1.000000\n"
        "fc,Linear,1,10010,10000,10,0.769231,0.009901\n"
        "conv,Conv2d,1,40,3000,1000,0.230769,0.990099\n"
        "act,ReLU,1,0,0,0,0.000000,0.000000"
    )
    rows = list(csv.DictReader(io.StringIO(text)))
    root, children = rows[0], [r for r in rows if r["depth"] == "1"]
    for column in ("params", "flops", "activations"):
        assert sum(int(r[column]) for r in children) == int(root[column])
    for column in ("flops_share", "activations_share"):
        assert sum(float(r[column]) for r in children) == pytest.approx(1.0, abs=1e-5)


def test_render_csv_has_every_module_regardless_of_depth() -> None:
    result = _caller_result()
    rows = list(csv.DictReader(io.StringIO(render(result, "csv", depth=0))))
    assert [r["name"] for r in rows] == [m.name for m in result.modules]
    assert max(int(r["depth"]) for r in rows) == 4


def test_render_json_round_trip() -> None:
    model, x = TestModel(), _image()
    flops = FlopCountAnalysis(model, x)
    acts = ActivationCountAnalysis(model, x, trace=flops.trace)
    result = build_result(model, {"flops": flops, "activations": acts})
    text = render(result, "json")
    assert text == result.to_json()
    back = Result.from_json(text)
    assert back == result
    assert back.total("flops") == flops.total() == 13000
    assert back.total("activations") == acts.total() == 1010
    data = json.loads(text)
    assert data["schema_version"] == 1 and data["metrics"] == ["flops", "activations"]
    assert data["inputs"] == [{"shape": [1, 3, 10, 10], "dtype": "float32"}]
    assert data["modules"][1] == {"name": "fc", "type": "Linear", "params": 10010,
                                  "metrics": {"flops": 10000, "activations": 10},
                                  "by_operator": {"flops": {"linear": 10000}, "activations": {"linear": 10}},
                                  "called": True, "output_shapes": {"1x10": 1}}


def test_shares() -> None:
    result = _test_model_result()
    assert result.share("fc", "flops") == pytest.approx(10000 / 13000)
    assert result.share("conv", "activations") == pytest.approx(1000 / 1010)
    assert sum(result.share(m.name, "flops") for m in result.children("")) == pytest.approx(1.0)


def test_render_depth_limits() -> None:
    result = _caller_result()
    assert render(result, "table", depth=0).splitlines()[2:] == [
        "model   TestNet    0.33K    0.3K  100.0%            30        100.0%",
    ]
    assert render(result, "tree", depth=1) == (
        "TestNet(\n"
        "  #params: 0.33K, #flops: 0.3K, #activations: 30\n"
        "  (a1): A1(#params: 0.11K, #flops: 100, #activations: 10)\n"
        "  (a2): A2(#params: 0.22K, #flops: 0.2K, #activations: 20)\n"
        ")"
    )
    assert len(render(result, "markdown", depth=2).splitlines()) == 2 + 5


def test_render_uncalled_is_na() -> None:
    result = _caller_result()
    note = ("N/A indicates a possibly missing statistic due to how the module was called. "
            "Missing values are still included in the parent's total.")
    assert render(result, "table") == (
        "module          type     #params  #flops  %flops  #activations  %activations\n"
        "--------------  -------  -------  ------  ------  ------------  ------------\n"
        "model           TestNet    0.33K    0.3K  100.0%            30        100.0%\n"
        "  a1            A1         0.11K    0.1K   33.3%            10         33.3%\n"
        "    a1.b1       A1B1       0.11K    0.1K   33.3%            10         33.3%\n"
        "      a1.b1.c1  A1B1C1     0.11K     N/A     N/A           N/A           N/A\n"
        "  a2            A2         0.22K    0.2K   66.7%            20         66.7%\n"
        "    a2.b1       A2B1       0.22K    0.2K   66.7%            20         66.7%\n"
        "      a2.b1.c1  Linear     0.11K    0.1K   33.3%            10         33.3%\n"
        "      a2.b1.c2  Linear     0.11K    0.1K   33.3%            10         33.3%\n"
        "\n" + note
    )
    assert "|       a1.b1.c1 | A1B1C1  |     0.11K |      N/A |      N/A |            N/A |            N/A |" in (
        render(result, "markdown"))
    tree = render(result, "tree")
    assert tree.startswith(note + "\nTestNet(\n")
    assert "      (c1): A1B1C1(#params: 0.11K, #flops: N/A, #activations: N/A)\n" in tree
    assert note not in render(result, "table", depth=2)  # the uncalled module is not shown


def _handmade() -> Result:
    """Hand-built: body.0 1.5M + body.1 0.5M flops = body 2M; the model 2.5M (0.5M ran in the uncalled head)."""
    return Result(
        model="Net", inputs=[{"shape": [2, 8], "dtype": "float32"}], metrics=["flops"],
        modules=[
            ModuleRow("", "Net", 1200, {"flops": 2_500_000}, {"flops": {"linear": 2_500_000}}),
            ModuleRow("body", "Sequential", 1200, {"flops": 2_000_000}, {"flops": {"linear": 2_000_000}}),
            ModuleRow("body.0", "Linear", 1000, {"flops": 1_500_000}, {"flops": {"linear": 1_500_000}}),
            ModuleRow("body.1", "Linear", 200, {"flops": 500_000}, {"flops": {"linear": 500_000}}),
            ModuleRow("head", "Head", 0, {"flops": 0}, {"flops": {}}, called=False),
        ],
        unsupported={"aten::mean": 1, "aten::add": 3}, assumptions=["x.item() read as 1"],
    )


def test_render_footer_golden() -> None:
    result = _handmade()
    assert render(result, "table", depth=1) == (
        "module  type        #params  #flops  %flops\n"
        "------  ----------  -------  ------  ------\n"
        "model   Net            1.2K    2.5M  100.0%\n"
        "  body  Sequential     1.2K      2M   80.0%\n"
        "  head  Head              0     N/A     N/A\n"
        "\n"
        "N/A indicates a possibly missing statistic due to how the module was called. "
        "Missing values are still included in the parent's total.\n"
        "Unsupported operators (not counted): aten::add (3 calls), aten::mean (1 call)\n"
        "Assumption: x.item() read as 1"
    )
    assert render(result, "markdown") == (
        "| module     | type       |   #params |   #flops |   %flops |\n"
        "|:-----------|:-----------|----------:|---------:|---------:|\n"
        "| model      | Net        |      1.2K |     2.5M |   100.0% |\n"
        "|   body     | Sequential |      1.2K |       2M |    80.0% |\n"
        "|     body.0 | Linear     |        1K |     1.5M |    60.0% |\n"
        "|     body.1 | Linear     |      0.2K |     0.5M |    20.0% |\n"
        "|   head     | Head       |         0 |      N/A |      N/A |\n"
        "\n"
        "- N/A indicates a possibly missing statistic due to how the module was called. "
        "Missing values are still included in the parent's total.\n"
        "- Unsupported operators (not counted): `aten::add` (3 calls), `aten::mean` (1 call)\n"
        "- Assumption: x.item() read as 1"
    )
    assert render(result, "csv").splitlines()[1:] == [
        ",Net,0,1200,2500000,1.000000",
        "body,Sequential,1,1200,2000000,0.800000",
        "body.0,Linear,2,1000,1500000,0.600000",
        "body.1,Linear,2,200,500000,0.200000",
        "head,Head,1,0,0,0.000000",
    ]


def test_unsupported_operators_from_a_real_run() -> None:
    model, x = WithMean(), torch.randn(2, 4)
    flops = FlopCountAnalysis(model, x).unsupported_ops_warnings(False)
    result = build_result(model, {"flops": flops})
    assert result.unsupported == {"modelmeter_test::blur": 1}
    assert render(result).endswith("\n\nUnsupported operators (not counted): modelmeter_test::blur (1 call)")


def test_csv_keeps_fractions_exact() -> None:
    result = _handmade()
    result.modules[3].metrics["flops"] = 0.5
    assert render(result, "csv").splitlines()[4] == "body.1,Linear,2,200,0.5,0.000000"


def test_exports() -> None:
    for name in ("Result", "render"):
        assert name in modelmeter.__all__
        assert getattr(modelmeter, name) is getattr(modelmeter.reports, name)
    for name in ("flop_count_table", "flop_count_str", "parameter_count_table"):  # adapters above the reports
        assert name in modelmeter.__all__
        assert getattr(modelmeter, name) is getattr(modelmeter.fvcore_api, name)
    assert "build_result" in modelmeter.__all__ and modelmeter.build_result is modelmeter.analysis.build_result


def _named_result(name: str, type_name: str = "Linear") -> Result:
    """A result of one child module named ``name`` (as a model or an edited file can name it)."""
    metrics = ["flops"]
    rows = [ModuleRow("", "Net", 20, {"flops": 32}), ModuleRow(name, type_name, 20, {"flops": 32})]
    return Result(model="Net", inputs=[], metrics=metrics, modules=rows, unsupported={"aten::x\x1b[2J": 1})


@pytest.mark.parametrize("fmt", ["table", "markdown", "tree"])
def test_control_characters_in_names_cannot_break_a_table_or_drive_the_terminal(fmt: str) -> None:
    """A newline or an escape sequence in a module's, a class's or an operator's name is printed as its escape:
    each row stays one line, and the terminal is sent no escape character."""
    text = render(_named_result("a\nb\x1b[31m", "Lin\rear"), fmt)
    assert "\x1b" not in text and "\r" not in text
    assert "a\\nb\\x1b[31m" in text and "Lin\\rear" in text
    assert len(text.splitlines()) == len(render(_named_result("ab", "Linear"), fmt).splitlines())
    if fmt != "tree":
        assert "aten::x\\x1b[2J" in text


def test_the_header_line_prints_a_models_name_escaped() -> None:
    from modelmeter.cli.output import header_line

    result = _named_result("ab")
    result.model = "Net\x1b[2J\n"
    line = header_line(result, backward=False)
    assert "\x1b" not in line and "\n" not in line and line.startswith("Net\\x1b[2J\\n on input")


def test_a_pipe_in_a_name_ends_no_markdown_cell() -> None:
    lines = render(_named_result("a|b"), "markdown").splitlines()
    assert "a\\|b" in lines[3]
    assert lines[3].replace("\\|", "").count("|") == lines[0].count("|")


def test_names_are_kept_exactly_in_json_and_csv() -> None:
    """The data formats keep a name as it is (JSON escapes it, CSV quotes it)."""
    result = _named_result("a\nb|c\x1b")
    assert json.loads(render(result, "json"))["modules"][1]["name"] == "a\nb|c\x1b"
    assert list(csv.reader(io.StringIO(render(result, "csv"))))[2][0] == "a\nb|c\x1b"


@pytest.mark.parametrize(("text", "error", "message"), [
    ('{"flops": NaN}', ValueError, "NaN is not a value a result holds"),
    ("[" * 100_000 + "]" * 100_000, ValueError, "nested too deeply"),
    ("[]", ValueError, "a result is a JSON object, got list"),
    ('{"schema_version": true}', ValueError, "unsupported result schema_version True"),
])
def test_from_json_refuses_what_no_result_holds(text: str, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        Result.from_json(text)


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d["modules"][1]["metrics"].update(flops="12"), "module 'a' of the result: flops is '12', not a number"),
    (lambda d: d["modules"][1]["metrics"].update(flops=-1), "flops is -1, not a number from 0 to 1e\\+30"),
    (lambda d: d["modules"][1]["by_operator"].update(flops={"aten::mm": 1e31}), "by_operator 'flops': aten::mm is"),
    (lambda d: d["modules"][1].update(params=1.5), "params is a float, not a int"),
    (lambda d: d["modules"][1].update(colour=1), "module 'a' of the result has unknown fields: 'colour'"),
    (lambda d: d["modules"].reverse(), "the result's first module row must be the model's"),
    (lambda d: d.update(unsupported=[]), "the result: unsupported is a list, not a dict"),
])
def test_from_dict_refuses_a_result_edited_by_hand(change: Callable[[dict[str, Any]], None], message: str) -> None:
    """What it reads is rendered as it is: a cost that is no number, or negative, was a traceback in a renderer
    (or printed); now it is one ValueError naming the module."""
    data = _named_result("a").to_dict()
    assert Result.from_dict(json.loads(json.dumps(data))) == _named_result("a")  # the round trip it must keep
    change(data)
    with pytest.raises((ValueError, TypeError), match=message):  # TypeError for an unknown field, as documented
        Result.from_dict(data)


def test_wide_and_combining_characters_keep_the_table_aligned() -> None:
    """A name of wide characters (CJK, emoji: two terminal columns each) or with combining accents (none) is
    padded by the columns it takes, so the columns after it stay aligned."""
    for name in ("模型😀", "e\u0301te\u0301", "ab"):
        lines = render(_named_result(name), "table").splitlines()
        ends = {text_width(line[:line.index("Linear" if "Linear" in line else "Net")]) for line in lines[2:4]}
        assert len(ends) == 1, lines
