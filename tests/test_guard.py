"""The cost guard: budgets, baselines (one or many models), their comparison, and diffs — library and command."""

from __future__ import annotations

import json
import math
import re
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from modelmeter import analyze
from modelmeter.cli import main
from modelmeter.cli.job import Job, analyse
from modelmeter.cli.job import job_argv as _job_argv
from modelmeter.cli.job import job_from_args as cli_job
from modelmeter.cli.options import build_parser
from modelmeter.errors import ModelMeterError
from modelmeter.guard import (
    BaselineFile,
    BaselineMismatch,
    CostAssertionError,
    assert_cost,
    check_budget,
    compare,
    diff,
    entry_from_result,
    load_costs,
    parse_budget,
    parse_quantity,
    render_diff,
)
from modelmeter.guard.specs import check_spec
from modelmeter.guard.values import MAX_FILE_BYTES, GuardFileError
from modelmeter.reports.render import format_bytes

MODEL_FILE = textwrap.dedent("""
    import torch
    from torch import nn

    def build(extra: int = 0, batch: int = 2):
        layers = [nn.Linear(16, 32), nn.ReLU(), *(nn.Linear(32, 32) for _ in range(int(extra))), nn.Linear(32, 4)]
        return nn.Sequential(*layers), torch.randn(int(batch), 16)
""")


def mlp(extra: int = 0) -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), *(nn.Linear(32, 32) for _ in range(extra)), nn.Linear(32, 4))


def entry(model: nn.Module, x: torch.Tensor, **options: object):  # type: ignore[no-untyped-def]
    return entry_from_result(analyze(model, x, quiet=True, **options).result())  # type: ignore[arg-type]


# --- quantities and budgets -------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "value"), [
    ("4.2G", 4.2e9), ("26M", 26e6), ("12m", 12e6), ("1500", 1500), ("2GiB", 2 * 2**30), ("1.5kib", 1536),
    ("3e9", 3e9), ("0.5T", 5e11), ("64KB", 64_000),
])
def test_quantities(text: str, value: float) -> None:
    assert parse_quantity(text) == pytest.approx(value)


@pytest.mark.parametrize("bad", ["", "G", "4.2X", "-1M", "flops"])
def test_bad_quantities_are_named(bad: str) -> None:
    with pytest.raises(ValueError, match="not a quantity"):
        parse_quantity(bad)


def test_budget_lists_what_is_over_and_by_how_much() -> None:
    result = analyze(mlp(), torch.randn(2, 16), quiet=True).result()
    assert parse_budget("flops=1K, params=100") == {"flops": 1000, "params": 100}
    over = check_budget(result, parse_budget("flops=1K,params=1M,activations=72"))
    assert [o.metric for o in over] == ["flops"]  # 2·16·32 + 2·32·4 = 1280 > 1000; activations 72 is not over
    assert str(over[0]) == "flops: 1.28K (1,280) is over the budget of 1K (1,000) by 0.28K (+28.0%)"
    with pytest.raises(ValueError, match="no metric 'peak_memory'.*memory analysis"):
        check_budget(result, {"peak_memory": 2**31})
    with pytest.raises(ValueError, match="need --backward"):
        check_budget(result, {"backward_flops": 1})
    with pytest.raises(ValueError, match="metric=amount"):
        parse_budget("flops")


# --- comparing with a baseline ----------------------------------------------------------------------------
def test_a_model_that_grows_by_one_layer_fails_naming_the_module() -> None:
    x = torch.randn(2, 16)
    comparison = compare("mlp", entry(mlp(), x), entry(mlp(extra=1), x))
    assert not comparison.ok
    grown = {(c.module, c.metric) for c in comparison.grew}
    assert ("", "flops") in grown and ("2", "flops") in grown and ("2", "params") in grown
    assert comparison.grew[0].module == ""  # the model first, then modules by size of change
    assert comparison.added == ["3"]
    report = comparison.report()
    assert "over its baseline" in report
    assert "module '2': flops 0.256K (256) -> 2.048K (2,048) (+1,792, +700.0%)" in report


def test_within_tolerance_passes_and_shrinking_is_a_note() -> None:
    x = torch.randn(2, 16)
    before, after = entry(mlp(), x), entry(mlp(), x)
    after.modules[""]["flops"] = before.modules[""]["flops"] * 1.009
    assert compare("mlp", before, after, tolerance=0.01).ok
    assert not compare("mlp", before, after, tolerance=0.005).ok
    after.modules[""]["flops"] = before.modules[""]["flops"] * 0.5
    smaller = compare("mlp", before, after, tolerance=0.01)
    assert smaller.ok and smaller.shrank and "save the baseline again" in smaller.report()
    with pytest.raises(ValueError, match="tolerance"):
        compare("mlp", before, after, tolerance=-1)


@pytest.mark.parametrize(("changed", "message"), [
    ({"x": torch.randn(4, 16)}, "inputs 2x16 float32, this run has 4x16 float32"),
    ({"convention": "macs"}, "convention 'fvcore', this run has 'macs'"),
    ({"backward": True}, "backward pass False, this run has True"),
])
def test_runs_that_are_not_comparable_are_a_mismatch(changed: dict[str, object], message: str) -> None:
    x = changed.pop("x", torch.randn(2, 16))
    assert isinstance(x, torch.Tensor)
    with pytest.raises(BaselineMismatch, match=message):
        compare("mlp", entry(mlp(), torch.randn(2, 16)), entry(mlp(), x, **changed))


