"""The cost guard's leftovers of session 11: a baseline keeps the model's training mode (BatchNorm and dropout count
otherwise in training), the rule that a backward pass without checkpointing recomputes nothing lives in one place,
and the run options a comparison checks are derived from what the command writes (cli/job.py, job_argv), so that an
option added there cannot be forgotten here."""

from __future__ import annotations

import dataclasses
import json
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from modelmeter import analyze
from modelmeter.cli import main
from modelmeter.cli.job import DeviceOptions, Job, job_argv
from modelmeter.cli.models import load_model
from modelmeter.guard import (
    BaselineFile,
    CostAssertionError,
    GuardFileError,
    assert_cost,
    compare,
    entry_from_result,
    training_mode,
)
from modelmeter.guard.baseline import COMMAND_MODE, COMPARED_APART, NOT_MEASURED, run_options
from modelmeter.guard.budget import metric_values
from test_guard import cli


def normed() -> nn.Sequential:
    """Conv, BatchNorm, dropout: fvcore counts BatchNorm 5 FLOPs per element in training, 2 in eval."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5))


X = torch.randn(2, 3, 8, 8)


def flags(model: nn.Module) -> list[bool]:
    return [module.training for module in model.modules()]


# --- 1. the training mode -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("saved", "checked"), [("train", "eval"), ("eval", "train")])
def test_a_baseline_in_one_training_mode_is_not_checked_in_the_other(tmp_path: Path, saved: str,
                                                                     checked: str) -> None:
    """A `.train()` baseline checked in `.eval()` "shrank" (BatchNorm's 5 FLOPs per element became 2) and passed;
    the other way round it "grew". Either way the runs measure different things: refused as other run options."""
    model = normed()
    getattr(model, saved)()
    assert_cost(model, X, tmp_path / "b.json", update=True)
    getattr(model, checked)()
    before = flags(model)
    with pytest.raises(CostAssertionError, match=f"run options 'mode: {saved}', this run has 'mode: {checked}'"):
        assert_cost(model, X, tmp_path / "b.json")
    assert flags(model) == before  # the model is left as it was
    getattr(model, saved)()
    assert assert_cost(model, X, tmp_path / "b.json") is not None


def test_a_frozen_batchnorm_in_training_is_a_mode_of_its_own(tmp_path: Path) -> None:
    """Fine-tuning freezes BatchNorm (model.train(), then bn.eval()): a module counts by its own flag, so the
    mode names the modules whose flag is not the model's."""
    model = normed().train()
    model[1].eval()
    assert training_mode(model) == "train except 1"
    assert_cost(model, X, tmp_path / "b.json", update=True)
    with pytest.raises(CostAssertionError, match="'mode: train except 1', this run has 'mode: train'"):
        assert_cost(model.train(), X, tmp_path / "b.json")


def test_training_mode_by_hand() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Dropout(), nn.BatchNorm1d(2)))
    assert training_mode(model.eval()) == "eval"
    assert training_mode(model.train()) == "train"
    model[1].eval()
    assert training_mode(model) == "train except 1, 1.0, 1.1"
    model.eval()
    model[1][0].train()
    assert training_mode(model) == "eval except 1.0"


def _drop_mode(path: Path) -> None:
    """The file as modelmeter wrote it before entries kept the training mode."""
    data = json.loads(path.read_text())
    for entry in data["models"].values():
        del entry["mode"]
    path.write_text(json.dumps(data))


def test_an_old_entry_of_assert_cost_is_checked_on_its_costs_with_a_note(tmp_path: Path) -> None:
    """An entry saved before the mode was kept is read and compared on its costs as before (the file stays usable);
    the modes were not compared, which the comparison notes and assert_cost warns about."""
    model = normed().eval()
    assert_cost(model, X, tmp_path / "b.json", update=True)
    _drop_mode(tmp_path / "b.json")
    assert BaselineFile.load(tmp_path / "b.json").entries["Sequential"].mode is None
    with pytest.warns(UserWarning, match="the baseline records no training mode"):
        comparison = assert_cost(model, X, tmp_path / "b.json")
    assert comparison is not None
    assert "note: the baseline records no training mode" in comparison.report()
    with pytest.raises(CostAssertionError, match=r"grew[\s\S]*note: the baseline records no training mode"):
        assert_cost(model.train(), X, tmp_path / "b.json")  # BatchNorm in training: more FLOPs, a failure


