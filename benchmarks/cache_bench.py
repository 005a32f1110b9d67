"""Benchmark of modelmeter's trace cache (docs/caching.md).

    python benchmarks/cache_bench.py [--model vit_b_16] [--execution auto] [--repeat 1] [--keep DIR]

1. **Persistent cache.** Analyses torchvision's ViT-B/16 with real weights (tensors on the CPU; the
   IMAGENET1K_V1 checkpoint when it is already in torch's hub cache, else the random initialisation — nothing
   is downloaded) in a new process with the cache on and a fresh temporary cache directory, then again in
   another new process reading the trace from that cache. Prints the time of ``analyze()`` + ``result()`` in
   each process, the whole process wall times (Python start, ``import torch``, building the model included),
   and their ratios. The issue's target is >= 10x for the analysis.
2. **One run for a table with activations.** ``flop_count_table(flops, activations=acts)`` on the same model
   with the cache off: a forward pre-hook counts the model's calls; it must be 1.

Exit status 0 when the model ran once for the table and the second process read the cache; 1 otherwise.
Wall-clock ratios are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any


def build(name: str) -> tuple[Any, Any, str]:
    """The torchvision model ``name`` with real weights on the CPU, an input, and where the weights came from."""
    import torch
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
    return model, torch.randn(1, 3, 224, 224), weights_note


def worker(args: argparse.Namespace) -> None:
    """One analysis in this (new) process; prints a JSON line."""
    started = time.perf_counter()
    import gc

    import modelmeter
    import modelmeter.cache  # imported on first use otherwise: part of starting up, not of the analysis
    import modelmeter.io

    model, x, weights_note = build(args.model)
    gc.collect()  # start both processes' timers with no collection pending from the imports and the build
    built = time.perf_counter()
    analysis = modelmeter.analyze(model, x, execution=args.execution, cache=True, cache_dir=args.cache_dir)
    result = analysis.result()
    done = time.perf_counter()
    print(json.dumps({"analysis_s": done - built, "setup_s": built - started, "from_cache": analysis.from_cache,
                      "flops": result.total("flops"), "activations": result.total("activations"),
                      "events": len(analysis.trace.events), "weights": weights_note}))


def one_process(args: argparse.Namespace, cache_dir: str) -> dict[str, Any]:
    command = [sys.executable, os.path.abspath(__file__), "--worker", "--model", args.model,
               "--execution", args.execution, "--cache-dir", cache_dir]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"worker failed ({done.returncode}):\n{done.stderr}")
    row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    row["process_s"] = wall
    return row


def runs_of_flop_count_table(name: str) -> tuple[int, str]:
    """How often the model ran for ``flop_count_table(flops, activations=acts)`` (cache off)."""
    from modelmeter import ActivationCountAnalysis, FlopCountAnalysis, flop_count_table

    model, x, _ = build(name)
    calls = []
    handle = model.register_forward_pre_hook(lambda module, inputs: calls.append(1))
    flops = FlopCountAnalysis(model, x).unsupported_ops_warnings(False).uncalled_modules_warnings(False)
    acts = ActivationCountAnalysis(model, x).unsupported_ops_warnings(False).uncalled_modules_warnings(False)
    table = flop_count_table(flops, max_depth=1, activations=acts)
    handle.remove()
    return len(calls), table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="vit_b_16", help="a torchvision model name (default vit_b_16)")
    parser.add_argument("--execution", choices=("auto", "fake", "real"), default="auto")
    parser.add_argument("--repeat", type=int, default=1, help="cold/warm process pairs to run (each cold one "
                                                              "with a fresh cache directory); medians are shown")
    parser.add_argument("--keep", metavar="DIR", help="use (and keep) this cache directory instead of a temporary one")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0

    import statistics

    import torch

    print(f"modelmeter trace cache benchmark: torchvision {args.model}, execution={args.execution}, "
          f"torch {torch.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    pairs = []
    for _ in range(args.repeat):
        cache_dir = args.keep or tempfile.mkdtemp(prefix="modelmeter-bench-")
        if args.keep:
            shutil.rmtree(os.path.join(cache_dir, "traces"), ignore_errors=True)
        try:
            cold = one_process(args, cache_dir)
            warm = one_process(args, cache_dir)
        finally:
            if not args.keep:
                shutil.rmtree(cache_dir, ignore_errors=True)
        pairs.append((cold, warm))
    cold, warm = pairs[-1]
    print(f"weights: {cold['weights']}")
    print(f"trace: {cold['events']} events; flops {cold['flops']:,}, activations {cold['activations']:,}")
    same = all(c["flops"] == w["flops"] and c["activations"] == w["activations"] for c, w in pairs)
    cached = all(not c["from_cache"] and w["from_cache"] for c, w in pairs)

    def median(key: str, which: int) -> float:
        return statistics.median(p[which][key] for p in pairs)

    first, again = median("analysis_s", 0), median("analysis_s", 1)
    first_p, again_p = median("process_s", 0), median("process_s", 1)
    print(f"analyze()+result(), new process, cache empty:     {first:8.3f} s")
    print(f"analyze()+result(), new process, from the cache:  {again:8.3f} s   -> {first / again:6.1f}x faster")
    print(f"whole process (start, import, build, analyse):     {first_p:8.3f} s vs {again_p:.3f} s -> "
          f"{first_p / again_p:.2f}x")
    print(f"  of which Python start + imports + building the model: ~{median('setup_s', 1):.3f} s per process")
    print(f"same counts from the cache: {same}; second process read the cache: {cached}")

    runs, table = runs_of_flop_count_table(args.model)
    print(f"\nflop_count_table(flops, activations=acts) ran the model {runs} time(s)")
    print(table)
    return 0 if runs == 1 and same and cached else 1


if __name__ == "__main__":
    sys.exit(main())
