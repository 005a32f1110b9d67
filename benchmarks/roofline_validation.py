"""The roofline's predicted time against measured kernel time, module by module.

    # on a CUDA machine: against a catalog device (the GPU it runs on)
    python benchmarks/roofline_validation.py --device-name h200 --markdown gpu.md --json gpu.json
    # without one: the same comparison on this CPU, against a device calibrated on it
    python benchmarks/roofline_validation.py --cpu --models resnet50 --batches 1,8 --markdown cpu.md

For each model and batch size:

1. **Predicted**: ``modelmeter.analyze(model, inputs, device=DEVICE).result()``; every module row's
   ``metrics["time"]`` is the roofline time of its forward (docs/roofline.md), with its compute-bound share.
2. **Measured**: the model's forward under ``torch.no_grad()`` in eval mode (as the analysis runs it), with a
   forward pre-hook and a forward hook on every module that open and close a ``torch.profiler.record_function``
   range named after it. Under ``torch.profiler`` each kernel is placed on the host timeline where it was launched
   (CUDA: the start of the operator that launched it, linked by the profiler's correlation id; CPU: the start of
   each outermost operator, whose own duration is the "kernel" time) and counted for every module whose range
   holds that point. ``--warmup`` runs first, then ``--repeat`` profiled runs; the run whose whole forward took the
   median time is reported, every module from that one run (so that they add up as the prediction's do).
3. **Compared**: per module, predicted, measured and their ratio measured/predicted; the rows to ``--depth``
   (inclusive times), then the time by module type (self time: a module's time less its children's).

``--cpu`` first measures this CPU's float32 ``torch.mm`` throughput and its memory bandwidth (a large tensor copy
and add; the best of several runs) and predicts against ``Device("this-cpu", ...)`` with those as its float32
matrix and vector peaks and its bandwidth. ``--device-name`` takes a name from ``modelmeter devices``; with CUDA
the model runs in ``--dtype`` (default bfloat16) and TF32 is off unless ``--tf32`` (then on for both the
prediction and the kernels). Nothing is downloaded: the models are built with random weights.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import datetime
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from modelmeter.devices import Device, get_device
from modelmeter.reports.result import Result

RANGE = "modelmeter-validation:"  # prefix of the record_function range opened around every module's forward
MODELS = ("resnet50", "vit_b_16", "llama_layer")


# models ------------------------------------------------------------------------------------------------------


class LlamaLayer(nn.Module):
    """One decoder layer of Llama-2-7B (4096 dims, 32 heads, 11008 FFN) with its rotary embedding, on hidden states
    of shape (batch, sequence, 4096)."""

    def __init__(self, hidden: int = 4096, ffn: int = 11008, heads: int = 32) -> None:
        super().__init__()
        from modelmeter.zoo.llama import LlamaConfig, LlamaDecoderLayer, RotaryEmbedding

        config = LlamaConfig(32000, hidden, ffn, 1, heads, heads)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)
        self.layer = LlamaDecoderLayer(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        cos, sin = self.rotary_emb(positions, x.dtype)
        return self.layer(x, cos, sin)


def build(name: str, batch: int, *, seq_len: int, dtype: torch.dtype) -> tuple[nn.Module, torch.Tensor]:
    """Model ``name`` (random weights, eval mode, in ``dtype``) on the CPU and an input of ``batch`` samples."""
    torch.manual_seed(0)
    model: nn.Module
    if name == "llama_layer":
        model, x = LlamaLayer(), torch.randn(batch, seq_len, 4096)
    elif name in ("resnet50", "vit_b_16"):
        import torchvision

        model, x = torchvision.models.get_model(name, weights=None), torch.randn(batch, 3, 224, 224)
    else:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    return model.eval().to(dtype), x.to(dtype)


# measuring ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    """A module's forward on the host timeline (microseconds)."""

    module: str
    start: float
    end: float


@dataclass(frozen=True)
class Kernel:
    """Device work launched at host time ``at`` that ran for ``duration`` (microseconds)."""

    at: float
    duration: float


