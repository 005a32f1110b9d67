"""Benchmark of modelmeter's persistent trace cache (docs/caching.md): a hit against recording, in new processes.

    python benchmarks/cache_bench.py [--models mlp,cnn,vit_b_16,llama_tiny,llama2_70b] [--repeat 5] [--execution auto]
                                     [--keep DIR] [--json out.json]

For each model, ``--repeat`` rounds, each in new Python processes:

1. **record**: ``analyze()`` + ``result()`` with the cache off — what recording and counting cost;
2. **first**: the same with the cache on and a fresh, empty cache directory — recording, counting, then storing
   the trace and the result beside it;
3. **hit**: again, from that cache directory — the trace and the result read instead.

Each process's timer starts after the imports (``modelmeter.analysis`` included), building the model and a
``gc.collect()``. Prints each column's median with its range, and the ratio record / hit of each round (median
and range), in wall-clock time and in the process's CPU time (steadier on a loaded machine).

Models: ``mlp`` and ``cnn`` (trivially small models, forward only: a hit must not be slower than recording even
where there is almost nothing to record), ``llama2_70b`` (Llama-2-70B from its ``transformers`` config on meta,
2048 tokens, forward and backward: issue 20's target is a hit >= 10x faster than recording), ``llama_tiny`` (the
same architecture with 2 layers of width 256, 128 tokens) and any torchvision model name
(real weights on the CPU: the IMAGENET1K_V1 checkpoint when it is already in torch's hub cache, else the random
initialisation — nothing is downloaded; forward only).

For the small models, also ``--repeat`` rounds in the benchmark's own process: record against a hit, each round
the median CPU time of 40 analyses (the in-process shared recordings cleared, so a hit reads the disk cache).

Then, for the first torchvision model: ``flop_count_table(flops, activations=acts)`` with the cache off, with a
forward pre-hook counting the model's calls: it must be 1.

Exit status 0 when every hit read the cache and counted what recording counted, and the table ran the model
once; 1 otherwise. Wall-clock ratios are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

LLAMA_SIZES = {
    "llama2_70b": ({"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                    "num_attention_heads": 64}, 2048),
    "llama_tiny": ({"hidden_size": 256, "intermediate_size": 896, "num_hidden_layers": 2,
                    "num_attention_heads": 8}, 128),
}


SMALL = ("mlp", "cnn")


def small(name: str) -> tuple[Any, Any]:
    """A trivially small model and its input: ``mlp`` (3 Linear layers and 2 ReLUs, 5 events) or ``cnn`` (2 conv
    layers, batch norm, pooling and a Linear head), where the cache's fixed costs weigh most."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name == "mlp":
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
        return model, torch.randn(8, 64)
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 32, 3), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    return model.eval(), torch.randn(2, 3, 32, 32)


def build(name: str) -> tuple[Any, Any, bool, str]:
    """The model ``name``, an input, whether the analysis runs the backward pass, and where the weights came from."""
    import torch

    if name in SMALL:
        return (*small(name), False, "random initialisation")
    if name in LLAMA_SIZES:
        import transformers

        sizes, tokens = LLAMA_SIZES[name]
        config = transformers.LlamaConfig(**sizes, num_key_value_heads=8, vocab_size=32000)
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
        return model, torch.zeros(1, tokens, dtype=torch.long, device="meta"), True, "meta (no weights)"
    import torchvision

    torch.manual_seed(0)  # the same weights and input in every process (execution="real" keys values)
    model = torchvision.models.get_model(name, weights=None).eval()
    weights_note = "random initialisation (real tensors; no checkpoint in the hub cache)"
    try:
        weights = torchvision.models.get_model_weights(name).DEFAULT
        path = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(weights.url))
        if os.path.isfile(path):
            model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
            weights_note = f"{weights} from {path}"
    except Exception as exc:  # no registered weights, or an unreadable file: keep the random ones
        weights_note += f" ({type(exc).__name__})"
    return model, torch.randn(1, 3, 224, 224), False, weights_note


