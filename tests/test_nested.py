"""Nested tensors as inputs. A jagged one (``layout=torch.jagged``) counts as the sum over its sequences: every
operator on it is recorded as the dense operators its implementation runs on the packed values, attention as one
call per sequence. Oracles: the analysis of each sequence on its own (a dense batch of one), summed, and hand
counts. What cannot be counted is one clear error naming the module and the operator."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from modelmeter import ModelRunError, analyze

SEQUENCES = [(3, 8), (5, 8), (1, 8)]
TOKENS = sum(length for length, _ in SEQUENCES)


def _jagged(requires_grad: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    sequences = [torch.randn(*shape) for shape in SEQUENCES]
    return torch.nested.nested_tensor(sequences, layout=torch.jagged, requires_grad=requires_grad), sequences


def _numbers(model: nn.Module, inputs: Any, **options: Any) -> dict[str, Any]:
    a = analyze(model, inputs, quiet=True, **options)
    return {"flops": a.flops.total(), "phases": a.flops.by_phase(), "activations": a.activations.total(),
            "by_module": a.flops.by_module()}


def _summed(model: nn.Module, sequences: list[torch.Tensor], **options: Any) -> dict[str, Any]:
    """The oracle: the analysis of each sequence as a dense batch of one, summed."""
    each = [_numbers(model, s.unsqueeze(0), **options) for s in sequences]
    phases = {phase: sum(n["phases"][phase] for n in each) for phase in each[0]["phases"]}
    by_module = {name: sum(n["by_module"][name] for n in each) for name in each[0]["by_module"]}
    return {"flops": sum(n["flops"] for n in each), "phases": phases,
            "activations": sum(n["activations"] for n in each), "by_module": by_module}


def _mlp() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))


@pytest.mark.parametrize("convention", ["fvcore", "flops"])
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("execution", ["auto", "real"])
def test_a_jagged_input_counts_as_the_sum_over_its_sequences(execution: str, backward: bool,
                                                             convention: str) -> None:
    nested, sequences = _jagged()
    model = _mlp()
    ours = _numbers(model, nested, execution=execution, backward=backward, convention=convention)
    assert ours == _summed(model, sequences, backward=backward, convention=convention)
    if convention == "fvcore":  # by hand: two linear layers over every token, fvcore's 5 per layer-norm element
        assert ours["phases"]["forward"] == TOKENS * (8 * 16 + 16 * 4) + 5 * TOKENS * 16
        assert ours["activations"] == TOKENS * (16 + 4)


def test_the_run_on_a_jagged_input_says_it_ran_real_kernels() -> None:
    nested, _ = _jagged()
    analysis = analyze(_mlp(), nested, quiet=True, memory=True)
    assert any("jagged nested tensor" in a for a in analysis.flops.assumptions())
    assert analysis.memory is not None and analysis.memory.peak() > 0
    assert analysis.flops.trace.inputs[0].shape == (TOKENS, 8)  # described by its packed values


class JaggedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (project(x).unflatten(-1, (2, 4)).transpose(1, 2) for project in (self.q, self.k, self.v))
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(-2)


def test_attention_on_a_jagged_input_is_counted_per_sequence() -> None:
    nested, sequences = _jagged()
    model = JaggedAttention()
    ours = analyze(model, nested, quiet=True, convention="macs").flops
    assert ours.total() == _summed(model, sequences, convention="macs")["flops"]
    # by hand: each sequence attends to itself only (L² pairs, 2 heads, 4 + 4 products a pair)
    assert ours.by_operator()["scaled_dot_product_attention"] == sum(2 * n * n * 8 for n, _ in SEQUENCES)


def test_the_backward_of_attention_on_a_jagged_input_is_a_clear_error() -> None:
    nested, _ = _jagged()
    with pytest.raises(ModelRunError, match=r"JaggedAttention.forward at operator "
                                            r"aten::scaled_dot_product_attention: .*backward pass of attention on "
                                            r"jagged nested tensors"):
        analyze(JaggedAttention(), nested, quiet=True, backward=True)


def test_jagged_inputs_need_real_kernels() -> None:
    nested, _ = _jagged()
    with pytest.raises(ValueError, match="jagged nested tensor inputs need real kernels.*execution='auto' or 'real'"):
        analyze(_mlp(), nested, execution="fake", quiet=True)
    with torch.device("meta"):
        meta_model = _mlp()
    with pytest.raises(ValueError, match="not on the meta device"):
        analyze(meta_model, nested, quiet=True)


def test_a_strided_nested_input_is_refused_by_name() -> None:
    strided = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)])
    with pytest.raises(TypeError, match=r"inputs\[0\]\['x'\]: a nested tensor of strided layout .*layout=torch.jagged"):
        analyze(_mlp(), ({"x": strided},), quiet=True)
    with pytest.raises(TypeError, match=r"^inputs\[0\]: a nested tensor of strided layout"):
        analyze(_mlp(), strided, quiet=True)


class MakesStridedNested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.nested.as_nested_tensor(list(x.unbind())))


def test_an_operator_on_a_strided_nested_tensor_inside_the_model_is_a_clear_error() -> None:
    # the operator that made it is named: what runs on it afterwards could not be counted
    with pytest.raises(ModelRunError, match=r"MakesStridedNested.forward at operator "
                                            r"aten::_nested_tensor_from_tensor_list: NestedLayoutError: "
                                            r"a nested tensor of strided layout"):
        analyze(MakesStridedNested(), torch.randn(2, 3, 8), quiet=True, execution="real")
