"""The process group of a collective operator, as plain data (:class:`GroupMeta`).

c10d's operators (``c10d::_allgather_base_``, ``c10d::allreduce_``, ...) take the group as a ``ProcessGroup``
script object; the functional ones (``_c10d_functional::all_reduce``, ...) by its registered name. Both become a
:class:`GroupMeta` in the recorded event, resolved through torch.distributed's own registry of groups, so a trace
says which group (and so which mesh dimension, and which link) every collective used without holding the group.
"""

from __future__ import annotations

from typing import Any

import torch

from .._torch_compat import resolve_group_name, script_object_type
from .trace import GroupMeta

# The namespaces of collective operators whose group argument is a name (``group_name``)
FUNCTIONAL_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")
_PROCESS_GROUP_TYPE = "__torch__.torch.classes.c10d.ProcessGroup"


def group_of_script_object(value: torch.ScriptObject) -> GroupMeta | None:
    """The :class:`GroupMeta` of a ``ProcessGroup`` script object (what c10d's operators take); None for any
    other script object."""
    if script_object_type(value) != _PROCESS_GROUP_TYPE:
        return None
    from torch import distributed

    return _described(distributed.ProcessGroup.unbox(value))


def group_of_name(name: Any) -> Any:
    """The :class:`GroupMeta` of the group a functional collective names (its ``group_name`` argument); the
    argument as it is when it is no name of a registered group (a group object is described by
    :func:`group_of_script_object` already)."""
    if not isinstance(name, str):
        return name
    try:
        group = resolve_group_name(name)
    except (RuntimeError, ValueError, KeyError):  # not registered (destroyed, or made by hand)
        return name
    return _described(group)


def group_name_positions(namespace: str, schema: torch.FunctionSchema) -> tuple[int, ...]:
    """Where a functional collective's schema takes the group's name (``()`` for every other operator)."""
    if namespace not in FUNCTIONAL_NAMESPACES:
        return ()
    return tuple(i for i, argument in enumerate(schema.arguments) if argument.name == "group_name")


def name_groups(inputs: list[Any], positions: tuple[int, ...]) -> None:
    """Replace the group names at ``positions`` of an event's placed ``inputs`` by their :class:`GroupMeta`."""
    for position in positions:
        if position < len(inputs):
            inputs[position] = group_of_name(inputs[position])


def _described(group: Any) -> GroupMeta:
    from torch import distributed

    try:
        ranks = tuple(distributed.get_process_group_ranks(group))
    except (RuntimeError, ValueError, KeyError):  # a group the default world does not know
        ranks = ()
    return GroupMeta(str(group.group_name), int(group.size()), ranks)