def test_baseline_file_keeps_several_models_and_is_stable(tmp_path: Path) -> None:
    path = tmp_path / "costs" / "baseline.json"
    baselines = BaselineFile({"a": entry(mlp(), torch.randn(2, 16)), "b": entry(mlp(1), torch.randn(3, 16))})
    baselines.save(path)
    text = path.read_text()
    data = json.loads(text)
    assert data["format"] == "modelmeter-baseline" and data["schema_version"] == 1
    assert set(data["models"]) == {"a", "b"} and "seconds" not in text and "torch" in data
    again = BaselineFile.load(path)
    assert again.entries == baselines.entries
    again.save(path)
    assert path.read_text() == text  # byte-stable
    with pytest.raises(BaselineMismatch, match="no entry 'c'.*entries: a, b"):
        again.entry("c", path)
    (tmp_path / "other.json").write_text('{"format": "something else"}')
    with pytest.raises(ModelMeterError, match="not a modelmeter baseline"):
        BaselineFile.load(tmp_path / "other.json")
    with pytest.raises(ModelMeterError, match="no baseline file"):
        BaselineFile.load(tmp_path / "missing.json")


def test_diff_of_two_saved_analyses(tmp_path: Path) -> None:
    x = torch.randn(2, 16)
    for name, model in (("a", mlp()), ("b", mlp(extra=2))):
        (tmp_path / f"{name}.json").write_text(analyze(model, x, quiet=True).result().to_json())
    differences = diff(load_costs(tmp_path / "a.json"), load_costs(tmp_path / "b.json"))
    changes = [abs(d.change) for d in differences]
    assert changes == sorted(changes, reverse=True)
    assert (differences[0].module, differences[0].metric, differences[0].change) == ("", "flops", 2 * 2 * 32 * 32)
    assert diff(load_costs(tmp_path / "a.json"), load_costs(tmp_path / "a.json")) == []


