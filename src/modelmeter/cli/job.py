"""One analysis of the command: the :class:`Job` that describes it (from the command line, or a baseline entry's
arguments), the run itself, and the command-line arguments that run it again."""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..devices import DeviceError
from ..engine.tracer import Execution
from ..errors import InputMismatchError, ModelExitError, ParallelPlanError
from ..parallel.pipeline import PipelineSplitError
from ..reports.result import MEMORY_METRICS, ROOFLINE_METRICS, Result
from .errors import ModelSpecError
from .models import LoadedModel, load_model
from .options import FIT_DEVICE, GUARD_OPTIONS, ONE_RUN_OPTIONS, OPTIMIZERS, options_given
from .output import check_layout

if TYPE_CHECKING:
    from ..analysis import Analysis


@dataclass(frozen=True)
class DeviceOptions:
    """The device the time is predicted on (a name, from the catalog or ``devices_file``), and the roofline's
    options (docs/roofline.md)."""

    name: str
    devices_file: str | None = None
    efficiency: float = 1.0
    launch_overhead: float = 0.0
    tf32: bool = False
    measured_time: float | None = None

    def argv(self) -> list[str]:
        """The command-line arguments that choose these options again."""
        argv = ["--device", self.name]
        argv += ["--devices-file", self.devices_file] if self.devices_file else []
        argv += ["--efficiency", repr(self.efficiency)] if self.efficiency != 1.0 else []
        argv += ["--launch-overhead", repr(self.launch_overhead)] if self.launch_overhead else []
        argv += ["--tf32"] * self.tf32
        argv += ["--measured-time", repr(self.measured_time)] if self.measured_time is not None else []
        return argv


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
    device: DeviceOptions | None = None
    parallel: str | None = None  # a parallel plan's text: the run is one rank's (docs/parallel.md)
    project: str | None = None  # set for a model named by a baseline file: what it may call is confined to this

    @property
    def model(self) -> str:
        """The model as the command line named it: the spec and its key=value arguments."""
        return " ".join([self.spec, *self.overrides])


def job_from_args(args: argparse.Namespace) -> Job:
    """The analysis the command line asks for; :class:`ModelSpecError` for options that contradict each other."""
    given = {"batch": args.batch, "resolution": args.resolution, "seq_len": args.seq_len}
    if args.input and (any(v is not None for v in given.values()) or args.sweep):
        raise ModelSpecError("--input fixes the input shapes: drop --batch/--resolution/--seq-len/--sweep, "
                             "or drop --input")
    if args.sweep and given[args.sweep[0]] is not None:
        raise ModelSpecError(f"--sweep {args.sweep[0].replace('_', '-')}=... and "
                             f"--{args.sweep[0].replace('_', '-')} both set; keep one")
    if args.compare and not args.html:
        raise ModelSpecError("--compare shows the difference in the HTML report: add --html FILE")
    if args.sweep and options_given(args, ONE_RUN_OPTIONS):
        raise ModelSpecError(f"--sweep reports many runs: use {' / '.join(ONE_RUN_OPTIONS)} per run")
    _check_memory_options(args)
    _check_loose_options(args)
    runs = [flag for flag, given in (("--sweep", args.sweep), ("--fit", args.fit is not None)) if given]
    check_layout(args, runs[0] if runs else None)
    execution = _execution(args)
    device = _device_options(args)
    _check_fit_device(args, device)
    if args.parallel is not None and execution == "real":
        raise ModelSpecError(f"--parallel {args.parallel} simulates its ranks on fake tensors (a fake process "
                             "group sends nothing): drop --real / --execution real")
    # under a plan, --fit answers the micro-batch of a training step: the plan's sharding is of the training state
    backward = args.backward or args.optimizer is not None or (args.fit is not None and args.parallel is not None)
    memory = (args.memory or args.optimizer is not None or args.fit is not None
              or any(metric in MEMORY_METRICS for metric in args.budget or {}))
    # A cost guard judges the model as it is: it runs it, never reads (or writes) the trace cache.
    guarded = bool(options_given(args, GUARD_OPTIONS))
    return Job(spec=args.model or "resnet50", overrides=tuple(args.overrides), shapes=tuple(args.input or ()),
               dtype=getattr(torch, args.dtype) if args.dtype else None, execution=execution,
               convention=args.convention, backward=backward, dense_attention=args.dense_attention,
               attention_kernel=args.attention_kernel,
               cache=args.cache and not guarded, cache_dir=args.cache_dir, memory=memory, optimizer=args.optimizer,
               state_dtype=args.state_dtype, foreach=args.foreach, device=device, parallel=args.parallel, **given)


def _execution(args: argparse.Namespace) -> Execution:
    """``--execution``, or ``real`` for ``--real``: both, naming different runs, contradict each other."""
    if args.real and args.execution not in ("auto", "real"):
        raise ModelSpecError(f"--real and --execution {args.execution} contradict each other: keep one")
    execution: Execution = "real" if args.real else args.execution
    return execution


