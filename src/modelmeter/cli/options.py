"""The analysis's command line (``modelmeter [analyse] MODEL [key=value ...] [options]``): its parser and the
types of its option values. Imports no torch, so that ``modelmeter --help`` answers at once; the choices below
are the library's own (tests/test_cli_package.py keeps them equal)."""

from __future__ import annotations

import argparse
import functools
import math
from typing import TYPE_CHECKING, Any

from ..handles.catalog import ATTENTION_KERNELS, CONVENTIONS
from .errors import MAX_TENSOR_BYTES
from .output import UsageParser

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "float16", "bfloat16")
FORMATS = ("table", "markdown", "json", "csv", "tree")  # modelmeter.reports.FORMATS
OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")  # modelmeter.OPTIMIZERS
FIT_DEVICE = "device"  # --fit device: the memory of the --device chosen
# The cost guard's options that judge one run (``--tolerance`` and ``--name`` qualify them): a run under one is
# guarded (it runs the model, never the cache); with the reports of one run, what --sweep and --fit refuse
GUARD_OPTIONS = ("--budget", "--save-baseline", "--check-baseline")
ONE_RUN_OPTIONS = (*GUARD_OPTIONS, "--html", "--save-trace")
SWEEP_AXES = {"resolution": "resolution", "batch": "batch", "seq-len": "seq_len", "seq_len": "seq_len"}
# --input's dtype names -> torch's
INPUT_DTYPES = {"float32": "float32", "float": "float32", "float16": "float16", "half": "float16",
                "bfloat16": "bfloat16", "float64": "float64", "double": "float64", "int64": "int64", "long": "int64",
                "int32": "int32", "int": "int32", "bool": "bool"}


# --- argument types --------------------------------------------------------------------------------------
def input_shape(text: str) -> tuple[tuple[int, ...], torch.dtype | None]:
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
        if dtype_text.lower() not in INPUT_DTYPES:
            raise argparse.ArgumentTypeError(
                f"unknown input dtype {dtype_text!r} in {text!r}; one of {', '.join(INPUT_DTYPES)}")
        import torch  # an analysis follows: torch is needed anyway

        dtype = getattr(torch, INPUT_DTYPES[dtype_text.lower()])
    # the bytes of the final dtype are checked with the model's inputs; here, what no dtype could hold
    if math.prod(shape) * (dtype.itemsize if dtype else 1) > MAX_TENSOR_BYTES:
        raise argparse.ArgumentTypeError(f"{text} has more elements than a tensor can hold; give smaller sizes")
    return shape, dtype


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    if value > MAX_TENSOR_BYTES:  # a size torch cannot hold (an int64), and more than any count of workers
        raise argparse.ArgumentTypeError(f"{text} is too large (at most 2**63 - 1)")
    return value


def depth(text: str) -> int:
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
        numbers = [positive(v.strip()) for v in values.split(",") if v.strip()]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"--sweep values must be positive integers, got {values!r}") from None
    if not numbers:
        raise argparse.ArgumentTypeError(f"--sweep {axis}= needs at least one value")
    return SWEEP_AXES[axis], numbers


