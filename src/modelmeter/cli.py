"""The ``modelmeter`` command: FLOPs, activations and parameters of a model, by module.

``modelmeter`` alone analyses the built-in ResNet-50 at 224x224; ``modelmeter MODEL`` another model:
a zoo name (``modelmeter list``), ``torchvision:NAME``, ``timm:NAME``, ``transformers:CONFIG [key=value ...]``,
``path/file.py:factory`` or ``package.module:factory`` (see :mod:`modelmeter.models`). Models are built on
the meta device and run on FakeTensors: no weights, no kernels, nothing downloaded. ``--sweep`` shows how
the cost grows with the resolution, batch or sequence length. ``--memory`` predicts the memory of inference
or, with ``--backward`` / ``--optimizer``, of a training step; ``--fit 24GiB`` finds the largest batch that
fits (docs/memory.md). Traces are cached on disk (``--no-cache`` to
skip, ``--cache-dir`` to choose where; ``modelmeter cache info`` / ``modelmeter cache clear``).

Exit status: 0 success, 2 usage error (bad option, shape, path or model name; found before the model runs),
1 the model failed to build or run, 130 interrupted (Ctrl-C). Each error is one line on stderr. Inputs the
command makes are meta tensors (no memory) unless ``--real``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import math
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO, TypeVar

import torch

from .cache.store import SIZE_ENV
from .engine.tracer import Execution
from .errors import ModelExitError, ModelMeterError
from .handles.attention import ATTENTION_KERNELS
from .handles.conventions import CONVENTIONS
from .metrics.memory import OPTIMIZERS
from .models import MAX_TENSOR_BYTES, LoadedModel, ModelSpecError, load_model, one_line
from .reports.render import FORMATS, format_bytes, format_size, render
from .reports.result import BYTE_METRICS, Result

if TYPE_CHECKING:
    from .guard import Entry

DTYPES = ("float32", "float16", "bfloat16")
FIT_CAP = 1 << 20  # --fit tries no batch larger than this
SWEEP_AXES = {"resolution": "resolution", "batch": "batch", "seq-len": "seq_len", "seq_len": "seq_len"}
_INPUT_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
                 "bfloat16": torch.bfloat16, "float64": torch.float64, "double": torch.float64,
                 "int64": torch.long, "long": torch.long, "int32": torch.int32, "int": torch.int32,
                 "bool": torch.bool}


# --- argument types --------------------------------------------------------------------------------------
def _shape(text: str) -> tuple[tuple[int, ...], torch.dtype | None]:
    """``1x3x224x224`` or ``2x128:long`` -> (shape, dtype or None)."""
    shape_text, _, dtype_text = text.partition(":")
    try:
        shape = tuple(int(part) for part in shape_text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"an input shape looks like 1x3x224x224 (optionally :long, :float16, ...), got {text!r}") from None
    if not shape or any(s <= 0 for s in shape):
        raise argparse.ArgumentTypeError(f"input sizes must be positive, got {text!r}")
    dtype = None
    if dtype_text:
        if dtype_text.lower() not in _INPUT_DTYPES:
            raise argparse.ArgumentTypeError(
                f"unknown input dtype {dtype_text!r} in {text!r}; one of {', '.join(_INPUT_DTYPES)}")
        dtype = _INPUT_DTYPES[dtype_text.lower()]
    # the bytes of the final dtype are checked with the model's inputs; here, what no dtype could hold
    if math.prod(shape) * (dtype.itemsize if dtype else 1) > MAX_TENSOR_BYTES:
        raise argparse.ArgumentTypeError(f"{text} has more elements than a tensor can hold; give smaller sizes")
    return shape, dtype


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    if value > MAX_TENSOR_BYTES:  # a size torch cannot hold (an int64), and more than any count of workers
        raise argparse.ArgumentTypeError(f"{text} is too large (at most 2**63 - 1)")
    return value


def _depth(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a depth of 0 or more, got {text!r}")
    return value


def _sweep(text: str) -> tuple[str, list[int]]:
    """``resolution=224,288,384`` -> ("resolution", [224, 288, 384])."""
    axis, sep, values = text.partition("=")
    axis = axis.strip()
    if not sep or axis not in SWEEP_AXES:
        raise argparse.ArgumentTypeError(
            f"--sweep must look like resolution=224,288 (or batch=..., seq-len=...), got {text!r}")
    try:
        numbers = [_positive(v.strip()) for v in values.split(",") if v.strip()]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"--sweep values must be positive integers, got {values!r}") from None
    if not numbers:
        raise argparse.ArgumentTypeError(f"--sweep {axis}= needs at least one value")
    return SWEEP_AXES[axis], numbers


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors on one line, ``modelmeter: argument --fit: ...`` (exit 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (`{self.prog} --help` lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="modelmeter",
        usage="modelmeter [MODEL] [key=value ...] [options]\n       modelmeter list\n"
              "       modelmeter cache {info,clear} [--cache-dir DIR]",
        description="What a PyTorch model costs: FLOPs, activations and parameters by module (fvcore numbers), "
                    "from one fake-tensor run. Nothing is downloaded.",
        epilog="MODEL: a built-in model (default resnet50; `modelmeter list`), torchvision:NAME, timm:NAME, "
               "transformers:CONFIG (e.g. transformers:LlamaConfig num_hidden_layers=2), path/file.py:factory or "
               "package.module:factory (factory() returns a module or a (model, inputs) pair). key=value "
               "arguments override the transformers config or go to the builder. Traces are cached on disk "
               "(`modelmeter cache info` shows where, `modelmeter cache clear` empties it). Exit status: 0 success, "
               "2 usage error, 1 the model failed to build or run, 130 interrupted.",
    )
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help="what to analyse (default resnet50); `list` shows the built-in models; "
                             "`diff A.json B.json` compares two saved analyses")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides (transformers) or builder / factory keyword arguments")
    inputs = parser.add_argument_group("inputs (default: the model's own, batch 1)")
    inputs.add_argument("--input", type=_shape, action="append", metavar="SHAPE[:DTYPE]",
                        help="an input's shape, e.g. 1x3x224x224 or 2x128:long; repeat for several inputs")
    inputs.add_argument("--batch", type=_positive, metavar="N", help="batch size of the default inputs")
    inputs.add_argument("--resolution", type=_positive, metavar="N", help="image side of image models")
    inputs.add_argument("--seq-len", type=_positive, metavar="N", help="sequence length of token models")
    inputs.add_argument("--dtype", choices=DTYPES, help="dtype of the model and its floating-point inputs")
    run = parser.add_argument_group("run")
    run.add_argument("--real", dest="execution", action="store_const", const="real", default="auto",
                     help="run real kernels (models are built on cpu instead of meta)")
    run.add_argument("--execution", choices=("auto", "fake", "real"), default="auto",
                     help="fake tensors (auto: fake, real kernels only if the model needs values) or real kernels")
    run.add_argument("--convention", choices=CONVENTIONS, default="fvcore",
                     help="counting convention: fvcore (default: one multiply-add is one flop, element-wise free), "
                          "macs (matrix/conv/attention multiply-adds only) or flops (real floating-point operations)")
    run.add_argument("--backward", action="store_true",
                     help="also run the backward pass (loss = sum of the outputs): forward and backward columns")
    run.add_argument("--dense-attention", action="store_true",
                     help="count masked (causal, sliding-window) attention as dense")
    run.add_argument("--attention-kernel", choices=ATTENTION_KERNELS, default="fused",
                     help="the kernel attention is counted at: fused (default: attended pairs, backward 2.5x the "
                          "forward's products) or math (every pair, backward 2x)")
    run.add_argument("--sweep", type=_sweep, metavar="AXIS=V1,V2,...",
                     help="one row per value: resolution=224,288,384, batch=1,8,64 or seq-len=128,512")
    run.add_argument("--jobs", type=_positive, metavar="N",
                     help="worker processes for --sweep (default: one per value, at most the CPU count)")
    run.add_argument("--no-cache", dest="cache", action="store_false",
                     help="neither read nor write the trace cache (default: traces are cached on disk)")
    run.add_argument("--cache-dir", metavar="DIR",
                     help="the cache directory (default: $MODELMETER_CACHE, else the user cache directory)")
    out = parser.add_argument_group("output")
    out.add_argument("--format", choices=FORMATS, default="table", help="output format (default table)")
    out.add_argument("--depth", type=_depth, default=2, metavar="N", help="module depth shown (default 2)")
    out.add_argument("--output", "-o", metavar="FILE", help="write the report to FILE instead of stdout")
    out.add_argument("--html", metavar="FILE",
                     help="also write a self-contained interactive HTML report (module chart, tables) to FILE")
    out.add_argument("--compare", metavar="RESULT.json",
                     help="with --html: show the difference per module to another analysis (saved with --format json)")
    guard = parser.add_argument_group("cost guard (docs/guard.md)")
    guard.add_argument("--budget", type=_budget, metavar="METRIC=N,...",
                       help="exit 1 when a metric is over its budget, e.g. flops=4.2G,params=26M,activations=12M")
    guard.add_argument("--save-baseline", metavar="FILE", help="add (or replace) this model's costs in FILE")
    guard.add_argument("--check-baseline", metavar="FILE",
                       help="exit 1 when a metric of a module grew beyond --tolerance over FILE's entry; without "
                            "MODEL, check every model FILE holds (in parallel)")
    guard.add_argument("--tolerance", type=_tolerance, default=0.0, metavar="T",
                       help="allowed growth for --check-baseline: 1%%, 0.01 (default 0)")
    guard.add_argument("--name", metavar="NAME", help="the baseline entry's name (default: MODEL and key=value)")
    memory = parser.add_argument_group("memory (docs/memory.md)")
    memory.add_argument("--memory", action="store_true",
                        help="also predict memory: the peak (how much, where, of what), activation bytes and each "
                             "module's peak; with --backward, of a training step (and the bytes saved for backward)")
    memory.add_argument("--optimizer", choices=tuple(OPTIMIZERS),
                        help="a training step with this torch.optim optimizer: its state and the temporaries of "
                             "its step() (implies --memory --backward)")
    memory.add_argument("--state-dtype", choices=DTYPES,
                        help="dtype of the optimizer's state (default: the parameters' dtype)")
    memory.add_argument("--foreach", action="store_true", default=None,
                        help="model the multi-tensor optimizer step, the CUDA default (default: one parameter at "
                             "a time, the CPU default)")
    memory.add_argument("--fit", type=_memory_size, metavar="SIZE",
                        help="the largest batch whose predicted peak fits in SIZE, e.g. 24GiB: batches doubled "
                             "from 1, then bisected (implies --memory)")
    return parser


def _budget(text: str) -> dict[str, float]:
    from .guard import parse_budget

    try:
        return parse_budget(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _memory_size(text: str) -> float:
    from .guard import parse_quantity

    try:
        value = parse_quantity(text)  # refuses what is not finite (1e400GiB) or absurd
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not value >= 1:  # NaN too
        raise argparse.ArgumentTypeError(f"a memory size must be at least one byte, got {text!r}")
    if value > MAX_TENSOR_BYTES:
        raise argparse.ArgumentTypeError(f"{text} is more memory than a machine can address (at most 8EiB)")
    return value


def _tolerance(text: str) -> float:
    """``1%`` or ``0.01``: a finite fraction >= 0 (``nan`` would make every comparison pass)."""
    from .guard.values import check_tolerance

    try:
        return check_tolerance(float(text[:-1]) / 100 if text.strip().endswith("%") else float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a tolerance: {text!r} (a finite number >= 0, e.g. 1% or 0.01)") \
            from None


# --- one analysis (also the sweep's worker) --------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    """Everything one analysis needs; plain picklable data, so a worker process can run it."""

    spec: str
    overrides: tuple[str, ...] = ()
    shapes: tuple[tuple[tuple[int, ...], torch.dtype | None], ...] = ()
    batch: int | None = None
    resolution: int | None = None
    seq_len: int | None = None
    dtype: torch.dtype | None = None
    execution: Execution = "auto"
    convention: str = "fvcore"
    backward: bool = False
    dense_attention: bool = False
    attention_kernel: str = "fused"
    cache: bool = True
    cache_dir: str | None = None
    memory: bool = False
    optimizer: str | None = None
    state_dtype: str | None = None
    foreach: bool | None = None
    project: str | None = None  # set for a model named by a baseline file: what it may call is confined to this


def analyse(job: Job) -> tuple[Result, LoadedModel, float, bool]:
    """Build and run the model once (or read its trace from the cache); the structured Result (flops,
    activations and, with ``job.memory``, memory), the model, seconds, and whether the trace came from the
    cache. Model code that calls ``sys.exit`` is a :class:`ModelExitError`."""
    with _model_code(job.spec):
        return _analyse(job)


@contextlib.contextmanager
def _model_code(what: str) -> Iterator[None]:
    """SystemExit (``sys.exit``) and the other BaseExceptions that are neither Exceptions nor KeyboardInterrupt,
    raised by the model's code, end the analysis as a failure naming the model (exit 1), never as a quiet exit
    (os._exit cannot be caught: docs/guard.md)."""
    try:
        yield
    except (Exception, KeyboardInterrupt):
        raise
    except BaseException as exc:
        raise ModelExitError(what, exc) from None


def _analyse(job: Job) -> tuple[Result, LoadedModel, float, bool]:
    from .analysis import analyze

    real = job.execution == "real"
    check = None
    if job.project is not None:
        from .guard.specs import check_factory

        check = functools.partial(check_factory, spec=job.spec, project=job.project)
    loaded = load_model(job.spec, job.overrides, device="cpu" if real else "meta", resolution=job.resolution,
                        factory_check=check)
    if job.dtype is not None:
        loaded.model.to(job.dtype)
    if job.shapes:
        inputs = loaded.explicit_inputs(job.shapes, job.dtype, real=real)
    else:
        inputs = loaded.inputs(batch=job.batch, resolution=job.resolution, seq_len=job.seq_len, dtype=job.dtype,
                               real=real)
    start = time.perf_counter()
    with _quiet_fake_tensor_log():
        try:
            analysis = analyze(loaded.model, inputs, convention=job.convention, dense_attention=job.dense_attention,
                               backward=job.backward, execution=job.execution, cache=job.cache,
                               cache_dir=job.cache_dir if job.cache else None, quiet=True, memory=job.memory,
                               optimizer=job.optimizer, state_dtype=job.state_dtype, foreach=job.foreach,
                               attention_kernel=job.attention_kernel)
        except TypeError as exc:  # the inputs do not fit the model's forward()
            raise ModelSpecError(str(exc)) from None
        result = analysis.result(name=loaded.name)
    result.assumptions = [*loaded.notes, *result.assumptions]
    return result, loaded, time.perf_counter() - start, analysis.from_cache


@contextlib.contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    """Silence torch's FakeTensor logger while a model runs: it logs a traceback (ERROR) when an operator rejects
    its inputs, before raising the error that the command reports in one line."""
    from ._torch_compat import FAKE_TENSOR_LOGGER

    logger = logging.getLogger(FAKE_TENSOR_LOGGER)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _worker_row(job: Job, row: Callable[[Result, float], dict[str, Any]]) -> dict[str, Any]:
    """What a worker process sends back: ``row(result, seconds)``, or the error as data (some exceptions,
    ModelRunError among them, do not survive pickling)."""
    try:
        result, _, seconds, _ = analyse(job)
    except ModelSpecError as exc:
        return {"error": one_line(exc), "code": 2}
    except ModelMeterError as exc:
        return {"error": one_line(exc), "code": 1}
    return row(result, seconds)


def sweep_point(job: Job) -> dict[str, Any]:
    """The sweep's worker (top level, so spawned processes can import it): one row."""
    return _worker_row(job, lambda result, seconds: {
        "params": result.root.params, "flops": result.total("flops"), "activations": result.total("activations"),
        "peak_memory": result.memory.get("peak"), "seconds": seconds, "execution": result.execution})