def _check_loose_options(args: argparse.Namespace) -> None:
    """Options that qualify another one that is not given: each would be ignored, silently."""
    for flag, given, needed, what in (
            ("--tolerance", args.tolerance != 0, args.check_baseline, "the growth --check-baseline FILE allows"),
            ("--name", args.name is not None, options_given(args, GUARD_OPTIONS),
             f"the name the cost guard ({', '.join(GUARD_OPTIONS)}) reports and saves"),
            ("--jobs", args.jobs is not None, args.sweep,
             "the worker processes of --sweep (or of --check-baseline FILE without a MODEL)")):
        if given and not needed:
            raise ModelSpecError(f"{flag} sets {what}: add that option, or drop {flag}")


def _check_fit_device(args: argparse.Namespace, device: DeviceOptions | None) -> None:
    """``--fit device`` needs the ``--device`` whose memory it fills; ``--fit SIZE`` with a device would ignore it
    (the search reports peaks, not times)."""
    if args.fit == FIT_DEVICE and device is None:
        raise ModelSpecError("--fit device fills the memory of --device NAME: add it (`modelmeter devices` lists "
                             "them), or give a size, e.g. --fit 24GiB")
    if args.fit is not None and args.fit != FIT_DEVICE and device is not None:
        raise ModelSpecError("--fit SIZE searches the batch by its peak memory and predicts no time: drop --device, "
                             "use --fit device to fill the device's memory, or run the batch it finds with "
                             "--batch N --device NAME")


def _device_options(args: argparse.Namespace) -> DeviceOptions | None:
    """The device options, the device looked up now (an unknown name is a usage error before any model runs)."""
    loose = [flag for flag, given in (("--devices-file", args.devices_file), ("--measured-time", args.measured_time),
                                      ("--efficiency", args.efficiency != 1.0),
                                      ("--launch-overhead", args.launch_overhead), ("--tf32", args.tf32)) if given]
    timed = [metric for metric in args.budget or {} if metric in ROOFLINE_METRICS]
    if args.device is None:
        if loose or timed:
            what = " and ".join(loose) or f"--budget {timed[0]}=..."
            raise ModelSpecError(f"{what} describe{'s' if len(loose) < 2 else ''} the time on a device: add "
                                 "--device NAME (`modelmeter devices` lists them)")
        return None
    from ..devices import DeviceError, get_device

    try:
        get_device(args.device, devices_file=args.devices_file)
    except (DeviceError, OSError) as exc:
        raise ModelSpecError(str(exc)) from None
    return DeviceOptions(args.device, args.devices_file, args.efficiency, args.launch_overhead, args.tf32,
                         args.measured_time)


def _check_memory_options(args: argparse.Namespace) -> None:
    """Usage errors of the memory options: optimizer settings without an optimizer, saved bytes without a
    backward pass, --fit with what fixes or varies the batch, or with what reports one run."""
    loose = [flag for flag, value in (("--state-dtype", args.state_dtype), ("--foreach", args.foreach)) if value]
    if loose and args.optimizer is None:
        raise ModelSpecError(f"{' and '.join(loose)} describe{'s' if len(loose) == 1 else ''} the optimizer's "
                             f"step: add --optimizer {{{','.join(OPTIMIZERS)}}}")
    phased = [m for m in args.budget or {} if m.startswith(("forward_", "backward_", "recompute_"))]
    if phased and not (args.backward or args.optimizer):
        raise ModelSpecError(f"--budget {phased[0]}=...: a phase's metric exists after a backward pass: add "
                             "--backward (or --optimizer)")
    if "saved_bytes" in (args.budget or {}) and not (args.backward or args.optimizer):
        raise ModelSpecError("--budget saved_bytes=...: the bytes saved for the backward pass exist in a training "
                             "step: add --backward (or --optimizer)")
    if args.fit is not None and (args.input or args.batch or args.sweep):
        raise ModelSpecError("--fit searches the batch size: drop --batch/--input/--sweep")
    if args.fit is not None and options_given(args, ONE_RUN_OPTIONS):
        raise ModelSpecError(f"--fit analyses many batches: use {' / '.join(ONE_RUN_OPTIONS)} on one run (--batch N)")


def job_argv(job: Job) -> list[str]:
    """The command-line arguments that build and run ``job`` again (what a baseline entry keeps)."""
    argv = [job.spec, *job.overrides, *input_argv(job)]
    if job.dtype is not None:
        argv += ["--dtype", _dtype_name(job.dtype)]
    argv += ["--convention", job.convention, "--execution", job.execution]
    argv += ["--backward"] * job.backward + ["--dense-attention"] * job.dense_attention
    argv += ["--attention-kernel", job.attention_kernel] if job.attention_kernel != "fused" else []
    argv += ["--memory"] * job.memory + (["--optimizer", job.optimizer] if job.optimizer else [])
    argv += (["--state-dtype", job.state_dtype] if job.state_dtype else []) + ["--foreach"] * bool(job.foreach)
    argv += ["--parallel", job.parallel] if job.parallel is not None else []
    return argv + (job.device.argv() if job.device is not None else [])


