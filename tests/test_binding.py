"""Formulas that read arguments by name (handles/binding.py): placement, defaults, errors, and the tables' formulas
checked against independent hand counts."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from model_helpers import Fn
from modelmeter import FlopCountAnalysis, TensorMeta
from modelmeter.engine.metadata import flat_outputs, place_arguments
from modelmeter.handles import attention, fvcore, products
from modelmeter.handles.binding import BoundFormula, Formula, bind_all, by_name
from modelmeter.handles.conventions import CONVENTIONS, get_convention, register_handle, unregister_handle
from opaque_ops import scale_op

PROPERTY = settings(max_examples=40, deadline=None)
A = torch.ops.aten


def meta(*shape: int) -> TensorMeta:
    return TensorMeta(tuple(shape), "float32", "cpu")


@by_name(mat1=("batch1", "mat"))
def _product(mat1: Any, beta: Any, alpha: Any, *, result: Any) -> tuple[Any, Any, Any, Any]:
    return mat1, beta, alpha, result


# --- placement ------------------------------------------------------------------------------------------
def test_keyword_only_arguments_are_read_where_the_recorder_placed_them() -> None:
    """``beta``/``alpha`` are keyword-only in ``addmm``'s schema; placed at their positions, they are read by name."""
    c, a, b = torch.randn(5), torch.randn(3, 4), torch.randn(4, 5)
    inputs = place_arguments(A.addmm.default._schema, (c, a, b), {"alpha": 2, "beta": 0.5})
    out = flat_outputs(A.addmm.default(c, a, b, beta=0.5, alpha=2))
    assert _product.bind("aten::addmm")(inputs, out) == (inputs[1], 0.5, 2, out[0])


def test_each_overload_is_read_by_its_own_schema() -> None:
    """``addmm.dtype`` puts ``out_dtype`` where ``addmm`` has ``beta``: the number of arguments tells them apart."""
    c, a, b = torch.randn(5), torch.randn(3, 4), torch.randn(4, 5)
    inputs = place_arguments(A.addmm.dtype._schema, (c, a, b, torch.float32), {"beta": 0.5, "alpha": 3})
    assert len(inputs) == 6
    _, beta, alpha, _ = _product.bind("aten::addmm")(inputs, [])
    assert (beta, alpha) == (0.5, 3)


def test_aliases_name_the_same_argument_in_other_operators() -> None:
    c, a, b = meta(2, 3, 5), meta(2, 3, 4), meta(2, 4, 5)
    assert _product.bind("aten::baddbmm")([c, a, b, 0, 0.125], [c])[:3] == (a, 0, 0.125)
    assert _product.bind("aten::addmv")([meta(3), meta(3, 4), meta(4), 1, 1], [meta(3)])[0] == meta(3, 4)


def test_an_out_overload_is_chosen_only_when_nothing_else_fits() -> None:
    """``max.other(self, other)`` and ``max.unary_out(self, *, out)`` both take two arguments."""

    @by_name
    def other_of(other: Any = None) -> Any:
        return other

    handle = other_of.bind("aten::max")
    assert handle([meta(3), meta(3)], [meta(3)]) == meta(3)
    assert handle([meta(3), 1, False], [meta(1)]) is None  # max.dim has no ``other``: the formula's default


def test_result_and_outputs() -> None:
    @by_name
    def both(*, result: Any, outputs: list[Any]) -> tuple[Any, list[Any]]:
        return result, outputs

    handle = both.bind("aten::mm")
    assert handle([meta(2, 3), meta(3, 4)], [meta(2, 4), meta(1)]) == (meta(2, 4), [meta(2, 4), meta(1)])
    assert handle([meta(2, 3), meta(3, 4)], []) == (None, [])


def test_a_backward_key_reads_its_forward_call() -> None:
    @by_name
    def causal(is_causal: Any) -> Any:
        return is_causal

    q = meta(1, 2, 8, 4)
    assert causal.bind("backward:aten::scaled_dot_product_attention")([q, q, q, None, 0.0, True, None, False], [])


