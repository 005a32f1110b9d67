"""``assert_cost``: the plain function (in-process) and the pytest plugin's fixture and ``--update-baselines``
flag (through pytest's own ``pytester``: in-process, after one analysis has loaded what torch loads lazily,
so that pytester's restore of ``sys.modules`` after each inner run cannot make torch import a second copy).

The model is a tiny MLP whose costs are hand arithmetic under fvcore (one per multiply-add, no bias FLOPs,
activations = outputs of the linear layers): on a 2x4 input, body ``Linear(4, 8)`` is 2·4·8 = 64 FLOPs,
16 activations and 4·8+8 = 40 parameters; head ``Linear(8, 2)`` is 2·8·2 = 32 FLOPs, 4 activations and
8·2+2 = 18 parameters. Growing the head by a ``Linear(2, 2)`` adds 2·2·2 = 8 FLOPs and 6 parameters.
"""

from __future__ import annotations

import inspect
import json
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from modelmeter import analyze
from modelmeter.guard import CostAssertionError, assert_cost, entry_from_result
from modelmeter.guard.assertions import record

pytest_plugins = ["pytester"]


class MLP(nn.Module):
    """4 -> 8 -> 2, with ``extra`` more ``Linear(2, 2)`` layers in its head (the model that grows by a layer)."""

    def __init__(self, extra: int = 0, bias: bool = True) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(8, 2, bias=bias), *(nn.Linear(2, 2) for _ in range(extra)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def x(batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 4)


def models(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())["models"]


# --- the plain function ----------------------------------------------------------------------------
def test_update_records_the_hand_counted_costs_then_the_same_model_passes(tmp_path: Path) -> None:
    path = tmp_path / "costs" / "mlp.json"
    assert assert_cost(MLP(), x(), path, update=True) is None
    entry = models(path)["MLP"]
    assert entry["inputs"] == [{"shape": [2, 4], "dtype": "float32"}]
    assert (entry["convention"], entry["backward"]) == ("fvcore", False)
    assert entry["modules"][""] == {"params": 58, "flops": 96, "activations": 20}
    assert entry["modules"]["body"] == {"params": 40, "flops": 64, "activations": 16}
    assert entry["modules"]["head"] == {"params": 18, "flops": 32, "activations": 4}
    comparison = assert_cost(MLP(), x(), path)
    assert comparison is not None and comparison.ok and not comparison.shrank


def test_a_model_grown_by_one_layer_fails_naming_the_module(tmp_path: Path) -> None:
    path = tmp_path / "mlp.json"
    assert_cost(MLP(), x(), path, update=True)
    with pytest.raises(CostAssertionError) as failure:
        assert_cost(MLP(extra=1), x(), path)
    report = str(failure.value)
    assert "module 'head': flops 32 -> 40 (+8, +25.0%)" in report
    assert "module 'head': params 18 -> 24 (+6, +33.3%)" in report
    assert "new modules: head.1" in report
    assert "'body'" not in report


def test_tolerance_is_a_fraction_per_module(tmp_path: Path) -> None:
    """A bias on the head: head params 16 -> 18 (+12.5%), the model's 56 -> 58 (+3.6%), FLOPs unchanged."""
    path = tmp_path / "mlp.json"
    assert_cost(MLP(bias=False), x(), path, update=True)
    comparison = assert_cost(MLP(), x(), path, tolerance=0.13)
    assert comparison is not None and comparison.ok
    with pytest.raises(CostAssertionError, match=r"module 'head': params 16 -> 18 \(\+2, \+12.5%\)"):
        assert_cost(MLP(), x(), path, tolerance=0.12)


@pytest.mark.parametrize(("batch", "options", "message"), [
    (3, {}, "recorded with inputs 2x4 float32, this run has 3x4 float32"),
    (2, {"convention": "flops"}, "recorded with convention 'fvcore', this run has 'flops'"),
    (2, {"backward": True}, "recorded with backward pass False, this run has True"),
])
def test_a_run_unlike_the_baseline_is_a_mismatch_not_a_pass(tmp_path: Path, batch: int, options: dict[str, Any],
                                                             message: str) -> None:
    path = tmp_path / "mlp.json"
    assert_cost(MLP(), x(), path, update=True)
    with pytest.raises(CostAssertionError, match=message):
        assert_cost(MLP(), x(batch), path, **options)


def test_a_missing_file_or_entry_fails_with_the_hint(tmp_path: Path) -> None:
    path = tmp_path / "mlp.json"
    with pytest.raises(CostAssertionError, match=r"no baseline file .*mlp.json.* for 'MLP'; call .*update=True"):
        assert_cost(MLP(), x(), path)
    assert_cost(MLP(), x(), path, update=True)
    with pytest.raises(CostAssertionError, match=r"no entry 'other' \(entries: MLP\); call .*update=True"):
        assert_cost(MLP(), x(), path, name="other")


def test_several_models_share_a_file_and_an_update_keeps_the_others(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    assert_cost(MLP(), x(), path, update=True)
    assert_cost(MLP(extra=1), x(), path, name="deeper", update=True)
    before = models(path)
    assert before["deeper"]["modules"][""]["flops"] == 96 + 8
    assert_cost(MLP(extra=2), x(), path, name="deeper", update=True)
    after = models(path)
    assert after["MLP"] == before["MLP"]
    assert after["deeper"]["modules"][""]["flops"] == 96 + 2 * 8
    assert_cost(MLP(), x(), path)
    assert_cost(MLP(extra=2), x(), path, name="deeper")


def test_parallel_updates_of_one_file_keep_every_entry(tmp_path: Path) -> None:
    """16 writers at once (as pytest-xdist workers updating one file); without the lock most entries are lost."""
    path = tmp_path / "costs.json"
    entry = entry_from_result(analyze(MLP(), x(), quiet=True).result())
    start = threading.Barrier(16)

    def write(i: int) -> None:
        start.wait()
        record(path, f"model{i}", entry)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert set(models(path)) == {f"model{i}" for i in range(16)}


# --- the pytest plugin -----------------------------------------------------------------------------
HEADER = "import torch\nfrom torch import nn\n\n\n" + inspect.getsource(MLP)


@pytest.fixture(scope="module")
def warm() -> None:
    """One analysis before ``pytester`` (a function-scoped fixture) snapshots ``sys.modules``."""
    analyze(MLP(), x(), quiet=True)


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """An inner pytest run (without hypothesis' plugin: its summary imports seconds of modules, every run)."""
    with pytest.MonkeyPatch.context() as env:  # on CI pytest's summary repeats whole messages: as a person sees it
        for name in ("CI", "BUILD_NUMBER"):
            env.delenv(name, raising=False)
        return pytester.runpytest_inprocess("-p", "no:hypothesispytest", *args)


def write_tests(pytester: pytest.Pytester, body: str) -> Path:
    """``tests/test_costs.py`` (below the directory pytest runs in) with the MLP and the tests in ``body``."""
    return pytester.makepyfile(**{"tests/test_costs": HEADER + textwrap.dedent(body)})


def test_plugin_fails_without_a_baseline_records_it_on_update_and_keeps_other_entries(
        warm: None, pytester: pytest.Pytester) -> None:
    write_tests(pytester, """
        def test_mlp(assert_cost):
            assert_cost(MLP(), torch.randn(2, 4), "baselines/costs.json")

        def test_deeper(assert_cost):
            assert_cost(MLP(extra=1), torch.randn(2, 4), "baselines/costs.json", name="deeper")
        """)
    path = pytester.path / "tests" / "baselines" / "costs.json"  # relative to the test file, not the working dir
    missing = run(pytester)
    missing.assert_outcomes(failed=2)
    missing.stdout.fnmatch_lines(["*no baseline file *costs.json* for 'MLP'; run `pytest --update-baselines`*"])
    assert not path.exists()

    run(pytester, "--update-baselines", "-k", "deeper").assert_outcomes(passed=1)
    assert set(models(path)) == {"deeper"}
    recorded = run(pytester, "--update-baselines", "-k", "mlp")
    recorded.assert_outcomes(passed=1)
    recorded.stdout.fnmatch_lines(["modelmeter: recorded 1 baseline entry in *tests/baselines/costs.json"])
    entries = models(path)
    assert set(entries) == {"MLP", "deeper"}
    assert entries["MLP"]["modules"][""]["flops"] == 96 and entries["deeper"]["modules"][""]["flops"] == 104

    run(pytester).assert_outcomes(passed=2)


def test_plugin_reports_growth_tolerance_and_mismatch(warm: None, pytester: pytest.Pytester) -> None:
    baselines = pytester.path / "tests" / "costs.json"
    assert_cost(MLP(), x(), baselines, update=True)
    assert_cost(MLP(bias=False), x(), baselines, name="no_bias", update=True)
    write_tests(pytester, """
        def test_grown(assert_cost):
            assert_cost(MLP(extra=1), torch.randn(2, 4), "costs.json")

        def test_within_tolerance(assert_cost):
            assert assert_cost(MLP(), torch.randn(2, 4), "costs.json", name="no_bias", tolerance=0.13).ok

        def test_over_tolerance(assert_cost):
            assert_cost(MLP(), torch.randn(2, 4), "costs.json", name="no_bias", tolerance=0.12)

        def test_other_input_shape(assert_cost):
            assert_cost(MLP(), torch.randn(3, 4), "costs.json")
        """)
    result = run(pytester)
    result.assert_outcomes(passed=1, failed=3)
    out = result.stdout.str()
    assert out.count("module 'head': flops 32 -> 40 (+8, +25.0%)") == 1
    assert out.count("module 'head': params 16 -> 18 (+2, +12.5%)") == 1
    assert "recorded with inputs 2x4 float32, this run has 3x4 float32" in out
    result.stdout.fnmatch_lines(["FAILED tests/test_costs.py::test_grown - Failed: MLP: over its*",
                                 "FAILED tests/test_costs.py::test_over_tolerance - Failed: no_bias: over*",
                                 "FAILED tests/test_costs.py::test_other_input_shape - Failed: MLP: the*"])
    assert "During handling" not in out


def test_plugin_never_passes_a_nan_tolerance_a_model_that_exits_or_a_broken_baseline(
        warm: None, pytester: pytest.Pytester) -> None:
    baselines = pytester.path / "tests" / "costs.json"
    assert_cost(MLP(), x(), baselines, update=True)
    (pytester.path / "tests" / "broken.json").write_text(
        baselines.read_text().replace('"flops": 96', '"flops": NaN', 1))
    write_tests(pytester, """
        import sys


        class Exits(MLP):
            def forward(self, x):
                sys.exit(0)


        def test_nan_tolerance(assert_cost):
            assert_cost(MLP(extra=1), torch.randn(2, 4), "costs.json", tolerance=float("nan"))

        def test_exits(assert_cost):
            assert_cost(Exits(), torch.randn(2, 4), "costs.json", name="MLP")

        def test_broken(assert_cost):
            assert_cost(MLP(), torch.randn(2, 4), "broken.json")
        """)
    result = run(pytester)
    result.assert_outcomes(failed=3)
    out = result.stdout.str()
    assert "ValueError: tolerance must be a finite number >= 0 (a fraction: 0.01 is 1%), got nan" in out
    assert "\nMLP: the model's code called sys.exit(0) before its analysis finished\n" in out
    assert "broken.json' is not valid JSON: NaN is not a value a baseline or saved analysis holds\n" in out


def test_two_tests_recording_one_entry_with_other_costs_fail_the_update(warm: None, pytester: pytest.Pytester) -> None:
    """Both default to the class name "MLP": the deeper one overwrote the entry, and from then on the smaller
    one was checked against the deeper one's costs, passing however much it grew up to them. Recording the
    same costs twice (one model checked in two tests) stays allowed."""
    write_tests(pytester, """
        def test_small(assert_cost):
            assert_cost(MLP(), torch.randn(2, 4), "costs.json")

        def test_small_again(assert_cost):
            assert_cost(MLP(), torch.randn(2, 4), "costs.json")

        def test_deeper(assert_cost):
            assert_cost(MLP(extra=1), torch.randn(2, 4), "costs.json")
        """)
    result = run(pytester, "--update-baselines")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines([
        "*test_deeper records the entry 'MLP' of *costs.json with other costs or inputs than "
        "tests/test_costs.py::test_small did in this run*give each its own name=",
        "MLP: over its baseline (tolerance 0.00%)"])
    assert models(pytester.path / "tests" / "costs.json")["MLP"]["modules"][""]["flops"] == 96  # the first's


def test_one_test_recording_one_entry_twice_with_other_costs_fails_the_update(warm: None,
                                                                              pytester: pytest.Pytester) -> None:
    """A loop over two models of one class in one test: the second call overwrote the first's entry (the guard
    against it looked at other tests only), the update passed, and from then on the smaller model was checked
    against the deeper one's costs — "shrank", a pass, however much it grew up to them. The summary counted
    the entries written by every call, also those compared instead."""
    write_tests(pytester, """
        def test_loop(assert_cost):
            for extra in (0, 1):
                assert_cost(MLP(extra=extra), torch.randn(2, 4), "costs.json")

        def test_same_twice(assert_cost):
            for _ in range(2):
                assert_cost(MLP(), torch.randn(2, 4), "other.json")
        """)
    result = run(pytester, "--update-baselines")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*test_loop records the entry 'MLP' of *costs.json with other costs or inputs than an earlier call of "
        "the same test did in this run*", "modelmeter: recorded 2 baseline entries in *"])
    assert models(pytester.path / "tests" / "costs.json")["MLP"]["modules"][""]["flops"] == 96  # the first's


