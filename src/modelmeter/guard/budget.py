"""Budgets: ``flops=4.2G,params=26M,activations=12M`` — upper limits on a model's costs."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import InvalidTypeError, InvalidValueError
from ..reports.format import parse_duration
from ..reports.render import format_metric
from ..reports.result import BYTE_METRICS, MEMORY_METRICS, RATIO_METRICS, ROOFLINE_METRICS, TIME_METRICS, Result
from .values import MAX_AMOUNT, check_amount

_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
_BINARY = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "pi": 2**50}


def parse_quantity(text: str) -> float:
    """``"4.2G"`` -> 4.2e9, ``"26M"`` -> 26e6, ``"2GiB"`` -> 2·2³⁰, ``"1500"`` -> 1500 (K/M/G/T/P are powers of
    1000, Ki/Mi/Gi/Ti/Pi of 1024; a trailing ``B`` is allowed). A ``ValueError`` for anything else, and for an
    amount that is not finite or over :data:`~modelmeter.guard.values.MAX_AMOUNT` (``1e400`` is infinity)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)(e\d+)?\s*([kmgtp]i?)?b?\s*", text.strip().lower())
    if match is None:
        raise InvalidValueError(f"not a quantity: {text!r} (e.g. 4.2G, 26M, 2GiB, 1500)")
    number, exponent, unit = match.groups()
    value = float(number + (exponent or ""))  # float() saturates at inf at once, where 10 ** 99999999 would not
    unit = unit or ""
    value *= _BINARY[unit] if unit.endswith("i") else _DECIMAL[unit]
    if value > MAX_AMOUNT:
        raise InvalidValueError(f"out of range: {text!r} is over {MAX_AMOUNT:g}")
    return value


Budget = dict[str, float]


def parse_budget(text: str) -> Budget:
    """``"flops=4.2G,params=26M"`` -> ``{"flops": 4.2e9, "params": 26e6}``; times in seconds (``time=5ms`` ->
    0.005, see :func:`~modelmeter.reports.format.parse_duration`); a clear error for anything else (a metric given
    twice, a ratio such as ``intensity`` that no budget bounds)."""
    budget: Budget = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        metric, sep, amount = part.partition("=")
        metric = metric.strip()
        if not sep or not metric:
            raise InvalidValueError(f"a budget is metric=amount, e.g. flops=4.2G; got {part!r}")
        if metric in budget:
            raise InvalidValueError(f"the budget names {metric!r} twice; give each metric once")
        if metric in RATIO_METRICS:
            raise InvalidValueError(f"{metric} is a ratio, not a cost: budget the time or the bytes instead")
        try:
            budget[metric] = parse_duration(amount) if metric in TIME_METRICS else parse_quantity(amount)
        except ValueError as exc:
            raise InvalidValueError(f"the budget of {metric}: {exc}") from None
    if not budget:
        raise InvalidValueError("an empty budget: give metric=amount pairs, e.g. flops=4.2G,params=26M")
    return budget


@dataclass(frozen=True)
class Over:
    """One metric over its budget."""

    metric: str
    value: float
    limit: float

    def __str__(self) -> str:
        excess = self.value - self.limit
        share = f" (+{100 * excess / self.limit:.1f}%)" if self.limit else ""
        value, limit, by = (format_metric(self.metric, amount) for amount in (self.value, self.limit, excess))
        if self.metric in TIME_METRICS:
            exact = f"{self.value:.6g} s"
        else:
            exact = f"{self.value:,.0f}{' bytes' if self.metric in BYTE_METRICS else ''}"
        return f"{self.metric}: {value} ({exact}) is over the budget of {limit} by {by}{share}"


def metric_values(result: Result) -> dict[str, float]:
    """The model's totals by metric name: every metric of the result, and ``params`` (the model's
    ``peak_memory`` is the run's peak)."""
    return {"params": float(result.root.params), **{m: float(result.total(m)) for m in result.metrics}}


def check_budget(result: Result, budget: Budget) -> list[Over]:
    """The metrics of ``result`` over ``budget``; an unknown metric is a :class:`ValueError` naming the known ones,
    a limit that is not a finite number >= 0 a ``TypeError`` / ``ValueError`` naming it."""
    if not isinstance(budget, dict):
        raise InvalidTypeError("budget must be a dict of metric -> limit (see parse_budget), got "
                               f"{type(budget).__name__}")
    for metric, limit in budget.items():
        check_amount(limit, f"budget[{metric!r}]")
    values = _budgeted_values(result, budget)
    return [Over(m, values[m], limit) for m, limit in budget.items() if values[m] > limit]


def within_budget(result: Result, budget: Budget) -> str:
    """What a budget that ``result`` keeps checked, for the line a passing ``--budget`` prints:
    ``"flops 4.11G ≤ 4.2G, params 25.6M ≤ 26M"`` (errors as :func:`check_budget`'s)."""
    values = _budgeted_values(result, budget)
    return ", ".join(f"{m} {format_metric(m, values[m])} ≤ {format_metric(m, limit)}" for m, limit in budget.items())


def _budgeted_values(result: Result, budget: Budget) -> dict[str, float]:
    """The totals of ``result`` by metric, once every metric of ``budget`` is known to be among them."""
    values = metric_values(result)
    unknown = [m for m in budget if m not in values]
    if unknown:
        raise InvalidValueError(f"no metric {', '.join(map(repr, unknown))} in this analysis{_hint(unknown)}; "
                                f"known: {', '.join(sorted(values))}")
    return values


def _hint(unknown: list[str]) -> str:
    """What would add the ``unknown`` metrics: a backward pass, the memory analysis."""
    if any(m.startswith(("forward_", "backward_", "recompute_")) for m in unknown):
        return " (phase metrics need --backward: a backward pass)"
    if any(m in ROOFLINE_METRICS for m in unknown):
        return " (the time and bytes on a device need --device NAME; analyze(..., device='h100'))"
    if any(m in MEMORY_METRICS for m in unknown):
        saved = ", and --backward for saved_bytes" if "saved_bytes" in unknown else ""
        return (f" (memory metrics come with the memory analysis: --memory{saved}; "
                f"analyze(..., memory=True{', backward=True' if saved else ''}))")
    return ""
