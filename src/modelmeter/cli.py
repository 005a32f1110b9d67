"""The ``modelmeter`` command: FLOPs, activations and parameters of a built-in model, by module.

``modelmeter`` alone analyses the built-in ResNet-50 at 224x224; ``modelmeter vit_b_16 --depth 2``
another zoo model. (Third-party models, other formats and conventions come with later releases.)
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch

from .analysis import ActivationCountAnalysis, FlopCountAnalysis
from .metrics.parameters import parameter_count
from .zoo import ZOO, available_models, get_model


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--input must look like 1x3x224x224, got {text!r}") from None
    if not shape or any(s <= 0 for s in shape):
        raise argparse.ArgumentTypeError(f"--input sizes must be positive, got {text!r}")
    return shape


def _format(value: float) -> str:
    """Human units as fvcore prints them: K, M, G, T, P with trailing zeros stripped."""
    for limit, suffix in ((1e14, "P"), (1e11, "T"), (1e8, "G"), (1e5, "M"), (1e2, "K")):
        if abs(value) > limit:
            return f"{value / (limit * 10):.3f}".rstrip("0").rstrip(".") + suffix
    return f"{value:.3f}".rstrip("0").rstrip(".")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modelmeter", description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="resnet50",
                        help=f"a built-in model (default resnet50): {', '.join(available_models())}")
    parser.add_argument("--input", type=_shape, default=None, help="input shape, e.g. 1x3x224x224")
    parser.add_argument("--depth", type=int, default=2, help="module depth of the table (default 2)")
    parser.add_argument("--execution", choices=("auto", "fake", "real"), default="auto",
                        help="fake tensors (no kernels, default) or real kernels")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.model not in ZOO:
        print(f"modelmeter: unknown model {args.model!r}; available: {', '.join(available_models())}",
              file=sys.stderr)
        return 2
    entry = ZOO[args.model]
    shape = args.input or entry.input_shape
    model = get_model(args.model).eval()
    inputs = torch.zeros(shape, dtype=entry.input_dtype)
    start = time.perf_counter()
    flops = FlopCountAnalysis(model, inputs, execution=args.execution).unsupported_ops_warnings(False)
    flops.uncalled_modules_warnings(False)
    acts = ActivationCountAnalysis(model, inputs, execution=args.execution, trace=flops.trace)
    acts.unsupported_ops_warnings(False).uncalled_modules_warnings(False)
    params = parameter_count(model)
    by_flops, by_acts = flops.by_module(), acts.by_module()
    elapsed = time.perf_counter() - start

    print(f"{args.model} on input {'x'.join(map(str, shape))} "
          f"({flops.trace.execution} run, {len(flops.trace.events)} events, {elapsed:.2f} s)")
    print(f"{'module':<44} {'#params':>9} {'flops':>9} {'activations':>12}")
    for name in by_flops:
        if name.count(".") + (1 if name else 0) > args.depth:
            continue
        label = ("  " * (name.count(".") + 1) + name.rsplit(".", 1)[-1]) if name else "model"
        print(f"{label:<44} {_format(params.get(name, 0)):>9} {_format(by_flops[name]):>9} "
              f"{_format(by_acts[name]):>12}")
    print("flops by operator: " + ", ".join(f"{op} {_format(v)}" for op, v in flops.by_operator().most_common()))
    unsupported = flops.unsupported_ops()
    if unsupported:
        print("not counted (no formula yet): " + ", ".join(f"{op} x{n}" for op, n in unsupported.most_common()))
    for note in flops.assumptions():
        print(f"assumed: {note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