def test_a_diff_of_unrelated_analyses_says_what_it_cannot_compare(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """FLOPs of another convention, and a metric only one file holds (a time without a device is no time of
    0s), are said in notes; such a metric gets no row."""
    x = torch.randn(2, 16)
    files = {"fvcore": analyze(mlp(), x, quiet=True), "macs": analyze(mlp(), x, convention="macs", quiet=True),
             "h100": analyze(mlp(), x, device="h100", quiet=True)}
    for name, analysis in files.items():
        (tmp_path / f"{name}.json").write_text(analysis.result().to_json())
    path = {name: str(tmp_path / f"{name}.json") for name in files}
    assert main(["diff", path["fvcore"], path["macs"]]) == 0
    out, err = capsys.readouterr()
    assert "note: the FLOPs are counted in different conventions (fvcore before, macs after)" in err
    assert main(["diff", path["fvcore"], path["h100"]]) == 0
    out, err = capsys.readouterr()
    assert "note: not compared, only the after file has them: bytes, time" in err
    assert out.strip() == "no differences"  # the same model: no row of a time "from 0s"
    assert {d.metric for d in diff(load_costs(path["h100"]), load_costs(path["fvcore"]))} == set()
    assert main(["diff", path["fvcore"], path["fvcore"]]) == 0
    assert "note" not in capsys.readouterr().err


# --- the command ------------------------------------------------------------------------------------------
def cli(capsys: pytest.CaptureFixture[str], *argv: str, code: int = 0) -> tuple[str, str]:
    status = main([*argv, "--no-cache", "--depth", "0"])
    out, err = capsys.readouterr()
    assert status == code, f"exit {status}, stderr: {err}"
    return out, err


@pytest.fixture
def model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory holding ``m.py`` (MODEL_FILE), so ``m.py:build`` names the model."""
    monkeypatch.chdir(tmp_path)
    Path("m.py").write_text(MODEL_FILE)
    return tmp_path


@pytest.mark.usefixtures("model_dir")
def test_command_saves_checks_and_names_what_grew(capsys: pytest.CaptureFixture[str]) -> None:
    cli(capsys, "m.py:build", "--save-baseline", "costs.json")
    cli(capsys, "resnet18", "--resolution", "32", "--save-baseline", "costs.json")
    assert set(BaselineFile.load("costs.json").entries) == {"m.py:build", "resnet18"}
    _, err = cli(capsys, "m.py:build", "--check-baseline", "costs.json")
    assert "m.py:build: within its baseline" in err
    _, err = cli(capsys, "m.py:build", "extra=1", "--name", "m.py:build", "--check-baseline", "costs.json", code=1)
    assert "grew   module '2': flops" in err and "new modules: 3" in err
    _, err = cli(capsys, "m.py:build", "batch=4", "--name", "m.py:build", "--check-baseline", "costs.json",
                 code=2)
    assert "recorded with inputs 2x16 float32, this run has 4x16 float32" in err
    _, err = cli(capsys, "m.py:build", "--convention", "macs", "--check-baseline", "costs.json", code=2)
    assert "convention 'fvcore'" in err
    out, _ = cli(capsys, "--check-baseline", "costs.json", "--jobs", "1")  # every model of the file
    assert "m.py:build: within its baseline" in out and "resnet18: within its baseline" in out


@pytest.mark.usefixtures("model_dir")
def test_command_check_all_fails_when_one_model_grew(capsys: pytest.CaptureFixture[str]) -> None:
    cli(capsys, "m.py:build", "--save-baseline", "costs.json")
    Path("m.py").write_text(MODEL_FILE.replace("range(int(extra))", "range(int(extra) + 1)"))
    out, _ = cli(capsys, "--check-baseline", "costs.json", "--tolerance", "1%", "--jobs", "1", code=1)
    assert "m.py:build: over its baseline (tolerance 1.00%)" in out and "module '2'" in out


@pytest.mark.parametrize("width", [40, 45, 52, 200])
def test_a_diff_fits_the_width_leaving_out_the_exact_change_first(tmp_path: Path, width: int) -> None:
    x = torch.randn(2, 16)
    for name, model in (("a", mlp()), ("b", mlp(extra=2))):
        (tmp_path / f"{name}.json").write_text(analyze(model, x, quiet=True).result().to_json())
    differences = diff(load_costs(tmp_path / "a.json"), load_costs(tmp_path / "b.json"))
    full = render_diff(differences).splitlines()
    lines = render_diff(differences, width=width).splitlines()
    if max(map(len, full)) <= width:
        assert lines == full
        return
    header = lines[0].split()
    assert header[:2] == ["module", "metric"] and header[-2:] in (["after", "%"], ["change", "%"])
    assert "change" not in header  # the exact change goes first, then the value before
    assert max(map(len, lines)) <= max(width, len(lines[1]))  # a narrow width keeps module, metric, after, %
    assert " ".join(lines[-2:]).startswith(f"(left out to fit {width} characters: change")
    rows = [line.split() for line in lines[1:len(differences) + 1]]
    assert [row[-1] for row in rows] == [line.split()[-1] for line in full[1:len(differences) + 1]]


@pytest.mark.usefixtures("model_dir")
def test_command_budget_and_diff(capsys: pytest.CaptureFixture[str]) -> None:
    cli(capsys, "m.py:build", "--budget", "flops=2K,params=1M")
    _, err = cli(capsys, "m.py:build", "--budget", "flops=1K,params=100", code=1)
    assert "over budget: m.py:build: flops: 1.28K" in err and "params: 0.676K" in err
    cli(capsys, "m.py:build", "--budget", "peak_memory=2GiB")  # turns the memory analysis on; well under
    cli(capsys, "m.py:build", "--budget", "flops=lots", code=2)
    cli(capsys, "m.py:build", "--format", "json", "--output", "a.json")
    cli(capsys, "m.py:build", "extra=2", "--format", "json", "--output", "b.json")
    out, _ = cli(capsys, "diff", "a.json", "b.json")
    assert out.splitlines()[1].split()[:2] == ["(model)", "flops"]
    data = json.loads(cli(capsys, "diff", "a.json", "b.json", "--format", "json")[0])
    assert data[0] == {"module": "", "metric": "flops", "before": 1280, "after": 1280 + 2 * 2 * 32 * 32,
                       "change": 2 * 2 * 32 * 32}
    cli(capsys, "diff", "a.json", code=2)
    cli(capsys, "diff", "a.json", "missing.json", code=2)


@pytest.mark.usefixtures("model_dir")
def test_a_passing_budget_says_what_it_checked(capsys: pytest.CaptureFixture[str]) -> None:
    # MODEL_FILE's model: 1,280 flops and 676 parameters (hand-counted in test_command_budget_and_diff)
    _, err = cli(capsys, "m.py:build", "--budget", "params=1M,flops=1280")
    assert err.splitlines()[-1] == "modelmeter: within budget: m.py:build: params 0.676K ≤ 1M, flops 1.28K ≤ 1.28K"
    _, err = cli(capsys, "m.py:build", "--name", "small", "--budget", "activations=1K")
    assert err.splitlines()[-1].startswith("modelmeter: within budget: small: activations ")
    _, err = cli(capsys, "m.py:build", "--budget", "flops=1279,params=1M", code=1)
    assert "within budget" not in err and "over budget: m.py:build: flops: 1.28K (1,280)" in err


# --- memory budgets -----------------------------------------------------------------------------------------
def test_memory_budgets_in_binary_units_with_a_hint() -> None:
    result = analyze(mlp(), torch.randn(2, 16), quiet=True).result()
    with pytest.raises(ValueError, match=r"memory analysis: --memory; analyze\(\.\.\., memory=True\)\)"):
        check_budget(result, {"activation_bytes": 1})
    with pytest.raises(ValueError, match="--memory, and --backward for saved_bytes"):
        check_budget(result, {"saved_bytes": 1, "peak_memory": 1})
    # activations: 2x32 (linear) + 2x32 (relu, not in place) + 2x4 (linear) = 136 float32 = 544 bytes
    memory = analyze(mlp(), torch.randn(2, 16), quiet=True, memory=True).result()
    assert memory.total("activation_bytes") == 544
    over = check_budget(memory, parse_budget("activation_bytes=500,flops=1K"))
    assert [str(o) for o in over] == [
        "activation_bytes: 544B (544 bytes) is over the budget of 500B (500 bytes) by 44B (+8.8%)",
        "flops: 1.28K (1,280) is over the budget of 1K (1,000) by 0.28K (+28.0%)"]


def test_peak_memory_budget_is_the_runs_peak_even_in_the_optimizers_step() -> None:
    result = analyze(mlp(), torch.randn(2, 16), quiet=True, memory=True, backward=True, optimizer="adamw",
                     foreach=True).result()
    assert result.memory["phase"] == "optimizer"  # the step's temporaries: outside every module
    peak = result.memory["peak"]
    assert check_budget(result, {"peak_memory": peak}) == []
    (over,) = check_budget(result, {"peak_memory": peak - 2048})
    assert (over.value, str(over).split(" is over")[0]) == (peak, f"peak_memory: {format_bytes(peak)} ({peak:,} bytes)")
    assert str(over).endswith(f"by 2KiB (+{100 * 2048 / (peak - 2048):.1f}%)")


@pytest.mark.usefixtures("model_dir")
def test_command_keeps_the_memory_options_in_the_baseline(capsys: pytest.CaptureFixture[str]) -> None:
    cli(capsys, "m.py:build", "--optimizer", "adamw", "--state-dtype", "bfloat16", "--foreach",
        "--save-baseline", "costs.json")
    entry = BaselineFile.load("costs.json").entries["m.py:build"]
    assert entry.spec[-6:] == ["--memory", "--optimizer", "adamw", "--state-dtype", "bfloat16", "--foreach"]
    assert "--backward" in entry.spec and entry.total("peak_memory") > 0
    out, _ = cli(capsys, "--check-baseline", "costs.json", "--jobs", "1")
    assert "m.py:build: within its baseline" in out


# --- nothing fools a guard: tolerances and budgets ------------------------------------------------------------
@pytest.mark.parametrize("tolerance", ["nan", "NaN%", "inf", "-inf", "1e400%", "-1", "-0.5%", "1e999"])
def test_a_tolerance_that_is_not_finite_or_is_negative_is_refused(capsys: pytest.CaptureFixture[str],
                                                                   tolerance: str) -> None:
    _, err = cli(capsys, "resnet18", "--check-baseline", "costs.json", f"--tolerance={tolerance}", code=2)
    assert f"argument --tolerance: not a tolerance: '{tolerance}' (a finite number >= 0" in err


@pytest.mark.usefixtures("model_dir")
def test_a_nan_tolerance_never_passes_a_model_that_grew(capsys: pytest.CaptureFixture[str]) -> None:
    """The oracle: the model grew by a hand-counted 2·32·32 = 2048 FLOPs (+160%), its last Linear from 2·32·4
    to 2·32·32 FLOPs (+700%): below 700% the check fails, above it passes; NaN (false in every comparison)
    is refused instead of passing."""
    cli(capsys, "m.py:build", "--save-baseline", "costs.json")
    grown = ("m.py:build", "extra=1", "--name", "m.py:build", "--check-baseline", "costs.json")
    _, err = cli(capsys, *grown, "--tolerance", "699%", code=1)
    assert "module '2': flops 0.256K (256) -> 2.048K (2,048) (+1,792, +700.0%)" in err and "the model" not in err
    _, err = cli(capsys, *grown, "--tolerance", "159%", code=1)
    assert "the model: flops 1.28K (1,280) -> 3.328K (3,328) (+2,048, +160.0%)" in err
    cli(capsys, *grown, "--tolerance", "701%")
    cli(capsys, *grown, "--tolerance", "nan", code=2)


@pytest.mark.parametrize("tolerance", [math.nan, math.inf, -0.01, -math.inf])
def test_compare_and_assert_cost_refuse_a_bad_tolerance_naming_it(tmp_path: Path, tolerance: float) -> None:
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="tolerance must be a finite number >= 0"):
        compare("mlp", entry(mlp(), x), entry(mlp(extra=1), x), tolerance)
    path = tmp_path / "costs.json"
    assert_cost(mlp(), x, path, update=True)
    with pytest.raises(ValueError, match="tolerance must be a finite number >= 0"):
        assert_cost(mlp(extra=1), x, path, tolerance=tolerance)


@pytest.mark.parametrize("tolerance", ["1%", None, True, [0.1]])
def test_a_tolerance_that_is_not_a_number_is_a_type_error(tmp_path: Path, tolerance: object) -> None:
    x = torch.randn(2, 16)
    with pytest.raises(TypeError, match="tolerance must be a number"):
        compare("mlp", entry(mlp(), x), entry(mlp(), x), tolerance)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tolerance must be a number"):
        assert_cost(mlp(), x, tmp_path / "costs.json", tolerance=tolerance)  # type: ignore[arg-type]


def test_compare_refuses_entries_holding_nan_or_negative_costs() -> None:
    x = torch.randn(2, 16)
    before, after = entry(mlp(), x), entry(mlp(extra=1), x)
    before.modules[""]["flops"] = math.nan  # NaN < anything is false: the growth would pass unseen
    with pytest.raises(ValueError, match="the baseline: module '': flops must be a finite number, got nan"):
        compare("mlp", before, after)
    before.modules[""]["flops"] = -1
    with pytest.raises(ValueError, match="flops cannot be negative"):
        compare("mlp", before, after)


@pytest.mark.parametrize(("budget", "message"), [
    ("flops=1e400", "the budget of flops: out of range: '1e400' is over 1e+30"),
    ("flops=1e99999999", "the budget of flops: out of range"),  # at once: no 10**99999999 is computed
    ("flops=2e30", "out of range: '2e30' is over 1e+30"),
    ("params=9999999999999999P", "the budget of params: out of range"),
    ("flops=nan", "the budget of flops: not a quantity: 'nan'"),
    ("flops=inf", "not a quantity: 'inf'"),
    ("flops=-1G", "not a quantity: '-1G'"),
    ("flops=1G,flops=2G", "the budget names 'flops' twice"),
])
def test_a_budget_out_of_range_is_one_clear_line(capsys: pytest.CaptureFixture[str], budget: str,
                                                 message: str) -> None:
    _, err = cli(capsys, "resnet18", "--budget", budget, code=2)
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(("limit", "error", "message"), [
    (math.nan, ValueError, r"budget\['flops'\] must be a finite number, got nan"),
    (math.inf, ValueError, r"budget\['flops'\] must be a finite number, got inf"),
    (-1, ValueError, r"budget\['flops'\] cannot be negative"),
    (10**400, ValueError, r"budget\['flops'\] is out of range: \(an integer of about 401 digits\)"),
    ("4G", TypeError, r"budget\['flops'\] must be a number, got str '4G'"),
    (True, TypeError, r"budget\['flops'\] must be a number, got bool"),
])
def test_check_budget_refuses_limits_that_would_pass_everything(limit: object, error: type[Exception],
                                                                message: str) -> None:
    result = analyze(mlp(), torch.randn(2, 16), quiet=True).result()
    with pytest.raises(error, match=message):
        check_budget(result, {"flops": limit})  # type: ignore[dict-item]


# --- nothing fools a guard: broken baselines and diff inputs --------------------------------------------------
Data = dict[str, Any]


def _set(path: list[str | int], value: object) -> Callable[[Data], None]:
    def change(data: Data) -> None:
        *parents, last = path
        for key in parents:
            data = data[key]  # type: ignore[index]
        data[last] = value  # type: ignore[index]
    return change


def _drop(*path: str) -> Callable[[Data], None]:
    def change(data: Data) -> None:
        *parents, last = path
        for key in parents:
            data = data[key]
        del data[last]
    return change


def _drop_metric(metric: str) -> Callable[[Data], None]:
    def change(data: Data) -> None:
        for values in data["models"]["m.py:build"]["modules"].values():
            del values[metric]
    return change


ENTRY = ["models", "m.py:build"]
FLOPS = [*ENTRY, "modules", "", "flops"]
BROKEN_BASELINES: list[tuple[str, Callable[[Data], None] | str, str]] = [
    ("string", _set(FLOPS, "1.28K"), "module '': flops must be a number, got str '1.28K'"),
    ("null", _set(FLOPS, None), "module '': flops must be a number, got NoneType None"),
    ("bool", _set(FLOPS, True), "module '': flops must be a number, got bool True"),
    ("huge int", _set(FLOPS, 10**40), "flops is out of range: (an integer of about 41 digits) is over 1e+30"),
    ("negative", _set(FLOPS, -1280), "module '': flops cannot be negative, got -1280"),
    ("1e400", '"flops": 1e400', "module '': flops must be a finite number, got inf"),
    ("NaN", '"flops": NaN', "is not valid JSON: NaN is not a value a baseline or saved analysis holds"),
    ("Infinity", '"flops": -Infinity',
     "is not valid JSON: -Infinity is not a value a baseline or saved analysis holds"),
    ("4301 digits", '"flops": ' + "9" * 4301, "is not valid JSON: Exceeds the limit (4300 digits)"),
    ("models list", _set(["models"], []), "models must be an object, got a list"),
    ("entry list", _set(ENTRY, [1, 2]), "the entry 'm.py:build' is a list, not an object"),
    ("no modules", _drop(*ENTRY, "modules"), "the entry 'm.py:build' lacks modules"),
    ("unknown field", _set([*ENTRY, "extra"], 1), "the entry 'm.py:build' has unknown fields: extra"),
    ("module list", _set([*ENTRY, "modules", "0"], [1]), "module '0' must be an object of metric -> value, got a "
                                                          "list"),
    ("inputs string", _set([*ENTRY, "inputs"], "2x16"), "inputs must be a list, got str '2x16'"),
    ("input shape", _set([*ENTRY, "inputs", 0, "shape"], [2, -16]), "inputs[0] is not {\"shape\": [sizes]"),
    ("backward string", _set([*ENTRY, "backward"], "no"), "backward must be true or false, got str 'no'"),
    ("spec string", _set([*ENTRY, "spec"], "m.py:build"), "spec must be a list, got str 'm.py:build'"),
    ("spec numbers", _set([*ENTRY, "spec"], [1, 2]), "spec must be a list of command-line arguments (strings)"),
    ("top-level list", _set(["models"], None), "models must be an object, got null"),
    ("escape in a name", _set([*ENTRY, "modules", "\x1b[2J"], {}), "a module's name is not a printable name"),
    ("schema", _set(["schema_version"], 99), "has baseline schema 99; this modelmeter reads 1"),
    ("schema true", _set(["schema_version"], True), "has baseline schema True; this modelmeter reads 1"),
    # an edited entry whose costs would never be compared: a silent pass before
    ("no model row", _drop(*ENTRY, "modules", ""), "the entry 'm.py:build' has no module '' (the model's totals)"),
    ("no modules at all", _set([*ENTRY, "modules"], {}), "has no module '' (the model's totals)"),
    ("a metric dropped", _drop_metric("flops"), "the entry 'm.py:build': the model (module '') lacks flops"),
    ("params dropped", _drop_metric("params"), "the model (module '') lacks params"),
    ("a metric of one module", _set([*ENTRY, "modules", "0", "bogus"], 5),
     "module '0' has other metrics than the model (bogus)"),
    ("a metric missing in one module", _drop(*ENTRY, "modules", "0", "activations"),
     "module '0' has other metrics than the model (activations)"),
    ("not JSON", "{", "is not valid JSON: Expecting property name"),
    ("deep nesting", "[" * 200_000, "is nested too deeply"),
    ("not UTF-8", "\udcff", "is not a text file (not UTF-8)"),
]


def _break(path: Path, how: Callable[[Data], None] | str) -> None:
    """Apply ``how`` to the baseline in ``path``: a change of its data, or a text replacing ``"flops": 1280``
    (or the whole file, for text that is not JSON)."""
    text = path.read_text()
    if callable(how):
        data = json.loads(text)
        how(data)
        path.write_text(json.dumps(data))
    elif how == "\udcff":
        path.write_bytes(b"\xff\xfe{}")
    elif how.startswith('"flops"'):
        path.write_text(text.replace('"flops": 1280', how, 1))
    else:
        path.write_text(how)


def one_line_error(err: str, message: str) -> None:
    assert message in err, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("modelmeter: ") and "Traceback" not in err


@pytest.mark.usefixtures("model_dir")
@pytest.mark.parametrize(("label", "how", "message"), BROKEN_BASELINES, ids=[b[0] for b in BROKEN_BASELINES])
def test_a_broken_baseline_is_one_clear_line_in_every_command(capsys: pytest.CaptureFixture[str], label: str,
                                                              how: Callable[[Data], None] | str,
                                                              message: str) -> None:
    cli(capsys, "m.py:build", "--save-baseline", "costs.json")
    _break(Path("costs.json"), how)
    broken = Path("costs.json").read_bytes()
    for argv in (["m.py:build", "--check-baseline", "costs.json"], ["--check-baseline", "costs.json"],
                 ["diff", "costs.json", "costs.json"], ["m.py:build", "--save-baseline", "costs.json"]):
        _, err = cli(capsys, *argv, code=2)
        one_line_error(err, message)
        assert "costs.json" in err
    assert Path("costs.json").read_bytes() == broken  # --save-baseline did not replace what it could not read
    with pytest.raises(GuardFileError, match=re.escape(message)):
        BaselineFile.load("costs.json")
    with pytest.raises(GuardFileError, match=re.escape(message)):
        load_costs("costs.json")


@pytest.mark.usefixtures("model_dir")
def test_a_huge_file_or_a_directory_is_refused_without_reading_it(capsys: pytest.CaptureFixture[str]) -> None:
    with open("huge.json", "wb") as f:  # sparse: 65 MiB that take no disk
        f.truncate(MAX_FILE_BYTES + 2**20)
    Path("folder.json").mkdir()
    for name, message in (("huge.json", "'huge.json' is 68,157,440 bytes: too large for a baseline or saved "
                                        "analysis (at most 64 MiB)"),
                          ("folder.json", "cannot read 'folder.json': Is a directory")):
        for argv in (["m.py:build", "--check-baseline", name], ["--check-baseline", name], ["diff", name, name]):
            one_line_error(cli(capsys, *argv, code=2)[1], message)


RESULT_ROW = ["modules", 0]
BROKEN_RESULTS: list[tuple[str, Callable[[Data], None], str]] = [
    ("string", _set([*RESULT_ROW, "metrics", "flops"], "1K"), "module '': flops must be a number, got str '1K'"),
    ("null", _set([*RESULT_ROW, "metrics", "flops"], None), "module '': flops must be a number, got NoneType"),
    ("negative", _set([*RESULT_ROW, "params"], -3), "module '': params cannot be negative, got -3"),
    ("huge", _set([*RESULT_ROW, "params"], 10**31), "module '': params is out of range"),
    ("modules dict", _set(["modules"], {}), "modules must be a list of module rows"),
    ("row string", _set(RESULT_ROW, "x"), "modules[0] is not a module row (name, params, metrics)"),
    ("escape in a name", _set([*RESULT_ROW, "name"], "\x1b]0;x\x07"), "modules[0]'s name is not a printable name"),
    ("no name", _drop(*RESULT_ROW, "name"), "modules[0] is not a module row"),  # type: ignore[arg-type]
]


@pytest.mark.usefixtures("model_dir")
@pytest.mark.parametrize(("label", "how", "message"), BROKEN_RESULTS, ids=[b[0] for b in BROKEN_RESULTS])
def test_a_broken_saved_analysis_is_one_clear_line_in_diff(capsys: pytest.CaptureFixture[str], label: str,
                                                           how: Callable[[Data], None], message: str) -> None:
    cli(capsys, "m.py:build", "--format", "json", "--output", "a.json")
    _break(Path("a.json"), how)
    one_line_error(cli(capsys, "diff", "a.json", "a.json", code=2)[1], message)
    with pytest.raises(GuardFileError, match=re.escape(message)):
        load_costs("a.json")


# --- nothing fools a guard: a baseline names only its own project's models -----------------------------------
EVIL = textwrap.dedent("""
    import pathlib

    pathlib.Path({sentinel!r}).touch()  # on import

    def build():
        pathlib.Path({sentinel!r}).touch()
""")
HELPERS = "import os\nfrom subprocess import run\n\nsystem = os.system\n"


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``tmp/project`` (the working directory) with ``m.py``, ``helpers.py`` (which imports ``run`` and
    ``system``) and ``link.py`` (a link to ``tmp/evil.py``); outside it ``tmp/evil.py`` and the importable
    module ``tmp/outside/evil_outside.py``, both of which touch ``tmp/PWNED`` when imported or built."""
    root = tmp_path / "project"
    root.mkdir()
    monkeypatch.chdir(root)
    (root / "m.py").write_text(MODEL_FILE)
    (root / "helpers.py").write_text(HELPERS)
    evil = EVIL.format(sentinel=str(tmp_path / "PWNED"))
    (tmp_path / "evil.py").write_text(evil)
    (root / "link.py").symlink_to(tmp_path / "evil.py")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "evil_outside.py").write_text(evil)
    monkeypatch.syspath_prepend(str(tmp_path / "outside"))
    return root


