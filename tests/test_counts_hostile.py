"""Counts on cases the other tests never saw: integer products, unknown operators reported once per call.

Oracles: hand arithmetic on small shapes, and the number of calls the model makes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from model_helpers import Fn
from modelmeter import FlopCountAnalysis


def analysis(model: nn.Module, inputs: Any, convention: str = "fvcore", **options: Any) -> FlopCountAnalysis:
    flops = FlopCountAnalysis(model, inputs, convention=convention, **options)
    return flops.unsupported_ops_warnings(False).uncalled_modules_warnings(False)


@pytest.mark.parametrize("execution", ["auto", "real"])
@pytest.mark.parametrize(("convention", "per_mac"), [("fvcore", 1), ("macs", 1), ("flops", 2)])
def test_int8_products_are_counted(execution: str, convention: str, per_mac: int) -> None:
    # torch._int_mm's result is int32: an integer result must not make a product free (it was a silent zero)
    a = torch.randint(-4, 4, (32, 24), dtype=torch.int8)
    b = torch.randint(-4, 4, (24, 16), dtype=torch.int8)
    flops = analysis(Fn(torch._int_mm), (a, b), convention, execution=execution)
    assert flops.by_operator() == {"_int_mm": per_mac * 32 * 24 * 16}
    assert not flops.unsupported_ops()


@pytest.mark.parametrize(("convention", "expected"), [("macs", 4 * 32 * 16), ("flops", 2 * 4 * 32 * 16 + 4 * 16)])
def test_int8_weight_product_counts_its_scale(convention: str, expected: int) -> None:
    # (4, 32) activations times an int8 weight (16, 32) with one scale per output channel
    x, w = torch.randn(4, 32), torch.randint(-4, 4, (16, 32), dtype=torch.int8)
    flops = analysis(Fn(torch._weight_int8pack_mm), (x, w, torch.rand(16)), convention)
    assert flops.by_operator() == {"_weight_int8pack_mm": expected}


@pytest.mark.parametrize("backward", [False, True])
def test_an_unknown_call_is_reported_once_per_call(backward: bool) -> None:
    # torch.linalg.inv runs linalg_inv_ex and _linalg_check_errors: three calls are three reports, not six
    def inverses(x: torch.Tensor) -> torch.Tensor:
        return sum((torch.linalg.inv(x + i * torch.eye(4)) for i in range(3)), torch.zeros(4, 4))

    x = torch.randn(4, 4) + 8 * torch.eye(4)
    unsupported = analysis(Fn(inverses), (x.requires_grad_(backward),), backward=backward).unsupported_ops()
    assert unsupported["aten::linalg_inv"] == 3
    assert "aten::_linalg_check_errors" not in unsupported


def test_calls_reported_once_inside_modules() -> None:
    # each module's report is the calls made under it
    class Solve(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.linalg.solve(a, b)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = Solve(), Solve()

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return self.second(a, self.first(a, b))

    a = torch.randn(3, 3) + 6 * torch.eye(3)
    flops = analysis(Twice(), (a, torch.randn(3, 2)))
    assert flops.unsupported_ops() == {"aten::linalg_solve": 2}
    assert flops.unsupported_ops("first") == {"aten::linalg_solve": 1}
