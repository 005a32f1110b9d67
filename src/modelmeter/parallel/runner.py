"""One rank's run of a model under a parallel plan, recorded by the ordinary engine into an ordinary Trace.

The plan is applied to a meta copy of the model on a fake process group (:mod:`.mesh`, :mod:`.apply`); the copy,
materialised as FakeTensors, runs the user's inputs — one rank's batch — under the same recorders as any run. What
the rank computes (local shapes), the collectives it issues and the parameter shards it holds are in the trace;
``Trace.parallel`` says which plan and rank it is, and names the mesh dimension of every process group.

The pipeline (``pp`` > 1) is not run here: this runner records the rank's dp x fsdp x tp work on the whole model it
is given, once, for the inputs given (one micro-batch). Cutting that trace into stages and the 1F1B schedule between
them are :func:`modelmeter.parallel.pipeline.stage_costs`'s (torch's schedules need real sends between stages, which
one process cannot run). ``Trace.parallel["mesh"]`` includes ``pp``, so the process groups and the rank's
coordinates are those of the full world.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Shard

from .._torch_compat import FakeTensorMode, class_name, fake_tensor_log_silenced
from ..engine.inputs import map_tensors
from ..engine.naming import ModuleNames
from ..engine.spec import RunSpec
from ..engine.trace import ModuleInfo, Trace
from ..engine.tracer import fake_like, record_trace
from ..errors import InvalidValueError, ModelRunError, ParallelPlanError
from .apply import materialize, meta_copy, parallelize
from .mesh import group_names, simulated_mesh
from .pipeline import check_stages
from .plan import ParallelPlan


def record_parallel(spec: RunSpec) -> Trace:
    """The trace of rank ``spec.parallel.rank`` running ``spec`` under the plan ``spec.parallel``; ``spec.model``
    is only read (a copy runs), and torch's distributed state is as before, also when the run raises."""
    plan = spec.parallel
    if plan is None:
        raise InvalidValueError("record_parallel needs a spec with a parallel plan")
    if spec.execution == "real":
        raise ParallelPlanError("execution='real' cannot run a parallel plan: its ranks are simulated on "
                                "FakeTensors (use execution='auto' or 'fake')")
    copy = meta_copy(spec.model)
    with simulated_mesh(plan) as mesh:
        flattened = parallelize(copy, plan, mesh)
        classes = tp_classes(copy, plan, (spec.args, spec.kwargs))
        frozen = frozen_bytes(copy)
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        materialize(copy, mode)
        sharded = ModuleNames(copy).infos()  # before the run: every parameter as its shard (a DTensor)
        with mode, fake_tensor_log_silenced(), warnings.catch_warnings():  # a rejected input: reported in a line
            # FSDP2's warning about an output that is a view speaks of the wrapping this runner made, not the user's:
            # printed at every call, and an error under `python -W error`
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")
            args, kwargs = (map_tensors(lambda t: fake_like(mode, t, _CPU), part) for part in (spec.args, spec.kwargs))
            try:
                # The copy's tensors are FakeTensors already: "real" runs them as they are, with no stand-ins.
                trace = record_trace(RunSpec(copy, args, kwargs, None, "real", spec.backward, spec.loss_fn))
            except ModelRunError as exc:
                raise _in_users_terms(exc, spec.model) from exc
        groups = group_names(mesh, flattened)
    trace.execution = "fake"
    trace.model = type(spec.model).__name__
    trace.modules = _as_declared(sharded, ModuleNames(spec.model))
    trace.parallel = describe_plan(plan, groups)
    if len(classes) > 1:
        trace.parallel["tp_classes"] = classes
    if frozen:
        trace.parallel["frozen"] = frozen
    check_stages(trace, plan.pp)  # pp stages need pp blocks: refused now, not when the stages are first costed
    return trace


_CPU = torch.device("cpu")
# What is true of a model that needs tensor values under a plan (the engine advises execution='real', refused here)
_VALUES_UNDER_A_PLAN = ("a parallel plan's ranks run on FakeTensors only, so it cannot run under one "
                        "(docs/parallel.md, \"Limits\")")