def test_spelled_out_arguments_for_an_operator_without_a_schema() -> None:
    @by_name(arguments=("query", "key", "value", "score_mod", "block_mask"))
    def mask_of(block_mask: Any = None) -> Any:
        return block_mask

    handle = mask_of.bind("aten::flex_attention")
    assert handle([meta(1), meta(1), meta(1), None, [1, 2], 0.5], []) == [1, 2]
    assert handle([meta(1), meta(1), meta(1)], []) is None


def test_bind_all_binds_formulas_and_keeps_everything_else() -> None:
    def raw(inputs: list[Any], outputs: list[Any]) -> int:
        return 1

    table = bind_all({"aten::addmm": _product, "aten::relu": raw, "aten::view": None})
    assert isinstance(table["aten::addmm"], BoundFormula) and table["aten::addmm"].op == "aten::addmm"
    assert table["aten::relu"] is raw and table["aten::view"] is None
    assert _product.bind("aten::addmm") is table["aten::addmm"]  # bound once per operator


# --- defaults -------------------------------------------------------------------------------------------
def test_an_argument_the_call_did_not_place_takes_the_schema_default() -> None:
    """A user-level call that passed only its positional arguments records only those: ``beta``/``alpha`` are 1."""
    a, b, c = meta(3, 4), meta(4, 5), meta(5)
    assert _product.bind("aten::addmm")([c, a, b], [meta(3, 5)])[:3] == (a, 1, 1)


def test_the_formula_default_stands_for_an_argument_the_operator_lacks_or_left_out() -> None:
    @by_name
    def flag(input: Any, training: Any = "unset") -> Any:
        return training

    # _batch_norm_with_update has no ``training``; native_batch_norm's is placed; its no_stats overload has it at 3
    x, w = meta(2, 3, 4), meta(3)
    assert flag.bind("aten::_batch_norm_with_update")([x, w, w, w, w, 0.1, 1e-5], []) == "unset"
    assert flag.bind("aten::native_batch_norm")([x, w, w, w, w, False, 0.1, 1e-5], []) is False
    assert flag.bind("aten::_native_batch_norm_legit")([x, w, w, False, 0.1, 1e-5], []) is False

    @by_name
    def scale(grad_output: Any, scale_grad_by_freq: Any = "unset") -> Any:
        return scale_grad_by_freq

    # no schema default: a short call takes the formula's
    assert scale.bind("aten::embedding_dense_backward")([meta(2, 4), meta(2)], []) == "unset"


# --- errors ---------------------------------------------------------------------------------------------
def test_an_argument_the_operator_does_not_have_is_an_error_naming_both() -> None:
    @by_name
    def typo(self: Any, mat_2: Any) -> int:
        return 0

    with pytest.raises(TypeError, match=r"typo reads argument 'mat_2', which aten::mm does not have.*mat2"):
        typo.bind("aten::mm")


def test_a_missing_argument_without_a_default_is_an_error_naming_the_operator_and_argument() -> None:
    @by_name
    def needs(self: Any, mat2: Any) -> int:
        return 0

    handle = needs.bind("aten::mm")
    with pytest.raises(TypeError, match=r"aten::mm: needs needs argument 'mat2'.*\(1 argument\)"):
        handle([meta(2, 3)], [])
    assert handle([meta(2, 3), meta(3, 4)], []) == 0


def test_an_operator_this_torch_lacks_fails_when_called() -> None:
    @by_name
    def anything(x: Any) -> int:
        return 0

    handle = anything.bind("mylib::not_registered")  # tables name operators of other versions and devices
    with pytest.raises(TypeError, match=r"mylib::not_registered: anything .* no schema for mylib::not_registered"):
        handle([meta(1)], [])


def test_an_operator_registered_after_binding_is_found_when_called() -> None:
    """A table is bound once per process, maybe before the operators it names exist (torch.distributed's fsdp::
    operators are registered when FSDP is first imported, by a parallel analysis after a plain one)."""
    @by_name
    def width(x: Any, n: int = 1) -> int:
        return int(x.shape[-1]) * n

    handle = width.bind("modelmeter_test::later")
    with pytest.raises(TypeError, match="no schema for modelmeter_test::later"):
        handle([meta(2, 3)], [])
    library = torch.library.Library("modelmeter_test", "DEF")
    try:
        library.define("later(Tensor x, int n=2) -> Tensor")
        assert handle([meta(2, 3)], []) == 6  # the schema's default, read now
        assert handle([meta(2, 3), 5], []) == 15
    finally:
        library._destroy()


