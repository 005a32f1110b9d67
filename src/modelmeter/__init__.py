"""modelmeter: what a PyTorch model costs — FLOPs, activations and parameters, by module and operator."""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from ._version import __version__

# Every public name -> the module that defines it, imported on first use: `modelmeter --help` and
# `modelmeter list` import this package without torch (shared/design.md)
_EXPORTS = {
    "analysis": ("ActivationCountAnalysis", "Analysis", "FlopCountAnalysis", "JitModelAnalysis", "ModelAnalysis",
                 "activation_count", "analyze", "flop_count"),
    "engine.inputs": ("Args",),
    "engine.trace": ("OpEvent", "TensorMeta", "Trace"),
    "errors": ("ModelMeterError", "ModelRunError"),
    "handles.base": ("CountInside", "Handle", "backward_key", "get_shape"),
    "handles.conventions": ("CONVENTIONS", "get_convention", "register_handle", "unregister_handle"),
    "memory": ("MemoryAnalysis",),
    "metrics.memory": ("OPTIMIZERS", "OptimizerSpec", "Peak", "Point"),
    "metrics.parameters": ("parameter_count",),
    "reports": ("Result", "build_result", "flop_count_str", "flop_count_table", "parameter_count_table", "render",
                "render_html", "write_html"),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}

if TYPE_CHECKING:
    from .analysis import (
        ActivationCountAnalysis,
        Analysis,
        FlopCountAnalysis,
        JitModelAnalysis,
        ModelAnalysis,
        activation_count,
        analyze,
        flop_count,
    )
    from .engine.inputs import Args
    from .engine.trace import OpEvent, TensorMeta, Trace
    from .errors import ModelMeterError, ModelRunError
    from .handles.base import CountInside, Handle, backward_key, get_shape
    from .handles.conventions import CONVENTIONS, get_convention, register_handle, unregister_handle
    from .memory import MemoryAnalysis
    from .metrics.memory import OPTIMIZERS, OptimizerSpec, Peak, Point
    from .metrics.parameters import parameter_count
    from .reports import (
        Result,
        build_result,
        flop_count_str,
        flop_count_table,
        parameter_count_table,
        render_html,
        write_html,
    )
    from .reports.render import render


def __getattr__(name: str) -> Any:
    """A public name (or a submodule), imported when first asked for."""
    if name in _HOME:
        with warnings.catch_warnings():  # numpy is optional; torch's CPU wheel warns on import without it
            warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
            value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME})


__all__ = [
    "CONVENTIONS",
    "OPTIMIZERS",
    "ActivationCountAnalysis",
    "Analysis",
    "Args",
    "CountInside",
    "FlopCountAnalysis",
    "Handle",
    "JitModelAnalysis",
    "MemoryAnalysis",
    "ModelAnalysis",
    "ModelMeterError",
    "ModelRunError",
    "OpEvent",
    "OptimizerSpec",
    "Peak",
    "Point",
    "Result",
    "TensorMeta",
    "Trace",
    "__version__",
    "activation_count",
    "analyze",
    "backward_key",
    "build_result",
    "flop_count",
    "flop_count_str",
    "flop_count_table",
    "get_convention",
    "get_shape",
    "parameter_count",
    "parameter_count_table",
    "register_handle",
    "render",
    "render_html",
    "unregister_handle",
    "write_html",
]
