"""modelmeter against fvcore, torch.utils.flop_counter and a plain forward pass, in one run on one machine.

    pip install -r benchmarks/requirements.txt   # the comparison packages: the benchmark's, not the library's
    python benchmarks/compare.py [--quick] [--repeat N] [--json out.json]

Sections (times are medians with min-max over ``--repeat`` runs after one warm-up run; fresh-process
measurements run min(repeat, 3) times without a warm-up, section 4 at least 5 times):

1. **Real tensors** (random initialisation on the CPU; nothing is downloaded): FLOPs + activations + parameters
   by module of ResNet-50, ViT-B/16, Swin-T and GPT-2 small. modelmeter is ``analyze(model, x, quiet=True)
   .result()`` (cache off; execution "auto": meta stand-ins for these CPU models); fvcore is ``FlopCountAnalysis`` +
   ``ActivationCountAnalysis`` + ``flop_count_table`` (warnings off); FlopCounterMode is
   ``torch.utils.flop_counter.FlopCounterMode(depth=None)`` around a forward under ``no_grad`` and
   ``get_flop_counts()`` (FLOPs only: it has no activations); forward is the model under ``no_grad``.
2. **Meta device**: the same models built and run on "meta". fvcore cannot run there (it traces with
   ``torch.jit.trace``, which needs real kernels); FlopCounterMode and a plain forward can.
3. **Llama-2-70B** from its config on meta, 2048 tokens: forward and forward+backward analyses, each in a fresh
   process: the analysis time, the whole process time, and the peak RSS (``resource.getrusage`` maxrss).
   ``--llama-only`` runs this section alone.
4. **Per-operator overhead**: a deep stack of tiny Linear+GELU layers on a (1, 8) input:
   (modelmeter time - plain forward time) / number of events in the trace, in microseconds; the two are timed in
   turn (15 runs each by default), so a drift of the machine's speed falls on both, with the floor: the forward
   under global module hooks and a function and a dispatch mode whose handlers do nothing (what any recorder of
   this kind pays before it records anything), and modelmeter with every repeated call recorded again (no replay);
   per run, modelmeter's, the floor's and the run without replay's time over the forward's. ``--overhead-only``
   runs this section alone.
5. **Cached re-analysis** of ViT-B/16: in-process (the metrics of a second analysis given ``trace=``) and
   persistent (``cache_dir=`` a new directory, then a second fresh process reading it) against the first analysis.

6. **fvcore's pattern**: ``FlopCountAnalysis(model, x)``, ``ActivationCountAnalysis(model, x)`` and
   ``flop_count_table(flops, activations=acts)`` on ResNet-50 and ViT-B/16 (real tensors), modelmeter's (the two
   analyses share one recording) and fvcore's, against FlopCounterMode and a plain forward, timed in turn; ratios
   per run, median (min-max). ``--pair-only`` runs this section alone. With ``--cpu-time``, sections 4 and 6 are
   timed in CPU time of the main thread with one torch thread (for a machine whose other tenants keep the cores busy).
7. **Recurrent layers**: a 2-layer bidirectional ``nn.LSTM(64, 128)`` followed by an ``nn.GRU(256, 128)``, on 4
   sequences of 40 and 160 steps (8 with ``--quick``): modelmeter's analysis against a plain forward, timed in turn
   in CPU time on one thread (on a loaded machine the forward's multi-threaded kernels stall, and its wall time with
   them); the ratio per run, median (min-max), and the analysis time per recorded event. ``--recurrent-only`` runs
   it alone.
8. **A parallel plan at scale**: a Llama-3.1-405B-shaped model (126 layers, hidden 16384, 128 heads, 8 key-value
   heads, FFN 53248, vocabulary 128256) from its config on meta under ``parallel="fsdp=128,tp=8"`` (1024 simulated
   ranks), 8192 tokens per rank, forward and backward with ``memory=True, optimizer="adamw"``, and the result and
   the communication built; each run in a fresh process: the analysis's wall and CPU time, the whole process's, and
   the peak RSS, with the load average before the run (a shared machine: CPU time says more than wall time there).
   ``--parallel-only`` runs it alone; ``--quick``: 2 layers of width 1024, 1024 tokens.

Every timed modelmeter run analyses a new input tensor (a clone): analyses of the same objects in the same state
share one recording in-process, so repeating one call would time the counting only.

``torch.set_num_threads(2)`` everywhere. ``--quick`` uses small models and inputs and fewer repeats (a test runs it).
Times are reported, never asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

THREADS = 2
# What the in-process sections time with: wall-clock seconds, or with --cpu-time the CPU time of the main thread
# (one torch thread): on a machine whose other tenants keep both cores busy, a real forward with two threads waits on
# its own second thread, and wall-clock ratios say more about the load than about the tools.
clock = time.perf_counter
MODELS = ("resnet50", "vit_b_16", "swin_t", "gpt2")
TOOLS = ("modelmeter", "fvcore", "flop_counter", "forward")


# timing ------------------------------------------------------------------------------------------------


def timed(fn: Callable[[], Any], repeat: int) -> dict[str, Any]:
    """Median, min and max seconds of ``fn`` over ``repeat`` runs after one warm-up run."""
    fn()
    times = []
    for _ in range(repeat):
        start = clock()
        fn()
        times.append(clock() - start)
    return summary(times)


def timed_in_turn(fns: dict[str, Callable[[], Any]], repeat: int,
                  timer: Callable[[], float] | None = None) -> dict[str, dict[str, Any]]:
    """As :func:`timed` for each of ``fns``, their runs taken in turn (a, b, a, b, ...): on a machine whose speed
    drifts, a difference of their medians is then not a difference of two moments. ``timer``: the module's
    :data:`clock` unless given (section 7 takes ``time.process_time``, the CPU time of this process)."""
    tick = clock if timer is None else timer
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = tick()
            fn()
            times[name].append(tick() - start)
    return {name: {**summary(values), "times": values} for name, values in times.items()}


def summary(times: list[float]) -> dict[str, Any]:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "runs": len(times)}


def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    """Median time of ``a`` over that of ``b`` (None when either did not run)."""
    if not a or not b or "median_s" not in a or "median_s" not in b:
        return None
    return float(a["median_s"] / b["median_s"])


# models ------------------------------------------------------------------------------------------------


def build(name: str, quick: bool, device: str) -> tuple[nn.Module, torch.Tensor]:
    """Model ``name`` (random weights, eval mode) and its input, on ``device``."""
    import torchvision

    torch.manual_seed(0)
    with torch.device(device):
        if name == "gpt2":
            import transformers

            sizes: dict[str, Any] = {"n_layer": 2, "n_embd": 128, "n_head": 4} if quick else {}
            model: nn.Module = transformers.GPT2LMHeadModel(transformers.GPT2Config(**sizes, use_cache=False))
            return model.eval(), torch.zeros(1, 32 if quick else 256, dtype=torch.long)
        if quick:  # the same architectures, a few narrow layers on a small image
            return quick_models()[name]().eval(), torch.randn(1, 3, 32, 32)
        model = torchvision.models.get_model(name, weights=None)
        return model.eval(), torch.randn(1, 3, 224, 224)


def quick_models() -> dict[str, Callable[[], nn.Module]]:
    """Small members of each family for ``--quick``."""
    from torchvision.models import ResNet, SwinTransformer, VisionTransformer
    from torchvision.models.resnet import Bottleneck

    return {"resnet50": lambda: ResNet(Bottleneck, [1, 1, 1, 1], width_per_group=16),
            "vit_b_16": lambda: VisionTransformer(32, 16, num_layers=2, num_heads=2, hidden_dim=64, mlp_dim=128),
            "swin_t": lambda: SwinTransformer([4, 4], 24, [1, 1, 1, 1], [1, 1, 1, 1], [4, 4])}


def run_modelmeter(model: nn.Module, x: torch.Tensor) -> Callable[[], Any]:
    """One analysis per call, each of a new input tensor: analyses of the same tensor in the same state share
    one recording in-process, and each timed run must record."""
    import modelmeter

    return lambda: modelmeter.analyze(model, x.clone(), cache=False, quiet=True).result()


def run_modelmeter_pair(model: nn.Module, x: torch.Tensor, record: bool = True) -> Callable[[], Any]:
    """fvcore's pattern in modelmeter: a FlopCountAnalysis and an ActivationCountAnalysis of the same call, and
    their table (a new input tensor per call, so each timed run records once; ``record=False``: the same tensor
    every time, so both analyses share the recording of the warm-up run — what the pattern costs besides it)."""
    from modelmeter import ActivationCountAnalysis, FlopCountAnalysis, flop_count_table

    def go() -> str:
        same = x.clone() if record else x
        with warnings.catch_warnings(), quiet_logger("modelmeter"):
            warnings.simplefilter("ignore")
            flops = FlopCountAnalysis(model, same).unsupported_ops_warnings(False).uncalled_modules_warnings(False)
            acts = ActivationCountAnalysis(model, same).unsupported_ops_warnings(False)
            return str(flop_count_table(flops, activations=acts.uncalled_modules_warnings(False)))
    return go


def run_fvcore(model: nn.Module, x: torch.Tensor) -> Callable[[], Any]:
    from fvcore.nn import ActivationCountAnalysis, FlopCountAnalysis, flop_count_table

    def go() -> str:
        with warnings.catch_warnings(), quiet_logger("fvcore"):
            warnings.simplefilter("ignore")
            flops = FlopCountAnalysis(model, x).unsupported_ops_warnings(False).uncalled_modules_warnings(False)
            acts = ActivationCountAnalysis(model, x).unsupported_ops_warnings(False).uncalled_modules_warnings(False)
            return str(flop_count_table(flops, activations=acts))
    return go


@contextlib.contextmanager
def quiet_logger(name: str) -> Iterator[None]:
    """Errors only from logger ``name`` (fvcore logs uncalled modules even with its warnings off)."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def run_flop_counter(model: nn.Module, x: torch.Tensor) -> Callable[[], Any]:
    from torch.utils.flop_counter import FlopCounterMode

    def go() -> Any:
        with torch.no_grad(), FlopCounterMode(display=False, depth=None) as mode:  # type: ignore[arg-type]
            model(x)
        return mode.get_flop_counts()
    return go


