"""The cost guard attacked as a team guarding a model's cost in CI would hit it: budgets exactly at the cost in
every spelling, counts too large for a float, tolerances at the tie, a baseline holding metrics the run did not
compute, a hand-merged file with a key given twice, a guard option given twice, and failures that must carry
every digit. The oracles are hand arithmetic (a Linear's FLOPs are in * out per row under fvcore) and Python's
exact ``Fraction``."""

from __future__ import annotations

import json
import math
import os
import textwrap
import threading
from collections.abc import Callable
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from torch import nn

from modelmeter import analyze
from modelmeter.guard import (
    BaselineMismatch,
    CostAssertionError,
    Entry,
    assert_cost,
    baseline,
    check_budget,
    compare,
    entry_from_result,
    parse_budget,
    parse_quantity,
    record,
)
from modelmeter.guard.values import parse_tolerance
from modelmeter.handles.conventions import register_handle, unregister_handle
from test_guard import cli

MODEL_FILE = textwrap.dedent("""
    from torch import nn

    def wide(inputs: int = 1001, outputs: int = 1000):
        return nn.Linear(int(inputs), int(outputs), bias=False)
""")


@pytest.fixture
def model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory holding ``m.py``: ``m.py:wide`` is Linear(1001, 1000) without a bias."""
    monkeypatch.chdir(tmp_path)
    Path("m.py").write_text(MODEL_FILE)
    return tmp_path


# --- budgets at the tie ------------------------------------------------------------------------------------
@pytest.mark.parametrize("unit", ["K", "M", "G", "T"])
def test_every_decimal_budget_is_the_exact_amount_it_spells(unit: str) -> None:
    """1.001G was 1000999999.9999999 (1.001 * 1e9 in floats): a model of exactly 1,001,000,000 FLOPs failed
    its budget of 1.001G. The oracle: the decimal's exact value."""
    scale = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}[unit]
    for thousandths in range(1, 5000):
        text = f"{thousandths // 1000}.{thousandths % 1000:03d}{unit}"
        assert parse_quantity(text) == Fraction(thousandths, 1000) * scale, text


@pytest.mark.parametrize(("text", "value"), [
    ("3e+9", 3 * 10**9), ("3E9", 3 * 10**9), ("2.5e-3K", 2.5), (" 4.2 g ", 4_200_000_000), ("1.5GiB", 3 * 2**29),
    ("0", 0), ("1e30", 10**30),
])
def test_quantities_in_scientific_notation_and_units(text: str, value: float) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["１２", "1e99999999", "1e" + "9" * 5000, "1e-99999999", "nan", "-1"])
def test_a_quantity_that_is_no_plain_amount_is_a_clear_error(text: str) -> None:
    with pytest.raises(ValueError, match="not a quantity|out of range"):
        parse_quantity(text)


@pytest.mark.parametrize(("text", "seconds"), [("5us", 5e-6), ("120us", 120e-6), ("3ms", 3e-3), ("7ns", 7e-9),
                                               ("0.1ms", 1e-4), ("5µs", 5e-6)])
def test_a_time_budget_is_the_float_nearest_the_time_it_spells(text: str, seconds: float) -> None:
    """5 * 1e-6 is 4.9999999999999996e-06, below a predicted time of 5e-06 s: that time was over a budget of
    5us."""
    assert parse_budget(f"time={text}") == {"time": seconds}


def test_a_time_budget_over_the_range_is_refused_when_parsed() -> None:
    with pytest.raises(ValueError, match="the budget of time: the amount is out of range"):
        parse_budget("time=1e31")


@pytest.mark.usefixtures("model_dir")
def test_a_model_exactly_at_its_budget_passes_and_one_flop_over_fails(capsys: pytest.CaptureFixture[str]) -> None:
    """Linear(1001, 1000) on one row: 1001 * 1000 = 1,001,000 FLOPs."""
    _, err = cli(capsys, "m.py:wide", "--input", "1x1001", "--budget", "flops=1.001M")
    assert "within budget: m.py:wide: flops 1.001M ≤ 1.001M" in err
    _, err = cli(capsys, "m.py:wide", "--input", "1x1001", "--budget", "flops=1.000999M", code=1)
    assert "flops: 1.001M (1,001,000) is over the budget of 1.001M (1,000,999) by 1 (+0.0001%)" in err


