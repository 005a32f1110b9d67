"""MemoryAnalysis: how much memory a model needs to run, or to train, predicted from one recorded run."""

from __future__ import annotations

import os
from collections import Counter
from typing import TYPE_CHECKING, Any, ClassVar

from torch import nn

from .analysis import ModelAnalysis
from .engine.trace import Phase, Trace
from .engine.tracer import Execution, LossFn
from .metrics.counting import Statistics, _Ancestors
from .metrics.memory import (
    MemoryModel,
    OptimizerSpec,
    Peak,
    Point,
    activation_bytes,
    activation_dtypes,
    module_peaks,
    optimizer_spec,
    peak,
    saved_bytes,
    timeline,
)

if TYPE_CHECKING:
    import torch

    from .cache import TraceCache


class MemoryAnalysis(ModelAnalysis):
    """Memory of inference (``training=False``) or of one training step, from one run on fake tensors.

    Every tensor storage the run makes is followed from the operator that allocates it to the moment it is
    freed (by Python's reference counts, as in a real run), and what autograd saves for the backward pass is
    observed with saved-tensor hooks. The counted metric (:meth:`total`, :meth:`by_module`,
    :meth:`by_operator`) is **activation bytes**: what the forward pass's operators allocate (views and
    in-place results allocate nothing). On top of it:

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

    Example::

        mem = MemoryAnalysis(model, torch.randn(32, 3, 224, 224), training=True, optimizer="adamw")
        mem.peak(); mem.peak_info().at; mem.saved_for_backward(); mem.by_module()
    """

    _phases: ClassVar[tuple[Phase, ...]] = ("forward",)

    def __init__(self, model: nn.Module, inputs: Any, *, training: bool = False,
                 optimizer: str | OptimizerSpec | None = None, state_dtype: str | torch.dtype | None = None,
                 foreach: bool | None = None, loss_fn: LossFn | None = None, execution: Execution = "auto",
                 trace: Trace | None = None, cache: bool | TraceCache | None = None,
                 cache_dir: str | os.PathLike[str] | None = None) -> None:
        if optimizer is not None and not training:
            raise ValueError("optimizer is part of a training step: pass training=True with it")
        if (state_dtype is not None or foreach is not None) and optimizer is None:
            raise ValueError("state_dtype and foreach describe the optimizer: pass optimizer= with them")
        if trace is not None and trace.backward != training:
            raise ValueError(f"the given trace {'has' if trace.backward else 'has no'} backward pass, but "
                             f"training={training}: record it with backward={training}")
        self._spec = None if optimizer is None else optimizer_spec(
            optimizer, state_dtype=None if state_dtype is None else str(state_dtype), foreach=foreach)
        super().__init__(model, inputs, execution=execution, trace=trace, cache=cache, cache_dir=cache_dir,
                         backward=training, loss_fn=loss_fn)
        self._memory: MemoryModel | None = None

    @property
    def training(self) -> bool:
        return self._backward

    @property
    def optimizer(self) -> OptimizerSpec | None:
        """The optimizer modelled in a training step (None: gradients only)."""
        return self._spec

    # memory ----------------------------------------------------------------------------------
    def peak(self) -> int:
        """The most bytes live at once during the run (a training step: including the optimizer's step)."""
        return self.peak_info().bytes

    def peak_info(self) -> Peak:
        """The peak, the operator, module and phase it happened in, and the live bytes by kind."""
        return peak(self._model_memory(), self._spec)

    def timeline(self) -> list[Point]:
        """Live bytes during every aten operator in run order (and the optimizer's step, last)."""
        return timeline(self._model_memory(), self._spec)

    def saved_for_backward(self, module_name: str = "") -> int:
        """Bytes the forward pass saved for the backward pass inside ``module_name`` (each storage once; the
        parameters, buffers and inputs autograd also keeps are no extra memory and not included). 0 for
        inference; activation checkpointing and ``torch.no_grad`` regions save less, exactly."""
        table = saved_bytes(self._model_memory()).get(self.canonical_module_name(module_name), Counter())
        return sum(table.values())

    def saved_by_module_and_operator(self) -> dict[str, Counter[str]]:
        """Saved-for-backward bytes by module, then by the operator that made the storage."""
        saved = saved_bytes(self._model_memory())
        return {name: Counter(saved.get(name, Counter())) for name in self._names.canonical}

    def module_peaks(self) -> Counter[str]:
        """Per module: the most bytes live while one of its operators ran."""
        return module_peaks(self._model_memory(), self._spec)

    # internals -------------------------------------------------------------------------------
    def _model_memory(self) -> MemoryModel:
        if self._memory is None or self._memory.trace is not self.trace:  # copy() may bring another trace
            self._memory = MemoryModel(self.trace, self._names)
        return self._memory

    def _analyze(self) -> Statistics:
        if self._stats is None:
            model = self._model_memory()
            counts = activation_bytes(model)
            uncalled = _Ancestors(self.trace, "owner").uncalled(self._names)
            self._stats = Statistics(counts, {"forward": counts}, activation_dtypes(model), {}, uncalled)
        return self._stats
