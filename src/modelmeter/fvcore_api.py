"""fvcore's parameter count and printed reports — ``parameter_count``, ``parameter_count_table``,
``flop_count_table`` and ``flop_count_str`` — as thin adapters: they collect plain data (the trace's module
table, per-module counts) from the analyses or the model and hand it to the renderers in ``reports``.

Unlike fvcore, the analyses passed in keep their warning settings: the reports read quiet copies that share
the recorded run.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from torch import nn

from .engine.gc_pause import paused
from .engine.naming import ModuleNames
from .errors import InvalidTypeError, check_depth, check_flag
from .metrics.parameters import count_by_prefix, parameter_shapes
from .reports.fvcore_tables import flop_count_str_text, flop_count_table_text, parameter_count_table_text
from .views import ModelAnalysis, check_same_model


def parameter_count(model: nn.Module) -> defaultdict[str, int]:
    """Number of parameter elements under every name prefix; ``""`` is the whole model.

    A parameter shared by several modules counts once, under its first name (as fvcore does).
    Works on the meta device: only shapes are read.
    """
    if not isinstance(model, nn.Module):
        raise InvalidTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return count_by_prefix(ModuleNames(model).infos())


def parameter_count_table(model: nn.Module, max_depth: int = 3) -> str:
    """Parameters per module (and parameter shapes) to ``max_depth`` levels, as fvcore's markdown table."""
    if not isinstance(model, nn.Module):
        raise InvalidTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_depth("max_depth", max_depth)
    modules = ModuleNames(model).infos()
    return parameter_count_table_text(count_by_prefix(modules), parameter_shapes(modules), max_depth)


def _quiet(analysis: ModelAnalysis) -> ModelAnalysis:
    """A copy of ``analysis`` that logs nothing, sharing its run (recorded now, the model's warnings hidden) and its
    statistics when it has counted them (``Analysis.table()`` after ``result()`` counts once).

    The analysis itself keeps its settings.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _ = analysis.trace  # records the run once, in the analysis's session
    return analysis.quiet_view()


def _check_analyses(flops: Any, activations: Any) -> None:
    """Refuse a ``flops`` or ``activations`` that is not an analysis."""
    for name, value in (("flops", flops), ("activations", activations)):
        if not isinstance(value, ModelAnalysis) and (name == "flops" or value is not None):
            raise InvalidTypeError(f"{name} must be an analysis such as FlopCountAnalysis(model, inputs), got "
                                   f"{type(value).__name__}")


def _columns(flops: ModelAnalysis, activations: ModelAnalysis | None, activations_header: str
             ) -> tuple[ModelAnalysis, dict[str, Mapping[str, Any]], dict[str, set[str]]]:
    """The flops view, its counts by module (and the activations', when given; an activations analysis that has
    not run yet reuses the flops' run when it is of the same call) and each column's uncalled modules."""
    _check_analyses(flops, activations)
    flop_view = _quiet(flops)
    counts: dict[str, Mapping[str, Any]] = {"#flops": flop_view.by_module()}
    uncalled = {"#flops": flop_view.uncalled_modules()}
    if activations is not None:
        act_view = _quiet(activations)
        check_same_model(flop_view, act_view, "activations", "flops")
        counts[activations_header] = act_view.by_module()
        uncalled[activations_header] = act_view.uncalled_modules()
    return flop_view, counts, uncalled


@paused
def flop_count_table(flops: ModelAnalysis, max_depth: int = 3, activations: ModelAnalysis | None = None,
                     show_param_shapes: bool = True) -> str:
    """Parameters and flops (and activations) per module as fvcore's markdown table.

    Rows to ``max_depth`` levels; all-zero modules dropped; a chain of single children with equal
    values shown as one row named by the deepest module; parameter shapes as rows when
    ``show_param_shapes``. An ``activations`` analysis that has not run yet reuses the flops run.
    """
    check_depth("max_depth", max_depth)
    check_flag("show_param_shapes", show_param_shapes)
    flop_view, counts, uncalled = _columns(flops, activations, "#activations")
    modules = flop_view.trace.modules
    return flop_count_table_text(count_by_prefix(modules), parameter_shapes(modules), counts, uncalled, max_depth,
                                 show_param_shapes)


@paused
def flop_count_str(flops: ModelAnalysis, activations: ModelAnalysis | None = None) -> str:
    """``repr(model)`` with ``#params``, ``#flops`` (and ``#acts``) added to every module, as fvcore prints it.

    Modules whose values are all zero get no line; uncalled modules show ``N/A``, with a note on top. Rendered
    from the trace's module table (labels, ``extra_repr``, child slots), not the live model.
    """
    flop_view, counts, uncalled = _columns(flops, activations, "#acts")
    modules = flop_view.trace.modules
    return flop_count_str_text(modules, {"#params": count_by_prefix(modules), **counts}, uncalled)