def test_counts_over_two_to_the_53_are_compared_with_every_digit() -> None:
    """9 * (2**52 + 1) FLOPs cannot be told from one less as floats: a budget one FLOP under the cost passed."""
    rows = 2**52 + 1
    result = analyze(nn.Linear(3, 3, bias=False), torch.empty(rows, 3, device="meta"), quiet=True).result()
    flops = 9 * rows
    assert result.total("flops") == flops and float(flops) == float(flops - 1)  # the oracle, and why it matters
    over = check_budget(result, parse_budget(f"flops={flops - 1}"))
    assert [o.metric for o in over] == ["flops"]
    assert f"({flops:,}) is over the budget of " in str(over[0]) and f"({flops - 1:,}) by 1 " in str(over[0])
    assert check_budget(result, parse_budget(f"flops={flops}")) == []


# --- tolerances at the tie --------------------------------------------------------------------------------
@pytest.mark.parametrize("tolerance", ["0.7%", "0.3%", "1.1%", "4.9%", "0.007", "2.5%"])
def test_a_growth_of_exactly_the_tolerance_passes(tolerance: str) -> None:
    """0.7 / 100 is 0.006999999999999999 in floats: a growth of exactly 0.7% failed a 0.7% tolerance (968,693,315,000
    FLOPs grown by 6,780,853,205 was one). The oracle: the growth as an exact Fraction of the decimal written."""
    fraction = Fraction(tolerance.removesuffix("%")) / (100 if tolerance.endswith("%") else 1)
    value = parse_tolerance(tolerance)
    for k in (1, 7, 968_693_315 // fraction.denominator + 1, 10**9 + 7):
        before = k * fraction.denominator * 1000
        at = before + k * fraction.numerator * 1000
        base = entry_from_result(analyze(nn.Linear(2, 2), torch.randn(1, 2), quiet=True).result())
        grown = {**base.modules[""], "flops": at}
        old = {**base.modules[""], "flops": before}
        ok = compare("m", _with(base, old), _with(base, grown), value)
        assert ok.ok and [c.metric for c in ok.shrank] == [], (tolerance, before, at)
        over = compare("m", _with(base, old), _with(base, {**grown, "flops": at + 1}), value)
        assert [c.metric for c in over.grew] == ["flops"]


def _with(entry: Entry, root: dict[str, float]) -> Entry:
    return replace(entry, modules={"": root})


@pytest.mark.parametrize("text", ["1e400", "1e99999%", "nan", "inf", "-1%", "1/3", ""])
def test_a_tolerance_that_is_no_finite_amount_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="tolerance"):
        parse_tolerance(text)


# --- what the run did not compute -------------------------------------------------------------------------
@pytest.mark.usefixtures("model_dir")
def test_a_baseline_with_memory_is_not_passed_by_a_run_without_it(capsys: pytest.CaptureFixture[str]) -> None:
    """The memory metrics of the entry were skipped by a run without --memory: a peak edited down to 1 byte
    (or a model whose memory grew) passed."""
    cli(capsys, "m.py:wide", "--input", "1x1001", "--memory", "--save-baseline", "b.json")
    data = json.loads(Path("b.json").read_text())
    for metrics in data["models"]["m.py:wide"]["modules"].values():
        metrics["peak_memory"] = 1
    Path("b.json").write_text(json.dumps(data))
    _, err = cli(capsys, "m.py:wide", "--input", "1x1001", "--check-baseline", "b.json", code=2)
    assert "the baseline holds activation_bytes, peak_memory, which this run did not compute" in err
    assert "--memory" in err
    _, err = cli(capsys, "m.py:wide", "--input", "1x1001", "--memory", "--check-baseline", "b.json", code=1)
    assert "grew   the model: peak_memory 1B (1 bytes) -> " in err
    cli(capsys, "--check-baseline", "b.json", code=1)  # every model: the entry's own --memory runs


def test_assert_cost_is_not_passed_by_a_run_without_the_baselines_metrics(tmp_path: Path) -> None:
    model, x = nn.Linear(4, 4), torch.randn(2, 4)
    with_memory = entry_from_result(analyze(model, x, quiet=True, memory=True).result())
    without = entry_from_result(analyze(model, x, quiet=True).result())
    with pytest.raises(BaselineMismatch, match="peak_memory, which this run did not compute"):
        compare("m", with_memory, without)
    assert compare("m", without, with_memory).ok  # a run computing more is checked on what the entry holds
    record(tmp_path / "c.json", "Linear", with_memory)
    with pytest.raises(CostAssertionError, match="did not compute"):
        assert_cost(model, x, tmp_path / "c.json")


