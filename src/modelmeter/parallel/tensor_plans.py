"""Tensor-parallel plans: which of a model's modules ``parallelize_module`` shards how, the Megatron-LM way.

Megatron-LM (Shoeybi et al. 2019, section 3) splits each transformer block into two regions that need one
all-reduce each in the forward pass: attention (q/k/v column-parallel, each rank a group of heads; the output
projection row-parallel) and the MLP (gate/up column-parallel, down row-parallel). The token embedding is sharded
along the vocabulary (row-wise, its input replicated) and the output head column-wise, gathered back to whole
logits, as torchtitan's Llama plan does without loss parallelism. With sequence parallelism (Korthikanti et al.
2022) the norms and residual adds between the regions work on a slice of the sequence (``SequenceParallel``, the
activations ``Shard(1)``): each region's input is all-gathered and its output reduce-scattered instead.

:func:`default_tp_plan` recognises the layout by module names (see ``_BLOCKS``); :func:`apply_tensor_parallel`
checks the head counts against the mesh and applies a plan to the analysis's own copy of the model.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Any, Literal

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ..errors import ParallelPlanError

__all__ = ["apply_tensor_parallel", "default_tp_plan"]


@dataclass(frozen=True)
class _Block:
    """A region Megatron-LM splits: its column-parallel projections (children, by name) feed its one row-parallel
    projection. An attention block's column split is a split of its heads."""

    kind: Literal["attention", "mlp"]
    columns: tuple[str, ...]
    row: str


# One line per naming of a block (Hugging Face / modelmeter's zoo, Meta's and torchtitan's Llama, fc1/fc2 MLPs).
_BLOCKS = (
    _Block("attention", ("q_proj", "k_proj", "v_proj"), "o_proj"),
    _Block("attention", ("wq", "wk", "wv"), "wo"),
    _Block("mlp", ("gate_proj", "up_proj"), "down_proj"),
    _Block("mlp", ("w1", "w3"), "w2"),
    _Block("mlp", ("fc1",), "fc2"),
)
# Projections that compute q, k and v in one product: a contiguous column split would mix q, k and v on a rank.
_FUSED_QKV = frozenset({"c_attn", "qkv_proj", "qkv", "query_key_value", "Wqkv", "in_proj"})
_OUTPUT_HEADS = frozenset({"lm_head", "output"})
# Modules between the two Linears of a plain MLP pair that act element by element, so a column shard passes through.
_ELEMENTWISE = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.SELU,
                nn.CELU, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Softplus, nn.Dropout, nn.Identity)
# Head counts an attention module may hold as attributes and use in its views (modelmeter's zoo, torchtitan, GPT-2).
_QUERY_HEADS = ("num_heads", "num_attention_heads", "n_heads", "n_head")
_KV_HEADS = ("num_kv_heads", "num_key_value_heads", "n_kv_heads")

_EXPLICIT = ("pass a plan explicitly: a dict of module names (or torch's wildcard patterns) to "
             "torch.distributed.tensor.parallel styles (ColwiseParallel(), RowwiseParallel(), ...), as "
             "ParallelPlan(tp_plan=...) or parallelize_module takes it")