@pytest.mark.parametrize("signature", ["*args", "**kwargs", "x, /", "*, other"])
def test_parameters_must_name_arguments_or_outputs(signature: str) -> None:
    namespace: dict[str, Any] = {}
    exec(f"def bad({signature}): return 0", namespace)
    with pytest.raises(TypeError, match="bad: parameter"):
        by_name(namespace["bad"])


def test_aliases_of_missing_parameters_are_an_error() -> None:
    with pytest.raises(TypeError, match="aliases for parameters it does not have: mat1"):
        by_name(mat1="batch1")(lambda self: 0)


# --- a registered formula for a custom operator --------------------------------------------------------
scale = scale_op("modelmeter_binding_test")


def test_register_handle_binds_a_formula_to_the_custom_operators_schema() -> None:
    @by_name
    def scale_flops(factor: float, *, result: Any) -> int:
        return 0 if factor == 1 else result.numel()  # multiplying by 1 is free

    register_handle("modelmeter_binding_test::scale", scale_flops)
    try:
        model = Fn(lambda t, f: scale(t, f))
        assert FlopCountAnalysis(model, (torch.randn(2, 5), 2.0)).by_operator() == Counter({"scale": 10})
        assert FlopCountAnalysis(model, (torch.randn(2, 5), 1.0)).total() == 0
    finally:
        unregister_handle("modelmeter_binding_test::scale")


# --- every table's formulas name real arguments ---------------------------------------------------------
def _bound_formulas() -> list[tuple[Formula[Any], str]]:
    """(formula, operator) of every formula in every convention's table and fvcore's activation table."""
    found: list[tuple[Formula[Any], str]] = []
    tables = [get_convention(c).handles for c in CONVENTIONS] + [fvcore.ACTIVATION_HANDLES]
    for table in tables:
        found.extend((entry.formula, entry.op) for entry in table.values() if isinstance(entry, BoundFormula))
    found.extend((cost, op) for op, (cost, _) in products.COSTS.items())
    found.extend((parse, op) for op, (parse, _) in attention.KERNELS.items())
    return found


def test_every_parameter_names_an_argument_of_an_operator_it_is_bound_to() -> None:
    """A parameter with a default must still be an argument somewhere (a misspelt one would always default);
    formulas made by one factory (``grid_sampler_backward_counter(2)``) count as one."""
    seen: dict[str, tuple[Formula[Any], set[str]]] = {}
    for formula, op in _bound_formulas():
        overloads = formula.bind(op).overloads
        if overloads is not None:
            key = f"{formula.fn.__module__}.{formula.fn.__qualname__}"
            seen.setdefault(key, (formula, set()))[1].update(a.name for o in overloads for a in o.arguments)
    assert len(seen) > 40
    for key, (formula, names) in seen.items():
        for parameter in formula.parameters:
            assert set(parameter.aliases) & names, (key, parameter.name)


# --- converted formulas against independent counts -------------------------------------------------------
@st.composite
def convolutions(draw: Any) -> dict[str, Any]:
    dims = draw(st.integers(1, 3))
    groups = draw(st.integers(1, 3))
    return {
        "dims": dims, "groups": groups, "n": draw(st.integers(1, 2)),
        "cin": groups * draw(st.integers(1, 3)), "cout": groups * draw(st.integers(1, 3)),
        "kernel": [draw(st.integers(1, 3)) for _ in range(dims)],
        "size": [draw(st.integers(3, 7)) for _ in range(dims)],
        "stride": [draw(st.integers(1, 2)) for _ in range(dims)],
        "padding": [draw(st.integers(0, 1)) for _ in range(dims)],
        "dilation": [draw(st.integers(1, 2)) for _ in range(dims)],
        "transposed": draw(st.booleans()), "bias": draw(st.booleans()),
    }