# --- hand-edited and merged files -------------------------------------------------------------------------
@pytest.mark.parametrize(("label", "edit", "key"), [
    ("a metric", lambda text: text.replace('"flops": 1001000', '"flops": 9, "flops": 1001000', 1), "flops"),
    ("an entry", lambda text: text.replace('"models": {', '"models": {"m.py:wide": {},', 1), "m.py:wide"),
    ("a module", lambda text: text.replace('"modules": {', '"modules": {"": {},', 1), ""),
])
@pytest.mark.usefixtures("model_dir")
def test_a_key_given_twice_is_refused_not_read_as_its_last(capsys: pytest.CaptureFixture[str], label: str,
                                                          edit: Callable[[str], str], key: str) -> None:
    """A merge or hand edit that gives a key twice: Python's parser kept the last, so the check compared with a
    value nobody reviewed (or dropped an entry); in every command, and in assert_cost."""
    cli(capsys, "m.py:wide", "--input", "1x1001", "--save-baseline", "b.json")
    text = Path("b.json").read_text()
    Path("b.json").write_text(edit(text))
    assert Path("b.json").read_text() != text, label
    message = f"the key {key!r} is given twice in one object"
    for argv in (("m.py:wide", "--input", "1x1001", "--check-baseline", "b.json"), ("--check-baseline", "b.json"),
                 ("diff", "b.json", "b.json")):
        _, err = cli(capsys, *argv, code=2)
        assert message in err and err.count("\n") == 1, err
    with pytest.raises(CostAssertionError, match=message):
        assert_cost(nn.Linear(1001, 1000, bias=False), torch.randn(1, 1001), "b.json", name="m.py:wide")


# --- the command line -------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [
    ("--budget", "flops=1M", "--budget", "params=2M"),
    ("--check-baseline", "a.json", "--check-baseline", "b.json"),
    ("--save-baseline", "a.json", "--save-baseline", "b.json"),
    ("--check-baseline", "a.json", "--tolerance", "50%", "--tolerance", "0"),
    ("--save-baseline", "a.json", "--name", "a", "--name", "b"),
])
@pytest.mark.usefixtures("model_dir")
def test_a_guard_option_given_twice_is_a_usage_error(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...]) -> None:
    """argparse keeps the last of an option given twice: the first budget (1,001,000 FLOPs are over 1M) or
    baseline went unchecked, exit 0."""
    _, err = cli(capsys, "m.py:wide", "--input", "1x1001", *argv, code=2)
    assert f"argument {argv[-2]}: given twice: give it once" in err
    assert not Path("a.json").exists() and not Path("b.json").exists()


@pytest.mark.usefixtures("model_dir")
def test_a_failed_check_names_every_digit_of_the_values(capsys: pytest.CaptureFixture[str]) -> None:
    """1001 * 1000 -> 1001 * 1001 FLOPs: 1.001M -> 1.002M rounded, the exact counts in the report."""
    cli(capsys, "m.py:wide", "--input", "1x1001", "--save-baseline", "b.json")
    _, err = cli(capsys, "m.py:wide", "outputs=1001", "--name", "m.py:wide", "--input", "1x1001",
                 "--check-baseline", "b.json", "--tolerance", "0.05%", code=1)
    assert "grew   the model: flops 1.001M (1,001,000) -> 1.002M (1,002,001) (+1,001, +0.1%)" in err
    _, err = cli(capsys, "m.py:wide", "outputs=1001", "--name", "m.py:wide", "--input", "1x1001",
                 "--check-baseline", "b.json", "--tolerance", "0.1%")
    assert "within its baseline" in err  # +1,001 of 1,001,000 is 0.1% exactly


