"""benchmarks/compare.py: every section is measured and every ratio comes from the times it reports.

Performance itself is never asserted: times depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "compare.py"


def load_compare() -> ModuleType:
    """benchmarks/compare.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("compare", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_timed_warms_up_once_and_summarises_the_timed_runs() -> None:
    compare = load_compare()
    calls: list[int] = []
    row = compare.timed(lambda: calls.append(1), 3)
    assert len(calls) == 4 and row["runs"] == 3
    assert 0 <= row["min_s"] <= row["median_s"] <= row["max_s"]
    assert compare.summary([3.0, 1.0, 2.0]) == {"median_s": 2.0, "min_s": 1.0, "max_s": 3.0, "runs": 3}
    assert compare.ratio({"median_s": 1.0}, {"median_s": 4.0}) == 0.25
    assert compare.ratio({"median_s": 1.0}, {"error": "RuntimeError"}) is None


def positive(cell: dict[str, Any]) -> bool:
    return bool(0 < cell["min_s"] <= cell["median_s"] <= cell["max_s"])


@pytest.mark.slow
def test_quick_run_measures_every_section(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)], capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {"machine", "real", "meta", "llama", "overhead", "cached"} <= report.keys()
    assert report["machine"]["cpu"] and report["machine"]["torch_threads"] == 2

    for section in ("real", "meta"):
        assert set(report[section]) == {"resnet50", "vit_b_16", "swin_t", "gpt2"}
        for name, row in report[section].items():
            assert positive(row["modelmeter"]), (section, name)
            if section == "real":  # every peer runs every model on real tensors
                assert all(positive(row[tool]) for tool in ("fvcore", "flop_counter", "forward")), name
            else:
                assert "jit" in row["fvcore"]["skipped"]
            for tool in ("fvcore", "flop_counter", "forward"):
                expected = row["modelmeter"]["median_s"] / row[tool]["median_s"] if "median_s" in row[tool] else None
                assert row["ratios"][f"modelmeter/{tool}"] == pytest.approx(expected), (section, name, tool)
    assert positive(report["meta"]["resnet50"]["flop_counter"]) and positive(report["meta"]["resnet50"]["forward"])

    for label in ("forward", "forward+backward"):
        llama = report["llama"][label]
        assert positive(llama) and positive(llama["process"]) and llama["peak_rss_mb"] > 0
        assert llama["process"]["median_s"] > llama["median_s"]

    overhead = report["overhead"]
    assert overhead["events"] > overhead["shallow"]["events"] > 0
    for row in (overhead, overhead["shallow"]):
        assert positive(row["modelmeter"]) and positive(row["forward"]) and positive(row["floor"])
        for tool in ("modelmeter", "floor"):
            per_run = [a / b for a, b in zip(row[tool]["times"], row["forward"]["times"], strict=True)]
            assert row["ratio_runs"][f"{tool}/forward"]["median_s"] == pytest.approx(statistics.median(per_run))
    extra = overhead["modelmeter"]["median_s"] - overhead["forward"]["median_s"]
    assert overhead["us_per_event"] == pytest.approx(extra / overhead["events"] * 1e6)
    shallow = overhead["shallow"]["modelmeter"]["median_s"] - overhead["shallow"]["forward"]["median_s"]
    assert overhead["marginal_us_per_event"] == pytest.approx(
        (extra - shallow) / (overhead["events"] - overhead["shallow"]["events"]) * 1e6)

    cached = report["cached"]
    for key in ("first", "in_process", "persistent_first", "persistent_cached"):
        assert positive(cached[key]), key
    assert cached["ratios"]["first/in_process"] == pytest.approx(
        cached["first"]["median_s"] / cached["in_process"]["median_s"])
    assert cached["ratios"]["persistent_first/persistent_cached"] == pytest.approx(
        cached["persistent_first"]["median_s"] / cached["persistent_cached"]["median_s"])
    assert "### 5. Cached re-analysis" in done.stdout

    for name, row in report["pair"].items():  # the pattern with its recording, and without it (shared)
        assert positive(row["modelmeter"]) and positive(row["shared"]), name
    assert "What the pattern costs besides its one recording" in done.stdout