# --- the command -----------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """The command: its exit status. A mistake on the command line is one line on stderr and exit 2, a model
    that fails one line and exit 1, Ctrl-C the line ``modelmeter: interrupted`` and exit 130."""
    try:
        return _main(build_parser(), list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:
        print("modelmeter: interrupted", file=sys.stderr)
        return 130


def _main(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    try:
        args = parser.parse_intermixed_args(_attach_negative_values(parser, argv))
    except SystemExit as exc:  # argparse printed the usage error (or --help)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        _check_paths(args)
        if args.model == "list":
            return _list(args)
        if args.model == "cache":
            return _cache_command(args)
        if args.model == "diff":
            return _diff_command(args)
        if args.model is None and args.check_baseline:
            return _check_all(args)
        _check_command_typo(args.model)
        job = _job(args)
        if args.fit is not None:
            return _run_fit(args, job)
        if args.sweep:
            return _run_sweep(args, job)
        return _run_one(args, job)
    except ModelSpecError as exc:
        _error(exc)
        return 2
    except ModelMeterError as exc:
        _error(exc)
        return 1


_COMMANDS = ("list", "cache", "diff")


def _check_command_typo(model: str | None) -> None:
    """``modelmeter cahce info`` names no model: say which command was meant (its arguments would otherwise be
    read as key=value overrides, and the error would be about them)."""
    from .models import suggest
    from .zoo import ZOO

    if model is None or ":" in model or model in ZOO:
        return
    close = suggest(model, _COMMANDS, n=1)
    if close:
        raise ModelSpecError(f"unknown model or command {model!r}; did you mean `modelmeter {close[0]}`?")


def _attach_negative_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--input -1x3`` as ``--input=-1x3``: argparse takes a value that starts with ``-`` for an option and says
    only "expected one argument"; attached, the value reaches the option's own check, which says what is wrong."""
    takes_value = {flag for action in parser._actions if action.nargs is None for flag in action.option_strings}
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in takes_value and len(arg) > 1 and arg[0] == "-" and (arg[1].isdigit() or arg[1] == "."):
            flag = out.pop()
            arg = f"{flag}={arg}" if flag.startswith("--") else flag + arg
        out.append(arg)
    return out


