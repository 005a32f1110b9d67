"""modelmeter: what a PyTorch model costs — FLOPs, activations and parameters, by module and operator."""

import warnings

with warnings.catch_warnings():  # numpy is optional; torch's CPU wheel warns on import without it
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch  # noqa: F401

from .analysis import (
    ActivationCountAnalysis,
    Analysis,
    FlopCountAnalysis,
    JitModelAnalysis,
    ModelAnalysis,
    activation_count,
    analyze,
    build_result,
    flop_count,
)
from .engine.inputs import Args
from .engine.spec import RunSpec
from .engine.trace import ModuleInfo, OpEvent, ParameterInfo, TensorMeta, Trace
from .errors import ModelMeterError, ModelRunError
from .fvcore_api import flop_count_str, flop_count_table, parameter_count, parameter_count_table
from .handles.base import CountInside, Handle, backward_key, get_shape
from .handles.conventions import CONVENTIONS, get_convention, register_handle, unregister_handle
from .memory import MemoryAnalysis
from .metrics.memory import OPTIMIZERS, OptimizerSpec, Peak, Point
from .reports import Result, render, render_html, write_html
from .session import Session, result_from_trace

__version__ = "0.1.0"

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
    "ModuleInfo",
    "OpEvent",
    "OptimizerSpec",
    "ParameterInfo",
    "Peak",
    "Point",
    "Result",
    "RunSpec",
    "Session",
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
    "result_from_trace",
    "unregister_handle",
    "write_html",
]
