"""A plan applied to a copy of the user's model, with PyTorch's own parallel APIs, and materialised as FakeTensors.

The user's model is never touched: :func:`meta_copy` makes a copy whose parameters and buffers are on the meta
device (no weight memory, whatever the model's size); :func:`parallelize` applies the plan to the copy the way
torchtitan does — tensor parallel first (``parallelize_module``), then data parallel per repeated block and on the
root (``fully_shard`` for ZeRO-2/3, torch's ``replicate`` for DDP and ZeRO-1) — and :func:`materialize` gives the
copy FakeTensor storage (``to_empty`` under a FakeTensorMode), so the run allocates nothing either.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._torch_compat import (
    FakeTensorMode,
    buffers_of,
    flattened_mesh,
    parameters_of,
    replicate_module,
    sharded_tensor_type,
)
from ..errors import ParallelPlanError
from .plan import ParallelPlan


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are empty tensors on the meta device (same shapes,
    dtypes, ``requires_grad``; tied ones stay tied). The model is only read; its weights are never copied."""
    dtensor = sharded_tensor_type()
    memo: dict[int, Any] = {}
    for module in model.modules():
        for name, param in parameters_of(module).items():
            if param is None or id(param) in memo:
                continue
            if dtensor is not None and isinstance(param, dtensor):
                raise ParallelPlanError(f"parameter {name!r} of {type(module).__name__} is a DTensor: the model is "
                                        "already parallelised; give the plain model and the plan instead")
            memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), param.requires_grad)
        for buffer in buffers_of(module).values():
            if buffer is not None and id(buffer) not in memo:
                memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    try:
        return copy.deepcopy(model, memo)
    except Exception as exc:  # a model holding a lock, a generator, an open file ...
        raise ParallelPlanError(f"a parallel analysis works on a copy of the model, and {type(model).__name__} "
                                f"cannot be copied: {type(exc).__name__}: {exc}") from exc


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks each data-parallel group is made of, as torchtitan groups a transformer: the modules with
    parameters of every ``ModuleList``/``Sequential`` — the model itself included — holding two or more of one class
    and none of another (its layers; modules without parameters between them, activations say, are left to the
    enclosing group), outermost such containers only (blocks are not split further).

    A block holding a parameter that a module outside it holds too (a weight tied across layers) is left to the
    root's group: FSDP2 and ``replicate`` manage a parameter in one group only, and refuse a tie across two."""
    if _identical_blocks(model):
        return _self_contained(model, _parameterised(model))
    found: list[nn.Module] = []

    def walk(module: nn.Module) -> None:
        for child in module.children():
            if _identical_blocks(child):
                found.extend(_parameterised(child))
            else:
                walk(child)

    walk(model)
    return _self_contained(model, found)


def _self_contained(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """The ``blocks`` none of whose parameters a module of ``model`` outside the block holds as well."""
    held_by: dict[int, set[int]] = {}  # parameter -> the modules holding it as their own
    for module in model.modules():
        for parameter in parameters_of(module).values():
            if parameter is not None:
                held_by.setdefault(id(parameter), set()).add(id(module))
    kept = []
    for block in blocks:
        inside = {id(module) for module in block.modules()}
        if all(held_by.get(id(parameter), set()) <= inside for parameter in block.parameters()):
            kept.append(block)
    return kept


def _parameterised(container: nn.Module) -> list[nn.Module]:
    return [block for block in container.children() if any(True for _ in block.parameters())]


def _identical_blocks(module: nn.Module) -> bool:
    if not isinstance(module, (nn.ModuleList, nn.Sequential)):
        return False
    blocks = _parameterised(module)
    return len(blocks) > 1 and len({type(b) for b in blocks}) == 1


def parallelize(model: nn.Module, plan: ParallelPlan, mesh: DeviceMesh | None) -> dict[str, DeviceMesh]:
    """Apply ``plan`` to ``model`` (a copy of the user's) on ``mesh``, in place. Returns the meshes it made besides
    ``mesh``'s own dimensions, by name: ``dp_fsdp``, the two data-parallel dimensions flattened into one, where
    ZeRO-1 replicates over both."""
    if mesh is None:
        return {}
    dims = plan.mesh
    if "tp" in dims:
        _tensor_parallel(model, plan, mesh["tp"])
    data_dims = tuple(name for name in ("dp", "fsdp") if name in dims)
    if data_dims:
        return _data_parallel(model, plan, mesh, data_dims)
    return {}


def _tensor_parallel(model: nn.Module, plan: ParallelPlan, mesh: DeviceMesh) -> None:
    """``parallelize_module`` by the plan's ``tp_plan`` or modelmeter's default plan for the model's layout, with
    head counts checked and made local (modelmeter.parallel.tensor_plans)."""
    from .tensor_plans import apply_tensor_parallel

    styles = dict(plan.tp_plan) if plan.tp_plan is not None else None
    apply_tensor_parallel(model, mesh, styles, sequence_parallel=plan.sequence_parallel)


def _data_parallel(model: nn.Module, plan: ParallelPlan, mesh: DeviceMesh,
                   dims: tuple[str, ...]) -> dict[str, DeviceMesh]:
    """``fully_shard`` (ZeRO-3, or ZeRO-2 without resharding after the forward; HSDP on ``dp`` x ``fsdp``) or
    ``replicate`` (DDP on ``dp``; ZeRO-1 on ``fsdp``, the optimizer's sharding being the memory metric's), per block
    and on the root: one all-gather / reduce-scatter / all-reduce group per block, as torchtitan groups them."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=_dtype(plan.param_dtype), reduce_dtype=_dtype(plan.reduce_dtype))
    apply: Callable[[nn.Module, bool], Any]
    made: dict[str, DeviceMesh] = {}
    sharded = "fsdp" in dims and plan.zero >= 2
    if sharded:
        data_mesh = mesh[dims] if len(dims) > 1 else mesh[dims[0]]

        def apply(module: nn.Module, root: bool) -> Any:
            # ZeRO-3 frees a block's gathered parameters after its forward, ZeRO-2 keeps them; the root is left to
            # FSDP2's default (kept: the backward pass needs it first)
            reshard = None if root else plan.zero == 3
            return fully_shard(module, mesh=data_mesh, reshard_after_forward=reshard, mp_policy=policy)
    else:
        replicate = replicate_module()
        replica_mesh = mesh[dims[0]]
        if len(dims) > 1:
            replica_mesh = made["_".join(dims)] = flattened_mesh(mesh[dims], "_".join(dims))

        def apply(module: nn.Module, root: bool) -> Any:
            return replicate(module, mesh=replica_mesh, mp_policy=policy)
    names = {id(module): name for name, module in model.named_modules()}
    for block in [*repeated_blocks(model), model]:
        try:
            apply(block, block is model)
        except Exception as exc:  # torch's refusal (a scalar parameter, say), named by the module it was given
            api = "fully_shard" if sharded else "replicate"
            where = f"module {names[id(block)]!r}" if block is not model else "the model"
            raise ParallelPlanError(f"the plan's {'/'.join(dims)} dimension cannot be applied: torch's {api} refused "
                                    f"{where} ({type(block).__name__}): {type(exc).__name__}: {exc}") from exc
    return made


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


def materialize(model: nn.Module, mode: FakeTensorMode) -> nn.Module:
    """Give the parallelised meta copy storage as FakeTensors of ``mode`` on the CPU (no memory is allocated):
    ``to_empty``, which FSDP2 and DTensor handle for their sharded parameters."""
    with mode:
        return model.to_empty(device="cpu")