SENTINEL = "{sentinel}"
HOSTILE_SPECS: list[tuple[list[str], str]] = [
    (["os:system", "command='touch {sentinel}'"], "the module 'os' is not in the baseline's project directory"),
    (["subprocess:run", "args=['touch', '{sentinel}']"], "the module 'subprocess' is not in the baseline's"),
    (["builtins:exec", "source='open(\"{sentinel}\", \"w\")'"], "the module 'builtins' is not in the baseline's"),
    (["evil_outside:build"], "the module 'evil_outside' is not in the baseline's project directory"),
    (["../evil.py:build"], "../evil.py is outside the baseline's project directory"),
    (["{tmp}/evil.py:build"], "/evil.py is an absolute path"),
    (["~/evil.py:build"], "~/evil.py is an absolute path"),
    (["link.py:build"], "link.py is outside the baseline's project directory"),
    (["helpers.py:run", "args=['touch', '{sentinel}']"], "helpers.py:run: a baseline may only call a function or "
                                                         "class defined in helpers.py itself"),
    (["helpers.py:system", "command='touch {sentinel}'"], "defined in helpers.py itself"),
    (["resnet18; touch {sentinel}"], "'resnet18; touch {sentinel}' is not a built-in model"),
    (["$(touch {sentinel})"], "is not a built-in model"),
    (["m.py:build && touch {sentinel}"], "the factory must be a Python name, got 'build && touch {sentinel}'"),
    (["m.py:build", "--output", "/etc/x"], "holds the option '--output', which a baseline may not hold"),
    (["m.py:build", "--save-baseline", "costs.json"], "holds the option '--save-baseline'"),
    (["m.py:build", "--check-baseline", "costs.json"], "holds the option '--check-baseline'"),
    (["m.py:build", "--out", "/etc/x"], "holds the option '--out'"),
    (["m.py:build", "-o", "/etc/x"], "holds the option '-o'"),
    (["m.py:build", "--html=/etc/x"], "holds the option '--html=/etc/x'"),
    (["m.py:build", "--", "--output"], "holds the option '--'"),
    (["resnet18", "--batch", "0"], "argument --batch: expected a positive integer, got '0'"),
    (["resnet18", "--batch"], "--batch needs a value"),
    (["m.py:build", "--dtype", "--output", "x=1"], "--dtype needs a value"),
    (["resnet18", "--convention", "evil"], "argument --convention: invalid choice: 'evil'"),
    (["resnet18", "--input", "1x3x32x32", "--batch", "2"], "--input fixes the input shapes"),
    (["torchvision:resnet18", "weights='DEFAULT'"], "torchvision option weights='DEFAULT' is not allowed in a "
                                                    "baseline: it may load weights, checkpoints or code"),
    (["timm:resnet18", "pretrained=True"], "timm option pretrained=True is not allowed"),
    (["timm:resnet18,checkpoint_path='/etc/passwd'"], "timm option checkpoint_path='/etc/passwd' is not allowed"),
    (["transformers:LlamaConfig", "auto_map={{'AutoModel': 'x.M'}}"], "transformers option auto_map="),
    (["transformers:LlamaConfig", "attn_implementation='kernels-community/x'"], "option attn_implementation="),
    (["torchvision:resnet18;touch"], "'torchvision:resnet18;touch' does not name a torchvision model"),
    (["--backward"], "its spec names no model"),
    (["cache"], "'cache' is not a built-in model"),  # the command's sub-commands are not models
    (["diff", "a.json", "b.json"], "expected key=value, got 'a.json'"),
    (["m.py:build", "key"], "expected key=value, got 'key'"),
    (["m.py:build", "x=" + "1" * 1000], "its spec is too long to be one the command wrote"),
]


