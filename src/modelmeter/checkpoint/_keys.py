"""State-dict key bookkeeping: grouped messages, prefix stripping, wrapper unwrapping, shared parameters."""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from torch import nn

from .._torch_compat import buffers_of, children_of, parameters_of, set_state_dict_metadata, state_dict_metadata

__all__ = [
    "WRAPPER_TYPES",
    "clean_key_map",
    "filter_reused_missing_keys",
    "get_missing_parameters_message",
    "get_unexpected_parameters_message",
    "named_modules_with_dup",
    "strip_prefix_if_present",
    "strip_wrapper_prefixes",
    "unwrap_model",
    "unwrap_state_dict",
]

WRAPPER_TYPES: tuple[type[nn.Module], ...] = (nn.DataParallel, nn.parallel.DistributedDataParallel)


def _group_keys(keys: Iterable[str]) -> dict[str, list[str]]:
    """``"a.b.weight"`` → ``{"a.b": ["weight"]}``; a key without a dot is its own group with no suffixes."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        prefix, dot, suffix = key.rpartition(".")
        if dot:
            groups.setdefault(prefix, []).append(suffix)
        else:
            groups.setdefault(key, [])
    return groups


def _group_str(prefix: str, suffixes: list[str]) -> str:
    if not suffixes:
        return prefix
    if len(suffixes) == 1:
        return f"{prefix}.{suffixes[0]}"
    return prefix + ".{" + ", ".join(sorted(suffixes)) + "}"


def get_missing_parameters_message(keys: Iterable[str]) -> str:
    """fvcore's message for model keys absent from a checkpoint, one sorted line per prefix: ``a.b.{bias, weight}``."""
    lines = sorted(_group_str(p, s) for p, s in _group_keys(keys).items())
    return "Some model parameters or buffers are not found in the checkpoint:\n" + "\n".join(lines)


def get_unexpected_parameters_message(keys: Iterable[str]) -> str:
    """fvcore's message for checkpoint keys the model does not use, indented, in first-seen order."""
    lines = ["  " + _group_str(p, s) for p, s in _group_keys(keys).items()]
    return "The checkpoint state_dict contains keys that are not used by the model:\n" + "\n".join(lines)


def strip_prefix_if_present(state_dict: dict[str, Any], prefix: str) -> None:
    """Remove ``prefix`` from every key, in place, but only if every (non-empty) key carries it.

    The ``_metadata`` attribute torch attaches to state dicts is renamed the same way (its root entry ``""`` is
    kept; the bare wrapper entry, e.g. ``"module"``, becomes the new root).
    """
    if not all(not key or key.startswith(prefix) for key in state_dict):
        return
    for key in list(state_dict):
        if key:
            state_dict[key[len(prefix) :]] = state_dict.pop(key)
    metadata = state_dict_metadata(state_dict)
    if metadata is None:
        return
    bare = prefix.rstrip(".")
    for key in list(metadata):
        if not key:
            continue
        if key == bare:
            metadata[""] = metadata.pop(key)
        elif key.startswith(prefix):
            metadata[key[len(prefix) :]] = metadata.pop(key)


def _prefix_depth(keys: Iterable[str], prefix: str) -> int:
    """How many times ``prefix`` repeats at the start of every (non-empty) key; 0 for no keys."""
    names = [k for k in keys if k]
    depth = 0
    while names and all(k.startswith(prefix * (depth + 1)) for k in names):
        depth += 1
    return depth


def strip_wrapper_prefixes(state_dict: dict[str, Any], model_keys: Iterable[str], prefix: str = "module.") -> None:
    """Remove the uniform ``prefix`` segments that wrappers (DataParallel / DDP, any number) added, in place.

    Only those beyond the model's own: a model whose child is called ``module`` keeps its ``module.`` keys
    (fvcore strips one ``prefix`` regardless, so such a model could not load its own checkpoint).
    """
    extra = _prefix_depth(state_dict, prefix) - _prefix_depth(model_keys, prefix)
    for _ in range(extra):
        strip_prefix_if_present(state_dict, prefix)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside any number of DataParallel / DistributedDataParallel wrappers around the root."""
    while isinstance(model, WRAPPER_TYPES):
        inner = model.module
        assert isinstance(inner, nn.Module)
        model = inner
    return model


def named_modules_with_dup(model: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """Like ``named_modules()`` but a module reachable by several paths is yielded once per path."""
    yield prefix, model
    for name, child in children_of(model).items():
        if child is not None:
            yield from named_modules_with_dup(child, f"{prefix}.{name}" if prefix else name)


def _module_path_map(model: nn.Module) -> dict[str, str]:
    """Module path → the same path without the ``module`` segments that wrappers inside the model add.

    Only paths that change are included, so an empty result means the model holds no nested wrapper.
    """
    mapping: dict[str, str] = {}

    def walk(module: nn.Module, actual: str, clean: str) -> None:
        for name, child in children_of(module).items():
            if child is None:
                continue
            child_actual = f"{actual}.{name}" if actual else name
            if isinstance(module, WRAPPER_TYPES) and name == "module":
                child_clean = clean
            else:
                child_clean = f"{clean}.{name}" if clean else name
            if child_actual != child_clean:
                mapping[child_actual] = child_clean
            walk(child, child_actual, child_clean)

    walk(model, "", "")
    return mapping


def clean_key_map(model: nn.Module, keys: Iterable[str]) -> dict[str, str]:
    """State-dict ``keys`` of ``model``: actual key → key without wrappers' ``module.`` segments (changed keys only)."""
    paths = _module_path_map(model)
    if not paths:
        return {}
    result: dict[str, str] = {}
    for key in keys:
        parts = key.split(".")
        for i in range(len(parts) - 1, 0, -1):
            clean = paths.get(".".join(parts[:i]))
            if clean is not None:
                rest = ".".join(parts[i:])
                result[key] = f"{clean}.{rest}" if clean else rest
                break
    return result


def unwrap_state_dict(model: nn.Module, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``model.state_dict()`` with the ``module.`` segments of wrappers nested inside the model removed."""
    key_map = clean_key_map(model, state_dict)
    if not key_map:
        return state_dict
    result: dict[str, Any] = type(state_dict)() if isinstance(state_dict, OrderedDict) else {}
    for key, value in state_dict.items():
        result[key_map.get(key, key)] = value
    metadata = state_dict_metadata(state_dict)
    if metadata is not None:
        paths = _module_path_map(model)
        new_metadata: dict[str, Any] = OrderedDict()
        # Inner paths come later, so the wrapped module's entry wins over its wrapper's.
        for key, value in metadata.items():
            new_metadata[paths.get(key, key)] = value
        set_state_dict_metadata(result, new_metadata)
    return result


def filter_reused_missing_keys(model: nn.Module, keys: Iterable[str]) -> list[str]:
    """Drop every name of a shared parameter/buffer when at least one of its names was loaded.

    A tensor registered under several names (tied weights, a module reused in two places) is reported missing
    only if *all* its names are missing.
    """
    missing = list(keys)
    missing_set = set(missing)
    names_of: dict[int, set[str]] = defaultdict(set)
    for prefix, module in named_modules_with_dup(model):
        tensors: Mapping[str, Any] = {**parameters_of(module), **buffers_of(module)}
        for name, tensor in tensors.items():
            if tensor is not None:
                names_of[id(tensor)].add(f"{prefix}.{name}" if prefix else name)
    drop: set[str] = set()
    for names in names_of.values():
        hit = names & missing_set
        if hit and hit != names:
            drop |= names
    return [k for k in missing if k not in drop]
