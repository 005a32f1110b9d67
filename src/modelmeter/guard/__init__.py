"""Guard a model's cost in CI: budgets, baselines and diffs (docs/guard.md).

``check_budget(result, "flops=4.2G,params=26M")`` lists what is over a budget; a :class:`BaselineFile` keeps
the costs of several models, module by module, and :func:`compare` says which block grew beyond a tolerance;
:func:`diff` lists per-module differences of two saved analyses. The ``modelmeter`` command (``--budget``,
``--save-baseline``, ``--check-baseline``, ``modelmeter diff``) and the pytest plugin (``assert_cost``) use them.
"""

from .assertions import CostAssertionError, assert_cost
from .baseline import (
    BaselineFile,
    BaselineMismatch,
    Comparison,
    Entry,
    compare,
    entry_from_result,
    record,
    training_mode,
)
from .budget import Budget, check_budget, parse_budget, parse_quantity
from .diff import Difference, diff, load_costs, render_diff
from .values import GuardFileError

__all__ = [
    "BaselineFile",
    "BaselineMismatch",
    "Budget",
    "Comparison",
    "CostAssertionError",
    "Difference",
    "Entry",
    "GuardFileError",
    "assert_cost",
    "check_budget",
    "compare",
    "diff",
    "entry_from_result",
    "load_costs",
    "parse_budget",
    "parse_quantity",
    "record",
    "render_diff",
    "training_mode",
]