@pytest.mark.parametrize(("saved", "checked", "shown"), [
    (("--optimizer", "adam"), ("--optimizer", "sgd"),
     "'--optimizer adam; mode: eval', this run has '--optimizer sgd; mode: eval'"),
    (("--optimizer", "adam"), ("--backward", "--memory"), "'--optimizer adam; mode: eval', this run has 'mode: eval'"),
    (("--backward", "--memory"), ("--optimizer", "sgd"), "'mode: eval', this run has '--optimizer sgd; mode: eval'"),
])
@pytest.mark.usefixtures("model_dir")
def test_a_run_with_other_run_options_is_not_compared(capsys: pytest.CaptureFixture[str], saved: tuple[str, ...],
                                                       checked: tuple[str, ...], shown: str) -> None:
    """The peak of a training step with Adam (two states per parameter) checked by a run with SGD or without an
    optimizer "shrank" by half: a model whose memory grew by up to that passed."""
    cli(capsys, "m.py:wide", "--input", "1x1001", *saved, "--save-baseline", "b.json")
    _, err = cli(capsys, "m.py:wide", "--input", "1x1001", *checked, "--check-baseline", "b.json", code=2)
    assert f"the baseline was recorded with run options {shown}" in err
    cli(capsys, "m.py:wide", "--input", "1x1001", *saved, "--check-baseline", "b.json")


@pytest.mark.parametrize("option", [("--device", "h100"), ("--parallel", "dp=2"), ("--efficiency", "0.5"),
                                    ("--tf32",), ("--launch-overhead", "4us"), ("--devices-file", "d.json"),
                                    ("--measured-time", "5ms")])
@pytest.mark.usefixtures("model_dir")
def test_check_all_refuses_the_device_and_plan_options_it_would_ignore(capsys: pytest.CaptureFixture[str],
                                                                       option: tuple[str, ...]) -> None:
    """`modelmeter --check-baseline costs.json --device h100` ran each entry as saved, without a device, and
    passed: the times the user meant to guard were never predicted."""
    cli(capsys, "m.py:wide", "--input", "1x1001", "--save-baseline", "b.json")
    _, err = cli(capsys, "--check-baseline", "b.json", *option, code=2)
    assert f"{option[0]}: a check of every model of b.json runs each entry as it was saved" in err


@pytest.mark.usefixtures("model_dir")
def test_an_entry_saved_with_a_parallel_plan_is_checked_by_check_all(capsys: pytest.CaptureFixture[str]) -> None:
    """The command wrote --parallel into the entry and check-all refused it as an option no baseline holds."""
    cli(capsys, "m.py:wide", "--input", "2x1001", "--parallel", "dp=2", "--save-baseline", "b.json")
    assert "--parallel" in json.loads(Path("b.json").read_text())["models"]["m.py:wide"]["spec"]
    _, err = cli(capsys, "--check-baseline", "b.json")
    assert "1 within the baseline" in err


def test_a_recompute_budget_without_checkpointing_is_zero_not_a_missing_metric() -> None:
    """--backward --budget recompute_flops=...: a model without activation checkpointing recomputes nothing, and
    the budget was a usage error telling the user to add the --backward they had given."""
    model, x = nn.Linear(4, 4), torch.randn(2, 4)
    trained = analyze(model, x, quiet=True, backward=True).result()
    assert "recompute_flops" not in trained.metrics
    assert check_budget(trained, parse_budget("recompute_flops=0")) == []
    with pytest.raises(ValueError, match="no metric 'recompute_flops'"):
        check_budget(analyze(model, x, quiet=True).result(), parse_budget("recompute_flops=0"))


@pytest.mark.usefixtures("model_dir")
def test_a_passing_check_says_what_it_compared(capsys: pytest.CaptureFixture[str]) -> None:
    """"within its baseline" alone cannot be told from a check that compared nothing."""
    cli(capsys, "m.py:wide", "--input", "1x1001", "--memory", "--save-baseline", "b.json")
    _, err = cli(capsys, "m.py:wide", "--input", "1x1001", "--memory", "--check-baseline", "b.json")
    assert ("m.py:wide: within its baseline (tolerance 0.00%): params, flops, activations, activation_bytes, "
            "peak_memory of the model and 0 modules compared") in err