@pytest.mark.parametrize(("spec", "message"), HOSTILE_SPECS, ids=[" ".join(s)[:40] for s, _ in HOSTILE_SPECS])
def test_a_baseline_cannot_make_the_command_call_what_it_likes(capsys: pytest.CaptureFixture[str], project: Path,
                                                               spec: list[str], message: str) -> None:
    """Every entry is checked before any model is built: the hostile entry is refused with exit 2, naming it,
    and nothing it names ran (the sentinel file does not exist)."""
    tmp = project.parent
    cli(capsys, "m.py:build", "--save-baseline", "costs.json")
    data = json.loads(Path("costs.json").read_text())
    hostile = [token.format(sentinel=tmp / "PWNED", tmp=tmp) for token in spec]
    data["models"]["hostile"] = {**data["models"]["m.py:build"], "spec": hostile}
    Path("costs.json").write_text(json.dumps(data))
    _, err = cli(capsys, "--check-baseline", "costs.json", "--jobs", "1", code=2)
    assert message.format(sentinel=tmp / "PWNED") in err
    assert "hostile" in err and "Traceback" not in err
    assert not (tmp / "PWNED").exists()


def test_a_baseline_may_name_files_and_modules_of_its_own_project(capsys: pytest.CaptureFixture[str],
                                                                   project: Path) -> None:
    """A file in a folder below the baseline and a package of the project's own are run again and pass; the
    same entries in a baseline kept in a folder next to them are outside its project and refused."""
    package = f"guardpkg_{project.parent.name.replace('-', '_')}"  # one per test: imports are cached in-process
    (project / "models").mkdir()
    (project / "models" / "net.py").write_text(MODEL_FILE)
    (project / package).mkdir()
    (project / package / "__init__.py").write_text("")
    (project / package / "nets.py").write_text(MODEL_FILE)
    for spec in ("models/net.py:build", f"{package}.nets:build", "m.py:build"):
        cli(capsys, spec, "--save-baseline", "costs.json")
    out, err = cli(capsys, "--check-baseline", "costs.json", "--jobs", "1")
    assert out.count("within its baseline") == 3
    assert "modelmeter: checked 3 models of costs.json: 3 within the baseline, 0 over it or failed" in err
    Path("baselines").mkdir()
    Path("costs.json").rename("baselines/costs.json")
    _, err = cli(capsys, "--check-baseline", "baselines/costs.json", "--jobs", "1", code=2)
    assert f"the baseline entry '{package}.nets:build': the module '{package}.nets' is not in the baseline's " \
           "project directory" in err  # the first entry in the file's order


