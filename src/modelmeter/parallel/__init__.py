"""Parallel training plans: one rank of a data-, fully-sharded-, tensor- (and pipeline-) parallel run, simulated
on PyTorch's own distributed machinery in this process (docs/parallel.md).

Only the plan is imported here (plain data, no torch.distributed): :mod:`.mesh`, :mod:`.apply` and :mod:`.runner`
are imported where a plan is run."""

from __future__ import annotations

from .plan import DIMS, ParallelPlan, as_plan

__all__ = ["DIMS", "ParallelPlan", "as_plan"]