def run_forward(model: nn.Module, x: torch.Tensor) -> Callable[[], Any]:
    def go() -> Any:
        with torch.no_grad():
            return model(x)
    return go


RUNNERS = {"modelmeter": run_modelmeter, "fvcore": run_fvcore, "flop_counter": run_flop_counter,
           "forward": run_forward}


def compare(device: str, quick: bool, repeat: int) -> dict[str, Any]:
    """Sections 1 and 2: every tool on every model on ``device``."""
    rows: dict[str, Any] = {}
    for name in MODELS:
        model, x = build(name, quick, device)
        row: dict[str, Any] = {}
        for tool in TOOLS:
            if tool == "fvcore" and device == "meta":
                row[tool] = {"skipped": "fvcore traces with torch.jit.trace, which cannot run on meta tensors"}
                continue
            try:
                row[tool] = timed(RUNNERS[tool](model, x), repeat)
            except Exception as exc:  # a peer that cannot run this model is reported, not fatal
                row[tool] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"}
        row["ratios"] = {f"modelmeter/{tool}": ratio(row["modelmeter"], row[tool]) for tool in TOOLS[1:]}
        rows[name] = row
        print(f"  {device} {name}: " + ", ".join(f"{t} {fmt(row[t])}" for t in TOOLS), file=sys.stderr)
    return rows


