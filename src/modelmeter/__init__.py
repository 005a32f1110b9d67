"""modelmeter: what a PyTorch model costs — FLOPs, activations and parameters, by module and operator."""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from ._version import __version__

# Every public name -> the module that defines it, imported on first use: `modelmeter --help`, `modelmeter list`
# and `modelmeter report` import this package without torch (shared/design.md)
_EXPORTS = {
    "analysis": ("ActivationCountAnalysis", "Analysis", "FlopCountAnalysis", "JitModelAnalysis", "ModelAnalysis",
                 "activation_count", "analyze", "build_result", "flop_count"),
    "devices": ("DEVICES", "Device", "DeviceError", "Interconnect", "device_from_dict", "device_to_dict",
                "get_device", "get_interconnect", "list_devices", "load_devices"),
    "engine.inputs": ("Args",),
    "engine.spec": ("RunSpec",),
    "engine.trace": ("GroupMeta", "ModuleInfo", "OpEvent", "ParameterInfo", "TensorMeta", "Trace"),
    "errors": ("InputMismatchError", "InvalidNameError", "InvalidTypeError", "InvalidValueError", "ModelExitError",
               "ModelMeterError", "ModelRunError", "ParallelPlanError", "UnsupportedError"),
    "fvcore_api": ("flop_count_str", "flop_count_table", "parameter_count", "parameter_count_table"),
    "handles.base": ("CountInside", "Handle", "backward_key", "get_shape"),
    "handles.conventions": ("CONVENTIONS", "get_convention", "register_handle", "unregister_handle"),
    "memory": ("MemoryAnalysis",),
    "metrics.communication": ("Communication", "communication"),
    "metrics.memory": ("OPTIMIZERS", "OptimizerSpec", "Peak", "Point"),
    "metrics.step_time": ("StepTime", "step_time"),
    "parallel.pipeline": ("PipelineCost", "PipelineSplitError", "StageCost", "stage_costs"),
    "parallel.plan": ("ParallelPlan",),
    "parallel.summary": ("RankCost", "RankCosts", "RankTime", "rank_costs"),
    "reports.html": ("render_html", "write_html"),
    "reports.render": ("render",),
    "reports.result": ("Result",),
    "reports.saved": ("SavedTraceError",),
    "session": ("Session", "result_from_trace"),
    "trace_files": ("load_trace", "save_trace"),
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
        build_result,
        flop_count,
    )
    from .devices import (
        DEVICES,
        Device,
        DeviceError,
        Interconnect,
        device_from_dict,
        device_to_dict,
        get_device,
        get_interconnect,
        list_devices,
        load_devices,
    )
    from .engine.inputs import Args
    from .engine.spec import RunSpec
    from .engine.trace import GroupMeta, ModuleInfo, OpEvent, ParameterInfo, TensorMeta, Trace
    from .errors import (
        InputMismatchError,
        InvalidNameError,
        InvalidTypeError,
        InvalidValueError,
        ModelExitError,
        ModelMeterError,
        ModelRunError,
        ParallelPlanError,
        UnsupportedError,
    )
    from .fvcore_api import flop_count_str, flop_count_table, parameter_count, parameter_count_table
    from .handles.base import CountInside, Handle, backward_key, get_shape
    from .handles.conventions import CONVENTIONS, get_convention, register_handle, unregister_handle
    from .memory import MemoryAnalysis
    from .metrics.communication import Communication, communication
    from .metrics.memory import OPTIMIZERS, OptimizerSpec, Peak, Point
    from .metrics.step_time import StepTime, step_time
    from .parallel.pipeline import PipelineCost, PipelineSplitError, StageCost, stage_costs
    from .parallel.plan import ParallelPlan
    from .parallel.summary import RankCost, RankCosts, RankTime, rank_costs
    from .reports.html import render_html, write_html
    from .reports.render import render
    from .reports.result import Result
    from .reports.saved import SavedTraceError
    from .session import Session, result_from_trace
    from .trace_files import load_trace, save_trace


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
    "DEVICES",
    "OPTIMIZERS",
    "ActivationCountAnalysis",
    "Analysis",
    "Args",
    "Communication",
    "CountInside",
    "Device",
    "DeviceError",
    "FlopCountAnalysis",
    "GroupMeta",
    "Handle",
    "InputMismatchError",
    "Interconnect",
    "InvalidNameError",
    "InvalidTypeError",
    "InvalidValueError",
    "JitModelAnalysis",
    "MemoryAnalysis",
    "ModelAnalysis",
    "ModelExitError",
    "ModelMeterError",
    "ModelRunError",
    "ModuleInfo",
    "OpEvent",
    "OptimizerSpec",
    "ParallelPlan",
    "ParallelPlanError",
    "ParameterInfo",
    "Peak",
    "PipelineCost",
    "PipelineSplitError",
    "Point",
    "RankCost",
    "RankCosts",
    "RankTime",
    "Result",
    "RunSpec",
    "SavedTraceError",
    "Session",
    "StageCost",
    "StepTime",
    "TensorMeta",
    "Trace",
    "UnsupportedError",
    "__version__",
    "activation_count",
    "analyze",
    "backward_key",
    "build_result",
    "communication",
    "device_from_dict",
    "device_to_dict",
    "flop_count",
    "flop_count_str",
    "flop_count_table",
    "get_convention",
    "get_device",
    "get_interconnect",
    "get_shape",
    "list_devices",
    "load_devices",
    "load_trace",
    "parameter_count",
    "parameter_count_table",
    "rank_costs",
    "register_handle",
    "render",
    "render_html",
    "result_from_trace",
    "save_trace",
    "stage_costs",
    "step_time",
    "unregister_handle",
    "write_html",
]