@torch.library.custom_op("guard_hostile::copy", mutates_args=())
def _copy(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_copy.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class _Copies(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _copy(x)


@pytest.mark.parametrize(("count", "message"), [(float("nan"), "must be a finite number, got nan"),
                                                (-1e9, "cannot be negative")])
def test_a_budget_refuses_a_cost_no_limit_can_judge(count: float, message: str) -> None:
    """A registered handle that returns NaN (over no limit) or a negative count (under every limit): the budget
    passed it. (A handle's negative count is refused where it is counted since: it is put in the result here.)"""
    register_handle("guard_hostile::copy", lambda inputs, outputs: count if math.isnan(count) else 1.0)
    try:
        result = analyze(_Copies(), torch.randn(2, 4), quiet=True, cache=False).result()
    finally:
        unregister_handle("guard_hostile::copy")
    if count < 0:
        result.root.metrics["flops"] = count
    with pytest.raises(ValueError, match=f"this run's flops {message}"):
        check_budget(result, parse_budget("flops=1G"))


@pytest.mark.usefixtures("model_dir")
def test_the_command_never_writes_a_baseline_it_cannot_read(capsys: pytest.CaptureFixture[str]) -> None:
    """--name with a newline was written, and from then on every check of every model of the file failed on it."""
    cli(capsys, "m.py:wide", "--input", "1x1001", "--save-baseline", "b.json")
    saved = Path("b.json").read_bytes()
    _, err = cli(capsys, "m.py:wide", "--input", "1x1001", "--name", "a\nb", "--save-baseline", "b.json", code=2)
    assert "is not a printable name" in err and "the baseline is not written" in err
    assert Path("b.json").read_bytes() == saved
    cli(capsys, "--check-baseline", "b.json")


def test_assert_cost_never_records_a_count_its_check_would_refuse(tmp_path: Path) -> None:
    """A registered handle's negative count was recorded; the file then failed every check of every model. (It is
    refused where it is counted since, naming the operator.)"""
    register_handle("guard_hostile::copy", lambda inputs, outputs: -5)
    try:
        with pytest.raises(ValueError, match="guard_hostile::copy returned -5; a cost cannot be negative"):
            assert_cost(_Copies(), torch.randn(2, 4), tmp_path / "c.json", update=True)
    finally:
        unregister_handle("guard_hostile::copy")
    assert not (tmp_path / "c.json").exists()


def test_writers_with_other_cache_directories_keep_every_entry(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """16 writers at once, each with its own cache directory (CI jobs given one each): the lock in the cache
    directory did not make them take turns, and 15 of the 16 entries were lost."""
    entry = entry_from_result(analyze(nn.Linear(2, 2), torch.randn(1, 2), quiet=True).result())
    own = threading.local()
    monkeypatch.setattr(baseline, "get_cache_dir", lambda: own.cache)
    start = threading.Barrier(16)

    def write(i: int) -> None:
        own.cache = str(tmp_path / f"cache{i}")
        start.wait()
        record(tmp_path / "costs.json", f"model{i}", entry)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert set(json.loads((tmp_path / "costs.json").read_text())["models"]) == {f"model{i}" for i in range(16)}
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("cache")) == ["costs.json"]


def test_the_report_shows_the_tolerance_applied() -> None:
    """0.005% was shown as 0.01%, a tolerance twice the one applied."""
    base = entry_from_result(analyze(nn.Linear(2, 2), torch.randn(1, 2), quiet=True).result())
    assert "(tolerance 0.005%)" in compare("m", base, base, parse_tolerance("0.005%")).report()
    assert "(tolerance 1.00%)" in compare("m", base, base, 0.01).report()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
@pytest.mark.usefixtures("model_dir")
def test_a_pipe_or_a_device_is_refused_without_opening_it(capsys: pytest.CaptureFixture[str]) -> None:
    """A pipe named as the baseline blocked the guard forever (CI's timeout, not a failure), and /dev/zero
    filled its memory (a MemoryError's stack trace)."""
    os.mkfifo("pipe.json")
    os.symlink("/dev/zero", "zero.json")
    for name in ("pipe.json", "zero.json"):
        message = f"{name!r} is not a regular file (a device, a pipe or a socket)"
        for argv in (("m.py:wide", "--input", "1x1001", "--check-baseline", name), ("--check-baseline", name),
                     ("diff", name, name), ("m.py:wide", "--input", "1x1001", "--save-baseline", name)):
            _, err = cli(capsys, *argv, code=2)
            assert message in err and err.count("\n") == 1, err
        with pytest.raises(CostAssertionError, match="not a regular file"):
            assert_cost(nn.Linear(1001, 1000, bias=False), torch.randn(1, 1001), name, name="m.py:wide")


def test_a_metric_in_capitals_is_named_as_unknown_not_as_a_bad_amount() -> None:
    """"TIME=5ms" said "not a quantity: '5ms'", sending the user to fix an amount that was right."""
    result = analyze(nn.Linear(2, 2), torch.randn(1, 2), quiet=True).result()
    with pytest.raises(ValueError, match="no metric 'TIME' in this analysis"):
        check_budget(result, parse_budget("TIME=5ms"))
    with pytest.raises(ValueError, match="Intensity is a ratio"):
        parse_budget("Intensity=5")


class Counted(nn.Linear):
    """A Linear that counts its calls: an argument refused before the model runs leaves it at 0."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        return super().forward(x)


@pytest.mark.parametrize(("options", "error", "message"), [
    ({"name": 1}, TypeError, "name must be a string .*got int 1"),
    ({"name": ("mlp",)}, TypeError, "name must be a string"),
    ({"name": ""}, ValueError, "name must be a printable name of 1 to 1000 characters"),
    ({"name": "a\nb"}, ValueError, "name must be a printable name"),
    ({"name": "x" * 1001}, ValueError, "name must be a printable name"),
    ({"baseline": 3}, TypeError, "baseline must be a path"),
    ({"baseline": None}, TypeError, "baseline must be a path"),
    ({"update": "0"}, TypeError, "update must be True or False, got '0'"),
    ({"update": "no"}, TypeError, "update must be True or False"),
])
@pytest.mark.parametrize("update", [False, True])
def test_assert_cost_refuses_a_name_baseline_or_update_it_cannot_use_before_the_model_runs(
        tmp_path: Path, options: dict[str, object], error: type[Exception], message: str, update: bool) -> None:
    """name=1 ran the model, then broke in sorting the file's names (a bare TypeError: '<' not supported between
    'int' and 'str') or, alone in a file, was written as "1" and never found again by name=1; name="" was the
    class name, silently; baseline=None was os.fspath's bare TypeError; update="0" (os.getenv's) recorded the
    costs instead of checking them, a pass whatever they were."""
    assert_cost(nn.Linear(2, 2), torch.randn(1, 2), tmp_path / "b.json", update=True)
    before = (tmp_path / "b.json").read_text()
    Counted.calls = 0
    arguments: dict[str, object] = {"baseline": tmp_path / "b.json", **options}
    with pytest.raises(error, match=message):
        assert_cost(Counted(2, 2), torch.randn(1, 2), **{"update": update, **arguments})  # type: ignore[arg-type]
    assert Counted.calls == 0
    assert (tmp_path / "b.json").read_text() == before


def test_a_baseline_that_is_a_symbolic_link_is_written_where_it_points(tmp_path: Path) -> None:
    """A project linking a shared baseline file: recording an entry through the link replaced the link with a
    file of its own (atomic_write renames over the path), and the shared file never got the entry."""
    shared = tmp_path / "shared" / "costs.json"
    assert_cost(nn.Linear(2, 2), torch.randn(1, 2), shared, update=True)
    (tmp_path / "project").mkdir()
    link = tmp_path / "project" / "costs.json"
    link.symlink_to(shared)
    assert_cost(nn.Linear(3, 3), torch.randn(1, 3), link, name="three", update=True)
    assert link.is_symlink()
    assert set(json.loads(shared.read_text())["models"]) == {"Linear", "three"}


@pytest.mark.parametrize("text", ["garbage",
                                  '{"format": "modelmeter-baseline", "schema_version": 1, "models": {"x": 3}}'])
def test_recording_into_a_broken_baseline_fails_in_one_line_before_the_model_runs(tmp_path: Path, text: str) -> None:
    """`pytest --update-baselines` ran the model, then raised GuardFileError from deep in the file's reading (a
    traceback through modelmeter), where the check of the same file fails in one line; the command's
    --save-baseline refuses such a file before the model runs."""
    (tmp_path / "b.json").write_text(text)
    Counted.calls = 0
    with pytest.raises(CostAssertionError, match="b.json") as failure:
        assert_cost(Counted(2, 2), torch.randn(1, 2), tmp_path / "b.json", update=True)
    assert Counted.calls == 0 and "\n" not in str(failure.value)
    assert (tmp_path / "b.json").read_text() == text