def _check_paths(args: argparse.Namespace) -> None:
    """Refuse, before any model is built, a path no file can have, a file the command could not write at the
    end, and a cache directory that is a file."""
    for option in ("--output", "--html", "--compare", "--save-baseline", "--check-baseline", "--cache-dir"):
        path = getattr(args, option[2:].replace("-", "_"))
        if path is not None and "\0" in path:
            raise ModelSpecError(f"{option} {path!r}: a path cannot hold a NUL character")
    for option, path in (("--output", args.output), ("--html", args.html), ("--save-baseline", args.save_baseline)):
        if path is not None:
            _check_writable(option, path)
    if args.cache_dir is not None:
        folder = Path(args.cache_dir).expanduser()
        if folder.exists() and not folder.is_dir():
            raise ModelSpecError(f"--cache-dir {args.cache_dir} is not a directory")


def _check_writable(option: str, path: str) -> None:
    target = Path(path).expanduser()
    folder = target.parent
    if target.is_dir():
        raise ModelSpecError(f"{option} {path} is a directory: give a file name (e.g. {target / 'report'})")
    if not folder.is_dir():
        reason = "is not a directory" if folder.exists() else "does not exist: create it first"
        raise ModelSpecError(f"{option} {path}: the folder {folder} {reason}")
    # the HTML report and baselines are written next to their target, then renamed: the folder must be writable
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ModelSpecError(f"{option} {path}: no permission to write there")