def test_a_second_recording_of_one_entry_within_the_tolerance_fails_the_update(warm: None,
                                                                              pytester: pytest.Pytester) -> None:
    """The second call's costs were compared with the test's tolerance: within it, the entry kept the first model's
    costs and the second was checked against them from then on (able to grow past its own tolerance)."""
    write_tests(pytester, """
        def test_loop(assert_cost):
            for extra in (0, 1):
                assert_cost(MLP(extra=extra), torch.randn(2, 4), "costs.json", tolerance=10.0)
        """)
    result = run(pytester, "--update-baselines")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*test_loop records the entry 'MLP' of *costs.json with other costs*"])


def test_a_baseline_that_is_no_path_is_refused_naming_it(warm: None, pytester: pytest.Pytester) -> None:
    """``here / 1`` raised pathlib's TypeError, naming no argument."""
    write_tests(pytester, """
        def test_mlp(assert_cost):
            assert_cost(MLP(), torch.randn(2, 4), 1)
        """)
    result = run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*InvalidTypeError: baseline must be a path, got int*"])


def test_a_first_recording_that_failed_leaves_the_entry_to_the_next_call(warm: None, pytester: pytest.Pytester) -> None:
    """The entry was noted as recorded before its first recording ran: one that failed (the model raised) made the
    next call compare against an entry never written, said to be recorded "with other costs"."""
    write_tests(pytester, """
        class Broken(MLP):
            def forward(self, x):
                raise ValueError("broken")

        def test_loop(assert_cost):
            try:
                assert_cost(Broken(), torch.randn(2, 4), "costs.json", name="mlp")
            except Exception:
                pass
            assert_cost(MLP(), torch.randn(2, 4), "costs.json", name="mlp")
        """)
    result = run(pytester, "--update-baselines")
    result.assert_outcomes(passed=1)
    assert models(pytester.path / "tests" / "costs.json")["mlp"]["modules"][""]["flops"] == 96
