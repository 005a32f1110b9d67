"""MemoryAnalysis: how much memory a model needs to run, or to train, predicted from one recorded run."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any, ClassVar

import torch
from torch import nn

from .engine.spec import Execution, LossFn, RunSpec
from .engine.trace import Phase, Trace
from .errors import InvalidTypeError, InvalidValueError
from .metrics.counting import Statistics
from .metrics.memory import (
    OptimizerSpec,
    Peak,
    Point,
    activation_statistics,
    for_plan,
    module_peaks,
    peak,
    saved_bytes,
    timeline,
)
from .parallel.plan import ParallelPlan
from .session import CacheSetting, MemoryColumns, Session, memory_columns, memory_optimizer
from .views import MetricView


class MemoryAnalysis(MetricView):
    """Memory of inference (``training=False``) or of one training step, from one run on fake tensors.

    Every tensor storage the run makes is followed from the operator that allocates it to the moment it is
    freed (by Python's reference counts, as in a real run), and what autograd saves for the backward pass is
    observed with saved-tensor hooks. The counted metric (:meth:`total`, :meth:`by_module`,
    :meth:`by_operator`, :meth:`by_dtype`) is **activation bytes**: what the forward pass's operators allocate
    (views and in-place results allocate nothing). On top of it:

    - :meth:`peak` / :meth:`peak_info`: the most bytes live at once — model state, inputs, activations,
      gradients and, with ``optimizer``, its state and the temporaries of its ``step()`` — and where;
    - :meth:`timeline`: live bytes during every operator;
    - :meth:`saved_for_backward`: bytes the forward pass saved for the backward pass, by module;
    - :meth:`module_peaks`: the most bytes live while each module ran.

    ``training=True`` runs the backward pass of ``loss_fn(output)`` (default: the sum of the outputs).
    ``optimizer``: ``"sgd"``, ``"momentum"``, ``"adam"``, ``"adamw"`` or an :class:`OptimizerSpec`, with its
    state in the parameters' dtype or in ``state_dtype``; ``foreach=True`` models the multi-tensor
    implementation (the CUDA default) instead of the per-parameter loop (the CPU default). A training step is
    taken in steady state: the optimizer's state exists and gradients are ``None`` when it starts (as after
    ``zero_grad()``). Inference runs under ``torch.no_grad()``. docs/memory.md has the model in full.

    A view over a :class:`~modelmeter.Session`, composed with it rather than a counting analysis: memory is
    attributed to the module that owns each operator, with no handles, so it has no ``set_op_handle``,
    ``clear_op_handles`` or ``ancestor_mode``. ``parallel`` records one rank of that plan (docs/parallel.md).

    Example::

        mem = MemoryAnalysis(model, torch.randn(32, 3, 224, 224), training=True, optimizer="adamw")
        mem.peak(); mem.peak_info().at; mem.saved_for_backward(); mem.by_module()
    """

    _phases: ClassVar[tuple[Phase, ...]] = ("forward",)

    def __init__(self, model: nn.Module, inputs: Any, *, training: bool = False,
                 optimizer: str | OptimizerSpec | None = None, state_dtype: str | torch.dtype | None = None,
                 foreach: bool | None = None, loss_fn: LossFn | None = None, execution: Execution = "auto",
                 trace: Trace | None = None, cache: CacheSetting = None,
                 cache_dir: str | os.PathLike[str] | None = None,
                 parallel: str | ParallelPlan | None = None) -> None:
        if not isinstance(training, bool):
            raise InvalidTypeError(f"training must be True or False, got {training!r}")
        if loss_fn is not None and not training:  # checked here: the run's spec would name its backward=
            raise InvalidValueError("loss_fn is the training step's loss: pass training=True with it")
        spec = memory_optimizer(training, optimizer, state_dtype, foreach)
        if trace is not None and trace.backward != training:
            raise InvalidValueError(f"the given trace {'has' if trace.backward else 'has no'} backward pass, but "
                                    f"training={training}: record it with backward={training}")
        run = RunSpec.of(model, inputs, execution=execution, backward=training, loss_fn=loss_fn, parallel=parallel)
        self._attach(Session(run, trace=trace, cache=cache, cache_dir=cache_dir), spec)

    @classmethod
    def from_session(cls, session: Session, *, optimizer: str | OptimizerSpec | None = None,
                     state_dtype: str | torch.dtype | None = None, foreach: bool | None = None) -> MemoryAnalysis:
        """The memory of ``session``'s run (a training step when its spec has a backward pass), sharing it with
        the session's other views."""
        view = cls.__new__(cls)
        view._attach(session, memory_optimizer(session.spec.backward, optimizer, state_dtype, foreach,
                                               switch="backward=True"))
        return view

    def _attach(self, session: Session, spec: OptimizerSpec | None) -> None:
        self._session = session
        self._spec = spec
        self._stats: Statistics | None = None

    @property
    def training(self) -> bool:
        return self._session.spec.backward

    @property
    def optimizer(self) -> OptimizerSpec | None:
        """The optimizer modelled in a training step (None: gradients only), as the run's parallel plan shards it
        and keeps its mixed precision (:func:`~modelmeter.metrics.memory.for_plan`)."""
        return for_plan(self._spec, self.trace)

    # memory ----------------------------------------------------------------------------------
    def peak(self) -> int:
        """The most bytes live at once during the run (a training step: including the optimizer's step)."""
        return self.peak_info().bytes

    def peak_info(self) -> Peak:
        """The peak, the operator, module and phase it happened in, and the live bytes by kind."""
        return peak(self._session.memory_model(), self.optimizer)

    def timeline(self) -> list[Point]:
        """Live bytes during every aten operator in run order (and the optimizer's step, last)."""
        return timeline(self._session.memory_model(), self.optimizer)

    def saved_for_backward(self, module_name: str = "") -> int:
        """Bytes the forward pass saved for the backward pass inside ``module_name`` (each storage once; the
        parameters, buffers and inputs autograd also keeps are no extra memory and not included). 0 for
        inference; activation checkpointing and ``torch.no_grad`` regions save less, exactly."""
        saved = saved_bytes(self._session.memory_model())
        return sum(saved.get(self.canonical_module_name(module_name), Counter()).values())

    def saved_by_module_and_operator(self) -> dict[str, Counter[str]]:
        """Saved-for-backward bytes by module, then by the operator that made the storage."""
        saved = saved_bytes(self._session.memory_model())
        return {name: Counter(saved.get(name, Counter())) for name in self.trace.module_table().canonical}

    def module_peaks(self) -> Counter[str]:
        """Per module: the most bytes live while one of its operators ran."""
        return module_peaks(self._session.memory_model(), self.optimizer)

    def columns(self) -> MemoryColumns:
        """What this analysis adds to a :class:`~modelmeter.Result` (saved bytes, module peaks, the summary)."""
        return memory_columns(self._session.memory_model(), self.optimizer)

    def statistics(self) -> Statistics:
        """Activation bytes over the trace: by module and operator, by dtype, and the modules that never ran."""
        if self._stats is None:
            self._stats = activation_statistics(self._session.memory_model())
        return self._stats