def test_the_recurrent_section_times_analysis_and_forward_in_turn() -> None:
    compare = load_compare()
    rows = compare.recurrent(True, 2)
    row = rows["8"]
    assert row["events"] > 0 and positive(row["modelmeter"]) and positive(row["forward"])
    per_run = [a / b for a, b in zip(row["modelmeter"]["times"], row["forward"]["times"], strict=True)]
    assert row["ratio_runs"]["median_s"] == pytest.approx(sorted(per_run)[0] / 2 + sorted(per_run)[1] / 2)
    assert row["us_per_event"] == pytest.approx(row["modelmeter"]["median_s"] / row["events"] * 1e6)
    assert "| 8 | " in compare.markdown_recurrent(rows)



@pytest.mark.slow
def test_the_parallel_section_measures_fresh_processes() -> None:
    """Section 8 (--quick: a 2-layer Llama under fsdp=128,tp=8): every run in a new process, its times, peak RSS and
    load reported, the analysis inside the process's time, the collectives of the run counted."""
    compare = load_compare()
    row = compare.parallel(True, 2)
    assert positive(row) and positive(row["analysis_cpu"]) and positive(row["process_cpu"])
    assert row["process"]["median_s"] > row["median_s"] and len(row["load"]) == len(row["rss_mb"]) == 2
    assert row["peak_rss_mb"] == max(row["rss_mb"]) > 0 and row["events"] > row["collectives"] > 0
    assert "| collectives |" in compare.markdown_parallel(row, True)


CACHE_BENCH = SCRIPT.parent / "cache_bench.py"


@pytest.mark.slow
def test_cache_bench_times_record_first_and_hit_in_new_processes(tmp_path: Path) -> None:
    """benchmarks/cache_bench.py on the tiny Llama: a round of three new processes, the hit read from the cache and
    counted what recording counted, and the ratio is record / hit of that round."""
    out = tmp_path / "cache.json"
    done = subprocess.run([sys.executable, str(CACHE_BENCH), "--models", "llama_tiny", "--repeat", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    row = json.loads(out.read_text())["llama_tiny"]
    assert row["same_result"] and row["hit_read_the_cache"] and row["events"] > 0
    (record,), (hit,) = row["record"]["runs"], row["hit"]["runs"]
    assert row["ratio"]["runs"] == [record / hit] and row["first"]["median"] > 0
    (record_cpu,), (hit_cpu,) = row["record_cpu"]["runs"], row["hit_cpu"]["runs"]
    assert row["ratio_cpu"]["runs"] == [record_cpu / hit_cpu]
    assert "| llama_tiny fwd+bwd |" in done.stdout


@pytest.mark.slow
def test_cache_bench_times_a_small_model_in_new_processes_and_in_one(tmp_path: Path) -> None:
    """benchmarks/cache_bench.py on the small MLP: the rounds in new processes, and rounds in its own process whose
    ratio is each round's record / hit; every hit read the cache and counted what recording counted."""
    out = tmp_path / "cache.json"
    done = subprocess.run([sys.executable, str(CACHE_BENCH), "--models", "mlp", "--repeat", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    row = json.loads(out.read_text())["mlp"]
    assert row["same_result"] and row["hit_read_the_cache"] and row["events"] > 0
    inside = row["in_process"]
    records, hits = inside["record_cpu"]["runs"], inside["hit_cpu"]["runs"]
    assert len(records) == 2 and inside["ratio_cpu"]["runs"] == [r / h for r, h in zip(records, hits, strict=True)]
    assert "| mlp |" in done.stdout and "In one process" in done.stdout and "flop_count_table" not in done.stdout