def pair(quick: bool, repeat: int) -> dict[str, Any]:
    """Section 6: fvcore's usage pattern (flops + activations analyses of one call, and their table) on ResNet-50
    and ViT-B/16 with real tensors: modelmeter's and fvcore's, against FlopCounterMode and a plain forward, timed
    in turn."""
    rows: dict[str, Any] = {}
    for name in ("resnet50", "vit_b_16"):
        model, x = build(name, quick, "cpu")
        fns = {"modelmeter": run_modelmeter_pair(model, x), "fvcore": run_fvcore(model, x),
               "flop_counter": run_flop_counter(model, x), "forward": run_forward(model, x),
               "shared": run_modelmeter_pair(model, x, record=False)}
        row: dict[str, Any] = timed_in_turn(fns, repeat)
        row["ratios"] = {f"modelmeter/{tool}": ratio(row["modelmeter"], row[tool]) for tool in TOOLS[1:]}
        row["ratio_runs"] = {f"modelmeter/{tool}": summary([a / b for a, b in zip(row["modelmeter"]["times"],
                                                                                 row[tool]["times"], strict=True)])
                             for tool in TOOLS[1:]}
        rows[name] = row
        print(f"  pair {name}: " + ", ".join(f"{t} {fmt(row[t])}" for t in (*TOOLS, "shared")), file=sys.stderr)
    return rows