def _job(args: argparse.Namespace) -> Job:
    given = {"batch": args.batch, "resolution": args.resolution, "seq_len": args.seq_len}
    if args.input and (any(v is not None for v in given.values()) or args.sweep):
        raise ModelSpecError("--input fixes the input shapes: drop --batch/--resolution/--seq-len/--sweep, "
                             "or drop --input")
    if args.sweep and given[args.sweep[0]] is not None:
        raise ModelSpecError(f"--sweep {args.sweep[0].replace('_', '-')}=... and "
                             f"--{args.sweep[0].replace('_', '-')} both set; keep one")
    if args.compare and not args.html:
        raise ModelSpecError("--compare shows the difference in the HTML report: add --html FILE")
    if args.sweep and (args.budget or args.save_baseline or args.check_baseline or args.html):
        raise ModelSpecError("--sweep reports many runs: use --budget / --save-baseline / --check-baseline / --html "
                             "per run")
    _check_memory_options(args)
    backward = args.backward or args.optimizer is not None
    memory = (args.memory or args.optimizer is not None or args.fit is not None
              or any(metric in BYTE_METRICS for metric in args.budget or {}))
    # A cost guard judges the model as it is: it runs it, never reads (or writes) the trace cache.
    guarded = bool(args.budget or args.save_baseline or args.check_baseline)
    return Job(spec=args.model or "resnet50", overrides=tuple(args.overrides), shapes=tuple(args.input or ()),
               dtype=getattr(torch, args.dtype) if args.dtype else None, execution=args.execution,
               convention=args.convention, backward=backward, dense_attention=args.dense_attention,
               attention_kernel=args.attention_kernel,
               cache=args.cache and not guarded, cache_dir=args.cache_dir, memory=memory, optimizer=args.optimizer,
               state_dtype=args.state_dtype, foreach=args.foreach, **given)


def _check_memory_options(args: argparse.Namespace) -> None:
    """Usage errors of the memory options: optimizer settings without an optimizer, saved bytes without a
    backward pass, --fit with what fixes or varies the batch, or with what reports one run."""
    loose = [flag for flag, value in (("--state-dtype", args.state_dtype), ("--foreach", args.foreach)) if value]
    if loose and args.optimizer is None:
        raise ModelSpecError(f"{' and '.join(loose)} describe{'s' if len(loose) == 1 else ''} the optimizer's "
                             f"step: add --optimizer {{{','.join(OPTIMIZERS)}}}")
    if "saved_bytes" in (args.budget or {}) and not (args.backward or args.optimizer):
        raise ModelSpecError("--budget saved_bytes=...: the bytes saved for the backward pass exist in a training "
                             "step: add --backward (or --optimizer)")
    if args.fit is not None and (args.input or args.batch or args.sweep):
        raise ModelSpecError("--fit searches the batch size: drop --batch/--input/--sweep")
    if args.fit is not None and (args.budget or args.save_baseline or args.check_baseline or args.html):
        raise ModelSpecError("--fit analyses many batches: use --budget / --save-baseline / --check-baseline / "
                             "--html on one run (--batch N)")


