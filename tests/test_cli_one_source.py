"""What the command wrote in two places now has one: the input options of a job (a baseline entry's arguments and
the message about inputs that do not fit), the options a baseline entry holds (what the command writes, what a
saved spec may hold, what a check of every model refuses), and the exit status of a refused input (a single run
and a row of --sweep alike: 2; a baseline entry's: 1)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from modelmeter.cli import guard as guard_command
from modelmeter.cli import main
from modelmeter.cli.errors import ModelSpecError
from modelmeter.cli.guard import check_all
from modelmeter.cli.job import DeviceOptions, Job, input_argv, job_argv, job_from_args
from modelmeter.cli.options import GUARD_OPTIONS, ONE_RUN_OPTIONS, build_parser, option_defaults, options_given
from modelmeter.cli.output import PATH_OPTIONS
from modelmeter.cli.refusals import worker_row
from modelmeter.guard.baseline import COMPARED_APART, NOT_MEASURED
from modelmeter.guard.specs import ENTRY_OPTIONS, check_spec

INPUT_FLAGS = ("--input", "--batch", "--resolution", "--seq-len")
JOBS = [
    Job("resnet18"),
    Job("resnet18", batch=4, resolution=64, dtype=torch.float16),
    Job("gpt2_tiny", seq_len=16, batch=2),
    Job("m.py:build", ("width=3",), shapes=(((1, 3, 32, 32), None),)),
    Job("m.py:build", shapes=(((2, 128), torch.int64), ((2, 128), torch.bool), ((4,), torch.bfloat16))),
    Job("m.py:build", shapes=(((7,), torch.float64),), execution="real", backward=True, convention="macs"),
]


def _input_options(argv: list[str]) -> list[str]:
    """The input options of an entry's arguments, each with its value, in order."""
    return [word for flag, value in itertools.pairwise(argv) if flag in INPUT_FLAGS for word in (flag, value)]


@pytest.mark.parametrize("job", JOBS)
def test_the_inputs_named_by_a_message_are_those_a_baseline_entry_keeps(job: Job) -> None:
    """The message about inputs that do not fit (cli/refusals.py) and the entry's arguments (job_argv) format the
    inputs once; both parse back to the job's inputs."""
    assert input_argv(job) == _input_options(job_argv(job))
    parsed = job_from_args(build_parser().parse_args([job.spec, *input_argv(job)]))
    assert (parsed.shapes, parsed.batch, parsed.resolution, parsed.seq_len) == \
        (job.shapes, job.batch, job.resolution, job.seq_len)


def test_a_job_without_chosen_inputs_names_none() -> None:
    assert input_argv(Job("resnet18", dtype=torch.float16, backward=True)) == []


# --- a refused input: exit 2 in a single run and in a sweep's row ---------------------------------------------------
def test_a_sweep_row_the_models_code_refuses_exits_2_as_the_single_run_does(capsys: pytest.CaptureFixture[str]) -> None:
    """GPT's block size refuses a sequence of 2048: one run exited 2 (the input given does not fit), the same value
    as a --sweep row exited 1, the status of a model that fails whatever its input."""
    assert main(["gpt2_tiny", "--seq-len", "2048", "--no-cache"]) == 2
    single = capsys.readouterr().err
    assert main(["gpt2_tiny", "--sweep", "seq-len=16,2048", "--jobs", "1", "--no-cache"]) == 2
    row = capsys.readouterr().err.splitlines()[-1]
    assert row.startswith("modelmeter: seq-len=2048: ") and "(--seq-len 2048) does not fit the model" in row
    assert row.removeprefix("modelmeter: seq-len=2048: ") == single.strip().removeprefix("modelmeter: ")


def test_a_worker_row_of_a_model_that_fails_on_its_default_input_too_is_code_1(tmp_path: Path) -> None:
    """The default run stays the oracle in a worker (a sweep's row, a baseline entry): a model that fails whatever
    its input is at fault, 1."""
    (tmp_path / "broken.py").write_text(  # 7 rows of the last dimension: neither input's 3 columns split so
        "import torch\n"
        "def build():\n"
        "    return torch.nn.Unflatten(-1, (7, -1)), torch.zeros(2, 3)\n")
    row = worker_row(Job(f"{tmp_path / 'broken.py'}:build", shapes=(((4, 3), None),), cache=False), lambda *_: {})
    assert row["code"] == 1 and row["error"].startswith("the model failed"), row


