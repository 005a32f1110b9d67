"""modelmeter: what a PyTorch model costs — FLOPs, activations and parameters, by module and operator."""

from .analysis import (
    ActivationCountAnalysis,
    FlopCountAnalysis,
    JitModelAnalysis,
    ModelAnalysis,
    activation_count,
    flop_count,
)
from .engine.inputs import Args
from .engine.trace import OpEvent, TensorMeta, Trace
from .errors import ModelMeterError, ModelRunError
from .handles.base import CountInside, Handle, get_shape
from .metrics.parameters import parameter_count

__version__ = "0.1.0"

__all__ = [
    "ActivationCountAnalysis",
    "Args",
    "CountInside",
    "FlopCountAnalysis",
    "Handle",
    "JitModelAnalysis",
    "ModelAnalysis",
    "ModelMeterError",
    "ModelRunError",
    "OpEvent",
    "TensorMeta",
    "Trace",
    "__version__",
    "activation_count",
    "flop_count",
    "get_shape",
    "parameter_count",
]