def _budget(text: str) -> dict[str, float]:
    from ..guard import parse_budget

    try:
        return parse_budget(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _memory_size(text: str) -> float:
    from ..guard import parse_quantity

    try:
        value = parse_quantity(text)  # refuses what is not finite (1e400GiB) or absurd
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not value >= 1:  # NaN too
        raise argparse.ArgumentTypeError(f"a memory size must be at least one byte, got {text!r}")
    if value > MAX_TENSOR_BYTES:
        raise argparse.ArgumentTypeError(f"{text} is more memory than a machine can address (at most 8EiB)")
    return value


def parallel_plan(text: str) -> str:
    """``dp=2,fsdp=64,tp=8,pp=4``: the plan's text as :class:`~modelmeter.ParallelPlan` writes it back; its error
    names the part that is wrong."""
    from ..errors import ParallelPlanError
    from ..parallel.plan import ParallelPlan

    try:
        return str(ParallelPlan.parse(text))
    except ParallelPlanError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fit_size(text: str) -> float | str:
    """``--fit``'s memory: a size (``24GiB``), or ``device`` for the memory of ``--device``."""
    return FIT_DEVICE if text.strip().lower() == FIT_DEVICE else _memory_size(text)


def _tolerance(text: str) -> float:
    """``1%`` or ``0.01``: a finite fraction >= 0 (``nan`` would make every comparison pass)."""
    from ..guard.values import parse_tolerance

    try:
        return parse_tolerance(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a tolerance: {text!r} (a finite number >= 0, e.g. 1% or 0.01)") \
            from None


# --- the parser ------------------------------------------------------------------------------------------
def build_parser(usage: str | None = None, commands: str = "") -> argparse.ArgumentParser:
    """The analysis's parser; ``usage`` and ``commands`` (the other subcommands, for the help) come from
    :mod:`modelmeter.cli`, which knows them."""
    parser = UsageParser(
        prog="modelmeter",
        usage=usage,
        description="What a PyTorch model costs: FLOPs, activations and parameters by module (fvcore numbers), "
                    "from one fake-tensor run. Nothing is downloaded.",
        epilog=commands + "MODEL: a built-in model (default resnet50; `modelmeter list`), torchvision:NAME, "
               "timm:NAME, transformers:CONFIG (e.g. transformers:LlamaConfig num_hidden_layers=2), "
               "path/file.py:factory or package.module:factory (factory() returns a module or a (model, inputs) "
               "pair). key=value arguments override the transformers config or go to the builder. Traces are "
               "cached on disk (`modelmeter cache info` shows where, `modelmeter cache clear` empties it). Exit "
               "status: 0 success, 2 usage error (or inputs the model cannot take), 1 the model failed to build or "
               "run, a cost is over --budget or grew over --check-baseline, or batch 1 does not fit --fit SIZE; 130 "
               "interrupted; 141 the reader of the output left early (| head).",
        parents=[analysis_options()],
    )
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help="what to analyse (default resnet50); `modelmeter list` shows the built-in models")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides (transformers) or builder / factory keyword arguments")
    return parser


@functools.cache
def option_defaults() -> dict[str, tuple[str, Any]]:
    """``{option: (dest, default)}`` of every option string of the analysis's parser, built once (a parser took
    0.4 ms to build, several times a job). argparse lists its actions only in the private ``_actions``; the
    defaults are read with the public ``get_default``."""
    parser = build_parser()
    return {option: (action.dest, parser.get_default(action.dest))
            for action in parser._actions for option in action.option_strings}


def options_given(args: argparse.Namespace, options: tuple[str, ...]) -> list[str]:
    """Those of ``options`` that ``args`` (the analysis's, parsed) holds at other than their default. An option
    the parser lacks was not given (tests/test_cli_one_source.py holds every list of options to the parser)."""
    defaults = option_defaults()
    return [option for option in options
            if option in defaults and getattr(args, defaults[option][0]) != defaults[option][1]]


def subcommand_parser(prog: str, usage: str, description: str) -> argparse.ArgumentParser:
    """The parser of another subcommand, before its own arguments are added: like every subcommand it accepts
    the analysis's options (``--no-cache``, ``--depth``...) and ignores those it has no use for, as the command
    always did, but its help names only its own."""
    hidden = analysis_options()
    for action in hidden._actions:
        action.help = argparse.SUPPRESS
    return UsageParser(prog=prog, usage=usage, description=description, parents=[hidden],
                       conflict_handler="resolve")


def analysis_options() -> argparse.ArgumentParser:
    """The analysis's options, in their groups (a parent parser: no positionals, no --help)."""
    parser = UsageParser(add_help=False)
    _input_options(parser)
    _run_options(parser)
    out = parser.add_argument_group("output")
    out.add_argument("--format", choices=FORMATS, default="table", help="output format (default table)")
    out.add_argument("--output", "-o", metavar="FILE", help="write the report to FILE instead of stdout")
    out.add_argument("--depth", type=depth, default=2, metavar="N", help="module depth shown (default 2)")
    layout_options(out)
    out.add_argument("--html", metavar="FILE",
                     help="also write a self-contained interactive HTML report (module chart, tables) to FILE")
    out.add_argument("--compare", metavar="RESULT",
                     help="with --html: show the difference per module to another analysis (a result saved with "
                          "--format json, or a saved trace)")
    out.add_argument("--save-trace", metavar="FILE",
                     help="also save the run to FILE (.mmtrace): `modelmeter report FILE` renders it without the model")
    _guard_options(parser)
    _memory_options(parser)
    time_options(parser)
    return parser


def _column_list(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"expected column names separated by commas (e.g. flops,time), got {text!r}")
    return names


def layout_options(group: argparse._ArgumentGroup) -> None:
    """``--wide``, ``--columns`` and ``--shapes``: which columns the table shows (docs/reports.md, "Fitting the
    width")."""
    chosen = group.add_mutually_exclusive_group()
    chosen.add_argument("--wide", action="store_const", const=("all",), dest="columns",
                        help="show every column, however wide the table (the default fits the terminal's width: "
                             "COLUMNS, or 120 when the output is not a terminal)")
    chosen.add_argument("--columns", type=_column_list, metavar="NAME,...",
                        help="the table's columns, in this order: type, params, a metric (flops, time, ...), "
                             "%%metric (its share), shapes; or all")
    group.add_argument("--shapes", action="store_true", help="add each module's output shapes to the table and tree")


def _input_options(parser: argparse.ArgumentParser) -> None:
    inputs = parser.add_argument_group("inputs (default: the model's own, batch 1)")
    inputs.add_argument("--input", type=input_shape, action="append", metavar="SHAPE[:DTYPE]",
                        help="an input's shape, e.g. 1x3x224x224 or 2x128:long; repeat for several inputs")
    inputs.add_argument("--batch", type=positive, metavar="N", help="batch size of the default inputs")
    inputs.add_argument("--resolution", type=positive, metavar="N", help="image side of image models")
    inputs.add_argument("--seq-len", type=positive, metavar="N", help="sequence length of token models")
    inputs.add_argument("--dtype", choices=DTYPES, help="dtype of the model and its floating-point inputs")


def _run_options(parser: argparse.ArgumentParser) -> None:
    run = parser.add_argument_group("run")
    run.add_argument("--real", action="store_true",
                     help="run real kernels (models are built on cpu instead of meta; --execution real)")
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
    run.add_argument("--jobs", type=positive, metavar="N",
                     help="worker processes for --sweep (default: one per value, at most the CPU count)")
    run.add_argument("--parallel", type=parallel_plan, metavar="PLAN",
                     help="one rank of a parallel training plan, e.g. dp=2,fsdp=64,tp=8,pp=4 (also zero=1|2|3, sp, "
                          "mp=bf16, mb=N, rank=R): the inputs are that rank's batch; adds a per-rank table "
                          "(docs/parallel.md)")
    run.add_argument("--no-cache", dest="cache", action="store_false",
                     help="neither read nor write the trace cache (default: traces are cached on disk)")
    run.add_argument("--cache-dir", metavar="DIR",
                     help="the cache directory (default: $MODELMETER_CACHE, else the user cache directory)")


class _Once(argparse.Action):
    """A guard option that may be given once: argparse keeps the last of an option given twice, so the first
    ``--budget`` (or ``--check-baseline``) of ``--budget flops=1G --budget params=2M`` would go unchecked."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        given: set[str] = namespace.__dict__.setdefault("guard_options_given", set())
        if self.dest in given:
            several = " (one --budget takes several metrics: flops=4.2G,params=26M)" * (self.dest == "budget")
            raise argparse.ArgumentError(self, f"given twice: give it once{several}")
        given.add(self.dest)
        setattr(namespace, self.dest, values)


def _guard_options(parser: argparse.ArgumentParser) -> None:
    guard = parser.add_argument_group("cost guard (docs/guard.md)")
    guard.add_argument("--budget", type=_budget, action=_Once, metavar="METRIC=N,...",
                       help="exit 1 when a metric is over its budget, e.g. flops=4.2G,params=26M,activations=12M")
    guard.add_argument("--save-baseline", action=_Once, metavar="FILE",
                       help="add (or replace) this model's costs in FILE")
    guard.add_argument("--check-baseline", action=_Once, metavar="FILE",
                       help="exit 1 when a metric of a module grew beyond --tolerance over FILE's entry; without "
                            "MODEL, check every model FILE holds (in parallel)")
    guard.add_argument("--tolerance", type=_tolerance, action=_Once, default=0.0, metavar="T",
                       help="allowed growth for --check-baseline: 1%%, 0.01 (default 0)")
    guard.add_argument("--name", action=_Once, metavar="NAME",
                       help="the name of the baseline entry and of the --budget report (default: MODEL and "
                            "key=value)")


def duration(text: str) -> float:
    """``5ms``, ``120us``, ``0.25s`` or ``0.25`` (seconds) as seconds."""
    from ..reports.format import parse_duration

    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fraction(text: str) -> float:
    """A fraction of the peak in (0, 1]: ``0.7`` or ``70%``."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a fraction: {text!r} (e.g. 0.7 or 70%)") from None
    if not 0 < value <= 1:  # NaN too
        raise argparse.ArgumentTypeError(f"a fraction of the peak is in (0, 1], got {text!r}")
    return value


