"""modelmeter: what a PyTorch model costs — FLOPs, activations and parameters, by module and operator."""

import warnings

with warnings.catch_warnings():  # numpy is optional; torch's CPU wheel warns on import without it
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch  # noqa: F401

from ._version import __version__
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
    render,
    render_html,
    write_html,
)

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