CHECKED_MODELS = """\
from pathlib import Path

import torch

HERE = Path(__file__).parent


class Fits(torch.nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.features = features

    def forward(self, x):
        if x.shape[-1] != self.features:
            raise ValueError(f"expected {self.features} features")
        return x * 2


def fits():
    features = int((HERE / "features.txt").read_text())
    return Fits(features), torch.zeros(2, features)


def grows():
    return torch.nn.Linear(4, int((HERE / "width.txt").read_text())), torch.zeros(2, 4)
"""


def test_a_baseline_entry_whose_saved_inputs_the_model_now_refuses_fails_with_growth(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The entry's inputs came from the baseline file, not the command line: a refusal is the model's failure, 1,
    naming the entry; it exited 2 (a usage error), and so did the check with another entry that grew (README:
    growth exits 1)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.py").write_text(CHECKED_MODELS)
    (tmp_path / "features.txt").write_text("3")
    (tmp_path / "width.txt").write_text("8")
    assert main(["m.py:fits", "--input", "5x3", "--save-baseline", "b.json", "--no-cache"]) == 0
    assert main(["m.py:grows", "--save-baseline", "b.json", "--no-cache"]) == 0
    (tmp_path / "features.txt").write_text("4")
    capsys.readouterr()
    assert main(["--check-baseline", "b.json", "--jobs", "1"]) == 1  # the refused entry alone
    err = capsys.readouterr().err
    assert "modelmeter: m.py:fits: " in err and "does not fit the model" in err, err
    assert "1 over it or failed, 0 not comparable or refused" in err, err
    (tmp_path / "width.txt").write_text("16")
    assert main(["--check-baseline", "b.json", "--jobs", "1"]) == 1
    assert "2 over it or failed, 0 not comparable or refused" in capsys.readouterr().err


# --- options_given: the parser's options and defaults, read once ---------------------------------------------------
def test_every_list_of_options_names_options_of_the_parser() -> None:
    """options_given takes an option the parser lacks as not given: a misspelt or removed option fails here."""
    every = set(option_defaults())
    for options in (GUARD_OPTIONS, ONE_RUN_OPTIONS, ENTRY_OPTIONS, guard_command._ONE_MODEL, PATH_OPTIONS):
        assert set(options) <= every, set(options) - every


@pytest.mark.parametrize("argv", [["resnet18"], ["resnet18", "--budget", "flops=1", "--depth", "3", "--html", "x"],
                                  ["--check-baseline", "b.json", "--batch", "2", "--real", "--format", "json"],
                                  ["m.py:f", "--depth", "2", "--format", "table", "--memory", "--parallel", "dp=2"]])
def test_options_given_equals_a_fresh_parsers_reading(argv: list[str]) -> None:
    """The map built once answers as a parser built for each call did (a default given explicitly is not given)."""
    args = build_parser().parse_args(argv)
    options = (*ONE_RUN_OPTIONS, *ENTRY_OPTIONS, *guard_command._ONE_MODEL, "--depth")
    parser = build_parser()
    dests = {option: action.dest for action in parser._actions for option in action.option_strings}
    fresh = [option for option in options if getattr(args, dests[option]) != parser.get_default(dests[option])]
    assert options_given(args, options) == fresh
    assert options_given(args, ("--no-such-option",)) == []  # was a KeyError at run time


# --- the options a baseline entry holds: one list (guard/specs.py), every consumer held to it ----------------------
def _options_and_values(argv: list[str]) -> dict[str, list[str]]:
    """The options of an entry's arguments (after the model and its key=value words), each with its values."""
    options: dict[str, list[str]] = {}
    for word in argv:
        if word.startswith("--"):
            last = options.setdefault(word, [])
        elif options:
            last.append(word)
    return options


# a job of every option at a value the command takes, other than its default
EVERY_OPTION = _options_and_values(job_argv(Job(
    "resnet18", shapes=(((2, 3), torch.float16),), batch=2, resolution=64, seq_len=7, dtype=torch.bfloat16,
    execution="real", convention="macs", backward=True, dense_attention=True, attention_kernel="math", memory=True,
    optimizer="adam", state_dtype="bfloat16", foreach=True, parallel="dp=2",
    device=DeviceOptions("h100", "d.json", 0.5, 4e-6, True, 0.005))))


def test_job_argv_writes_exactly_the_options_an_entry_holds() -> None:
    """Each of ENTRY_OPTIONS is written, with one value where it says one follows (--input once here)."""
    assert set(EVERY_OPTION) == set(ENTRY_OPTIONS)
    assert {option: len(values) == 1 for option, values in EVERY_OPTION.items()} == ENTRY_OPTIONS


def test_a_comparison_sorts_only_options_an_entry_holds() -> None:
    assert set(ENTRY_OPTIONS) >= COMPARED_APART | NOT_MEASURED


def test_a_saved_spec_may_hold_exactly_the_entry_options(tmp_path: Path) -> None:
    """check_spec refuses every other option of the command, and none of these as one a baseline may not hold."""
    parser = build_parser()
    every = {option for action in parser._actions for option in action.option_strings if option.startswith("--")}
    assert set(ENTRY_OPTIONS) <= every
    for option in sorted(every):
        if option in ("--help",):
            continue
        argv = ["resnet18", option, *EVERY_OPTION.get(option, ["1"] * ENTRY_OPTIONS.get(option, False))]
        try:
            check_spec(argv, "e", tmp_path / "b.json", build_parser())
            refused = ""
        except ModelSpecError as exc:
            refused = str(exc)
        assert ("which a baseline may not hold" in refused) == (option not in ENTRY_OPTIONS), (option, refused)


@pytest.mark.parametrize("option", [*ENTRY_OPTIONS, "--budget", "--save-baseline", "--name", "--sweep", "--fit",
                                    "--real", "--html", "--compare", "--output", "--save-trace", "--format"])
def test_a_check_of_every_model_refuses_what_each_entry_brings_and_what_acts_on_one_model(option: str) -> None:
    """Each entry runs as it was saved: an entry option on the command line would be ignored, silently (--save-trace
    was: no trace was written)."""
    values = {"--budget": ["flops=1"], "--sweep": ["batch=1,2"], "--fit": ["1GiB"], "--real": [],
              "--format": ["json"]}.get(option) or EVERY_OPTION.get(option) or ["x.json"]
    args = build_parser().parse_args(["--check-baseline", "b.json", option, *values])
    with pytest.raises(ModelSpecError, match=f"^{option}: a check of every model of b.json runs each entry as it"):
        check_all(args)


@pytest.mark.parametrize("option", ["--tolerance", "--jobs", "--no-cache", "--depth"])
def test_a_check_of_every_model_takes_its_own_options(option: str, tmp_path: Path) -> None:
    values = {"--tolerance": ["1%"], "--jobs": ["2"], "--depth": ["1"]}.get(option, [])
    args = build_parser().parse_args(["--check-baseline", str(tmp_path / "b.json"), option, *values])
    with pytest.raises(ModelSpecError, match="no baseline file"):  # refused for the missing file alone
        check_all(args)


# --- the guard's options that judge one run: one tuple (cli/options.py) ---------------------------------------------
GUARD_VALUES = {"--budget": "flops=1G", "--save-baseline": "s.json", "--check-baseline": "c.json"}


def test_the_guard_options_are_the_guard_groups_less_its_qualifiers() -> None:
    group = next(g for g in build_parser()._action_groups if g.title and g.title.startswith("cost guard"))
    flags = [option for action in group._group_actions for option in action.option_strings]
    assert (*GUARD_OPTIONS, "--tolerance", "--name") == tuple(sorted(flags, key=[*GUARD_OPTIONS, "--tolerance",
                                                                                "--name"].index))
    assert set(GUARD_VALUES) == set(GUARD_OPTIONS)


@pytest.mark.parametrize("option", GUARD_OPTIONS)
def test_each_guard_option_guards_the_run_and_is_refused_by_sweep_and_fit(option: str) -> None:
    def job(*argv: str) -> Job:
        return job_from_args(build_parser().parse_args(["resnet18", option, GUARD_VALUES[option], *argv]))

    assert not job().cache  # guarded: the model runs
    assert job("--name", "mine").model == "resnet18"  # --name qualifies it
    for argv, words in ((["--sweep", "batch=1,2"], "--sweep reports many runs"),
                        (["--fit", "1GiB"], "--fit analyses many batches")):
        with pytest.raises(ModelSpecError, match=words):
            job(*argv)
