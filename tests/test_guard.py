"""The cost guard: budgets, baselines (one or many models), their comparison, and diffs — library and command."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from modelmeter import analyze
from modelmeter.cli import main
from modelmeter.errors import ModelMeterError
from modelmeter.guard import (
    BaselineFile,
    BaselineMismatch,
    assert_cost,
    check_budget,
    compare,
    diff,
    entry_from_result,
    load_costs,
    parse_budget,
    parse_quantity,
)
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
    assert str(over[0]) == "flops: 1.28K (1,280) is over the budget of 1K by 0.28K (+28.0%)"
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
    assert "over its baseline" in report and "module '2': flops 0.256K -> 2.048K (+1,792, +700.0%)" in report


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
    assert out.splitlines()[1].split()[:2] == ["model", "flops"]
    data = json.loads(cli(capsys, "diff", "a.json", "b.json", "--format", "json")[0])
    assert data[0] == {"module": "", "metric": "flops", "before": 1280, "after": 1280 + 2 * 2 * 32 * 32,
                       "change": 2 * 2 * 32 * 32}
    cli(capsys, "diff", "a.json", code=2)
    cli(capsys, "diff", "a.json", "missing.json", code=2)


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
        "activation_bytes: 544B (544 bytes) is over the budget of 500B by 44B (+8.8%)",
        "flops: 1.28K (1,280) is over the budget of 1K by 0.28K (+28.0%)"]


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
    assert "module '2': flops 0.256K -> 2.048K (+1,792, +700.0%)" in err and "the model" not in err
    _, err = cli(capsys, *grown, "--tolerance", "159%", code=1)
    assert "the model: flops 1.28K -> 3.328K (+2,048, +160.0%)" in err
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
    (10**400, ValueError, r"budget\['flops'\] is out of range: \(an integer of 1329 bits\)"),
    ("4G", TypeError, r"budget\['flops'\] must be a number, got str '4G'"),
    (True, TypeError, r"budget\['flops'\] must be a number, got bool"),
])
def test_check_budget_refuses_limits_that_would_pass_everything(limit: object, error: type[Exception],
                                                                message: str) -> None:
    result = analyze(mlp(), torch.randn(2, 16), quiet=True).result()
    with pytest.raises(error, match=message):
        check_budget(result, {"flops": limit})  # type: ignore[dict-item]