def _run_one(args: argparse.Namespace, job: Job) -> int:
    expected = _baseline_entry(args, job)  # a missing or broken baseline fails before the model runs
    other = _read_compare(args.compare) if args.compare else None  # before the run: a bad file wastes no time
    result, _, seconds, cached = analyse(job)
    text = render(result, args.format, args.depth)
    if args.format in ("table", "tree"):
        inputs = ", ".join("x".join(map(str, i["shape"])) for i in result.inputs)
        source = ", from the cache" if cached else ""
        passes = "forward + backward" if job.backward else "forward"
        passes += f" + {job.optimizer} step" if job.optimizer else ""
        peak = f", peak memory {format_bytes(result.memory['peak'])}" if result.memory else ""
        text = (f"{result.model} on input {inputs} ({result.execution} run{source}, {passes}, "
                f"{result.convention} convention, {seconds:.2f} s{peak})\n{text}")
    _emit(text, args.output)
    if args.html:
        _write_html(args.html, result, other)
    return _guard(args, job, result, expected)


def _read_compare(path: str) -> Result:
    try:
        with open(path, encoding="utf-8") as f:
            return Result.from_json(f.read())
    except OSError as exc:
        raise ModelSpecError(f"cannot read --compare {path}: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelSpecError(f"--compare {path}: not a saved analysis (--format json): {one_line(exc)}") from None


def _write_html(path: str, result: Result, other: Result | None) -> None:
    from .reports.html import write_html

    try:
        write_html(result, path, compare=other)
    except OSError as exc:
        raise ModelSpecError(f"cannot write --html {path}: {exc.strerror or exc}") from None
    print(f"modelmeter: wrote {path}", file=sys.stderr)


# --- cost guard ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _usage_errors() -> Iterator[None]:
    """A baseline or saved analysis that cannot be used, or runs that cannot be compared: a usage error (exit
    2), one line."""
    from .guard import BaselineMismatch
    from .guard.values import GuardFileError

    try:
        yield
    except (BaselineMismatch, GuardFileError) as exc:
        raise ModelSpecError(str(exc)) from None


def _entry_name(args: argparse.Namespace, job: Job) -> str:
    return args.name or " ".join([job.spec, *job.overrides])


def _baseline_entry(args: argparse.Namespace, job: Job) -> Entry | None:
    """The entry --check-baseline compares with, read (and the file --save-baseline will write, if there is one,
    checked) before the model runs."""
    from .guard import BaselineFile

    with _usage_errors():
        if args.save_baseline and os.path.exists(args.save_baseline):
            BaselineFile.load(args.save_baseline)
        if not args.check_baseline:
            return None
        return BaselineFile.load(args.check_baseline).entry(_entry_name(args, job), args.check_baseline)


def _guard(args: argparse.Namespace, job: Job, result: Result, expected: Entry | None) -> int:
    """--budget, --check-baseline (against ``expected``) and then --save-baseline for one analysed model: 0, or
    1 when a cost is too high. The baseline is saved only when every check passed, so a failed check never
    overwrites the baseline it failed against."""
    from .guard import check_budget, compare, entry_from_result, record

    status = 0
    name = _entry_name(args, job)
    if args.budget:
        try:
            over = check_budget(result, args.budget)
        except ValueError as exc:
            raise ModelSpecError(str(exc)) from None
        for item in over:
            print(f"modelmeter: over budget: {name}: {item}", file=sys.stderr)
        status = 1 if over else status
    entry = entry_from_result(result, spec=_job_argv(job))
    if expected is not None:
        with _usage_errors():
            comparison = compare(name, expected, entry, args.tolerance)
        print(comparison.report(), file=sys.stderr)
        status = 1 if not comparison.ok else status
    if args.save_baseline and status:
        print(f"modelmeter: did not save the baseline of {name} in {args.save_baseline}: a check failed",
              file=sys.stderr)
    elif args.save_baseline:
        with _usage_errors():
            record(args.save_baseline, name, entry)
        print(f"modelmeter: saved the baseline of {name} in {args.save_baseline}", file=sys.stderr)
    return status


def _job_argv(job: Job) -> list[str]:
    """The command-line arguments that build and run ``job`` again (what a baseline entry keeps)."""
    argv = [job.spec, *job.overrides]
    for shape, dtype in job.shapes:
        argv += ["--input", "x".join(map(str, shape)) + (f":{str(dtype).removeprefix('torch.')}" if dtype else "")]
    for flag, value in (("--batch", job.batch), ("--resolution", job.resolution), ("--seq-len", job.seq_len)):
        if value is not None:
            argv += [flag, str(value)]
    if job.dtype is not None:
        argv += ["--dtype", str(job.dtype).removeprefix("torch.")]
    argv += ["--convention", job.convention, "--execution", job.execution]
    argv += ["--backward"] * job.backward + ["--dense-attention"] * job.dense_attention
    argv += ["--attention-kernel", job.attention_kernel] if job.attention_kernel != "fused" else []
    argv += ["--memory"] * job.memory + (["--optimizer", job.optimizer] if job.optimizer else [])
    argv += (["--state-dtype", job.state_dtype] if job.state_dtype else []) + ["--foreach"] * bool(job.foreach)
    return argv


def baseline_point(job: Job) -> dict[str, Any]:
    """Worker of a baseline check (top level, for spawned processes): the entry as data."""
    from dataclasses import asdict

    from .guard import entry_from_result

    return _worker_row(job, lambda result, _: {"entry": asdict(entry_from_result(result, spec=_job_argv(job)))})


# What a check of every model of a baseline takes from each entry: giving it on the command line is a mistake
_PER_ENTRY = {"--budget": "budget", "--save-baseline": "save_baseline", "--name": "name", "--input": "input",
              "--batch": "batch", "--resolution": "resolution", "--seq-len": "seq_len", "--dtype": "dtype",
              "--sweep": "sweep", "--fit": "fit", "--html": "html", "--compare": "compare", "--output": "output",
              "--backward": "backward", "--dense-attention": "dense_attention", "--memory": "memory",
              "--optimizer": "optimizer", "--state-dtype": "state_dtype", "--foreach": "foreach"}


def _check_all(args: argparse.Namespace) -> int:
    """``modelmeter --check-baseline FILE``: every model of FILE analysed again (in parallel) and compared. What
    an entry may run is checked for every entry before any model is built (modelmeter.guard.specs)."""
    from .guard import BaselineFile
    from .guard.specs import check_spec, project_of

    ignored = [flag for flag, dest in _PER_ENTRY.items() if getattr(args, dest) not in (None, False)]
    ignored += ["--convention"] * (args.convention != "fvcore") + ["--execution"] * (args.execution != "auto")
    ignored += ["--attention-kernel"] * (args.attention_kernel != "fused")
    ignored += ["--format"] * (args.format != "table")  # the reports are text
    if ignored:
        raise ModelSpecError(f"{', '.join(ignored)}: a check of every model of {args.check_baseline} runs each "
                             "entry as it was saved; name a MODEL to check one model with other options")
    with _usage_errors():
        baselines = BaselineFile.load(args.check_baseline)
    if not baselines.entries:
        raise ModelSpecError(f"the baseline {args.check_baseline!r} holds no models")
    project = str(project_of(args.check_baseline))
    jobs = {}
    for name, entry in baselines.entries.items():
        parsed = check_spec(entry.spec, name, args.check_baseline, build_parser())
        try:
            job = _job(parsed)
        except ModelSpecError as exc:
            raise ModelSpecError(f"the baseline entry {name!r}: {exc}") from None
        jobs[name] = replace(job, cache=False, project=project)  # guards run the model
    outcomes = _in_parallel(baseline_point, jobs, args.jobs, "baselines")
    codes = [_report_check(name, baselines.entries[name], outcome, args.tolerance)
             for name, outcome in outcomes.items()]
    print(f"modelmeter: checked {len(codes)} model{'s' * (len(codes) != 1)} of {args.check_baseline}: "
          f"{codes.count(0)} within the baseline, {codes.count(1)} over it or failed, {codes.count(2)} not "
          "comparable or refused", file=sys.stderr)
    return max(codes)


def _report_check(name: str, expected: Entry, outcome: dict[str, Any], tolerance: float) -> int:
    """Print the comparison of one entry of a check of every model; its exit status."""
    from .guard import BaselineMismatch, Entry, compare

    if "error" in outcome:
        print(f"modelmeter: {name}: {outcome['error']}", file=sys.stderr)
        return int(outcome["code"])
    try:
        comparison = compare(name, expected, Entry(**outcome["entry"]), tolerance)
    except BaselineMismatch as exc:
        print(f"modelmeter: {exc}", file=sys.stderr)
        return 2
    print(comparison.report())
    return 0 if comparison.ok else 1


def _diff_command(args: argparse.Namespace) -> int:
    """``modelmeter diff A.json B.json``: per-module differences, the largest change first."""
    from .guard import diff, load_costs, render_diff

    if len(args.overrides) != 2:
        raise ModelSpecError("usage: modelmeter diff BEFORE.json AFTER.json (results saved with --format json, "
                             "or baseline files)")
    try:
        differences = diff(load_costs(args.overrides[0]), load_costs(args.overrides[1]))
    except ModelMeterError as exc:
        raise ModelSpecError(str(exc)) from None
    if args.format == "json":
        text = json.dumps([{"module": d.module, "metric": d.metric, "before": d.before, "after": d.after,
                            "change": d.change} for d in differences], indent=2)
    else:
        text = render_diff(differences)
    _emit(text, args.output)
    return 0


def _list(args: argparse.Namespace) -> int:
    from .zoo import ZOO

    rows = [(e.name, "x".join(map(str, e.input_shape)) + " " + str(e.input_dtype).removeprefix("torch."),
             e.description) for e in ZOO.values()]
    if args.format == "json":
        text = json.dumps([{"name": n, "input": i, "description": d} for n, i, d in rows], indent=2)
    else:
        width = max(len(r[0]) for r in rows)
        in_width = max(len(r[1]) for r in rows)
        lines = ["built-in models (random weights, nothing downloaded):",
                 *(f"  {n:<{width}}  {i:<{in_width}}  {d}" for n, i, d in rows),
                 "",
                 "also: torchvision:NAME, timm:NAME, transformers:CONFIG [key=value ...], "
                 "path/file.py:factory, package.module:factory"]
        text = "\n".join(lines)
    _emit(text, args.output)
    return 0


def _cache_command(args: argparse.Namespace) -> int:
    """``modelmeter cache info`` (where, how many entries, how big, the limit) and ``modelmeter cache clear``."""
    from .cache import TraceCache

    action = args.overrides[0] if len(args.overrides) == 1 else None
    if action not in ("info", "clear"):
        raise ModelSpecError("usage: modelmeter cache info|clear [--cache-dir DIR]")
    try:
        cache = TraceCache(args.cache_dir)
    except (OSError, ValueError) as exc:
        raise ModelSpecError(f"no usable trace cache: {exc}") from None
    if action == "clear":
        removed = cache.clear()
        text = (json.dumps({"removed": removed, "path": cache.path}, indent=2) if args.format == "json"
                else f"removed {removed} cached trace{'' if removed == 1 else 's'} from {cache.path}")
    else:
        info = cache.info()
        text = json.dumps(info, indent=2) if args.format == "json" else "\n".join([
            f"trace cache: {info['path']}",
            f"entries:     {info['entries']}",
            f"size:        {_bytes(info['bytes'])}",
            f"limit:       {_bytes(info['limit'])} (${SIZE_ENV})"])
    _emit(text, args.output)
    return 0


def _bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit} ({n} bytes)"
    return f"{n} bytes"