def input_argv(job: Job) -> list[str]:
    """The input options of ``job`` as the command line gives them (``--input 2x128:int64``, ``--batch 8``); []
    for none: what a baseline entry keeps of them, and what a message about inputs that do not fit names."""
    argv = []
    for shape, dtype in job.shapes:
        argv += ["--input", "x".join(map(str, shape)) + (f":{_dtype_name(dtype)}" if dtype else "")]
    for flag, value in (("--batch", job.batch), ("--resolution", job.resolution), ("--seq-len", job.seq_len)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --- the run ---------------------------------------------------------------------------------------------
def analyse(job: Job, save_trace: str | None = None) -> tuple[Result, LoadedModel, float, bool]:
    """Build and run the model once (or read its trace from the cache); the structured Result (flops,
    activations and, with ``job.memory``, memory), the model, seconds, and whether the trace came from the
    cache; the run saved to ``save_trace`` when given. Model code that calls ``sys.exit`` is a
    :class:`ModelExitError`."""
    with model_code(job.spec):
        return _analyse(job, save_trace)


@contextlib.contextmanager
def model_code(what: str) -> Iterator[None]:
    """SystemExit (``sys.exit``) and the other BaseExceptions that are neither Exceptions nor KeyboardInterrupt,
    raised by the model's code, end the analysis as a failure naming the model (exit 1), never as a quiet exit
    (os._exit cannot be caught: docs/guard.md). What the model's code prints goes to stderr: stdout holds the
    report alone (``--format json | jq`` reads JSON)."""
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    except (Exception, KeyboardInterrupt):
        raise
    except BaseException as exc:
        raise ModelExitError(what, exc) from None


def _analyse(job: Job, save_trace: str | None) -> tuple[Result, LoadedModel, float, bool]:
    from ..analysis import analyze  # looked up at each run: tests replace it to prove that no model ran

    real = job.execution == "real"
    check = None
    if job.project is not None:
        from ..guard.specs import check_factory

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
    timing = _timing(job.device)
    start = time.perf_counter()
    with _plan_errors(job.parallel):
        try:
            analysis = analyze(loaded.model, inputs, convention=job.convention, dense_attention=job.dense_attention,
                               backward=job.backward, execution=job.execution, cache=job.cache,
                               cache_dir=job.cache_dir if job.cache else None, quiet=True, memory=job.memory,
                               optimizer=job.optimizer, state_dtype=job.state_dtype, foreach=job.foreach,
                               attention_kernel=job.attention_kernel, parallel=job.parallel, **timing)
            analysis.trace.assumptions[:0] = loaded.notes  # what the loader assumed is an assumption of the run
        except TypeError as exc:  # the inputs do not fit the model's forward()
            raise ModelSpecError(str(exc)) from None
        except InputMismatchError as exc:  # nor its layers: the input given is at fault, as with a bad shape
            raise ModelSpecError(str(exc)) from exc
        try:
            result = analysis.result(name=loaded.name)
        except DeviceError as exc:  # the device lacks a rate the model's work needs, or its numbers overflow
            raise device_error(job.device, exc) from None
    if save_trace is not None:
        _save(analysis, save_trace, loaded.name)
    return result, loaded, time.perf_counter() - start, analysis.from_cache


@contextlib.contextmanager
def _plan_errors(plan: str | None) -> Iterator[None]:
    """A plan the model cannot take (``tp`` not dividing its heads, fewer blocks than pipeline stages, no
    tensor-parallel plan known for it) is a usage error naming ``--parallel``, as a bad input shape is."""
    try:
        yield
    except (ParallelPlanError, PipelineSplitError) as exc:
        if plan is None:
            raise
        raise ModelSpecError(f"--parallel {plan}: {exc}") from None


def device_error(options: DeviceOptions | None, exc: Exception) -> ModelSpecError:
    """A usage error naming the ``--device`` (and its file) that cannot time this run."""
    if options is None:
        return ModelSpecError(str(exc))
    source = f" (from --devices-file {options.devices_file})" if options.devices_file else ""
    return ModelSpecError(f"--device {options.name}{source}: {exc}")


def _timing(options: DeviceOptions | None) -> dict[str, Any]:
    """``analyze``'s time options for ``options``."""
    if options is None:
        return {}
    from ..devices import get_device

    return {"device": get_device(options.name, devices_file=options.devices_file),
            "efficiency": options.efficiency, "launch_overhead": options.launch_overhead, "tf32": options.tf32,
            "measured_time": options.measured_time}


def _save(analysis: Analysis, path: str, name: str) -> None:
    from ..trace_files import save_trace

    try:
        save_trace(analysis, path, name=name)
    except OSError as exc:
        raise ModelSpecError(f"cannot write --save-trace {path}: {exc.strerror or exc}") from None
    print(f"modelmeter: wrote {path}", file=sys.stderr)