def worker(args: argparse.Namespace) -> None:
    """One analysis in this (new) process; prints a JSON line."""
    started = time.perf_counter()
    import gc

    import modelmeter
    import modelmeter.analysis  # imported on first use otherwise: part of starting up, not of the analysis
    import modelmeter.cache
    import modelmeter.io

    model, x, backward, weights_note = build(args.model)
    gc.collect()  # start every process's timer with no collection pending from the imports and the build
    built, cpu = time.perf_counter(), time.process_time()
    cache = args.cache_dir is not None
    analysis = modelmeter.analyze(model, x, backward=backward, execution=args.execution, cache=cache,
                                  cache_dir=args.cache_dir, quiet=True)
    result = analysis.result()
    done, cpu = time.perf_counter(), time.process_time() - cpu
    print(json.dumps({"analysis_s": done - built, "cpu_s": cpu, "setup_s": built - started,
                      "from_cache": analysis.from_cache,
                      "result": result.to_json(indent=None), "events": len(analysis.trace.events),
                      "weights": weights_note}))


def one_process(args: argparse.Namespace, model: str, cache_dir: str | None) -> dict[str, Any]:
    command = [sys.executable, os.path.abspath(__file__), "--worker", "--model", model, "--execution", args.execution]
    if cache_dir is not None:
        command += ["--cache-dir", cache_dir]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"worker failed ({done.returncode}):\n{done.stderr}")
    row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    row["process_s"] = wall
    return row