# --- sweeps ----------------------------------------------------------------------------------------------
def _run_sweep(args: argparse.Namespace, job: Job) -> int:
    if args.format == "tree":
        raise ModelSpecError("--sweep prints one row per value: use --format table, markdown, csv or json")
    axis, values = args.sweep
    jobs = [replace(job, **{axis: v}) for v in values]
    workers = min(args.jobs or os.cpu_count() or 1, len(values))
    if workers > 1:  # fail fast, before starting processes, on a spec or an axis that does not fit the model
        probe = replace(job, **{axis: values[0]})
        with _model_code(probe.spec):
            loaded = load_model(probe.spec, probe.overrides, device="meta", resolution=probe.resolution)
        loaded.inputs(batch=probe.batch, resolution=probe.resolution, seq_len=probe.seq_len)
        del loaded, probe
    rows = _in_parallel(sweep_point, dict(zip(values, jobs, strict=True)), workers,
                        f"sweep {axis.replace('_', '-')}")
    failed = [(v, rows[v]) for v in values if "error" in rows[v]]
    if failed:
        value, row = failed[0]
        print(f"modelmeter: {axis.replace('_', '-')}={value}: {row['error']}", file=sys.stderr)
        return int(row["code"])
    _emit(_sweep_report(job, axis, values, [rows[v] for v in values], args.format), args.output)
    return 0