def attribute(spans: Iterable[Span], kernels: Iterable[Kernel]) -> dict[str, float]:
    """Seconds of kernel time per module: a kernel counts for every module whose forward was running (its span
    holds the launch point, ends included) when it was launched; a module that ran twice gets both runs."""
    ordered = sorted(kernels, key=lambda kernel: kernel.at)
    launches = [kernel.at for kernel in ordered]
    before = [0.0]  # before[i]: microseconds of the first i kernels
    for kernel in ordered:
        before.append(before[-1] + kernel.duration)
    totals: dict[str, float] = {}
    for span in spans:
        first, last = bisect.bisect_left(launches, span.start), bisect.bisect_right(launches, span.end)
        totals[span.module] = totals.get(span.module, 0.0) + (before[last] - before[first]) * 1e-6
    return totals


def host_timeline(events: Iterable[Any], *, cuda: bool) -> tuple[list[Span], list[Kernel]]:
    """The module spans and the kernels of a profile's events (``torch.profiler.profile().events()``), on the
    threads the module ranges were recorded on.

    With ``cuda`` a kernel is each device kernel the profiler linked to a host operator (``event.kernels``),
    placed at that operator's start; without, the "kernels" are the outermost host operators (inside no operator,
    only inside module ranges) and their durations."""
    events = list(events)
    spans = [Span(e.name.removeprefix(RANGE), e.time_range.start, e.time_range.end)
             for e in events if e.name.startswith(RANGE)]
    threads = {e.thread for e in events if e.name.startswith(RANGE)}
    kernels = []
    for event in events:
        if event.thread not in threads or event.name.startswith(RANGE):
            continue
        if cuda and event.kernels:
            kernels.append(Kernel(event.time_range.start, sum(kernel.duration for kernel in event.kernels)))
        elif not cuda and _outermost(event):
            kernels.append(Kernel(event.time_range.start, event.time_range.end - event.time_range.start))
    return spans, kernels


def _outermost(event: Any) -> bool:
    """True for an operator inside no other operator (only inside module ranges, or nothing)."""
    parent = event.cpu_parent
    while parent is not None:
        if not parent.name.startswith(RANGE):
            return False
        parent = parent.cpu_parent
    return True