class Recurrent(nn.Module):
    """Section 7's model: a 2-layer bidirectional LSTM, then a GRU on its output."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(64, 128, num_layers=2, bidirectional=True)
        self.gru = nn.GRU(256, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gru(self.lstm(x)[0])[0]


def recurrent(quick: bool, repeat: int) -> dict[str, Any]:
    """Section 7: the analysis of a recurrent model against its forward, at two sequence lengths."""
    torch.manual_seed(0)
    model = Recurrent().eval()
    rows: dict[str, Any] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU time of one thread: a loaded machine stalls a multi-threaded kernel's wall time
    try:
        for steps in (8,) if quick else (40, 160):
            rows[str(steps)] = recurrent_row(model, steps, repeat)
    finally:
        torch.set_num_threads(threads)
    return rows


def recurrent_row(model: nn.Module, steps: int, repeat: int) -> dict[str, Any]:
    """Section 7 at one sequence length: events, CPU times in turn, the ratio per run."""
    import modelmeter

    x = torch.randn(steps, 4, 64)
    events = len(modelmeter.analyze(model, x.clone(), cache=False, quiet=True).trace.events)
    row: dict[str, Any] = timed_in_turn({"modelmeter": run_modelmeter(model, x), "forward": run_forward(model, x)},
                                        repeat, timer=time.process_time)
    row["events"] = events
    row["ratio_runs"] = summary([a / b for a, b in zip(row["modelmeter"]["times"], row["forward"]["times"],
                                                       strict=True)])
    row["us_per_event"] = row["modelmeter"]["median_s"] / events * 1e6
    print(f"  recurrent {steps} steps: modelmeter {fmt(row['modelmeter'])}, forward {fmt(row['forward'])}",
          file=sys.stderr)
    return row


def markdown_recurrent(rows: dict[str, Any]) -> str:
    """Section 7 as a markdown table."""
    lines = ["### 7. Recurrent layers: LSTM(64, 128, 2 layers, bidirectional) + GRU(256, 128), batch 4 (CPU time, "
             "one thread)", "",
             "| steps | events | modelmeter | forward | mm/forward per run | µs per event |",
             "|---|---|---|---|---|---|"]
    for steps, row in rows.items():
        runs = row["ratio_runs"]
        lines.append(f"| {steps} | {row['events']} | {fmt(row['modelmeter'])} | {fmt(row['forward'])} | "
                     f"{runs['median_s']:.2f}x ({runs['min_s']:.2f}-{runs['max_s']:.2f}) | "
                     f"{row['us_per_event']:.1f} |")
    return "\n".join([*lines, ""])


# Llama-2-70B in fresh processes ------------------------------------------------------------------------

_LLAMA = textwrap.dedent("""
    import json, resource, sys, time
    started = time.perf_counter()
    import torch, transformers, modelmeter
    torch.set_num_threads(%d)
    quick, backward = sys.argv[1] == "1", sys.argv[2] == "1"
    sizes = (dict(hidden_size=256, intermediate_size=896, num_hidden_layers=2, num_attention_heads=8)
             if quick else dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                num_attention_heads=64))
    config = transformers.LlamaConfig(**sizes, num_key_value_heads=8, vocab_size=32000)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    tokens = torch.zeros(1, 128 if quick else 2048, dtype=torch.long, device="meta")
    built = time.perf_counter()
    result = modelmeter.analyze(model, tokens, backward=backward, cache=False, quiet=True).result()
    done = time.perf_counter()
    print(json.dumps({"analysis_s": done - built, "process_s": done - started,
                      "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
""") % THREADS


def fresh(code: str, *args: str) -> dict[str, Any]:
    """Run ``code`` in a new Python process; its last stdout line, parsed as JSON."""
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"subprocess failed ({done.returncode}):\n{done.stderr[-3000:]}")
    row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return row


def llama(quick: bool, repeat: int) -> dict[str, Any]:
    """Section 3: forward and forward+backward of Llama-2-70B on meta, each run in a fresh process."""
    out: dict[str, Any] = {}
    for label, backward in (("forward", "0"), ("forward+backward", "1")):
        runs = [fresh(_LLAMA, "1" if quick else "0", backward) for _ in range(repeat)]
        out[label] = {**summary([r["analysis_s"] for r in runs]),
                      "process": summary([r["process_s"] for r in runs]),
                      "peak_rss_mb": max(r["rss_mb"] for r in runs)}
        print(f"  llama {label}: {fmt(out[label])}, {out[label]['peak_rss_mb']:.0f} MB", file=sys.stderr)
    return out


# a parallel plan at scale, in fresh processes ------------------------------------------------------------

_PARALLEL = textwrap.dedent("""
    import json, os, resource, sys, time
    started, started_cpu = time.perf_counter(), time.process_time()
    load = os.getloadavg()[0]
    import torch, transformers, modelmeter
    torch.set_num_threads(%d)
    quick = sys.argv[1] == "1"
    sizes = (dict(hidden_size=1024, intermediate_size=3328, num_hidden_layers=2) if quick
             else dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126))
    config = transformers.LlamaConfig(**sizes, num_attention_heads=128, num_key_value_heads=8, vocab_size=128256,
                                      rope_theta=500000.0, max_position_embeddings=131072)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    tokens = torch.zeros(1, 1024 if quick else 8192, dtype=torch.long, device="meta")
    built, built_cpu = time.perf_counter(), time.process_time()
    analysis = modelmeter.analyze(model, tokens, parallel="fsdp=128,tp=8", backward=True, memory=True,
                                  optimizer="adamw", cache=False, quiet=True)
    analysis.result()
    volume = analysis.communication.total()
    done, done_cpu = time.perf_counter(), time.process_time()
    print(json.dumps({"analysis_s": done - built, "analysis_cpu_s": done_cpu - built_cpu,
                      "process_s": done - started, "process_cpu_s": done_cpu - started_cpu,
                      "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "load": load,
                      "events": len(analysis.trace.events), "collectives": volume.count}))
""") % THREADS


def parallel(quick: bool, repeat: int) -> dict[str, Any]:
    """Section 8: the 405B-shaped model under fsdp=128,tp=8, each run in a fresh process."""
    runs = [fresh(_PARALLEL, "1" if quick else "0") for _ in range(repeat)]
    row = {**summary([r["analysis_s"] for r in runs]),
           **{key: summary([r[f"{key}_s"] for r in runs]) for key in ("analysis_cpu", "process", "process_cpu")},
           "peak_rss_mb": max(r["rss_mb"] for r in runs), "rss_mb": [r["rss_mb"] for r in runs],
           "load": [r["load"] for r in runs], "events": runs[0]["events"], "collectives": runs[0]["collectives"]}
    print(f"  parallel: {fmt(row)}, {row['peak_rss_mb']:.0f} MB", file=sys.stderr)
    return row


def markdown_parallel(row: dict[str, Any], quick: bool) -> str:
    """Section 8 as a markdown table."""
    title = ("2-layer Llama of width 1024, 1024 tokens (--quick)" if quick
             else "Llama-3.1-405B-shaped (126 layers), 8192 tokens")
    load = ", ".join(f"{value:.1f}" for value in row["load"])
    return "\n".join([
        f"### 8. {title} under fsdp=128,tp=8 (1024 ranks), forward + backward + memory (fresh process each)", "",
        "| analysis (wall) | analysis (CPU) | whole process (wall) | whole process (CPU) | peak RSS | events "
        "| collectives |", "|---|---|---|---|---|---|---|",
        f"| {fmt(row)} | {fmt(row['analysis_cpu'])} | {fmt(row['process'])} | {fmt(row['process_cpu'])} "
        f"| {row['peak_rss_mb']:.0f} MB | {row['events']} | {row['collectives']} |", "",
        f"Load average (1 min) before each run: {load}.", ""])


# per-operator overhead ---------------------------------------------------------------------------------


def overhead(quick: bool, repeat: int) -> dict[str, Any]:
    """Section 4: microseconds of engine work per recorded operator event on many tiny layers.

    ``us_per_event`` is (modelmeter time - plain forward time) / events, fixed costs included;
    ``marginal_us_per_event`` is the slope between this stack and one a fifth as deep (fixed costs cancel).
    """
    layers = 50 if quick else 500
    deep, shallow = (tiny_stack(n, repeat) for n in (layers, layers // 5))
    per_event = (deep["modelmeter"]["median_s"] - deep["forward"]["median_s"]) / deep["events"] * 1e6
    extra = [row["modelmeter"]["median_s"] - row["forward"]["median_s"] for row in (deep, shallow)]
    marginal = (extra[0] - extra[1]) / (deep["events"] - shallow["events"]) * 1e6
    print(f"  overhead: {per_event:.1f} us/event over {deep['events']} events, marginal {marginal:.1f}",
          file=sys.stderr)
    return {**deep, "shallow": shallow, "us_per_event": per_event, "marginal_us_per_event": marginal}


def tiny_stack(layers: int, repeat: int) -> dict[str, Any]:
    """Events and times of modelmeter, of a plain forward and of the floor (:func:`run_floor`) on ``layers`` x
    (Linear(8, 8) + GELU), timed in turn; per run, modelmeter's and the floor's time over the forward's."""
    import modelmeter

    model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(layers))).eval()
    x = torch.randn(1, 8)
    events = len(modelmeter.analyze(model, x, cache=False, quiet=True).trace.events)
    times = timed_in_turn({"modelmeter": run_modelmeter(model, x), "forward": run_forward(model, x),
                           "floor": run_floor(model, x), "no replay": run_without_replay(model, x)}, repeat)
    ratios = {f"{tool}/forward": summary([a / b for a, b in zip(times[tool]["times"], times["forward"]["times"],
                                                                  strict=True)])
              for tool in ("modelmeter", "floor", "no replay")}
    return {"layers": layers, "events": events, **times, "ratio_runs": ratios}