def summary(values: list[float]) -> dict[str, Any]:
    """Median, min and max of ``values`` (and the values)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def rounds(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """``args.repeat`` rounds of record / first / hit processes for ``model``; their times and ratios."""
    runs: list[dict[str, dict[str, Any]]] = []
    for _ in range(args.repeat):
        cache_dir = args.keep or tempfile.mkdtemp(prefix="modelmeter-bench-")
        if args.keep:
            shutil.rmtree(os.path.join(cache_dir, "traces"), ignore_errors=True)
        try:
            record = one_process(args, model, None)
            first = one_process(args, model, cache_dir)
            hit = one_process(args, model, cache_dir)
        finally:
            if not args.keep:
                shutil.rmtree(cache_dir, ignore_errors=True)
        runs.append({"record": record, "first": first, "hit": hit})
        print(f"  {model}: record {record['analysis_s']:.4f} s, first {first['analysis_s']:.4f} s, "
              f"hit {hit['analysis_s']:.4f} s", file=sys.stderr)
    same = all(r["hit"]["result"] == r["record"]["result"] == r["first"]["result"] for r in runs)
    cached = all(not r["record"]["from_cache"] and not r["first"]["from_cache"] and r["hit"]["from_cache"]
                 for r in runs)
    return {"events": runs[-1]["record"]["events"], "weights": runs[-1]["record"]["weights"],
            "same_result": same, "hit_read_the_cache": cached,
            **{kind: summary([r[kind]["analysis_s"] for r in runs]) for kind in ("record", "first", "hit")},
            **{f"{kind}_cpu": summary([r[kind]["cpu_s"] for r in runs]) for kind in ("record", "first", "hit")},
            "setup_s": summary([r["hit"]["setup_s"] for r in runs]),
            "ratio": summary([r["record"]["analysis_s"] / r["hit"]["analysis_s"] for r in runs]),
            "ratio_cpu": summary([r["record"]["cpu_s"] / r["hit"]["cpu_s"] for r in runs])}


def in_process(args: argparse.Namespace, name: str, calls: int = 40) -> dict[str, Any]:
    """For a small model, ``args.repeat`` rounds in this process, each the median CPU time of ``calls`` analyses
    with the cache off and of as many hits (the in-process shared recordings cleared first, so that a hit reads
    the disk cache as a new process would, with the imports, the cache directory and the source digests warm)."""
    import gc

    import modelmeter
    import modelmeter.analysis
    from modelmeter.cache.shared import SHARED

    model, x, _, _ = build(name)
    cache_dir = tempfile.mkdtemp(prefix="modelmeter-bench-")

    def analysis_cpu(cache: bool, first: bool = False) -> float:
        SHARED.clear()
        gc.collect()
        cpu = time.process_time()
        analysis = modelmeter.analyze(model, x, execution=args.execution, cache=cache,
                                      cache_dir=cache_dir if cache else None, quiet=True)
        analysis.result()
        if analysis.from_cache != (cache and not first):
            sys.exit(f"{name}: an analysis in one process did not read the cache as expected")
        return time.process_time() - cpu

    try:
        analysis_cpu(True, first=True)  # records and stores
        rows = [{kind: statistics.median(analysis_cpu(kind == "hit") for _ in range(calls))
                 for kind in ("record", "hit")} for _ in range(args.repeat)]
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    return {"record_cpu": summary([r["record"] for r in rows]), "hit_cpu": summary([r["hit"] for r in rows]),
            "ratio_cpu": summary([r["record"] / r["hit"] for r in rows])}


def runs_of_flop_count_table(name: str) -> tuple[int, str]:
    """How often the model ran for ``flop_count_table(flops, activations=acts)`` (cache off)."""
    from modelmeter import ActivationCountAnalysis, FlopCountAnalysis, flop_count_table

    model, x, _, _ = build(name)
    calls = []
    handle = model.register_forward_pre_hook(lambda module, inputs: calls.append(1))
    flops = FlopCountAnalysis(model, x).unsupported_ops_warnings(False).uncalled_modules_warnings(False)
    acts = ActivationCountAnalysis(model, x).unsupported_ops_warnings(False).uncalled_modules_warnings(False)
    table = flop_count_table(flops, max_depth=1, activations=acts)
    handle.remove()
    return len(calls), table


def seconds(row: dict[str, Any]) -> str:
    """The median and range of ``row``, in milliseconds below a tenth of a second."""
    if row["max"] < 0.1:
        return f"{row['median'] * 1e3:.1f} ms ({row['min'] * 1e3:.1f}-{row['max'] * 1e3:.1f})"
    return f"{row['median']:.3f} s ({row['min']:.3f}-{row['max']:.3f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp,cnn,vit_b_16,llama_tiny,llama2_70b",
                        help="comma-separated: mlp, cnn, llama2_70b, llama_tiny or torchvision model names "
                             "(default mlp,cnn,vit_b_16,llama_tiny,llama2_70b)")
    parser.add_argument("--execution", choices=("auto", "fake", "real"), default="auto")
    parser.add_argument("--repeat", type=int, default=5, help="rounds per model, each in new processes (default 5)")
    parser.add_argument("--keep", metavar="DIR", help="use (and keep) this cache directory instead of a temporary one")
    parser.add_argument("--json", metavar="FILE", help="also write the numbers to FILE")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0

    import torch

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    print(f"modelmeter trace cache benchmark: {', '.join(models)}, execution={args.execution}, {args.repeat} "
          f"round(s), torch {torch.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    report = {name: rounds(args, name) for name in models}
    print("\n| model | events | record (cache off) | first (cache empty) | hit | record / hit | CPU: record | CPU: hit "
          "| record / hit in CPU time |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, row in report.items():
        ratio, cpu = row["ratio"], row["ratio_cpu"]
        print(f"| {name}{' fwd+bwd' if name in LLAMA_SIZES else ''} | {row['events']} | {seconds(row['record'])} | "
              f"{seconds(row['first'])} | {seconds(row['hit'])} | "
              f"{ratio['median']:.1f}x ({ratio['min']:.1f}-{ratio['max']:.1f}) | "
              f"{seconds(row['record_cpu'])} | {seconds(row['hit_cpu'])} | "
              f"{cpu['median']:.1f}x ({cpu['min']:.1f}-{cpu['max']:.1f}) |")
    small_models = [name for name in models if name in SMALL]
    if small_models:
        print(f"\nIn one process (each round the median CPU time of 40 analyses; {args.repeat} rounds):\n")
        print("| model | CPU: record | CPU: hit | record / hit in CPU time |\n|---|---|---|---|")
    for name in small_models:
        row = report[name]["in_process"] = in_process(args, name)
        cpu = row["ratio_cpu"]
        print(f"| {name} | {seconds(row['record_cpu'])} | {seconds(row['hit_cpu'])} | "
              f"{cpu['median']:.2f}x ({cpu['min']:.2f}-{cpu['max']:.2f}) |")
    ok = True
    for name, row in report.items():
        print(f"{name}: weights {row['weights']}; Python start + imports + build ~{row['setup_s']['median']:.2f} s "
              f"per process; same result from the cache: {row['same_result']}; hit read the cache: "
              f"{row['hit_read_the_cache']}")
        ok = ok and row["same_result"] and row["hit_read_the_cache"]
    vision = [name for name in models if name not in LLAMA_SIZES and name not in SMALL]
    if vision:
        runs, table = runs_of_flop_count_table(vision[0])
        print(f"\nflop_count_table(flops, activations=acts) on {vision[0]} ran the model {runs} time(s)")
        print(table)
        ok = ok and runs == 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