def test_check_all_refuses_options_it_would_ignore(capsys: pytest.CaptureFixture[str], project: Path) -> None:
    cli(capsys, "m.py:build", "--save-baseline", "costs.json")
    for extra in (["--budget", "flops=1"], ["--save-baseline", "other.json"], ["--batch", "4"],
                  ["--convention", "macs"], ["--name", "x"], ["--backward"], ["--format", "json"]):
        _, err = cli(capsys, "--check-baseline", "costs.json", *extra, code=2)
        assert f"{extra[0]}: a check of every model of costs.json runs each entry as it was saved" in err
    assert not Path("other.json").exists()


# --- nothing fools a guard: model code that exits, a check that fails ----------------------------------------
EXITS = textwrap.dedent("""
    import os
    import sys

    import torch
    from torch import nn


    class Custom(BaseException):
        pass


    class Exits(nn.Module):
        def __init__(self, how):
            super().__init__()
            self.linear = nn.Linear(16, 4)
            self.how = how

        def forward(self, x):
            if self.how == "exit":
                sys.exit(0)
            raise Custom("not an Exception")


    def build_exits():
        sys.exit(0)


    def build_says():
        sys.exit("done")


    def forward_exits():
        return Exits("exit"), torch.randn(2, 16)


    def forward_raises():
        return Exits("custom"), torch.randn(2, 16)


    def dies():
        os._exit(0)
""")