@PROPERTY
@given(convolutions())
def test_convolution_formula_equals_the_hand_count(c: dict[str, Any]) -> None:
    """``aten::convolution`` in every convention: ``N · C_out · out_spatial · (C_in/groups) · K`` multiply-adds
    (transposed: ``N · C_in · in_spatial · (C_out/groups) · K``), plus a bias add per output under ``flops``."""
    dims, groups, kernel = c["dims"], c["groups"], c["kernel"]
    reach = [d * (k - 1) + 1 for d, k in zip(c["dilation"], kernel, strict=True)]
    size = [max(s, r) for s, r in zip(c["size"], reach, strict=True)]
    x = torch.empty(c["n"], c["cin"], *size, device="meta")
    if c["transposed"]:
        w = torch.empty(c["cin"], c["cout"] // groups, *kernel, device="meta")
    else:
        w = torch.empty(c["cout"], c["cin"] // groups, *kernel, device="meta")
    bias = torch.empty(c["cout"], device="meta") if c["bias"] else None
    args = (x, w, bias, c["stride"], c["padding"], c["dilation"], c["transposed"], [0] * dims, groups)
    out = A.convolution.default(*args)
    per_position = (c["cin"] // groups) * c["cout"] * math.prod(kernel)
    positions = math.prod(size if c["transposed"] else out.shape[-dims:])
    macs = c["n"] * per_position * positions
    inputs, outputs = place_arguments(A.convolution.default._schema, args, {}), flat_outputs(out)
    for convention in CONVENTIONS:
        handle = products.handles(convention)["aten::convolution"]
        assert callable(handle)
        expected = 2 * macs + out.numel() * c["bias"] if convention == "flops" else macs
        assert handle(inputs, outputs) == Counter({"conv": expected})


@PROPERTY
@given(st.integers(1, 4), st.integers(1, 6), st.integers(1, 6), st.integers(1, 6),
       st.sampled_from([0, 1, 0.5]), st.sampled_from([1, 2, 0.125]), st.booleans())
def test_addmm_and_bmm_formulas_equal_the_hand_count(b: int, m: int, k: int, n: int, beta: float, alpha: float,
                                                     batched: bool) -> None:
    """``addmm``/``baddbmm``: ``(b·)m·n·k`` multiply-adds (``FlopCounterMode`` counts twice that), plus under
    ``flops`` per output element the add (beta not 0), beta's multiply (not 0 or 1) and alpha's (not 1)."""
    lead = [b] if batched else []
    op, fn = (A.baddbmm.default, "aten::baddbmm") if batched else (A.addmm.default, "aten::addmm")
    c, x, y = torch.randn(*lead, m, n), torch.randn(*lead, m, k), torch.randn(*lead, k, n)
    with FlopCounterMode(display=False) as counter:
        out = op(c, x, y, beta=beta, alpha=alpha)
    inputs, outputs = place_arguments(op._schema, (c, x, y), {"beta": beta, "alpha": alpha}), flat_outputs(out)
    macs = (b if batched else 1) * m * n * k
    assert 2 * macs == counter.get_total_flops()
    terms = (beta != 0) + (beta not in (0, 1)) + (alpha != 1)
    assert products.handles("macs")[fn](inputs, outputs) == macs  # type: ignore[operator]
    assert products.handles("flops")[fn](inputs, outputs) == 2 * macs + terms * out.numel()  # type: ignore[operator]
    # bmm: the same product without the added term
    bmm_in = place_arguments(A.bmm.default._schema, (x.reshape(-1, m, k), y.reshape(-1, k, n)), {})
    bmm_out = flat_outputs(A.bmm.default(x.reshape(-1, m, k), y.reshape(-1, k, n)))
    assert products.handles("fvcore")["aten::bmm"](bmm_in, bmm_out) == macs  # type: ignore[operator]


def test_set_op_handle_binds_a_formula_by_name() -> None:
    """A user's formula over named arguments, bound to fvcore's ``aten::linear`` key: it reads ``weight`` where that
    operator's schema puts it."""
    @by_name
    def weight_rows_times_batch(input: Any, weight: Any, *, result: Any) -> int:
        return input.shape[0] * weight.shape[0]

    model = nn.Sequential(nn.Linear(8, 5), nn.Linear(5, 3))
    flops = FlopCountAnalysis(model, torch.randn(4, 8)).set_op_handle("aten::linear", weight_rows_times_batch)
    assert flops.by_operator() == {"linear": 4 * 5 + 4 * 3}
