"""``modelmeter MODEL --parallel PLAN``: the flag, its errors, the per-rank table (text, JSON, HTML) and ``--fit``
under a plan (docs/parallel.md, "The command").

Run in-process through ``main([...])`` on the zoo's tiny Llama (2 layers, 64 wide). The per-rank dict
(``Result.parallel``) is built by hand where the rendering is tested, so each number in the table is known;
end-to-end checks run the dict the analysis makes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from modelmeter.analysis import Analysis
from modelmeter.cli import fit as fit_module
from modelmeter.cli import main
from modelmeter.cli.fit import rank_peak
from modelmeter.cli.job import job_argv, job_from_args
from modelmeter.cli.options import build_parser
from modelmeter.reports.format import format_bytes
from modelmeter.reports.html_parallel import memory_bars, parallel_section
from modelmeter.reports.ranks import folded_ranks, rank_table
from modelmeter.reports.result import Result
from modelmeter.trace_files import read_saved_trace

MODEL = "llama2_tiny"
GiB = 2**30


def run(capsys: pytest.CaptureFixture[str], *argv: str, code: int = 0) -> tuple[str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    assert status == code, f"exit {status}, stderr: {err}"
    return out, err


def entry(first: int, last: int, stage: int | None, flops: int, held: int, peak: int | None, sent: float,
          step: float | None) -> dict[str, Any]:
    """One row of ``Result.parallel["ranks"]``: the peak's parts a quarter each of parameter, gradient, optimizer
    state and activation; received 1.5 times sent (as a pipeline's ranks receive more than they send)."""
    quarter = None if peak is None else peak // 4
    memory = None if peak is None or quarter is None else {
        "peak": peak, "parts": {"parameter": quarter, "gradient": quarter, "optimizer_state": quarter,
                                "activation": peak - 3 * quarter}}
    time = None if step is None else {"compute": step / 2, "communication": step, "exposed": step / 2,
                                      "step": step, "bubble": None, "assumption": "collectives overlap compute"}
    return {"ranks": [first, last], "count": last - first + 1, "stage": stage,
            "flops": {"forward": flops // 3, "backward": flops - flops // 3, "total": flops},
            "parameters": {"held": held, "global": held * 64},
            "memory": memory,
            "communication": {"sent": sent, "received": 1.5 * sent,
                              "by_kind": {"all_gather": {"count": 3, "payload": int(sent), "sent": sent,
                                                         "received": sent}},
                              "by_dim": {"fsdp": {"count": 3, "sent": sent, "received": sent}}},
            "time": time}


def plan_dict(memory: bool = True, time: bool = True) -> dict[str, Any]:
    """A 4096-rank plan with a pipeline of 4 stages, its ranks folded into three rows."""
    def peak(gib: float) -> int | None:
        return int(gib * GiB) if memory else None

    def step(seconds: float) -> float | None:
        return seconds if time else None

    return {"plan": "pp=4,dp=2,fsdp=64,tp=8", "world_size": 4096, "mesh": {"pp": 4, "dp": 2, "fsdp": 64, "tp": 8},
            "micro_batches": 8, "per": "step",
            "ranks": [entry(0, 1023, 0, 12_345_000_000_000, 1_581_000_000, peak(57), 12.5 * GiB, step(1.25)),
                      entry(1024, 3071, 1, 11_345_000_000_000, 1_480_000_000, peak(51.5), 11 * GiB, step(1.25)),
                      entry(3072, 4095, 3, 14_345_000_000_000, 1_600_000_000, peak(70), 13 * GiB, step(0.5))],
            "pipeline": {"stages": 4, "micro_batches": 8, "bubble_fraction": 0.2727, "schedule": "1F1B"}}


@pytest.fixture
def with_ranks(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Every analysis's Result carries :func:`plan_dict` as its ``parallel`` (the command's plumbing, whatever
    the per-rank analysis makes)."""
    made = plan_dict()
    result = Analysis.result

    def with_plan(self: Analysis, name: str | None = None) -> Result:
        found = result(self, name)
        found.parallel = made  # type: ignore[attr-defined]  # a field once the per-rank analysis lands
        return found

    monkeypatch.setattr(Analysis, "result", with_plan)
    return made


# --- the flag --------------------------------------------------------------------------------------------------
def test_the_plan_reaches_the_analysis(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    saved = tmp_path / "rank.mmtrace"
    out, _ = run(capsys, MODEL, "--parallel", "tp=2, fsdp=2", "--backward", "--depth", "0", "--no-cache",
                 "--save-trace", str(saved))
    assert "rank 0 of 4 under fsdp=2,tp=2," in out.replace("\n  ", " ")  # the plan as ParallelPlan writes it
    parallel = read_saved_trace(str(saved)).trace.parallel
    assert parallel is not None
    assert (parallel["plan"], parallel["world_size"], parallel["mesh"]) == ("fsdp=2,tp=2", 4, {"fsdp": 2, "tp": 2})


def test_the_plan_is_part_of_the_job_and_its_arguments() -> None:
    args = build_parser().parse_intermixed_args([MODEL, "--parallel", "dp=2,fsdp=64,tp=8,pp=4,mp=bf16"])
    job = job_from_args(args)
    assert job.parallel == "pp=4,dp=2,fsdp=64,tp=8,param_dtype=bfloat16,reduce_dtype=float32"
    argv = job_argv(job)
    assert argv[argv.index("--parallel") + 1] == job.parallel  # a baseline entry runs the same plan again
    assert job_from_args(build_parser().parse_intermixed_args(argv)) == job


@pytest.mark.parametrize(("argv", "says"), [
    (["--parallel", "fsdp=2,foo=3"], "argument --parallel: unknown part 'foo=3' of the parallel plan"),
    (["--parallel", "fsdp=0"], "argument --parallel: part 'fsdp=0' of the parallel plan: fsdp must be at least 1"),
    (["--parallel", "fsdp=2,fsdp=4"], "argument --parallel: part 'fsdp=4' of the parallel plan sets fsdp again"),
    (["--parallel", ""], "argument --parallel: an empty parallel plan"),
    (["--parallel", "fsdp=2", "--real"], "--parallel fsdp=2 simulates its ranks on fake tensors"),
    (["--parallel", "tp=3"], "--parallel tp=3: attention module 'model.layers.0.self_attn' has 4 query heads"),
    (["--fit", "device"], "--fit device fills the memory of --device NAME"),
    (["--fit", "1GiB", "--device", "h100"], "--fit SIZE searches the batch by its peak memory"),
])
def test_bad_plans_are_usage_errors(capsys: pytest.CaptureFixture[str], argv: list[str], says: str) -> None:
    _, err = run(capsys, MODEL, "--no-cache", *argv, code=2)
    assert err.startswith(f"modelmeter: {says}") and err.count("\n") == 1, err


def test_the_plan_composes_with_the_cache(capsys: pytest.CaptureFixture[str]) -> None:
    first, _ = run(capsys, MODEL, "--parallel", "fsdp=2", "--optimizer", "adamw", "--depth", "0")
    again, _ = run(capsys, MODEL, "--parallel", "fsdp=2", "--optimizer", "adamw", "--depth", "0")
    other, _ = run(capsys, MODEL, "--parallel", "fsdp=4", "--optimizer", "adamw", "--depth", "0")
    assert "from the cache" not in first and "from the cache" in again
    assert "from the cache" not in other  # another plan is another run
    params = [re.search(r"^model\s+Llama\s+(\S+)", text, re.M).group(1)  # type: ignore[union-attr]
              for text in (first, again, other)]
    # the rank's parameter shards: the model's 220,480 parameters (every first dimension divisible by 4) halved,
    # 110,240, and quartered, 55,120
    assert params == ["0.11M", "0.11M", "55.12K"]


def test_a_sweep_runs_the_plan_for_each_value(capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = run(capsys, MODEL, "--parallel", "fsdp=2", "--sweep", "batch=1,2", "--jobs", "1", "--no-cache")
    assert out.startswith(f"{MODEL}: sweep of batch (fake run, one rank under fsdp=2)")
    assert [line.split()[1] for line in out.splitlines()[2:4]] == ["0.11M", "0.11M"]  # the rank's shards


# --- the per-rank table ----------------------------------------------------------------------------------------
def test_ranks_are_folded() -> None:
    assert folded_ranks({"ranks": [0, 1023], "count": 1024}) == "0–1023 (×1024)"
    assert folded_ranks({"ranks": [5, 5], "count": 1}) == "5"
    assert folded_ranks({"ranks": [0, 6], "count": 4}) == "0–6 (×4)"  # ranks of equal cost need not be contiguous


def test_the_table_by_hand() -> None:
    lines = rank_table(plan_dict(), width=None).splitlines()
    assert lines[0] == ("Per rank under pp=4,dp=2,fsdp=64,tp=8: 4,096 ranks (mesh pp=4 × dp=2 × fsdp=64 × tp=8), "
                        "ranks of equal cost in one row; numbers per step of 8 micro-batches")
    assert lines[1].split() == ["ranks", "stage", "#flops", "#params", "held", "peak", "memory", "sent",
                                "received", "step", "time"]
    # one unit per column: the largest value's (T FLOPs, G parameters, GiB, s)
    assert lines[3].split() == ["0–1023", "(×1024)", "0", "12.345T", "1.581G", "57GiB", "12.5GiB", "18.75GiB",
                                "1.25s"]
    assert lines[5].split() == ["3072–4095", "(×1024)", "3", "14.345T", "1.6G", "70GiB", "13GiB", "19.5GiB",
                                "0.5s"]
    assert lines[6] == ("Pipeline: 4 stages, 8 micro-batches per step (1F1B, derived from per-stage traces): the "
                        "bubble is 27.3% of the step")
    assert lines[7] == "Step time: collectives overlap compute"


def test_the_table_without_memory_or_time() -> None:
    forward_only = plan_dict(memory=False, time=False)  # a pipeline's inference: no schedule
    forward_only["pipeline"].update(bubble_fraction=None, schedule=None)
    lines = rank_table(forward_only).splitlines()
    assert lines[1].split() == ["ranks", "stage", "#flops", "#params", "held", "sent", "received"]
    assert lines[-1] == "Pipeline: 4 stages, 8 micro-batches per step, forward only: no schedule, no bubble"


@pytest.mark.parametrize("width", [80, 200])
def test_the_table_fits_the_terminal(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                     with_ranks: dict[str, Any], width: int) -> None:
    monkeypatch.setenv("COLUMNS", str(width))
    out, _ = run(capsys, MODEL, "--parallel", "fsdp=2", "--no-cache")
    assert max(map(len, out.splitlines())) <= width
    modules, ranks = out.split("\nPer rank under ")  # after the model's table
    assert "\nmodel " in modules
    header = ranks.splitlines()[2 if width == 80 else 1].split()
    if width == 200:
        assert header == ["ranks", "stage", "#flops", "#params", "held", "peak", "memory", "sent", "received",
                          "step", "time"] and "Left out" not in ranks
    else:  # the short headers
        assert header == ["ranks", "stage", "#flops", "#params", "peak", "sent", "recv", "step"]


def test_a_narrow_table_leaves_columns_out() -> None:
    lines = rank_table(plan_dict(), width=60).splitlines()
    assert max(map(len, lines)) <= 60
    assert lines[3].split() == ["ranks", "stage", "#flops", "peak", "sent", "step"]  # the least telling left out
    assert "Left out to fit 60 characters: received, params (all columns: --wide)" in \
        " ".join(line.strip() for line in lines)


def test_wide_shows_every_column(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                 with_ranks: dict[str, Any]) -> None:
    monkeypatch.setenv("COLUMNS", "40")
    out, _ = run(capsys, MODEL, "--parallel", "fsdp=2", "--no-cache", "--wide", "--depth", "0")
    assert "received" in out and "Left out" not in out


def test_markdown_has_the_table_too(capsys: pytest.CaptureFixture[str], with_ranks: dict[str, Any]) -> None:
    out, _ = run(capsys, MODEL, "--parallel", "fsdp=2", "--no-cache", "--format", "markdown", "--depth", "0")
    assert "| 0–1023 (×1024) | 0 | 12.345T | 1.581G | 57GiB | 12.5GiB | 18.75GiB | 1.25s |" in \
        re.sub(" +", " ", out)
    assert "- Pipeline: 4 stages" in out


def test_csv_stays_one_table(capsys: pytest.CaptureFixture[str], with_ranks: dict[str, Any]) -> None:
    out, _ = run(capsys, MODEL, "--parallel", "fsdp=2", "--no-cache", "--format", "csv")
    assert "Per rank" not in out and out.startswith("name,type,depth,params")


def test_html_has_the_parallel_section(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                       with_ranks: dict[str, Any]) -> None:
    page = tmp_path / "report.html"
    run(capsys, MODEL, "--parallel", "fsdp=2", "--no-cache", "--html", str(page))
    text = page.read_text(encoding="utf-8")
    section = text[text.index('<section id="parallel">'):]
    section = section[:section.index("</section>")]
    assert "<h2>Parallel plan</h2>" in section and "<td class=\"text\">1024–3071 (×2048)</td>" in section
    assert section.count("<tr>") == 4 and section.count('class="k-optimizer_state"') == 3
    assert ".k-optimizer_state" in text  # the bars' colours are on the page


def test_memory_bars_by_hand() -> None:
    bars = memory_bars(plan_dict())
    assert bars is not None and bars["kinds"] == ["parameter", "gradient", "optimizer_state", "activation"]
    widest, first = bars["rows"][2], bars["rows"][0]
    assert widest["parts"][0]["x"] == 150.0 and widest["end"] == 660.0  # the highest peak spans the room
    assert first["end"] == pytest.approx(150 + 510 * 57 / 70, abs=0.01)
    quarter = int(57 * GiB) // 4
    assert [part["bytes"] for part in first["parts"]] == [quarter] * 3 + [int(57 * GiB) - 3 * quarter]
    assert memory_bars(plan_dict(memory=False)) is None


def test_html_text_is_escaped() -> None:
    hostile = plan_dict()
    hostile["plan"] = "<script>alert(1)</script>"
    hostile["ranks"][0]["memory"]["parts"] = {"<b>": 1}
    section = parallel_section(hostile)
    assert "<script>" not in section and "<b>" not in section and "&lt;script&gt;" in section


def test_json_carries_the_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = run(capsys, MODEL, "--parallel", "fsdp=2", "--backward", "--memory", "--no-cache", "--format", "json")
    parallel = json.loads(out)["parallel"]
    assert (parallel["plan"], parallel["world_size"], parallel["mesh"]) == ("fsdp=2", 2, {"fsdp": 2})
    assert sum(row["count"] for row in parallel["ranks"]) == 2


def test_the_analysis_makes_the_table(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    out, _ = run(capsys, MODEL, "--parallel", "fsdp=2,tp=2", "--optimizer", "adamw", "--device", "h100",
                 "--no-cache")
    assert "Per rank under fsdp=2,tp=2: 4 ranks" in out and max(map(len, out.splitlines())) <= 80


# --- --fit under a plan ----------------------------------------------------------------------------------------
def fit(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    out, _ = run(capsys, MODEL, "--optimizer", "adamw", *argv, "--format", "json")
    data: dict[str, Any] = json.loads(out)
    return data


def test_fit_under_fsdp_finds_a_larger_micro_batch(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # A training step with AdamW at 64 tokens a sample: about 4.1MiB at batch 1 on one device, 3.4MiB on a rank of
    # fsdp=2 (half the parameters, gradients and Adam's state), each sample adding about 1.1MiB of activations and
    # kernels' temporaries (batch 2: 5.1MiB alone, 4.5MiB on the rank).
    limit, limit_bytes = "4.75MiB", 4.75 * 2**20
    alone = fit(capsys, "--fit", limit)
    sharded = fit(capsys, "--fit", limit, "--parallel", "fsdp=2")
    assert (alone["largest"], sharded["largest"]) == (1, 2)
    assert sharded["parallel"] == "fsdp=2" and alone["parallel"] is None
    assert sharded["step"] == "training step with adamw"
    for data in (alone, sharded):
        assert data["peak"] <= limit_bytes < data["next"]["peak"]
    out, err = run(capsys, MODEL, "--optimizer", "adamw", "--fit", limit, "--parallel", "fsdp=2")
    assert "fit: micro-batch 2: peak" in err
    size, fitting, failing = (format_bytes(v) for v in (limit_bytes, sharded["peak"], sharded["next"]["peak"]))
    assert out.splitlines()[-1] == (f"largest micro-batch per rank that fits in {size}: 2 (peak {fitting}; "
                                    f"micro-batch 3 needs {failing})")
    # --fit device: the same limit as a device's memory (the runs come from the cache now)
    devices = tmp_path / "small.json"
    devices.write_text(json.dumps({"devices": {"small": {
        "memory": 19 * 2**18, "bandwidth": 1e12, "vector": {"fp32": 1e12}}}}))
    on_device = fit(capsys, "--fit", "device", "--device", "small", "--devices-file", str(devices),
                    "--parallel", "fsdp=2")
    assert (on_device["limit"], on_device["largest"], on_device["tried"]) == (19 * 2**18, 2, sharded["tried"])


def test_fit_under_a_plan_is_a_training_step(capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fit_module, "FIT_CAP", 1)  # one micro-batch tried
    out, _ = run(capsys, MODEL, "--fit", "1GiB", "--parallel", "fsdp=2", "--format", "json")
    assert json.loads(out)["step"] == "training step"  # no --backward given: a plan's sharding is of training


def test_fit_takes_the_worst_rank() -> None:
    parallel = plan_dict()
    assert rank_peak({"peak": 1}, parallel) == int(70 * GiB)  # the last stage's, the highest
    assert rank_peak({"peak": 1}, plan_dict(memory=False)) == 1  # no per-rank memory: the run's own
    assert rank_peak({"peak": 7}, None) == 7


def test_fit_under_a_pipeline_takes_the_worst_stage(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    plan = ["--parallel", "pp=2,fsdp=2,mb=4", "--optimizer", "adamw"]
    one = json.loads(run(capsys, MODEL, *plan, "--batch", "1", "--format", "json")[0])
    stages = [row["memory"]["peak"] for row in one["parallel"]["ranks"]]
    assert len(stages) == 2 and max(stages) != one["memory"]["peak"]  # the whole model's run is not a stage's
    monkeypatch.setattr(fit_module, "FIT_CAP", 1)
    data = fit(capsys, "--fit", "1GiB", *plan)
    assert data["tried"] == [{"batch": 1, "peak": max(stages), "fits": True}]