def run_without_replay(model: nn.Module, x: torch.Tensor) -> Callable[[], Any]:
    """modelmeter with every repeated call recorded again (``engine.replay.replay_disabled()``): what the replay of
    repeated calls saves."""
    from modelmeter.engine.replay import replay_disabled

    analysis = run_modelmeter(model, x)

    def go() -> Any:
        with replay_disabled():
            return analysis()
    return go


def run_floor(model: nn.Module, x: torch.Tensor) -> Callable[[], Any]:
    """A forward under what a recording adds before it records anything: global module hooks (before and after
    every call) and a function mode and a dispatch mode (modelmeter's kind: no torch.compile guard), all with empty
    handlers."""
    from torch.overrides import TorchFunctionMode

    from modelmeter._torch_compat import EagerDispatchMode

    class Functions(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            return func(*args, **(kwargs or {}))

    class Dispatch(EagerDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            return func(*args, **(kwargs or {}))

    def nothing(*_: Any) -> None:
        return None

    def go() -> Any:
        hooks = nn.modules.module
        handles = [hooks.register_module_forward_pre_hook(nothing),
                   hooks.register_module_forward_hook(nothing, always_call=True)]
        try:
            with torch.no_grad(), Functions(), Dispatch():
                return model(x)
        finally:
            for handle in handles:
                handle.remove()
    return go


# cached re-analysis ------------------------------------------------------------------------------------

_CACHED = textwrap.dedent("""
    import json, sys, time
    import torch, modelmeter, modelmeter.cache
    sys.path.insert(0, sys.argv[3])
    torch.set_num_threads(%d)
    from compare import build
    model, x = build("vit_b_16", sys.argv[1] == "1", "cpu")
    start = time.perf_counter()
    analysis = modelmeter.analyze(model, x, cache_dir=sys.argv[2], quiet=True)
    analysis.result()
    print(json.dumps({"analysis_s": time.perf_counter() - start, "from_cache": analysis.from_cache}))
""") % THREADS


def cached(quick: bool, repeat: int) -> dict[str, Any]:
    """Section 5: re-analysis from a trace in the same process, and from the persistent cache in a new one."""
    import modelmeter
    from modelmeter import ActivationCountAnalysis, FlopCountAnalysis, build_result

    model, x = build("vit_b_16", quick, "cpu")
    trace = modelmeter.analyze(model, x, cache=False, quiet=True).trace

    def again() -> Any:
        flops = FlopCountAnalysis(model, x, trace=trace).unsupported_ops_warnings(False)
        flops.uncalled_modules_warnings(False)
        acts = ActivationCountAnalysis(model, x, trace=trace).unsupported_ops_warnings(False)
        acts.uncalled_modules_warnings(False)
        return build_result(model, {"flops": flops, "activations": acts})

    first = timed(run_modelmeter(model, x), repeat)
    in_process = timed(again, repeat)
    here = os.path.dirname(os.path.abspath(__file__))
    cold, warm = [], []
    for _ in range(repeat):
        directory = tempfile.mkdtemp(prefix="modelmeter-bench-")
        try:
            cold.append(fresh(_CACHED, "1" if quick else "0", directory, here))
            warm.append(fresh(_CACHED, "1" if quick else "0", directory, here))
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    if any(r["from_cache"] for r in cold) or not all(r["from_cache"] for r in warm):
        raise RuntimeError("the persistent cache was not used as expected")
    out = {"first": first, "in_process": in_process,
           "persistent_first": summary([r["analysis_s"] for r in cold]),
           "persistent_cached": summary([r["analysis_s"] for r in warm])}
    out["ratios"] = {"first/in_process": ratio(first, in_process),
                     "persistent_first/persistent_cached": ratio(out["persistent_first"], out["persistent_cached"])}
    print(f"  cache: {out['ratios']}", file=sys.stderr)
    return out


# report ------------------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    """What ran the benchmark."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as lines:
        cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), cpu)
    versions = {}
    for package in ("modelmeter", "fvcore", "torchvision", "transformers"):
        try:
            versions[package] = __import__(package).__version__
        except Exception:  # a missing comparison package is reported in the table
            versions[package] = "not installed"
    return {"cpu": cpu, "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(), "torch": torch.__version__,
            **versions,
            "platform": platform.platform(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat("T", "seconds")}


def fmt(cell: dict[str, Any] | None) -> str:
    """A time cell: median (min-max), or why it is missing."""
    if not cell:
        return "-"
    if "median_s" not in cell:
        return "n/a: " + (cell.get("skipped") or cell.get("error", ""))
    return f"{cell['median_s'] * 1e3:.1f} ms ({cell['min_s'] * 1e3:.1f}-{cell['max_s'] * 1e3:.1f})"


def fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def markdown(report: dict[str, Any]) -> str:
    """The results as markdown tables."""
    m = report["machine"]
    lines = [f"## modelmeter benchmark ({'quick' if report['quick'] else 'full'}; {report['repeat']} repeats)", "",
             f"{m['date']}; {m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable), "
             f"torch.set_num_threads({m['torch_threads']}); Python {m['python']}, torch {m['torch']}, "
             f"modelmeter {m['modelmeter']}, fvcore {m['fvcore']}, torchvision {m['torchvision']}, "
             f"transformers {m['transformers']}; {m['platform']}.",
             "Times: median (min-max) after a warm-up run.", ""]
    for section, title in (("real", "1. By-module FLOPs + activations + parameters, real tensors (CPU)"),
                           ("meta", "2. The same on the meta device")):
        lines += [f"### {title}", "",
                  "| model | modelmeter | fvcore | FlopCounterMode | forward | mm/fvcore | mm/FlopCounterMode "
                  "| mm/forward |", "|---|---|---|---|---|---|---|---|"]
        for name, row in report[section].items():
            r = row["ratios"]
            lines.append(f"| {name} | " + " | ".join(fmt(row[t]) for t in TOOLS) + " | "
                         + " | ".join(fmt_ratio(r[f"modelmeter/{t}"]) for t in TOOLS[1:]) + " |")
        lines.append("")
    lines.append(markdown_llama(report["llama"], report["quick"]))
    o = report["overhead"]
    c = report["cached"]
    lines += ["", f"### 4. Engine overhead: {o['layers']} x (Linear(8, 8) + GELU) on a (1, 8) input", "",
              f"modelmeter {fmt(o['modelmeter'])}, forward {fmt(o['forward'])}, {o['events']} events: "
              f"**{o['us_per_event']:.1f} µs per operator event** (fixed costs included); "
              f"{o['marginal_us_per_event']:.1f} µs per event marginal (against {o['shallow']['layers']} layers, "
              f"{o['shallow']['events']} events: modelmeter {fmt(o['shallow']['modelmeter'])}, "
              f"forward {fmt(o['shallow']['forward'])}).", "", markdown_overhead_ratios(o), "",
              "### 5. Cached re-analysis (ViT-B/16)", "",
              "| analysis | time | speed-up |", "|---|---|---|",
              f"| first (in process) | {fmt(c['first'])} | 1x |",
              f"| again from its trace (in process) | {fmt(c['in_process'])} | "
              f"{fmt_ratio(c['ratios']['first/in_process'])} |",
              f"| first, fresh process, empty cache | {fmt(c['persistent_first'])} | 1x |",
              f"| fresh process, from the cache | {fmt(c['persistent_cached'])} | "
              f"{fmt_ratio(c['ratios']['persistent_first/persistent_cached'])} |", ""]
    return "\n".join(lines)


def markdown_llama(rows: dict[str, Any], quick: bool) -> str:
    """Section 3 as a markdown table."""
    lines = ["### 3. Llama-2-70B from its config on meta, 2048 tokens (fresh process each)" if not quick
             else "### 3. Small Llama from its config on meta, 128 tokens (fresh process each; --quick)", "",
             "| pass | analysis | whole process (imports, build) | peak RSS |", "|---|---|---|---|"]
    for label, row in rows.items():
        lines.append(f"| {label} | {fmt(row)} | {fmt(row['process'])} | {row['peak_rss_mb']:.0f} MB |")
    return "\n".join(lines)


def markdown_overhead_ratios(row: dict[str, Any]) -> str:
    """Section 4's ratios per run: modelmeter's and the floor's time over the forward's, median (min-max)."""
    cells = [f"{row['ratio_runs'][key]['median_s']:.2f}x ({row['ratio_runs'][key]['min_s']:.2f}-"
             f"{row['ratio_runs'][key]['max_s']:.2f})"
             for key in ("modelmeter/forward", "floor/forward", "no replay/forward")]
    return (f"Per run, against the forward: modelmeter {cells[0]}; the floor (the forward under global module hooks "
            f"and two modes, all with empty handlers: {fmt(row['floor'])}) {cells[1]}; modelmeter without the replay "
            f"of repeated calls ({fmt(row['no replay'])}) {cells[2]}.")


def markdown_pair(rows: dict[str, Any]) -> str:
    """Section 6 as a markdown table: times, and modelmeter's ratios as median (min-max) over the runs."""
    lines = ["### 6. fvcore's pattern: FlopCountAnalysis + ActivationCountAnalysis + flop_count_table (CPU)", "",
             "| model | modelmeter | fvcore | FlopCounterMode | forward | mm/fvcore | mm/FlopCounterMode "
             "| mm/forward |", "|---|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        runs = row["ratio_runs"]
        cells = [f"{runs[key]['median_s']:.2f}x ({runs[key]['min_s']:.2f}-{runs[key]['max_s']:.2f})"
                 for key in (f"modelmeter/{t}" for t in TOOLS[1:])]
        lines.append(f"| {name} | " + " | ".join(fmt(row[t]) for t in TOOLS) + " | " + " | ".join(cells) + " |")
    lines += ["", "What the pattern costs besides its one recording (both analyses sharing a recording made before: "
              "their two call keys, counting and the table): " + "; ".join(
                  f"{name} {fmt(row['shared'])}, {ratio(row['shared'], row['flop_counter']):.2f}x FlopCounterMode"
                  for name, row in rows.items() if "shared" in row) + "."]
    return "\n".join([*lines, ""])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small models and inputs, 1 repeat (for tests)")
    parser.add_argument("--repeat", type=int, help="timed runs per measurement (default 5, 1 with --quick)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--pair-only", action="store_true", help="only section 6 (fvcore's usage pattern)")
    parser.add_argument("--overhead-only", action="store_true", help="only section 4 (the per-event overhead)")
    parser.add_argument("--recurrent-only", action="store_true", help="only section 7 (recurrent layers)")
    parser.add_argument("--parallel-only", action="store_true", help="only section 8 (a parallel plan at scale)")
    parser.add_argument("--llama-only", action="store_true", help="only section 3 (Llama-2-70B on meta)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="sections 4 and 6 in CPU time of the main thread, one torch thread (a loaded machine)")
    args = parser.parse_args()
    repeat = args.repeat or (1 if args.quick else 5)
    global clock
    if args.cpu_time:
        if not (args.pair_only or args.overhead_only):
            parser.error("--cpu-time times sections 4 and 6: pass it with --pair-only and/or --overhead-only")
        clock = time.thread_time
    torch.set_num_threads(1 if args.cpu_time else THREADS)
    report: dict[str, Any] = {"quick": args.quick, "repeat": repeat, "machine": machine(), "cpu_time": args.cpu_time}
    if args.pair_only or args.overhead_only or args.recurrent_only or args.parallel_only or args.llama_only:
        if args.llama_only:
            report["llama"] = llama(args.quick, min(repeat, 3))
            print(markdown_llama(report["llama"], args.quick))
        if args.overhead_only:
            report["overhead"] = overhead(args.quick, 3 * max(repeat, 5))
            print(markdown_overhead_ratios(report["overhead"]))
        if args.pair_only:
            report["pair"] = pair(args.quick, repeat)
            print(markdown_pair(report["pair"]))
        if args.recurrent_only:
            report["recurrent"] = recurrent(args.quick, repeat)
            print(markdown_recurrent(report["recurrent"]))
        if args.parallel_only:
            report["parallel"] = parallel(args.quick, min(repeat, 3))
            print(markdown_parallel(report["parallel"], args.quick))
        if args.json:
            with open(args.json, "w") as out:
                json.dump(report, out, indent=1)
        return 0
    report["real"] = compare("cpu", args.quick, repeat)
    report["meta"] = compare("meta", args.quick, repeat)
    report["llama"] = llama(args.quick, min(repeat, 3))
    report["overhead"] = overhead(args.quick, 3 * max(repeat, 5))  # cheap, and the noisiest: more runs
    report["cached"] = cached(args.quick, min(repeat, 3))
    report["pair"] = pair(args.quick, repeat)
    report["recurrent"] = recurrent(args.quick, repeat)
    report["parallel"] = parallel(args.quick, min(repeat, 3))
    print(markdown(report) + "\n" + markdown_pair(report["pair"]) + "\n" + markdown_recurrent(report["recurrent"])
          + "\n" + markdown_parallel(report["parallel"], args.quick))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
