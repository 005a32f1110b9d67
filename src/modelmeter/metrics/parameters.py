"""Parameter counts by module: every dotted prefix of every parameter name, shared parameters once."""

from __future__ import annotations

from collections import defaultdict

from torch import nn


def parameter_count(model: nn.Module) -> defaultdict[str, int]:
    """Number of parameter elements under every name prefix; ``""`` is the whole model.

    A parameter shared by several modules counts once, under its first name (as fvcore does).
    Works on the meta device: only shapes are read.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    counts: defaultdict[str, int] = defaultdict(int)
    for name, param in model.named_parameters():
        size = param.numel()
        parts = name.split(".")
        counts[""] += size
        for i in range(1, len(parts) + 1):
            counts[".".join(parts[:i])] += size
    return counts