def _in_users_terms(exc: ModelRunError, model: nn.Module) -> ModelRunError:
    """``exc``, raised by the copy's run, in the user's terms, worded anew from its parts: the modules it names by
    the model's own classes (``fully_shard`` and ``replicate`` give the copy's modules classes of their own,
    ``FSDPLinear``), and a model that needs tensor values told that no plan can run it (``execution='real'``, which
    the engine advises, is refused under a plan)."""
    if exc.wording is None:
        return type(exc)(str(exc), exc.module, exc.operator)
    own = {name: type(module).__name__ for name, module in ModuleNames(model).modules.items()}
    wording = exc.wording.reworded(own, _VALUES_UNDER_A_PLAN)
    return type(exc)(wording.text(), exc.module, exc.operator, wording)


def frozen_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the frozen parameters (``requires_grad=False``: no gradient, no optimizer state) of the rank's
    shards, by the module holding them (each parameter under its first holder, as the module table counts it):
    what a pipeline stage's share of the gradients and optimizer state leaves out."""
    frozen: dict[str, int] = {}
    seen: set[int] = set()
    for name, module in model.named_modules():
        for parameter in module.parameters(recurse=False):
            if id(parameter) in seen:
                continue
            seen.add(id(parameter))
            if not parameter.requires_grad:
                local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
                frozen[name] = frozen.get(name, 0) + local.nbytes
    return frozen


def tp_classes(model: nn.Module, plan: ParallelPlan, inputs: Any) -> list[list[int]]:
    """The tensor-parallel coordinates (0 to ``tp - 1``) grouped by the shards their ranks hold, in order: one group
    when ``tp`` splits every dimension evenly. A dimension ``tp`` does not divide is split as ``torch.chunk`` splits
    it (DTensor's ``Shard``), so the last coordinates hold less: the sharded dimensions of ``model``'s parameters
    (the parallelised copy) and, under sequence parallelism, dimension 1 of the ``inputs``' tensors (the sequence,
    which ``SequenceParallel`` shards) tell the groups apart."""
    if plan.tp == 1:
        return []
    sizes = [size for parameter in model.parameters() for size in _tp_sharded_sizes(parameter)]
    if plan.sequence_parallel:
        map_tensors(lambda t: sizes.append(t.shape[1]) if t.dim() >= 2 else None, inputs)
    groups: dict[tuple[int, ...], list[int]] = {}
    for coordinate in range(plan.tp):
        groups.setdefault(tuple(_chunk(size, plan.tp, coordinate) for size in sizes), []).append(coordinate)
    return list(groups.values())


def _tp_sharded_sizes(parameter: torch.Tensor) -> list[int]:
    """The global sizes of the dimensions of ``parameter`` (a DTensor) that its mesh's ``tp`` dimension shards."""
    names = getattr(getattr(parameter, "device_mesh", None), "mesh_dim_names", None) or ()
    placements = getattr(parameter, "placements", ())
    return [parameter.shape[placement.dim] for name, placement in zip(names, placements, strict=False)
            if name == "tp" and isinstance(placement, Shard)]


def _chunk(size: int, parts: int, index: int) -> int:
    """The length of part ``index`` of ``size`` elements split as ``torch.chunk(..., parts)`` splits them."""
    step = -(-size // parts)
    return max(0, min(step, size - index * step))


def describe_plan(plan: ParallelPlan, groups: dict[str, str]) -> dict[str, Any]:
    """What ``Trace.parallel`` holds: the plan and the simulated rank as plain data, and the mesh dimension of
    every process group by the group's name (what the collectives' events name)."""
    return {"plan": str(plan), "world_size": plan.world_size, "rank": plan.rank, "mesh": plan.mesh,
            "coordinates": plan.coordinates(), "groups": groups, "options": plan.options()}


def _as_declared(infos: list[ModuleInfo], names: ModuleNames) -> list[ModuleInfo]:
    """The copy's module table with the user's class names: ``fully_shard`` and ``replicate`` give a module a class
    of their own (``FSDPLinear``), which is no class of the model's."""
    return [replace(info, type=type(module).__name__, label=class_name(module))
            if (module := names.modules.get(info.name)) is not None else info for info in infos]