K = TypeVar("K")


def _in_parallel(work: Callable[[Job], dict[str, Any]], jobs: dict[K, Job], workers: int | None,
                 label: str) -> dict[K, dict[str, Any]]:
    """``work(job)`` for every job, in spawned worker processes when there are several (one per job, at most
    the CPU count or ``workers``), with a progress line; results in the order of ``jobs``."""
    count = min(workers or os.cpu_count() or 1, len(jobs))
    progress = _Progress(len(jobs), label)
    done: dict[K, dict[str, Any]] = {}
    try:
        if count <= 1:
            for key, job in jobs.items():
                done[key] = work(job)
                progress.step(f"{key}")
        else:
            from modelmeter_cli import quit_on_interrupt

            context = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(max_workers=count, mp_context=context, initializer=quit_on_interrupt) as pool:
                futures: dict[Future[dict[str, Any]], K] = {pool.submit(work, job): key for key, job in jobs.items()}
                try:
                    for future in as_completed(futures):
                        done[futures[future]] = _outcome(future)
                        progress.step(f"{futures[future]}")
                except KeyboardInterrupt:  # start no more work; the workers themselves quit on the same Ctrl-C
                    pool.shutdown(wait=False, cancel_futures=True)
                    raise
    finally:
        progress.close()
    return {key: done[key] for key in jobs}


def _outcome(future: Future[dict[str, Any]]) -> dict[str, Any]:
    """A worker's row, or a failure (exit 1) when its process died: the model's code called ``os._exit``, or
    the process crashed or was killed."""
    try:
        return future.result()
    except BrokenProcessPool:
        return {"error": "its worker process died before the analysis finished (the model's code called "
                         "os._exit, or the process crashed or ran out of memory)", "code": 1}


def _sweep_report(job: Job, axis: str, values: list[int], rows: list[dict[str, Any]], fmt: str) -> str:
    label = axis.replace("_", "-")
    base = rows[0]["flops"]
    for row in rows:
        row["flops_ratio"] = row["flops"] / base if base else math.nan
    # (table header, key, table cell); a memory run adds its peak
    columns: list[tuple[str, str, Callable[[Any], str]]] = [
        ("#params", "params", format_size), ("flops", "flops", format_size),
        ("activations", "activations", format_size)]
    if job.memory:
        columns.append(("peak memory", "peak_memory", format_bytes))
    columns.append(("flops ratio", "flops_ratio", lambda ratio: f"{ratio:.2f}x"))
    if fmt == "json":
        return json.dumps({"model": " ".join([job.spec, *job.overrides]), "axis": label,
                           "execution": rows[0]["execution"],
                           "rows": [{label: v, **{key: r[key] for _, key, _ in columns}}
                                    for v, r in zip(values, rows, strict=True)]}, indent=2)
    if fmt == "csv":
        lines = [",".join([label, *(key for _, key, _ in columns)])]
        lines += [",".join([str(v), *(f"{r[key]:.6g}" if key == "flops_ratio" else str(r[key])
                                      for _, key, _ in columns)])
                  for v, r in zip(values, rows, strict=True)]
        return "\n".join(lines)
    header = [label, *(title for title, _, _ in columns)]
    table = [[str(v), *(cell(r[key]) for _, key, cell in columns)] for v, r in zip(values, rows, strict=True)]
    lines = _text_table(header, table, fmt, f"{' '.join([job.spec, *job.overrides])}: sweep of {label} "
                                            f"({rows[0]['execution']} run)")
    growth = [_growth("flops", label, values, [r["flops"] for r in rows])]
    if job.memory:
        growth.append(_growth("peak memory", label, values, [r["peak_memory"] for r in rows]))
    if any(growth):
        lines += ["", *filter(None, growth)]
    return "\n".join(lines)


def _text_table(header: list[str], table: list[list[str]], fmt: str, title: str) -> list[str]:
    """Lines of a markdown table, or of a terminal table under ``title``: the first column left-aligned."""
    if fmt == "markdown":
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join([":---", *["---:"] * (len(header) - 1)]) + "|"]
        return lines + ["| " + " | ".join(row) + " |" for row in table]
    widths = [max(len(row[i]) for row in [header, *table]) for i in range(len(header))]
    return [title, *("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths, strict=True)))
                     for row in [header, *table])]


