"""Budgets: ``flops=4.2G,params=26M,activations=12M`` — upper limits on a model's costs."""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from ..errors import InvalidTypeError, InvalidValueError
from ..reports.format import parse_duration
from ..reports.render import format_metric
from ..reports.result import MEMORY_METRICS, RATIO_METRICS, ROOFLINE_METRICS, TIME_METRICS, Result
from .values import MAX_AMOUNT, check_amount, percent, shorten, with_exact

_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
_BINARY = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "pi": 2**50}


def parse_quantity(text: str) -> float:
    """``"4.2G"`` -> 4200000000, ``"26M"`` -> 26000000, ``"2GiB"`` -> 2·2³⁰, ``"1500"`` -> 1500, ``"3e+9"`` ->
    3000000000 (K/M/G/T/P are powers of 1000, Ki/Mi/Gi/Ti/Pi of 1024; a trailing ``B`` is allowed). The amount is
    exact: an int when it is a whole number (``"1.001G"`` is 1001000000, where 1.001 * 1e9 in floats is just
    below it and a cost at the budget would be over it), else the nearest float. A ``ValueError`` for anything
    else, and for an amount over :data:`~modelmeter.guard.values.MAX_AMOUNT` (``1e400``)."""
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(e[+-]?[0-9]+)?\s*([kmgtp]i?)?b?", text.strip().lower())
    if match is None:
        raise InvalidValueError(f"not a quantity: {text!r} (e.g. 4.2G, 26M, 2GiB, 1500)")
    number, exponent, unit = match.groups()
    if exponent and (len(exponent) > 6 or abs(int(exponent[1:])) > 400):  # no exact Fraction of 10**99999999
        raise InvalidValueError(f"out of range: {shorten(text)} (from 0 to {MAX_AMOUNT:g})")
    unit = unit or ""
    value = Fraction(number + (exponent or "")) * (_BINARY[unit] if unit.endswith("i") else _DECIMAL[unit])
    if value > MAX_AMOUNT:
        raise InvalidValueError(f"out of range: {text!r} is over {MAX_AMOUNT:g}")
    return int(value) if value.denominator == 1 else float(value)


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
        if metric.lower() in RATIO_METRICS:
            raise InvalidValueError(f"{metric} is a ratio, not a cost: budget the time or the bytes instead")
        try:
            budget[metric] = parse_duration(amount) if metric.lower() in TIME_METRICS else parse_quantity(amount)
            check_amount(budget[metric], "the amount")  # (a duration of 1e31 s is a float parse_duration takes)
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
        share = f" ({percent(excess / self.limit)})" if self.limit else ""
        value, limit = (with_exact(self.metric, amount) for amount in (self.value, self.limit))
        by = format_metric(self.metric, excess)
        return f"{self.metric}: {value} is over the budget of {limit} by {by}{share}"


def metric_values(result: Result) -> dict[str, float]:
    """The model's totals by metric name: every metric of the result, ``params`` (the model's ``peak_memory``
    is the run's peak), and with a backward pass ``recompute_*``, 0 without activation checkpointing. Counts
    stay ints: as floats, two counts over 2**53 could round to one."""
    return with_recompute({"params": result.root.params, **{m: result.total(m) for m in result.metrics}})


def with_recompute(values: dict[str, float]) -> dict[str, float]:
    """``values`` (metric -> amount) with ``recompute_*`` for every ``backward_*``: a backward pass without
    activation checkpointing recomputes nothing, so its recompute_* are 0, not missing (a budget of them checks
    0; a baseline holds 0, and a run that starts recomputing has grown). The one place this rule lives."""
    implied = ("recompute_" + metric.removeprefix("backward_") for metric in values if metric.startswith("backward_"))
    return {**values, **{metric: 0 for metric in implied if metric not in values}}


def check_budget(result: Result, budget: Budget) -> list[Over]:
    """The metrics of ``result`` over ``budget``; an unknown metric is a :class:`ValueError` naming the known ones,
    a limit that is not a finite number >= 0 a ``TypeError`` / ``ValueError`` naming it."""
    if not isinstance(budget, dict):
        raise InvalidTypeError("budget must be a dict of metric -> limit (see parse_budget), got "
                               f"{type(budget).__name__}")
    for metric, limit in budget.items():
        check_amount(limit, f"budget[{metric!r}]")
    values = _budgeted_values(result, budget)
    limits = {metric: exact_amount(limit) for metric, limit in budget.items()}
    return [Over(m, values[m], limit) for m, limit in limits.items() if values[m] > limit]


def exact_amount(limit: float) -> float:
    """A limit given as a float that spells a whole number, as that integer (``1e23`` -> 10**23, where the float
    is 99,999,999,999,999,991,611,392): as :func:`parse_quantity`'s amounts, a count exactly at it is within it,
    and what it is over by is exact. Any other limit as it is."""
    if type(limit) is not float:
        return limit
    spelled = Fraction(repr(limit))
    return int(spelled) if spelled.denominator == 1 else limit


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
        raise InvalidValueError(f"no metric {', '.join(map(repr, unknown))} in this analysis"
                                f"{missing_metrics_hint(unknown)}; known: {', '.join(sorted(values))}")
    for metric in budget:  # NaN is over no limit and a negative count is under every one
        try:
            check_amount(values[metric], f"this run's {metric}")
        except ValueError as exc:
            raise InvalidValueError(f"{exc}: a registered handle returned it, and no budget can judge it") from None
    return values


def missing_metrics_hint(unknown: list[str]) -> str:
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
