"""The run spec: everything that decides what one recorded run of a model is, as one object passed whole."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from .._torch_compat import caller_modes_set_aside
from ..errors import InvalidTypeError, InvalidValueError
from ..parallel.plan import ParallelPlan, as_plan
from .inputs import Args, check_inputs, split_inputs, tensors_in
from .metadata import dtype_name
from .naming import ModuleNames
from .trace import Trace

Execution = Literal["auto", "fake", "real"]
LossFn = Callable[[Any], torch.Tensor]


@dataclass(frozen=True, eq=False)
class RunSpec:
    """``model(*args, **kwargs)`` run once with ``execution`` (``"auto"``, ``"fake"`` or ``"real"``), and its
    backward pass of ``loss_fn(output)`` when ``backward`` (the default loss: the sum of the output's
    floating-point tensors). ``inputs`` are the inputs as the user gave them (what :meth:`of` split into
    ``args`` and ``kwargs``), kept so that an analysis can be copied with the same inputs. ``parallel``: the run is
    one rank's under that plan (:mod:`modelmeter.parallel`; the inputs are that rank's), None for one device.

    The recorder (``record_trace``), the cache key (``trace_key``) and the trace cache (``cached_trace``) all
    take the spec whole. Compared by identity: inputs hold tensors, whose ``==`` is element-wise.
    """

    model: nn.Module
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    inputs: Any = None
    execution: Execution = "auto"
    backward: bool = False
    loss_fn: LossFn | None = None
    parallel: ParallelPlan | None = None

    @classmethod
    def of(cls, model: nn.Module, inputs: Any, *, execution: Execution = "auto", backward: bool = False,
           loss_fn: LossFn | None = None, parallel: str | ParallelPlan | None = None) -> RunSpec:
        """The spec of running ``model`` on ``inputs`` (a tensor, a tuple of positional arguments, a dict of
        keyword arguments or :class:`modelmeter.Args`), checked before anything runs: inputs that do not fit
        ``model.forward``, numpy arrays, a ``loss_fn`` without ``backward`` are rejected with a clear error;
        ``parallel`` may be a plan's text (``"fsdp=8,tp=2"``), parsed here."""
        if not isinstance(backward, bool):  # a truthy "no" would run, and record, a backward pass
            raise InvalidTypeError(f"backward must be True or False, got {backward!r}")
        args, kwargs = split_inputs(inputs)
        with caller_modes_set_aside():  # reading the inputs is the analysis's work: the caller's modes see none of it
            check_inputs(model, args, kwargs)
        if loss_fn is not None and not backward:
            raise InvalidValueError("loss_fn is only used for the backward pass: pass backward=True with it")
        return cls(model, args, kwargs, inputs, execution, backward, loss_fn, as_plan(parallel))

    def check_trace(self, trace: Trace) -> None:
        """Refuse a ``trace`` given for this run (``trace=``) that records another one, whose counts would be
        answered as this run's: another model, inputs of other shapes or dtypes, no backward pass where this run has
        one, a parallel plan where it has none or none where it has one."""
        if not isinstance(trace, Trace):
            raise InvalidTypeError(f"trace must be a modelmeter Trace (another analysis's .trace), got "
                                   f"{type(trace).__name__}")
        names = ModuleNames(self.model).canonical
        if trace.model != type(self.model).__name__ or (
                self.parallel is None and trace.parallel is None and [info.name for info in trace.modules] != names):
            raise InvalidValueError(f"trace records a run of another model (a {trace.model} of {len(trace.modules)} "
                                    f"modules, not a {type(self.model).__name__} of {len(names)}): pass the trace of "
                                    "an analysis of this model")
        tensors = tensors_in((self.args, self.kwargs))
        given = [(tuple(t.shape), dtype_name(t.dtype)) for t in tensors]
        recorded = [(tuple(t.shape), t.dtype) for t in trace.inputs]
        plain = [type(t) is torch.Tensor for t in tensors]  # (a jagged nested tensor is recorded by its values)
        if len(given) != len(recorded) or any(
                p and g != r for p, g, r in zip(plain, given, recorded, strict=True)):
            raise InvalidValueError(f"trace records a run on other inputs ({_shapes(recorded)}, not "
                                    f"{_shapes(given)}): pass the trace of an analysis of these inputs")
        if self.backward and not trace.backward:  # (a backward run's trace holds the forward one's too)
            raise InvalidValueError("trace records a run without its backward pass, and this one has backward=True")
        if (trace.parallel is None) != (self.parallel is None):
            raise InvalidValueError("trace and this run differ in their parallel plan (one has none)")

    def with_call(self, model: nn.Module | None = None, inputs: Any = None) -> RunSpec:
        """The same run of another model and/or other inputs (``None``: this spec's), checked as by :meth:`of`."""
        if inputs is None:
            inputs = self.inputs if self.inputs is not None else Args(*self.args, **self.kwargs)
        return RunSpec.of(self.model if model is None else model, inputs, execution=self.execution,
                          backward=self.backward, loss_fn=self.loss_fn, parallel=self.parallel)


def _shapes(described: list[tuple[tuple[int, ...], str]]) -> str:
    """Input tensors as ``1x3x8x8 float32, 2 int64``, for a message."""
    return ", ".join(f"{'x'.join(map(str, shape)) or 'scalar'} {dtype}" for shape, dtype in described) or "none"
