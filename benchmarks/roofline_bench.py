"""What the roofline adds to an analysis's time (docs/roofline.md, "Cost").

    python benchmarks/roofline_bench.py [--repeat 7] [--quick] [--json out.json]

For each model, on the meta device (nothing is allocated or downloaded), forward and forward+backward:

- **analysis**: ``analyze(model, x, cache=False, quiet=True).result()`` — the trace and the default metrics;
- **roofline**: ``roofline(analysis.trace, RooflineSettings(get_device("h100")))`` on that same trace — the two
  counting passes (FLOPs in the ``flops`` convention, bytes), the pairing into units and the summary.

Each run times both back to back, so the ratio ``(analysis + roofline) / analysis`` of one run compares two
moments of the same machine; the median ratio and its range over ``--repeat`` runs (after one warm-up run) are
printed. The issue's target is a ratio <= 1.20. Models: torchvision's ResNet-50 (weights=None) on a 224x224
image and the zoo's Llama-2 7B on 128 tokens (``--quick``: ResNet-18 and the 2-layer zoo Llama).
``torch.set_num_threads(2)``. Ratios are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

THREADS = 2


def models(quick: bool) -> dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]]:
    """Name -> a builder of (model on meta, its input on meta)."""
    import torchvision

    from modelmeter.zoo import get_model

    resnet = "resnet18" if quick else "resnet50"
    llama = "llama2_tiny" if quick else "llama2_7b"
    tokens = 64 if quick else 128

    def image_model() -> tuple[nn.Module, torch.Tensor]:
        with torch.device("meta"):
            model = torchvision.models.get_model(resnet, weights=None)
        return model, torch.empty(1, 3, 224, 224, device="meta")

    def language_model() -> tuple[nn.Module, torch.Tensor]:
        return get_model(llama, device="meta"), torch.zeros(1, tokens, dtype=torch.long, device="meta")

    return {resnet: image_model, llama: language_model}


def measure(model: nn.Module, x: torch.Tensor, backward: bool, repeat: int) -> dict[str, Any]:
    """Analysis and roofline times of ``repeat`` runs (after a warm-up run), and their ratios run by run."""
    import modelmeter
    from modelmeter.devices import get_device
    from modelmeter.metrics.roofline import RooflineSettings, roofline

    settings = RooflineSettings(get_device("h100"))
    analysis_s, roofline_s, ratios = [], [], []
    events = 0
    for run in range(repeat + 1):
        start = time.perf_counter()
        analysis = modelmeter.analyze(model, x, backward=backward, cache=False, quiet=True)
        analysis.result()
        middle = time.perf_counter()
        roofline(analysis.trace, settings)
        end = time.perf_counter()
        events = len(analysis.trace.events)
        if run:  # the first run warms up
            analysis_s.append(middle - start)
            roofline_s.append(end - middle)
            ratios.append((end - start) / (middle - start))
    return {"events": events, "analysis": summary(analysis_s), "roofline": summary(roofline_s),
            "ratio": summary(ratios)}


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": len(values)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="small models (a test runs it)")
    parser.add_argument("--json", help="also write the report as JSON to this file")
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    report: dict[str, Any] = {}
    print(f"{'model':<12} {'pass':<17} {'events':>7} {'analysis s':>11} {'roofline s':>11} "
          f"{'ratio (median, min-max)':>24}")
    for name, build in models(args.quick).items():
        model, x = build()
        for label, backward in (("forward", False), ("forward+backward", True)):
            row = report.setdefault(name, {})[label] = measure(model, x, backward, args.repeat)
            ratio = row["ratio"]
            print(f"{name:<12} {label:<17} {row['events']:>7} {row['analysis']['median']:>11.3f} "
                  f"{row['roofline']['median']:>11.4f} {ratio['median']:>10.3f} ({ratio['min']:.3f}-"
                  f"{ratio['max']:.3f})", flush=True)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