def default_tp_plan(model: nn.Module, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The Megatron-LM tensor-parallel plan of ``model``, for ``parallelize_module``: module names to styles.

    Recognised: attention blocks with q/k/v/o projections (``q_proj`` ... ``o_proj``, or ``wq`` ... ``wo``) and
    gated MLPs (``gate_proj``/``up_proj``/``down_proj``, ``w1``/``w3``/``w2``) or ``fc1``/``fc2`` ones, as in
    modelmeter's zoo Llama and Hugging Face's Llama, Mistral and Qwen2; every ``nn.Embedding`` (row-wise, its
    input replicated); an output head named ``lm_head`` or ``output`` (column-wise, logits gathered whole); norms
    (replicated, or ``SequenceParallel`` with ``sequence_parallel``); and plain MLP stacks, ``nn.Sequential``s of
    ``nn.Linear`` and element-wise modules, their Linears paired column-wise then row-wise (these have no sequence
    dimension: ``sequence_parallel`` leaves them as they are). ``model`` is not changed.

    Raises :class:`~modelmeter.errors.ParallelPlanError` naming the first module with parameters it cannot place:
    GPT-2's fused q/k/v projection (``c_attn``; Hugging Face's is a ``Conv1D``, which torch's styles do not shard
    either) among them.
    """
    plan: dict[str, ParallelStyle] = {}
    placed: set[str] = set()
    blocks: set[str] = set()
    for name, module in model.named_modules():
        if name in placed:
            continue
        block = _block_of(module)
        if block is not None:
            plan.update(_block_plan(name, module, block, sequence_parallel))
            placed.update(_join(name, child) for child in (*block.columns, block.row))
            blocks.add(name)
        elif isinstance(module, nn.Sequential):
            pairs = _linear_pairs(name, module)
            plan.update(pairs)
            placed.update(pairs)
    for name, module in _holders(model):
        if name in placed:
            continue
        # a norm inside a block (Qwen3's per-head q/k norms) works on the block's gathered activations, never on
        # sequence shards
        between_blocks = sequence_parallel and not _inside(name, blocks)
        style = _leaf_style(name, module, sequence_sharded=between_blocks)
        if style is not None:
            plan[name] = style
    return plan


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh, plan: Mapping[str, ParallelStyle] | None = None, *,
                          sequence_parallel: bool = False) -> nn.Module:
    """Shard ``model`` over the one-dimensional ``mesh`` by ``plan`` (:func:`default_tp_plan`'s when None) with
    ``parallelize_module``, and return it.

    ``model`` is changed in place, so it must be the analysis's own copy (built on meta): besides the sharding, an
    attention module that keeps its head counts as attributes and views its projections with them (modelmeter's
    zoo Llama: ``num_heads``, ``num_kv_heads``) gets the local counts, each divided by the mesh's size — as
    PyTorch's tensor-parallel tutorial and torchtitan adjust ``n_heads`` — since a rank's q projection makes only
    its share of the heads. Hugging Face attention reads the count from the shapes (``view(..., -1, head_dim)``)
    and needs nothing. Head counts (query and key/value) that the mesh's size does not divide raise
    :class:`~modelmeter.errors.ParallelPlanError` naming the module, and so do the input features of a row-parallel
    Linear fed by shards (an MLP's intermediate size). (Attention blocks are those whose query
    projection the plan names exactly, with ``ColwiseParallel``; a wildcard entry of a plan of your own is not
    followed.)

    Tied parameters (an output head sharing the embedding's weight) are tied again afterwards: each style
    distributes its own copy, and both styles of the default plan shard that weight the same way (``Shard(0)``, the
    vocabulary); ties whose styles place them differently raise.
    """
    ranks = mesh.size()
    chosen = default_tp_plan(model, sequence_parallel) if plan is None else dict(plan)
    _check_plan(model, chosen, given=plan is not None)
    attention = [(name, module) for name, module in model.named_modules()
                 if _sharded_attention(name, module, chosen)]
    for name, module in attention:
        _check_heads(name, module, ranks)
    _check_row_inputs(model, chosen, ranks)
    for _, module in attention:
        for attribute in _head_attributes(module):
            setattr(module, attribute, getattr(module, attribute) // ranks)
    tied = _tied_parameters(model)
    for key, style in chosen.items():  # one entry at a time, as parallelize_module goes through a plan
        try:
            # src_data_rank=None: each rank initialises its own shard (no scatter from rank 0), as a run on meta
            # tensors does
            parallelize_module(model, mesh, {key: style}, src_data_rank=None)
        except Exception as exc:  # torch's refusal (a style on a module it does not shard), named by the entry
            raise ParallelPlanError(f"tensor-parallel plan entry {key!r}: torch's {type(style).__name__} cannot "
                                    f"apply to it: {type(exc).__name__}: {exc}") from exc
    for group in tied:
        _tie_again(model, group)
    return model


# --- recognising the layout -------------------------------------------------------------------------------------
def _block_of(module: nn.Module) -> _Block | None:
    """The block ``module`` is, by its children's names (each an ``nn.Linear``), or None."""
    children = dict(module.named_children())
    for block in _BLOCKS:
        names = (*block.columns, block.row)
        if all(isinstance(children.get(child), nn.Linear) for child in names):
            return block
    return None


def _block_plan(name: str, module: nn.Module, block: _Block, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Styles of a block and its projections.

    The block's input becomes one replicated DTensor for all its column-parallel projections (Megatron-LM's ``f``):
    their input gradients add up as partial sums and are all-reduced once per block, not once per projection. With
    ``sequence_parallel`` that input arrives in sequence shards, is all-gathered once, and the block's output is
    reduce-scattered back to them."""
    plan: dict[str, ParallelStyle] = {name: _block_input(module, block, Shard(1) if sequence_parallel else Replicate())}
    plan.update({_join(name, child): ColwiseParallel() for child in block.columns})
    row = RowwiseParallel(output_layouts=Shard(1), use_local_output=False) if sequence_parallel else RowwiseParallel()
    plan[_join(name, block.row)] = row
    return plan


def _block_input(module: nn.Module, block: _Block, arriving: Shard | Replicate) -> PrepareModuleInput:
    """``PrepareModuleInput`` turning a block's hidden states, ``arriving`` so, into a replicated DTensor.

    It needs to know how the states are passed: Hugging Face's decoder layers call attention with keywords
    (``self_attn(hidden_states=...)``); other blocks are taken to be called with their positional parameters that
    have no default, the hidden states first (modelmeter's zoo Llama: ``(x, cos, sin)``; an MLP: ``(x)``)."""
    parameters = [p for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if block.kind == "attention" and type(module).__module__.startswith("transformers."):
        first = parameters[0].name
        return PrepareModuleInput(input_kwarg_layouts={first: arriving},
                                  desired_input_kwarg_layouts={first: Replicate()})
    required = sum(1 for p in parameters if p.default is p.empty) or 1
    others = (None,) * (required - 1)
    return PrepareModuleInput(input_layouts=(arriving, *others), desired_input_layouts=(Replicate(), *others))


def _linear_pairs(name: str, sequential: nn.Sequential) -> dict[str, ParallelStyle]:
    """A plain MLP stack's Linears, column-wise then row-wise in pairs; nothing when ``sequential`` holds other
    modules with parameters or ones that do not act element by element (a norm or softmax over a shard would be
    wrong). An odd Linear left over is not placed here."""
    children = list(sequential.named_children())
    if not all(isinstance(child, (nn.Linear, *_ELEMENTWISE)) for _, child in children):
        return {}
    linears = [_join(name, child_name) for child_name, child in children if isinstance(child, nn.Linear)]
    plan: dict[str, ParallelStyle] = {}
    for column, row in zip(linears[0::2], linears[1::2], strict=False):
        plan[column], plan[row] = ColwiseParallel(), RowwiseParallel()
    return plan


def _leaf_style(name: str, module: nn.Module, *, sequence_sharded: bool) -> ParallelStyle | None:
    """The style of a module with parameters of its own that no block placed (``sequence_sharded``: it works on the
    activations between blocks, under sequence parallelism): None to keep it replicated (a norm otherwise); raises
    for one it cannot place."""
    last = name.rpartition(".")[2]
    if _is_conv1d(module) or (last in _FUSED_QKV and isinstance(module, nn.Linear)):
        raise ParallelPlanError(_fused_message(name, module))
    if isinstance(module, nn.Embedding):
        if sequence_sharded:
            return RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)
        return RowwiseParallel(input_layouts=Replicate())
    if _is_norm(module):
        return SequenceParallel() if sequence_sharded else None
    if isinstance(module, nn.Linear) and last in _OUTPUT_HEADS:
        entering = Shard(1) if sequence_sharded else Replicate()
        return ColwiseParallel(input_layouts=entering, output_layouts=Replicate())
    raise ParallelPlanError(
        f"no tensor-parallel place known for module {name!r} ({type(module).__name__}): the default plan knows "
        "attention blocks (q_proj/k_proj/v_proj/o_proj or wq/wk/wv/wo), MLPs (gate_proj/up_proj/down_proj, "
        "w1/w3/w2, fc1/fc2), embeddings, norms, an lm_head/output head and nn.Sequential stacks of Linear pairs; "
        + _EXPLICIT)


def _fused_message(name: str, module: nn.Module) -> str:
    kind = "projection computing q, k and v in one product"
    if _is_conv1d(module):
        kind = "Hugging Face Conv1D (GPT-2's layout, weight stored (in, out))"
    return (f"module {name!r} is a {kind}: the default tensor-parallel plan does not shard it (torch's "
            "ColwiseParallel/RowwiseParallel shard nn.Linear and nn.Embedding, and a contiguous column split of a "
            f"fused q/k/v projection would give a rank parts of q, k and v instead of whole heads); {_EXPLICIT}, "
            "or split the projection into q/k/v Linears")


def _holders(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The modules that hold parameters of their own, in the model's order."""
    for name, module in model.named_modules():
        if next(module.parameters(recurse=False), None) is not None:
            yield name, module


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def _is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``transformers.pytorch_utils.Conv1D``, told without importing transformers."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers.")


def _inside(name: str, blocks: set[str]) -> bool:
    """Whether module ``name`` lies inside one of ``blocks`` (module names)."""
    parts = name.split(".")
    return any(".".join(parts[:end]) in blocks for end in range(1, len(parts)))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


# --- head counts --------------------------------------------------------------------------------------------------
def _sharded_attention(name: str, module: nn.Module, plan: Mapping[str, Any]) -> bool:
    """Whether ``module`` is an attention block whose query projection ``plan`` shards column-wise."""
    block = _block_of(module)
    return block is not None and block.kind == "attention" and \
        isinstance(plan.get(_join(name, block.columns[0])), ColwiseParallel)


def _check_plan(model: nn.Module, plan: Mapping[str, Any], *, given: bool) -> None:
    """Raise unless ``plan`` (``given`` by the user, or the default one) has entries, each a ``ParallelStyle`` for
    a key that names a module of ``model``: ``parallelize_module`` skips a key that names nothing with a warning,
    and a plan that shards nothing would be counted as tensor parallelism that does nothing."""
    if not plan:
        whose = "the tensor-parallel plan given"
        if not given:
            whose = f"the default tensor-parallel plan of {type(model).__name__}"
        raise ParallelPlanError(f"{whose} shards nothing (no entries); {_EXPLICIT}")
    names = [name for name, _ in model.named_modules(remove_duplicate=False)]
    for key, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise ParallelPlanError(f"tensor-parallel plan entry {key!r} is a {type(style).__name__}, not a "
                                    "torch.distributed.tensor.parallel ParallelStyle (ColwiseParallel(), ...)")
        if not any(_matches(name, key) for name in names):
            raise ParallelPlanError(f"tensor-parallel plan entry {key!r} names no module of {type(model).__name__} "
                                    "(its keys are module names, as model.named_modules() gives them, or fnmatch "
                                    "patterns of them)")


def _check_heads(name: str, module: nn.Module, ranks: int) -> None:
    """Raise unless ``ranks`` divides the module's query and key/value head counts (each rank computes whole heads;
    key/value heads are not replicated across ranks as Megatron-LM can do for grouped-query attention)."""
    for what, count in _head_counts(module).items():
        if count % ranks:
            where = f"attention module {name!r}" if name else f"the attention model ({type(module).__name__})"
            raise ParallelPlanError(
                f"{where} has {count} {what} heads, which tp={ranks} does not divide: each rank "
                f"computes whole heads; choose a tp that divides {count}")


def _check_row_inputs(model: nn.Module, plan: Mapping[str, Any], ranks: int) -> None:
    """Raise unless ``ranks`` divides the input features of every Linear the plan makes row-parallel with its input
    in shards of the last dimension (``RowwiseParallel``'s default, fed by a column-parallel projection's local
    output): DTensor rebuilds that input from equal local shards, so an uneven split would give it a global width
    the weight does not have — and torch fails deep inside its sharding propagation."""
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or module.in_features % ranks == 0:
            continue
        for key, style in plan.items():
            if isinstance(style, RowwiseParallel) and isinstance(style.input_layouts[0], Shard) and _matches(name, key):
                raise ParallelPlanError(
                    f"module {name!r} (Linear, {module.in_features} input features) is row-parallel over tp={ranks} "
                    f"ranks, which do not divide {module.in_features}: its input arrives in equal shards of the "
                    f"features (the column-parallel projection before it splits them); choose a tp that divides "
                    f"{module.in_features}")


def _matches(name: str, key: str) -> bool:
    """Whether plan key ``key`` names module ``name``, as ``parallelize_module`` matches it: atom by atom with
    ``fnmatch`` (``""`` is the model itself)."""
    names, keys = name.split(".") if name else [], key.split(".") if key else []
    return len(names) == len(keys) and all(fnmatch(n, k) for n, k in zip(names, keys, strict=True))


def _head_counts(module: nn.Module) -> dict[str, int]:
    """Query and key/value head counts: from the module's attributes, else from its Hugging Face config, else from
    its q and k projections' widths over a ``head_dim`` it keeps (an attention that views ``(..., -1, head_dim)``)."""
    config = getattr(module, "config", None)
    query = _first_count(module, _QUERY_HEADS) or _first_count(config, ("num_attention_heads",)) or \
        _heads_by_width(module, 0)
    kv = _first_count(module, _KV_HEADS) or _first_count(config, ("num_key_value_heads",)) or \
        _heads_by_width(module, 1) or query
    return {what: count for what, count in (("query", query), ("key/value", kv)) if count}


def _heads_by_width(module: nn.Module, column: int) -> int | None:
    """The heads the block's ``column``-th projection (0: q, 1: k) makes: its output features over the module's
    ``head_dim``; None without one, or when it does not divide them."""
    head_dim = _first_count(module, ("head_dim",))
    block = _block_of(module)
    if not head_dim or block is None:
        return None
    features: int = getattr(module, block.columns[column]).out_features
    return features // head_dim if features % head_dim == 0 else None


def _first_count(owner: Any, names: tuple[str, ...]) -> int | None:
    for attribute in names:
        value = getattr(owner, attribute, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _head_attributes(module: nn.Module) -> list[str]:
    """The head counts ``module`` holds as attributes (divided per rank on the copy)."""
    return [a for a in (*_QUERY_HEADS, *_KV_HEADS) if isinstance(getattr(module, a, None), int)]


# --- tied parameters ----------------------------------------------------------------------------------------------
def _tied_parameters(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Groups of (module name, attribute) holding one parameter, for each parameter held in more than one place."""
    places: dict[int, list[tuple[str, str]]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for attribute, parameter in module.named_parameters(recurse=False):
            places.setdefault(id(parameter), []).append((name, attribute))
    return [sorted(set(group)) for group in places.values() if len(set(group)) > 1]


def _tie_again(model: nn.Module, group: list[tuple[str, str]]) -> None:
    """Make every place of ``group`` hold the first place's (sharded) parameter again."""
    first_name, first_attribute = group[0]
    shared = getattr(model.get_submodule(first_name), first_attribute)
    for name, attribute in group[1:]:
        module = model.get_submodule(name)
        other = getattr(module, attribute)
        if other is shared:
            continue
        if getattr(other, "placements", None) != getattr(shared, "placements", None):
            raise ParallelPlanError(
                f"parameters {_join(first_name, first_attribute)!r} and {_join(name, attribute)!r} are tied, but the "
                f"plan places them differently ({getattr(shared, 'placements', 'replicated')} and "
                f"{getattr(other, 'placements', 'replicated')}); untie them, or pass a plan that shards both alike")
        setattr(module, attribute, shared)
