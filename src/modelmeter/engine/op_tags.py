"""What PyTorch's operator registry says about an operator, recorded with the trace.

Metrics classify operators by two facts only torch's registry knows: whether an operator returns a view of
an input (no data moves) and whether torch tags it ``pointwise``. The run records both for every operator it
saw (:attr:`~modelmeter.engine.trace.Trace.op_tags`), so a trace is counted alike in a process with another
torch, or with none (a saved trace rendered by ``modelmeter report``).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache

import torch

from .._torch_compat import schema_of

VIEW = "view"
POINTWISE = "pointwise"


def op_tags(ops: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """The tags of every operator in ``ops``, and of the out-of-place form of each in-place one (``add_``:
    ``add``), which classification falls back on."""
    tags: dict[str, tuple[str, ...]] = {}
    for op in ops:
        if op in tags:
            continue
        tags[op] = registry_tags(op)
        if op.endswith("_") and not op.endswith("__"):
            tags.setdefault(op[:-1], registry_tags(op[:-1]))
    return tags


@cache
def registry_tags(op: str) -> tuple[str, ...]:
    """``("view",)``, ``("pointwise",)``, both or neither, for an operator name like ``"aten::add.Tensor"``'s
    packet ``"aten::add"``; ``()`` for a name torch does not know (a Python function, a custom Function)."""
    namespace, _, name = op.partition("::")
    packet = getattr(getattr(torch.ops, namespace, None), name, None) if name else None
    if packet is None:
        return ()
    overloads = packet.overloads()
    if not overloads:
        return ()
    found = []
    default = getattr(packet, "default" if "default" in overloads else overloads[0])
    returns = schema_of(default).returns
    if returns and returns[0].alias_info is not None and not returns[0].alias_info.is_write:
        found.append(VIEW)
    if any(torch.Tag.pointwise in getattr(packet, o).tags for o in overloads):
        found.append(POINTWISE)
    return tuple(found)
