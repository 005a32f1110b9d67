"""Higher-order operators (``torch.cond``, ``while_loop``, ``scan``, ``map``, ``invoke_subgraph`` and the wrappers an
exported program keeps) run as torch's eager kernels run them, so the operators of their bodies are recorded.

Set aside with the recorders, a body would run unseen: a silent zero. A higher-order operator that is neither run
here nor run as a whole (``flex_attention``, counted by its rule; ``print``, no work) is refused by name
(:func:`refuse`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._torch_compat import pytree
from ..errors import UnsupportedError

# Run as a whole, set aside with the recorders: flex_attention is counted by its own rule (handles/attention.py; its
# bodies are score modifiers, not layers), print and _export_tracepoint (an unflattened program's) do no work.
COUNTED_WHOLE = frozenset({"flex_attention", "print", "_export_tracepoint"})


def _cond(pred: Any, true_fn: Callable[..., Any], false_fn: Callable[..., Any], operands: Any) -> Any:
    """``cond``: the branch its predicate picks (the predicate read as a value: known, assumed on the meta device, or
    the fake run falls back to real kernels)."""
    return true_fn(*operands) if bool(pred) else false_fn(*operands)


def _loop(cond_fn: Callable[..., Any], body_fn: Callable[..., Any], carried: Any,
          additional: Any) -> Iterator[tuple[Any, ...]]:
    """The carried values after each iteration of ``while_loop`` (its condition read as a value before each)."""
    carried = tuple(carried)
    while bool(cond_fn(*carried, *additional)):
        carried = tuple(body_fn(*carried, *additional))
        yield carried


def _while_loop(cond_fn: Callable[..., Any], body_fn: Callable[..., Any], carried: Any, additional: Any,
                *_: Any, **__: Any) -> tuple[Any, ...]:
    """``while_loop``: the body run while the condition holds; the carried values are returned (copied when the body
    never ran, as torch's eager kernel does)."""
    final = deque(_loop(cond_fn, body_fn, carried, additional), maxlen=1)
    if not final:
        return tuple(v.clone() if isinstance(v, torch.Tensor) else v for v in carried)
    return final[0]


def _while_loop_stacked(cond_fn: Callable[..., Any], body_fn: Callable[..., Any], carried: Any, additional: Any,
                        *_: Any, **__: Any) -> tuple[Any, ...]:
    """``while_loop_stack_output``: every iteration's carried values, stacked."""
    steps = list(_loop(cond_fn, body_fn, carried, additional))
    if not steps:
        return tuple(v.unsqueeze(0).clone() if isinstance(v, torch.Tensor) else v for v in carried)
    return tuple(torch.stack(values) for values in zip(*steps, strict=True))


def _scan(combine_fn: Callable[..., Any], init: Any, xs: Any, additional: Any, *_: Any, **__: Any) -> tuple[Any, ...]:
    """``scan``: ``combine_fn(carry, x[i])`` for every slice of ``xs`` along dim 0, the carry threaded through; the
    final carry and the stacked outputs."""
    carry, outputs = tuple(init), []
    for i in range(xs[0].shape[0] if xs else 0):
        result = tuple(combine_fn(*carry, *(x.select(0, i) for x in xs), *additional))
        carry = result[:len(carry)]
        outputs.append(result[len(carry):])
    return (*carry, *(torch.stack(values) for values in zip(*outputs, strict=True)))


def _map(f: Callable[..., Any], xs: Any, pos_args: Any, *_: Any, **__: Any) -> Any:
    """``map``: ``f`` on every slice of ``xs`` along dim 0, the results stacked."""
    results = [f(*slices, *pos_args) for slices in zip(*(x.unbind(0) for x in xs), strict=True)]
    flat = [pytree.tree_flatten(result) for result in results]
    stacked = [torch.stack(leaves) for leaves in zip(*(leaves for leaves, _ in flat), strict=True)]
    return pytree.tree_unflatten(stacked, flat[0][1])


def _invoke_subgraph(subgraph: Callable[..., Any], identifier: Any, *operands: Any) -> Any:
    """``invoke_subgraph`` (``nested_compile_region``): the subgraph called on its operands."""
    return subgraph(*operands)


def _with_grad(enabled: bool, body: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``wrap_with_set_grad_enabled`` (an exported ``torch.no_grad()`` block): the body under that grad mode."""
    with torch.set_grad_enabled(enabled):
        return body(*args, **kwargs)


def _with_autocast(device_type: str, dtype: Any, enabled: bool, cache_enabled: Any, body: Callable[..., Any],
                   *args: Any, **kwargs: Any) -> Any:
    """``wrap_with_autocast`` (an exported ``torch.autocast`` block): the body under that autocast."""
    with torch.autocast(device_type, dtype, enabled, cache_enabled):
        return body(*args, **kwargs)


def _runners() -> dict[Any, Callable[..., Any]]:
    """The higher-order operators of this torch that run here, by operator."""
    named: dict[str, Callable[..., Any]] = {
        "cond": _cond, "while_loop": _while_loop, "while_loop_stack_output": _while_loop_stacked, "scan": _scan,
        "map_impl": _map, "invoke_subgraph": _invoke_subgraph, "wrap_with_set_grad_enabled": _with_grad,
        "wrap_with_autocast": _with_autocast}
    return {getattr(torch.ops.higher_order, name): run for name, run in named.items()
            if hasattr(torch.ops.higher_order, name)}


RUNNERS = _runners()


def run_body(run: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``run(*args, **kwargs)`` with torch.compile off for every frame it runs: eager ``torch.cond`` & co. call the
    operator inside a compiled wrapper, which would otherwise trace the recorders themselves."""
    return torch.compiler.disable(run, recursive=True)(*args, **kwargs)


def refuse(name: str) -> UnsupportedError:
    """The error for a higher-order operator neither run here nor counted as a whole."""
    return UnsupportedError(f"the higher-order operator {name} cannot be counted (its body would run unseen, a "
                            f"silent zero); the ones counted are {', '.join(sorted(_counted()))}")


def _counted() -> set[str]:
    """The names of the higher-order operators run here or as a whole."""
    return {op.name() for op in RUNNERS} | set(COUNTED_WHOLE)
