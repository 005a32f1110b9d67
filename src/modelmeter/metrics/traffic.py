"""The ``bytes`` metric: memory traffic of every kernel, by module, operator and phase."""

from __future__ import annotations

from ..engine.trace import Trace
from ..handles.traffic import kernel_rule, traffic_table
from .counting import Statistics, Unit, count


def count_bytes(trace: Trace, attention_kernel: str = "fused", units: list[Unit] | None = None) -> Statistics:
    """Bytes read plus written by every kernel of ``trace`` (views free), in every phase."""
    return count(trace, traffic_table(attention_kernel), fallback=kernel_rule, units=units)
