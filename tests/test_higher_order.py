"""Higher-order operators are counted as their bodies' operators run, as torch's eager kernels run them, or refused
by name: never a silent zero (engine/higher_order.py). Hand arithmetic is the oracle (torch's FlopCounterMode counts
a loop's body once, and the larger branch of a conditional whichever runs)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from modelmeter import ModelRunError, UnsupportedError, analyze


def _hop(name: str) -> object:
    """The higher-order operator ``name`` of this torch, or a clean skip."""
    if not hasattr(torch.ops.higher_order, name):
        pytest.skip(f"this torch has no higher-order operator {name}")
    return getattr(torch.ops.higher_order, name)


def _python_api(module: str, name: str) -> object:
    """torch's user-facing function for a higher-order operator, or a clean skip."""
    found = getattr(pytest.importorskip(module, reason=f"this torch has no {module}"), name, None)
    if found is None:
        pytest.skip(f"this torch has no {module}.{name}")
    return found


class _Loop(nn.Module):
    """``while_loop``: a layer applied ``n`` times, ``n`` a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        while_loop = _python_api("torch._higher_order_ops.while_loop", "while_loop")
        return while_loop(lambda i, y: i < n, lambda i, y: (i + 1, self.layer(y)),  # type: ignore[operator]
                          (torch.zeros((), dtype=torch.int64), x))[1]


class _Scan(nn.Module):
    """``scan``: a recurrence over the rows of ``x``."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scan = _python_api("torch._higher_order_ops.scan", "scan")

        def step(carry: torch.Tensor, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = self.layer(carry) + row
            return y, y.clone()

        return scan(step, x[0], x)[1]  # type: ignore[operator]


class _Map(nn.Module):
    """``map``: a layer on every row of ``x``."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _python_api("torch._higher_order_ops.map", "map")(self.layer, x)  # type: ignore[operator]


class _Cond(nn.Module):
    """``torch.cond`` on the sign of an activation: a layer, or a copy."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, self.layer, lambda x: x.clone(), (x,))


def _cases() -> list[tuple[str, nn.Module, tuple[torch.Tensor, ...], int]]:
    x = torch.randn(5, 8)
    return [("while_loop", _Loop(), (torch.randn(4, 8), torch.tensor(3)), 3 * 4 * 8 * 8),
            ("scan", _Scan(), (x,), 5 * 8 * 8),
            ("map_impl", _Map(), (x,), 5 * 8 * 8),
            ("cond", _Cond(), (x.abs(),), 5 * 8 * 8)]


@pytest.mark.parametrize("exported", [False, True], ids=["eager", "exported"])
@pytest.mark.parametrize("case", range(4), ids=["while_loop", "scan", "map", "cond"])
def test_a_higher_order_operator_counts_the_work_its_body_does(case: int, exported: bool) -> None:
    # Set aside with the recorders, their bodies ran unseen (a silent zero); eager ones failed inside dynamo's trace
    # of the recorders ("Observed exception").
    name, model, inputs, expected = _cases()[case]
    _hop(name)
    if exported:
        model = torch.export.export(model, inputs).module()
    analysis = analyze(model, inputs, convention="macs", execution="real", quiet=True)
    assert analysis.flops.total() == expected
    assert f"aten::{name}" in {event.op for event in analysis.trace.events}


def test_a_loop_that_never_runs_counts_nothing_and_a_longer_one_more() -> None:
    _hop("while_loop")
    x = torch.randn(4, 8)
    exported = torch.export.export(_Loop(), (x, torch.tensor(3))).module()
    for n in (0, 1, 5):
        analysis = analyze(exported, (x, torch.tensor(n)), convention="macs", execution="real", quiet=True)
        assert analysis.flops.total() == n * 4 * 8 * 8


class _Opaque(nn.Module):
    """A higher-order operator with no eager runner here, called the way an exported program calls one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scan = _hop("associative_scan")
        return scan(lambda a, b: a @ b, (x,), ())[0]  # type: ignore[operator]


def test_a_higher_order_operator_not_counted_is_refused_by_name() -> None:
    # (it ran set aside with the recorders, no rule for it: a silent zero)
    with pytest.raises(ModelRunError, match="the higher-order operator associative_scan cannot be counted") as raised:
        analyze(_Opaque(), (torch.randn(4, 3, 3),), execution="real", quiet=True)
    assert isinstance(raised.value.__cause__, UnsupportedError)


class _Direct(nn.Module):
    """Higher-order operators called as an exported program's graph calls them."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.layer = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op = _hop(self.name)
        if self.name == "invoke_subgraph":
            return op(self.layer, "layer", op(self.layer, "layer", x))  # type: ignore[operator]
        n = torch.tensor(3)
        return op(lambda i, y: i < n, lambda i, y: (i + 1, self.layer(y)),  # type: ignore[operator]
                  (torch.zeros((), dtype=torch.int64), x), ())[1]


@pytest.mark.parametrize(("name", "calls"), [("invoke_subgraph", 2), ("while_loop_stack_output", 3)])
def test_a_higher_order_operator_called_directly_counts_every_call_of_its_body(name: str, calls: int) -> None:
    analysis = analyze(_Direct(name), (torch.randn(5, 8),), convention="macs", execution="real", quiet=True)
    assert analysis.flops.total() == calls * 5 * 8 * 8


class _Printing(nn.Module):
    """torch's ``print`` higher-order operator, which does no work, beside a product."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _hop("print")("x is {x}", x=x)  # type: ignore[operator]
        return x @ x.T


def test_a_higher_order_operator_that_does_no_work_is_not_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # (capsys: the operator prints)
    analysis = analyze(_Printing(), (torch.ones(4, 8),), convention="macs", execution="real", quiet=True)
    assert analysis.flops.total() == 4 * 4 * 8


@pytest.mark.parametrize("exported", [False, True], ids=["eager", "exported"])
def test_a_loops_backward_pass_counts_every_iteration(exported: bool) -> None:
    # 3 iterations of a 4x8 @ 8x8 product: forward 3 * 256; weight gradients 3 * 256; input gradients for the two
    # iterations whose input came from the layer (the caller's x needs none) 2 * 256.
    _hop("while_loop")
    model: nn.Module = _Loop()
    inputs = (torch.randn(4, 8), torch.tensor(3))
    if exported:
        model = torch.export.export(model, inputs).module()
    analysis = analyze(model, inputs, convention="macs", execution="real", backward=True, quiet=True)
    assert analysis.flops.total() == (3 + 3 + 2) * 4 * 8 * 8