def _growth(what: str, label: str, values: list[int], amounts: list[float]) -> str:
    """``flops grow 2.94x from resolution 224 to 384, about resolution^2.00`` (first to last value)."""
    if len(values) < 2 or values[0] == values[-1] or not amounts[0] or not amounts[-1]:
        return ""
    ratio = amounts[-1] / amounts[0]
    exponent = math.log(ratio) / math.log(values[-1] / values[0])
    verb = "grow" if what.endswith("s") else "grows"
    return f"{what} {verb} {ratio:.2f}x from {label} {values[0]} to {values[-1]}, about {label}^{exponent:.2f}"


# --- the largest batch that fits -----------------------------------------------------------------------
def largest_fitting(fits: Callable[[int], bool], cap: int) -> int:
    """The largest ``n`` in 1..``cap`` with ``fits(n)``, for a ``fits`` true up to some size and false above:
    doubling from 1 until one does not fit (or ``cap`` is reached), then bisection. 0 when 1 does not fit."""
    if not fits(1):
        return 0
    low, high = 1, 0  # low fits; high (once found) does not
    while not high:
        if low >= cap:
            return cap
        trial = min(2 * low, cap)
        if fits(trial):
            low = trial
        else:
            high = trial
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


class _DoesNotFit(ModelMeterError):
    """Batch 1 is already over the --fit size (exit 1)."""


def _run_fit(args: argparse.Namespace, job: Job) -> int:
    """``--fit SIZE``: one analysis per batch tried; the batches tried, and the largest whose peak <= SIZE."""
    if args.format == "tree":
        raise ModelSpecError("--fit prints the batches it tried: use --format table, markdown, csv or json")
    limit = int(args.fit)  # peaks are whole bytes
    peaks: dict[int, int] = {}
    memory: dict[str, Any] = {}

    def fits(batch: int) -> bool:
        result, _, seconds, _ = analyse(replace(job, batch=batch))
        memory.update(result.memory)
        peaks[batch] = int(result.memory["peak"])
        print(f"fit: batch {batch}: peak {format_bytes(peaks[batch])} ({seconds:.1f} s)", file=sys.stderr)
        return peaks[batch] <= limit

    largest = largest_fitting(fits, FIT_CAP)
    step = _step_phrase(memory)
    if not largest:
        raise _DoesNotFit(f"batch 1 does not fit in {format_bytes(limit)}: its {step} peaks at "
                          f"{format_bytes(peaks[1])} ({peaks[1]:,} bytes)")
    _emit(_fit_report(job, limit, step, peaks, largest, args.format), args.output)
    return 0


def _step_phrase(memory: dict[str, Any]) -> str:
    """``"inference"``, ``"training step"`` or ``"training step with adamw (bfloat16 state, foreach)"``."""
    if not memory.get("training"):
        return "inference"
    optimizer = memory.get("optimizer")
    if not optimizer:
        return "training step"
    details = [f"{optimizer['state_dtype']} state" if optimizer.get("state_dtype") else "",
               "foreach" if optimizer.get("foreach") else ""]
    notes = ", ".join(filter(None, details))
    return f"training step with {optimizer['name']}" + (f" ({notes})" if notes else "")


def _fit_report(job: Job, limit: int, step: str, peaks: dict[int, int], largest: int, fmt: str) -> str:
    tried = sorted(peaks)
    above = largest + 1 if largest + 1 in peaks else None
    model = " ".join([job.spec, *job.overrides])
    if fmt == "json":
        return json.dumps({"model": model, "limit": limit, "step": step,
                           "tried": [{"batch": b, "peak": peaks[b], "fits": peaks[b] <= limit} for b in tried],
                           "largest": largest, "peak": peaks[largest],
                           "next": None if above is None else {"batch": above, "peak": peaks[above]},
                           "capped": above is None}, indent=2)
    if fmt == "csv":
        return "\n".join(["batch,peak,fits", *(f"{b},{peaks[b]},{peaks[b] <= limit}" for b in tried)])
    table = [[str(b), format_bytes(peaks[b]), "yes" if peaks[b] <= limit else "no"] for b in tried]
    lines = _text_table(["batch", "peak", "fits"], table, fmt,
                        f"{model}: the largest batch in {format_bytes(limit)} ({step})")
    if above is None:
        final = (f"batch {largest} fits in {format_bytes(limit)} (peak {format_bytes(peaks[largest])}): the search "
                 f"stops at batch {FIT_CAP}, larger ones were not tried")
    else:
        final = (f"largest batch that fits in {format_bytes(limit)}: {largest} (peak {format_bytes(peaks[largest])}; "
                 f"batch {above} needs {format_bytes(peaks[above])})")
    return "\n".join([*lines, "", final])


class _Progress:
    """A one-line progress bar on stderr (redrawn in place on a terminal, one line per step otherwise)."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None) -> None:
        self.total, self.done, self.label = total, 0, label
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.start = time.perf_counter()
        self._draw("")

    def step(self, what: str) -> None:
        self.done += 1
        self._draw(f"{what} done")

    def _draw(self, what: str) -> None:
        filled = round(20 * self.done / self.total)
        line = (f"{self.label} [{'#' * filled}{'.' * (20 - filled)}] {self.done}/{self.total} "
                f"{time.perf_counter() - self.start:.1f}s {what}").rstrip()
        if self.tty:
            self.stream.write("\r" + line.ljust(79))
        elif self.done:  # not a terminal: no empty starting bar, one line per finished value
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


# --- helpers ---------------------------------------------------------------------------------------------
def _emit(text: str, output: str | None) -> None:
    if not text.endswith("\n"):
        text += "\n"
    if output is None:
        sys.stdout.write(text)
        return
    try:
        with open(output, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        raise ModelSpecError(f"cannot write --output {output}: {exc.strerror or exc}") from None
    print(f"modelmeter: wrote {output}", file=sys.stderr)


def _error(exc: BaseException) -> None:
    print(f"modelmeter: {one_line(exc, 600)}", file=sys.stderr)  # room for long paths and torch's own words


if __name__ == "__main__":
    raise SystemExit(main())