def test_an_entry_without_a_mode_on_the_other_side_is_not_compared_either() -> None:
    """A library user's entry_from_result(result) records no mode: compared on its costs, with the note."""
    result = analyze(normed().eval(), X, quiet=True).result()
    comparison = compare("m", entry_from_result(result, mode="eval"), entry_from_result(result))
    assert comparison.ok
    assert comparison.notes == ["this run records no training mode (saved before modelmeter kept it), so the modes "
                                "were not compared: save the baseline again to compare them"]


MODEL_FILE = textwrap.dedent("""
    from torch import nn

    def normed():
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5))
""")


def in_project(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Work in ``path``, where ``m.py:normed`` names the model."""
    monkeypatch.chdir(path)
    (path / "m.py").write_text(MODEL_FILE)


def test_the_command_records_the_mode_it_builds_models_in(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The command's models are in eval mode (load_model): its entries say so, and an entry it saved before
    entries kept the mode is one of eval mode, compared without a note. An entry of another mode is refused."""
    in_project(tmp_path, monkeypatch)
    assert training_mode(load_model("m.py:normed").model) == COMMAND_MODE == "eval"
    cli(capsys, "m.py:normed", "--input", "2x3x8x8", "--save-baseline", "b.json")
    assert BaselineFile.load("b.json").entries["m.py:normed"].mode == "eval"
    _drop_mode(Path("b.json"))
    _, err = cli(capsys, "m.py:normed", "--input", "2x3x8x8", "--check-baseline", "b.json")
    assert "within its baseline" in err and "note" not in err
    data = json.loads(Path("b.json").read_text())
    data["models"]["m.py:normed"]["mode"] = "train"
    Path("b.json").write_text(json.dumps(data))
    _, err = cli(capsys, "m.py:normed", "--input", "2x3x8x8", "--check-baseline", "b.json", code=2)
    assert "run options 'mode: train', this run has 'mode: eval'" in err
    _, err = cli(capsys, "--check-baseline", "b.json", code=2)
    assert "run options 'mode: train', this run has 'mode: eval'" in err


@pytest.mark.parametrize("mode", ["Train", "training", "eval except", 1, None, ["eval"], "eval\nexcept x",
                                  "eval except \x1b[2J"])
def test_a_mode_no_run_has_is_refused_when_the_file_is_read(tmp_path: Path, mode: Any) -> None:
    """A hand-edited mode that no run can have would refuse every check as another run's, and one with an escape
    sequence would rewrite the terminal that prints it: refused on reading."""
    assert_cost(normed(), X, tmp_path / "b.json", update=True)
    data = json.loads((tmp_path / "b.json").read_text())
    data["models"]["Sequential"]["mode"] = mode
    (tmp_path / "b.json").write_text(json.dumps(data))
    with pytest.raises(GuardFileError, match="mode must be"):
        BaselineFile.load(tmp_path / "b.json")


# --- 2. recompute_* in one place --------------------------------------------------------------------------------
class Block(nn.Module):
    """Linear, tanh, Linear (checkpointed or not), then a head: the checkpointed block runs its first Linear again
    in the backward pass (the tanh needs its output; the second Linear's is not needed)."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 8)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return self.head(checkpoint(self.block, x, use_reentrant=False))
        return self.head(self.block(x))


def test_a_budget_and_a_baseline_hold_the_same_metrics() -> None:
    """A budget of recompute_flops checked 0 without checkpointing, while the baseline's entry held no such
    metric: the rule lived twice, once in each."""
    result = analyze(Block(False), torch.randn(4, 8), backward=True, quiet=True).result()
    entry = entry_from_result(result)
    assert entry.modules[""] == metric_values(result)
    assert entry.modules["block.0"]["recompute_flops"] == entry.modules[""]["recompute_flops"] == 0


def test_a_run_that_starts_recomputing_has_grown() -> None:
    """A baseline saved without checkpointing held no recompute_flops, so a run that started recomputing was
    not compared on them; now it holds 0, and the recomputation is a growth. Oracle: the first Linear's forward,
    once more (4 rows of 8 * 8 under fvcore)."""
    x = torch.randn(4, 8, requires_grad=True)
    plain = entry_from_result(analyze(Block(False), x, backward=True, quiet=True).result())
    recomputing = entry_from_result(analyze(Block(True), x, backward=True, quiet=True).result())
    comparison = compare("block", plain, recomputing)
    grown = {(change.module, change.metric): (change.before, change.after) for change in comparison.grew}
    assert grown[("", "recompute_flops")] == grown[("block.0", "recompute_flops")] == (0, 4 * 8 * 8)
    assert compare("block", recomputing, plain).shrank  # and back: a note, not a mismatch


@pytest.mark.parametrize("old", [False, True])
def test_a_diff_of_a_baseline_and_a_result_of_one_backward_pass_finds_nothing(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, old: bool) -> None:
    """With recompute_* 0 in a baseline's entry, `modelmeter diff` noted "not compared, only the before file has
    them: recompute_flops" against the result of the same run: the result, and an entry saved before entries
    held them (old), follow the same rule."""
    in_project(tmp_path, monkeypatch)
    cli(capsys, "m.py:normed", "--input", "2x3x8x8", "--backward", "--save-baseline", "b.json")
    if old:
        data = json.loads(Path("b.json").read_text())
        for metrics in data["models"]["m.py:normed"]["modules"].values():
            del metrics["recompute_flops"]
        Path("b.json").write_text(json.dumps(data))
        assert BaselineFile.load("b.json").entries["m.py:normed"].modules["0"]["recompute_flops"] == 0
    cli(capsys, "m.py:normed", "--input", "2x3x8x8", "--backward", "--format", "json", "-o", "r.json")
    for files in (("b.json", "r.json"), ("r.json", "b.json")):
        assert main(["diff", *files]) == 0
        out, err = capsys.readouterr()
        assert "no differences" in out and "not compared" not in err, err


# --- 3. the run options, derived from what the command writes -----------------------------------------------------
# a value other than the default for every field of a Job (a field added to Job needs one here)
EVERY_FIELD: dict[str, Any] = {
    "spec": "m.py:build", "overrides": ("width=3",), "shapes": (((2, 3), torch.float16),), "batch": 2,
    "resolution": 64, "seq_len": 7, "dtype": torch.bfloat16, "execution": "real", "convention": "pytorch",
    "backward": True, "dense_attention": True, "attention_kernel": "math", "cache": False, "cache_dir": "c",
    "memory": True, "optimizer": "adam", "state_dtype": "bfloat16", "foreach": True,
    "device": DeviceOptions("h100", "d.json", 0.5, 4e-6, True, 0.005), "parallel": "dp=2", "project": "p",
}
NOT_IN_ARGV = {"cache", "cache_dir", "project"}  # how the command runs a job, not what it measures


def test_every_field_of_a_job_reaches_the_arguments_of_its_entry() -> None:
    """A field of Job that job_argv does not write would be lost from the entry (and from every comparison)."""
    assert set(EVERY_FIELD) == {f.name for f in dataclasses.fields(Job)}, "give the new field a value above"
    base = Job(spec="resnet50")
    for name, value in EVERY_FIELD.items():
        changed = job_argv(dataclasses.replace(base, **{name: value})) != job_argv(base)
        assert changed != (name in NOT_IN_ARGV), name


def test_every_option_the_command_writes_is_a_run_option_unless_the_guard_compares_it_apart() -> None:
    """The guard's list of run options repeated job_argv's: an option added there was not compared. Now every
    option job_argv writes is one, unless the guard names it as compared on its own or measuring nothing; the
    names it sets apart are options job_argv writes (none stale)."""
    argv = job_argv(Job(**EVERY_FIELD))
    written = {token.partition("=")[0] for token in argv if token.startswith("--")}
    assert written >= COMPARED_APART | NOT_MEASURED
    assert not COMPARED_APART & NOT_MEASURED
    assert run_options(argv) == ("--attention-kernel math --dense-attention --dtype bfloat16 --foreach "
                                 "--optimizer adam --parallel dp=2 --state-dtype bfloat16")


def test_an_option_the_guard_does_not_know_is_a_run_option() -> None:
    """An option job_argv starts writing (say --grad-accum) changes what is measured until the guard is told
    otherwise: compared, never silently ignored."""
    spec = ["m.py:build", "width=3", "--grad-accum", "4", "--execution", "auto", "--optimizer=adam", "--memory"]
    assert run_options(spec) == "--grad-accum 4 --optimizer adam"
    assert run_options(spec, "eval") == "--grad-accum 4 --optimizer adam; mode: eval"
    assert run_options([]) == "none"


def test_the_dtype_is_a_run_option() -> None:
    """--dtype was compared with the inputs, which a language model's token ids (int64 whatever the dtype) do not
    show: gpt2 in bfloat16 checked against a float32 baseline "shrank" and passed."""
    assert run_options(["gpt2_tiny", "--dtype", "bfloat16"]) == "--dtype bfloat16"


def test_no_warning_for_an_entry_that_records_its_mode(tmp_path: Path) -> None:
    assert_cost(normed(), X, tmp_path / "b.json", update=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert assert_cost(normed(), X, tmp_path / "b.json") is not None