@pytest.fixture
def exits_dir(model_dir: Path) -> Path:
    Path("exits.py").write_text(EXITS)
    return model_dir


@pytest.mark.usefixtures("exits_dir")
@pytest.mark.parametrize(("spec", "how"), [
    ("exits.py:build_exits", "called sys.exit(0)"), ("exits.py:build_says", "called sys.exit('done')"),
    ("exits.py:forward_exits", "called sys.exit(0)"), ("exits.py:forward_raises", "raised Custom"),
])
def test_model_code_that_exits_fails_the_guard(capsys: pytest.CaptureFixture[str], spec: str, how: str) -> None:
    """Before, sys.exit(0) in build() or forward() ended the command with exit status 0 and no output."""
    cli(capsys, "m.py:build", "--save-baseline", "costs.json")
    for guard in (["--budget", "flops=1G"], ["--name", "m.py:build", "--check-baseline", "costs.json"]):
        _, err = cli(capsys, spec, *guard, code=1)
        one_line_error(err, f"modelmeter: {spec}: the model's code {how} before its analysis finished")


@pytest.mark.usefixtures("exits_dir")
def test_a_sweep_fails_when_the_model_exits_while_it_is_probed(capsys: pytest.CaptureFixture[str]) -> None:
    """A sweep with workers builds the model once in the command's process first (to fail fast)."""
    _, err = cli(capsys, "exits.py:build_exits", "--sweep", "batch=1,2", "--jobs", "2", code=1)
    one_line_error(err, "modelmeter: exits.py:build_exits: the model's code called sys.exit(0)")