@contextlib.contextmanager
def module_ranges(model: nn.Module) -> Iterator[None]:
    """A profiler range around every module's forward, named after the module; the hooks are removed after."""
    open_ranges: dict[int, list[record_function]] = {}
    handles = []

    def enter(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            scope = record_function(RANGE + name)
            scope.__enter__()
            open_ranges.setdefault(id(module), []).append(scope)
        return hook

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        open_ranges[id(module)].pop().__exit__(None, None, None)

    try:
        for name, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(enter(name)))
            handles.append(module.register_forward_hook(leave, always_call=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass(frozen=True)
class Measured:
    """Seconds of kernel time per module in the profiled run whose whole forward took the median time (one run, so
    that the modules add up as the prediction's do), and the whole forward's seconds in every run, fastest first."""

    modules: dict[str, float]
    runs: list[float]


def measure(model: nn.Module, inputs: torch.Tensor, *, cuda: bool, warmup: int, repeat: int) -> Measured:
    """Kernel time per module (by its name in ``named_modules``; 0 for one that launched nothing) over ``repeat``
    profiled forwards after ``warmup`` unprofiled ones."""
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    runs = []
    with module_ranges(model), torch.no_grad():
        for _ in range(warmup):
            model(inputs)
        sync()
        for _ in range(repeat):
            with profile(activities=activities) as prof:
                model(inputs)
                sync()
            runs.append(attribute(*host_timeline(prof.events(), cuda=cuda)))
    runs.sort(key=lambda run: run.get("", 0.0))
    median = runs[(len(runs) - 1) // 2]
    return Measured({name: median.get(name, 0.0) for name, _ in model.named_modules()},
                    [run.get("", 0.0) for run in runs])


# calibrating this CPU ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Calibration:
    """What this CPU reached: float32 matrix-product FLOP/s and memory bytes/s (the best of several runs)."""

    matmul_flops: float
    bandwidth: float
    matmul_size: int
    stream_bytes: int


def best_seconds(fn: Callable[[], Any], repeat: int) -> float:
    """The fastest of ``repeat`` timed runs of ``fn`` after one warm-up run."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def calibrate_cpu(*, size: int = 2048, stream_mib: int = 256, repeat: int = 10) -> Calibration:
    """This CPU's float32 peak (an n x n ``torch.mm``: 2 n^3 FLOPs) and bandwidth (a copy reads and writes the
    tensor, an add reads two and writes one; the faster of the two)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    out = torch.empty(size, size)
    flops = 2 * size**3 / best_seconds(lambda: torch.mm(a, b, out=out), repeat)
    n = stream_mib * 2**20 // 4
    x, y, z = torch.rand(n), torch.rand(n), torch.empty(n)
    copy = 2 * x.nbytes / best_seconds(lambda: z.copy_(x), repeat)
    add = 3 * x.nbytes / best_seconds(lambda: torch.add(x, y, out=z), repeat)
    return Calibration(flops, max(copy, add), size, x.nbytes)


def calibrated_device(calibration: Calibration, memory: int) -> Device:
    """A user device with this CPU's measured float32 peak (its matrix and its vector units are the same FMA units)
    and bandwidth."""
    peak = {"fp32": calibration.matmul_flops}
    return Device(name="this-cpu", label=f"this CPU, calibrated ({cpu_name()})",
                  memory=memory, bandwidth=calibration.bandwidth, matrix=dict(peak), vector=dict(peak),
                  source="benchmarks/roofline_validation.py --cpu: torch.mm and tensor copy/add on this machine")


def cpu_name() -> str:
    """The processor's model name (Linux: /proc/cpuinfo), else what ``platform`` says."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as info:
        for line in info:
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def physical_memory() -> int:
    """Bytes of RAM; 1 where the OS does not say (a Device needs a positive size, and no time depends on it)."""
    with contextlib.suppress(ValueError, OSError, AttributeError):
        return max(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), 1)
    return 1


# comparing ---------------------------------------------------------------------------------------------------


@dataclass
class Row:
    """One module (or module type): predicted and measured seconds and the compute-bound share of the prediction."""

    module: str
    type: str
    predicted: float
    measured: float
    compute_bound: float

    @property
    def ratio(self) -> float | None:
        """measured / predicted (None when nothing was predicted)."""
        return self.measured / self.predicted if self.predicted else None


@dataclass
class Comparison:
    """One model at one batch size on one device."""

    model: str
    batch: int
    inputs: str
    device: str
    runs: list[float]  # the whole forward's measured seconds in every run, fastest first
    modules: list[Row]  # every module, inclusive times, in the model's order
    types: list[Row] = field(default_factory=list)  # by module type, self times

    @property
    def total(self) -> Row:
        return self.modules[0]


def compare(result: Result, measured: Mapping[str, float]) -> list[Row]:
    """A row per module of ``result`` (the prediction) with its measured seconds (0 where none were measured)."""
    return [Row(row.name, row.type, row.metrics.get("time", 0.0), measured.get(row.name, 0.0),
                row.metrics.get("compute_bound", 0.0)) for row in result.modules]


def by_type(rows: Sequence[Row]) -> list[Row]:
    """Self times (a module's time less its direct children's) summed by module type, the largest prediction
    first; the compute-bound share likewise of the self time. Together they add up to the model's time.
    ``rows`` are :func:`compare`'s, the model first."""
    totals = {row.module: row for row in rows}
    self_time = {name: [row.predicted, row.measured, row.compute_bound * row.predicted]
                 for name, row in totals.items()}
    for name in totals:
        if name:
            parent = self_time[name.rpartition(".")[0]]
            child = totals[name]
            parent[0] -= child.predicted
            parent[1] -= child.measured
            parent[2] -= child.compute_bound * child.predicted
    model = rows[0]
    grouped: dict[str, list[float]] = {}
    for name, (predicted, measured, bound) in self_time.items():
        sums = grouped.setdefault(totals[name].type, [0.0, 0.0, 0.0])
        sums[0] += _residue_free(predicted, model.predicted)
        sums[1] += _residue_free(measured, model.measured)
        sums[2] += _residue_free(bound, model.predicted)
    found = [Row("", kind, p, m, b / p if p else 0.0) for kind, (p, m, b) in grouped.items() if p or m]
    return sorted(found, key=lambda row: -row.predicted)


def _residue_free(value: float, scale: float) -> float:
    """0 for what is left of a subtraction of equal sums added in another order (|value| <= 1e-9 x scale)."""
    return 0.0 if abs(value) <= 1e-9 * abs(scale) else value


def shown(rows: Sequence[Row], depth: int) -> list[Row]:
    """The rows to ``depth`` (0: the model) that predicted or measured any time."""
    return [row for row in rows if _depth(row.module) <= depth and (row.predicted or row.measured)]


def _depth(name: str) -> int:
    return name.count(".") + 1 if name else 0


# formatting --------------------------------------------------------------------------------------------------


def seconds(value: float) -> str:
    """Seconds with 3 significant figures in s, ms, µs or ns."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value / 1e-9:.3g} ns"


def ratio(row: Row) -> str:
    """measured / predicted with 2 decimals, a dash when nothing was predicted."""
    return "—" if row.ratio is None else f"{row.ratio:.2f}"


def table(rows: Sequence[Row], first: str) -> str:
    """A markdown table of ``rows``; ``first`` names the first column ("module" or "type")."""
    lines = [f"| {first} | predicted | measured | measured / predicted | compute-bound share |",
             "|---|---:|---:|---:|---:|"]
    for row in rows:
        label = row.type if first == "type" else f"{row.module or '(model)'} ({row.type})"
        lines.append(f"| {label} | {seconds(row.predicted)} | {seconds(row.measured)} | {ratio(row)} "
                     f"| {row.compute_bound:.0%} |")
    return "\n".join(lines)


def section(comparison: Comparison, depth: int) -> str:
    """The markdown of one model at one batch size."""
    total, runs = comparison.total, comparison.runs
    return "\n\n".join([
        f"### {comparison.model}, batch {comparison.batch}",
        f"Input {comparison.inputs}. Whole forward: predicted {seconds(total.predicted)}, measured "
        f"{seconds(total.measured)}, ratio **{ratio(total)}** (the median of {len(runs)} runs, "
        f"{seconds(runs[0])} to {seconds(runs[-1])}; every module below is from that run).",
        f"By module (to depth {depth}; each includes its submodules):",
        table(shown(comparison.modules, depth), "module"),
        "By module type (self time: a module's time less its children's, so the rows add up to the model):",
        table(comparison.types, "type")])


# running -----------------------------------------------------------------------------------------------------


def run_one(name: str, batch: int, *, device: Device, cuda: bool, args: argparse.Namespace) -> Comparison:
    """Predict, measure and compare one model at one batch size."""
    from modelmeter import analyze  # the analysis (and its roofline) only here: the other parts run without it

    dtype = getattr(torch, args.dtype)
    model, x = build(name, batch, seq_len=args.seq_len, dtype=dtype)
    predicted = analyze(model, x, device=device, quiet=True, cache=False, tf32=args.tf32,
                        efficiency=args.efficiency, launch_overhead=args.launch_overhead).result()
    if cuda:
        model, x = model.cuda(), x.cuda()
    measured = measure(model, x, cuda=cuda, warmup=args.warmup, repeat=args.repeat)
    rows = compare(predicted, measured.modules)
    inputs = f"{tuple(x.shape)} {args.dtype}"
    return Comparison(name, batch, inputs, device.name, measured.runs, rows, by_type(rows))


def machine(cuda: bool) -> dict[str, Any]:
    """When and on what the measurements were made."""
    found = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
             "cpu": cpu_name(), "cores": os.cpu_count(),
             "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version()}
    if cuda:
        found["gpu"] = torch.cuda.get_device_name()
    return found


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options, with the defaults of the mode (CUDA or ``--cpu``) filled in and checked."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--device-name", help="catalog device to predict for (`modelmeter devices`); needs CUDA")
    where.add_argument("--cpu", action="store_true", help="measure on this CPU against a device calibrated on it")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,8,64; --cpu 1,8)")
    parser.add_argument("--seq-len", type=int, default=None, help="llama_layer tokens per sample "
                                                                  "(default 2048; --cpu 128)")
    parser.add_argument("--dtype", default=None, help="model dtype (default bfloat16; --cpu: float32, the only one)")
    parser.add_argument("--tf32", action="store_true", help="float32 products on tensor cores, predicted and run")
    parser.add_argument("--efficiency", type=float, default=1.0, help="passed to analyze (default 1: pure roofline)")
    parser.add_argument("--launch-overhead", type=float, default=0.0, help="seconds per kernel, passed to analyze")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--depth", type=int, default=2, help="module rows to this depth (0: the model)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--markdown", help="write the tables to this file")
    parser.add_argument("--json", help="write every number to this file")
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in (args.batches or ("1,8" if args.cpu else "1,8,64")).split(",")]
    args.models = args.models.split(",")
    unknown = [name for name in args.models if name not in MODELS]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}: choose from {', '.join(MODELS)}")
    args.seq_len = args.seq_len or (128 if args.cpu else 2048)
    args.dtype = args.dtype or ("float32" if args.cpu else "bfloat16")
    if args.cpu and args.dtype != "float32":
        parser.error("--cpu calibrates float32 only: leave --dtype out")
    if not isinstance(getattr(torch, args.dtype, None), torch.dtype):
        parser.error(f"--dtype {args.dtype!r} is not a torch dtype")
    return args


def header(device: Device, calibration: Calibration | None, info: Mapping[str, Any], args: argparse.Namespace) -> str:
    """The lines above the tables: machine, device, settings and, on the CPU, the calibrated peaks."""
    lines = [f"Measured {info['date']} on {info.get('gpu') or info['cpu']} ({info['cores']} cores, "
             f"{info['torch_threads']} torch threads), torch {info['torch']}; device `{device.name}` "
             f"({device.label}); {args.warmup} warm-up runs, median of {args.repeat}; prediction: "
             f"efficiency {args.efficiency}, launch overhead {args.launch_overhead} s, tf32 {args.tf32}."]
    if calibration is not None:
        lines.append(f"Calibrated peaks: float32 `torch.mm` {calibration.matmul_flops / 1e9:.1f} GFLOP/s "
                     f"({calibration.matmul_size}x{calibration.matmul_size}), memory "
                     f"{calibration.bandwidth / 1e9:.2f} GB/s (copy/add of {calibration.stream_bytes >> 20} MiB); "
                     f"ridge {calibration.matmul_flops / calibration.bandwidth:.1f} FLOPs/byte.")
    return "\n\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Compare every model at every batch size; print the tables, and write them where asked."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = not args.cpu
    if cuda and not torch.cuda.is_available():
        print("no CUDA device here: use --cpu for the comparison on this CPU", file=sys.stderr)
        return 2
    calibration = None
    if args.cpu:
        calibration = calibrate_cpu()
        device = calibrated_device(calibration, physical_memory())
    else:
        device = get_device(args.device_name)
        torch.backends.cuda.matmul.allow_tf32 = args.tf32
        torch.backends.cudnn.allow_tf32 = args.tf32
    info = machine(cuda)
    parts = [header(device, calibration, info, args)]
    print(parts[0], flush=True)
    comparisons = []
    for name in args.models:
        for batch in args.batches:
            comparison = run_one(name, batch, device=device, cuda=cuda, args=args)
            comparisons.append(comparison)
            parts.append(section(comparison, args.depth))
            print("\n" + parts[-1], flush=True)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as out:
            out.write("\n\n".join(parts) + "\n")
    if args.json:
        report = {"machine": info, "device": asdict(device), "settings": vars(args),
                  "calibration": None if calibration is None else asdict(calibration),
                  "comparisons": [asdict(c) for c in comparisons]}
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(report, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