def _measured_time(text: str) -> float:
    """A measured step's time: a duration above 0 (an MFU of a zero time is no number) and under 1e9 s."""
    seconds = duration(text)
    if not 0 < seconds < 1e9:
        raise argparse.ArgumentTypeError(f"a measured step takes more than 0s (and less than 1e9 s), got {text!r}")
    return seconds


def _launch_overhead(text: str) -> float:
    """Seconds added per kernel: a duration under one second (kernel launches take microseconds)."""
    seconds = duration(text)
    if seconds >= 1:
        raise argparse.ArgumentTypeError(f"a kernel launch's overhead is under 1s (e.g. 4us), got {text!r}")
    return seconds


def time_options(parser: argparse.ArgumentParser) -> None:
    """The options of the time on a device (the analysis's, and ``report``'s to recount a saved trace)."""
    time = parser.add_argument_group("time on a device (docs/roofline.md)")
    time.add_argument("--device", metavar="NAME",
                      help="predict the time on this accelerator (roofline): adds the bytes, time, FLOPs per byte and "
                           "bound columns; `modelmeter devices` lists them")
    time.add_argument("--devices-file", metavar="FILE",
                      help="a JSON or TOML file of devices of your own, for --device (docs/devices.md)")
    time.add_argument("--measured-time", type=_measured_time, metavar="T",
                      help="the time a measured step took (e.g. 123ms): gives the MFU and HFU")
    time.add_argument("--efficiency", type=_fraction, default=1.0, metavar="F",
                      help="the fraction of the peaks kernels reach, e.g. 0.7 (default 1: the pure roofline)")
    time.add_argument("--launch-overhead", type=_launch_overhead, default=0.0, metavar="T",
                      help="time added per kernel launched, e.g. 4us (default 0)")
    time.add_argument("--tf32", action="store_true",
                      help="float32 matrix products on tensor cores at the TF32 peak (default: the float32 peak)")


def _memory_options(parser: argparse.ArgumentParser) -> None:
    memory = parser.add_argument_group("memory (docs/memory.md)")
    memory.add_argument("--memory", action="store_true",
                        help="also predict memory: the peak (how much, where, of what), activation bytes and each "
                             "module's peak; with --backward, of a training step (and the bytes saved for backward)")
    memory.add_argument("--optimizer", choices=OPTIMIZERS,
                        help="a training step with this torch.optim optimizer: its state and the temporaries of "
                             "its step() (implies --memory --backward)")
    memory.add_argument("--state-dtype", choices=DTYPES,
                        help="dtype of the optimizer's state (default: the parameters' dtype)")
    memory.add_argument("--foreach", action="store_true", default=None,
                        help="model the multi-tensor optimizer step, the CUDA default (default: one parameter at "
                             "a time, the CPU default)")
    memory.add_argument("--fit", type=_fit_size, metavar="SIZE",
                        help="the largest batch whose predicted peak fits in SIZE, e.g. 24GiB, or `device`: the "
                             "memory of --device NAME; batches doubled from 1, then bisected (implies --memory). "
                             "With --parallel: the largest micro-batch per rank of a training step (implies "
                             "--backward), the peak of the plan's worst rank")