@pytest.mark.usefixtures("exits_dir")
def test_check_all_checks_every_model_after_one_exits(capsys: pytest.CaptureFixture[str]) -> None:
    cli(capsys, "m.py:build", "--save-baseline", "costs.json")
    data = json.loads(Path("costs.json").read_text())
    for name in ("a_exits", "b_raises"):
        spec = "exits.py:forward_exits" if name == "a_exits" else "exits.py:forward_raises"
        data["models"][name] = {**data["models"]["m.py:build"], "spec": [spec]}
    Path("costs.json").write_text(json.dumps(data))
    out, err = cli(capsys, "--check-baseline", "costs.json", "--jobs", "1", code=1)
    assert "m.py:build: within its baseline" in out
    assert "modelmeter: a_exits: exits.py:forward_exits: the model's code called sys.exit(0)" in err
    assert "modelmeter: b_raises: exits.py:forward_raises: the model's code raised Custom" in err
    assert "checked 3 models of costs.json: 1 within the baseline, 2 over it or failed" in err


@pytest.mark.slow
@pytest.mark.usefixtures("exits_dir")
def test_check_all_in_worker_processes_fails_when_a_worker_exits_or_dies(capsys: pytest.CaptureFixture[str]) -> None:
    """sys.exit in a worker process used to reach the parent through the future and end it with status 0;
    os._exit kills the worker (nothing can catch it): the pool breaks, which is a failure too."""
    cli(capsys, "m.py:build", "--save-baseline", "costs.json")
    data = json.loads(Path("costs.json").read_text())
    data["models"]["exits"] = {**data["models"]["m.py:build"], "spec": ["exits.py:forward_exits"]}
    Path("costs.json").write_text(json.dumps(data))
    _, err = cli(capsys, "--check-baseline", "costs.json", "--jobs", "2", code=1)
    assert "modelmeter: exits: exits.py:forward_exits: the model's code called sys.exit(0)" in err
    data["models"]["dies"] = {**data["models"]["m.py:build"], "spec": ["exits.py:dies"]}
    Path("costs.json").write_text(json.dumps(data))
    _, err = cli(capsys, "--check-baseline", "costs.json", "--jobs", "2", code=1)
    assert "modelmeter: dies: its worker process died before the analysis finished (the model's code called " \
           "os._exit" in err


@pytest.mark.usefixtures("exits_dir")
def test_keyboard_interrupt_is_not_taken_for_a_model_failure() -> None:
    Path("ctrl_c.py").write_text("def build():\n    raise KeyboardInterrupt\n")
    with pytest.raises(KeyboardInterrupt):
        analyse(Job("ctrl_c.py:build"))


def test_assert_cost_fails_when_forward_calls_sys_exit(tmp_path: Path) -> None:
    class Exits(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise SystemExit(0)

    assert_cost(mlp(), torch.randn(2, 16), tmp_path / "costs.json", name="m", update=True)
    with pytest.raises(CostAssertionError, match=r"m: the model's code called sys.exit\(0\) before its analysis"):
        assert_cost(Exits(), torch.randn(2, 16), tmp_path / "costs.json", name="m")


@pytest.mark.usefixtures("model_dir")
def test_a_failed_check_never_overwrites_the_baseline(capsys: pytest.CaptureFixture[str]) -> None:
    """Check first, save only when every check of the run passed. Hand count of the grown MLP (one more
    Linear(32, 32) on 2 samples): 2·16·32 + 2·32·32 + 2·32·4 = 3328 FLOPs."""
    cli(capsys, "m.py:build", "--save-baseline", "costs.json")
    saved = Path("costs.json").read_bytes()
    Path("m.py").write_text(MODEL_FILE.replace("range(int(extra))", "range(int(extra) + 1)"))
    both = ("m.py:build", "--check-baseline", "costs.json", "--save-baseline", "costs.json")
    _, err = cli(capsys, *both, code=1)
    assert "grew   the model: flops 1.28K (1,280) -> 3.328K (3,328)" in err
    assert "modelmeter: did not save the baseline of m.py:build in costs.json: a check failed" in err
    assert Path("costs.json").read_bytes() == saved
    _, err = cli(capsys, "m.py:build", "--budget", "flops=3K", "--save-baseline", "new.json", code=1)
    assert "did not save" in err and not Path("new.json").exists()
    cli(capsys, *both, "--tolerance", "800%")  # growth accepted: now it is saved
    assert BaselineFile.load("costs.json").entries["m.py:build"].total("flops") == 3328


@pytest.mark.parametrize("job", [
    Job("m.py:build", ("extra=1",), shapes=(((2, 16), torch.float32), ((3,), None)), dtype=torch.float16,
        execution="real", convention="macs", backward=True, dense_attention=True, memory=True, optimizer="adamw",
        state_dtype="bfloat16", foreach=True),
    Job("resnet18", batch=2, resolution=32, execution="fake"),
    Job("gpt2_tiny", seq_len=16, convention="flops", attention_kernel="math"),
])
def test_every_spec_the_command_writes_is_accepted_and_runs_the_same_job(project: Path, job: Job) -> None:
    """The allowed options are exactly those _job_argv writes: a saved spec parses back to the job it came from."""
    argv = _job_argv(job)
    parsed = check_spec(argv, "entry", project / "costs.json", build_parser())
    assert cli_job(parsed) == job
