"""fvcore semantics of the analysis objects: names, attribution, caching, settings, inputs, errors."""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

from modelmeter import (
    ActivationCountAnalysis,
    Args,
    FlopCountAnalysis,
    ModelRunError,
    TensorMeta,
    activation_count,
    flop_count,
    parameter_count,
)
from opaque_ops import blur, mix, warp

# Linear(10, 10) on one row is 10 * 10 = 100 multiply-adds.
LINEAR_FLOPS = 100


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class SharedModules(nn.Module):
    """The model of fvcore's verified alias example (reference doc §1.7)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Inner()
        self.b = Inner()
        self.b.fc = self.a.fc
        lin = nn.Linear(10, 10)
        self.alias1 = lin
        self.alias2 = lin
        self.unused = nn.Linear(10, 10)
        self.ml = nn.ModuleList([nn.Linear(10, 10)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x) + self.b(x)
        x = self.alias1(x) + self.alias2(x)
        return self.ml[0](x)


def quiet(analysis):
    return analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False)


def test_owner_mode_matches_fvcore_alias_example() -> None:
    flops = quiet(FlopCountAnalysis(SharedModules(), torch.randn(1, 10)))
    assert dict(flops.by_module()) == {"": 500, "a": 200, "a.fc": 200, "b": 0, "alias1": 200, "unused": 0,
                                       "ml": 100, "ml.0": 100}
    assert flops.uncalled_modules() == {"unused"}
    assert flops.canonical_module_name("b.fc") == "a.fc"
    assert flops.canonical_module_name("alias2") == "alias1"
    assert flops.total("b.fc") == 2 * LINEAR_FLOPS


def test_caller_mode_matches_fvcore_alias_example_and_recomputes_without_retracing() -> None:
    flops = quiet(FlopCountAnalysis(SharedModules(), torch.randn(1, 10)))
    flops.total()
    trace = flops.trace
    flops.ancestor_mode("caller")
    assert dict(flops.by_module()) == {"": 500, "a": 100, "a.fc": 200, "b": 100, "alias1": 200, "unused": 0,
                                       "ml": 0, "ml.0": 100}
    assert flops.uncalled_modules() == {"ml", "unused"}  # a ModuleList is never called
    assert flops.trace is trace  # the mode change recomputed from the same record


def test_unknown_module_name_is_a_clear_key_error() -> None:
    flops = FlopCountAnalysis(Inner(), torch.randn(1, 10))
    with pytest.raises(KeyError, match="not among the descendants"):
        flops.total("nope")
    with pytest.raises(TypeError, match="module_name must be a string"):
        flops.total(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Unrecognized ancestor mode"):
        flops.ancestor_mode("parent")


class Recursive(nn.Module):
    """Calls its own child twice, nested: an op must count once per module."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor, depth: int = 2) -> torch.Tensor:
        return self.fc(self(x, depth - 1)) if depth else x


def test_op_counts_once_per_module_under_recursion() -> None:
    flops = FlopCountAnalysis(Recursive(), (torch.randn(1, 10),))
    assert flops.total() == 2 * LINEAR_FLOPS
    assert flops.total("fc") == 2 * LINEAR_FLOPS
    flops.ancestor_mode("caller")
    assert flops.total() == 2 * LINEAR_FLOPS


class NonForwardNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.submod = Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.submod.forward(x)


def test_module_run_through_forward_counts_for_owner_not_caller() -> None:
    flops = quiet(FlopCountAnalysis(NonForwardNet(), torch.randn(1, 10)))
    assert flops.total("submod") == LINEAR_FLOPS
    assert flops.uncalled_modules() == set()
    flops.ancestor_mode("caller")
    assert flops.total("submod") == 0
    assert flops.uncalled_modules() == {"submod"}


def test_data_parallel_root_and_module_get_the_full_count() -> None:
    model = nn.DataParallel(nn.Linear(10, 10))
    flops = FlopCountAnalysis(model, torch.randn(10, 10))
    assert flops.total() == flops.total("module") == 1000
    assert set(flops.by_module()) == {"", "module"}
    flops.ancestor_mode("caller")
    assert flops.total("module") == 1000


class WithInnerDataParallel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.DataParallel(Inner())
        self.head = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def test_data_parallel_inside_a_model_attributes_to_its_submodules() -> None:
    model = WithInnerDataParallel()
    flops = FlopCountAnalysis(model, torch.randn(1, 10))
    assert flops.by_module() == Counter({"": 200, "backbone": 100, "backbone.module": 100,
                                         "backbone.module.fc": 100, "head": 100})
    assert "forward" not in vars(model.backbone)  # the wrapper is left as it was


def test_set_op_handle_clear_and_copy() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.Flatten(), nn.Linear(4 * 4 * 4, 2))
    x = torch.randn(1, 3, 4, 4)
    flops = quiet(FlopCountAnalysis(model, x))
    assert flops.by_operator() == Counter({"conv": 3 * 4 * 16, "linear": 64 * 2})
    flops.set_op_handle("aten::linear", lambda inputs, outputs: 7)
    assert flops.by_operator() == Counter({"conv": 192, "linear": 7})
    flops.set_op_handle(**{"aten::linear": None})
    assert flops.by_operator() == Counter({"conv": 192})
    assert flops.unsupported_ops() == Counter()
    copied = flops.copy()
    assert type(copied) is FlopCountAnalysis
    assert copied.by_operator() == Counter({"conv": 192})  # ignored op stays ignored
    assert copied.trace is flops.trace  # same model and inputs: no second run
    flops.ancestor_mode("caller")
    assert flops.copy(new_inputs=torch.randn(2, 3, 4, 4)).total() == 2 * 192
    assert flops.copy()._ancestor_mode == "caller"
    flops.clear_op_handles()
    assert flops.total() == 0
    assert flops.unsupported_ops() == Counter({"aten::_convolution": 1, "aten::linear": 1})  # fvcore's names
    with pytest.raises(TypeError, match="pairs of names and handles"):
        flops.set_op_handle("aten::linear")


def test_returned_counters_are_copies() -> None:
    flops = FlopCountAnalysis(Inner(), torch.randn(1, 10))
    flops.by_operator()["linear"] += 1
    flops.by_module_and_operator()[""]["linear"] += 1
    assert flops.total() == LINEAR_FLOPS


def test_unsupported_ops_computes_on_demand_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    class Opaque(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return blur(x) + warp(x) + mix(x)

    flops = FlopCountAnalysis(Opaque(), torch.randn(1, 1, 4, 4))
    with caplog.at_level(logging.WARNING, logger="modelmeter"):
        assert flops.unsupported_ops() == Counter({f"modelmeter_test::{op}": 1 for op in ("blur", "warp", "mix")})
        flops.total()
    assert sum("Unsupported operator" in r.message for r in caplog.records) == 3


def test_flop_count_and_activation_count_functions() -> None:
    model = nn.Sequential(nn.Conv2d(3, 10, 1), nn.ReLU(), nn.Flatten(), nn.Linear(1000, 10))
    x = torch.randn(1, 3, 10, 10)
    gflops, skipped = flop_count(model, (x,))
    assert dict(gflops) == {"conv": 3e-06, "linear": 1e-05}
    assert skipped == Counter()
    acts, _ = activation_count(model, (x,))
    assert dict(acts) == {"conv": 0.001, "linear": 1e-05}
    gflops, _ = flop_count(model, (x,), supported_ops={"aten::linear": None})
    assert dict(gflops) == {"conv": 3e-06}


def test_parameter_count_counts_shared_parameters_once() -> None:
    class NetWithReuse(nn.Module):
        def __init__(self, reuse: bool) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(100, 100, 3)
            self.conv2 = nn.Conv2d(100, 100, 3)
            if reuse:
                self.conv2.weight = self.conv1.weight

    counts = parameter_count(NetWithReuse(False))
    assert counts[""] == 180200 and counts["conv1"] == 90100 and counts["conv2.bias"] == 100
    shared = parameter_count(NetWithReuse(True))
    assert shared[""] == 90200 and shared["conv2"] == 100 and "conv2.weight" not in shared


def _parameter_count_by_definition(model: nn.Module) -> dict[str, int]:
    """fvcore's definition: every prefix of every name ``named_parameters()`` yields, in its order."""
    counts: dict[str, int] = {}
    for name, param in model.named_parameters():
        parts = name.split(".")
        for key in ["", *(".".join(parts[:i]) for i in range(1, len(parts) + 1))]:
            counts[key] = counts.get(key, 0) + param.numel()
    return counts


def test_parameter_count_is_named_parameters_by_prefix_in_its_order() -> None:
    shared = nn.Linear(3, 4)
    tied = nn.Linear(4, 4)
    tied.weight = shared.weight  # a parameter shared by two modules: under its first name
    model = nn.Sequential(shared, nn.Sequential(shared, tied, nn.ReLU()), nn.ModuleDict({"z": nn.Linear(0, 2)}))
    model.register_parameter("own", nn.Parameter(torch.ones(5)))
    model[1].register_parameter("empty", None)
    counts = parameter_count(model)
    expected = _parameter_count_by_definition(model)
    assert list(counts.items()) == list(expected.items())
    assert counts["1.1"] == 4 and "1.0" not in counts and counts["2.z.bias"] == 2 and counts["own"] == 5


class KwargsModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, *, extra: list[torch.Tensor], scale: float = 1.0) -> dict[str, torch.Tensor]:
        return {"out": self.fc(x) * scale + extra[0] @ extra[1]}


def test_inputs_as_args_kwargs_nested_lists_and_dict_outputs() -> None:
    x = torch.randn(2, 4)
    extra = [torch.randn(2, 5), torch.randn(5, 4)]
    flops = FlopCountAnalysis(KwargsModel(), Args(x, extra=extra, scale=2.0))
    assert flops.by_operator() == Counter({"linear": 2 * 4 * 4, "matmul": 2 * 5 * 4})


def test_bad_inputs_name_the_argument() -> None:
    np = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        FlopCountAnalysis(lambda x: x, torch.randn(1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"inputs\[0\] is a numpy array"):
        FlopCountAnalysis(Inner(), (np.zeros((1, 10)),))
    with pytest.raises(TypeError, match=r"Inner.forward\(x: .*too many positional"):
        FlopCountAnalysis(Inner(), (torch.randn(1, 10), torch.randn(1)))
    with pytest.raises(TypeError, match="inputs is None"):
        FlopCountAnalysis(Inner(), None)


def test_a_failing_model_names_module_and_operator() -> None:
    model = nn.Sequential(nn.Linear(10, 10), nn.Sequential(nn.Linear(3, 3)))
    flops = FlopCountAnalysis(model, torch.randn(1, 10))
    with pytest.raises(ModelRunError, match=r"module '1.0' \(Linear\) at operator aten::linear") as info:
        flops.total()
    assert info.value.module == "1.0" and info.value.operator == "aten::linear"


class Stateful(nn.Module):
    """Updates BatchNorm statistics, a buffer and a plain tensor attribute in place, and flips a flag."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.register_buffer("calls", torch.zeros(()))
        self.plain = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.plain.add_(1)
        self.bn.training = True
        return self.bn(self.conv(x))


def _state(model: nn.Module) -> dict[str, object]:
    return {
        "tensors": {k: v.clone() for k, v in model.state_dict().items()},
        "training": [m.training for m in model.modules()],
        "requires_grad": [p.requires_grad for p in model.parameters()],
        "hooks": [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()],
        "grads": [p.grad for p in model.parameters()],
        "plain": [(v, v.clone()) for m in model.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)],
    }


def _assert_same_state(before: dict[str, object], after: dict[str, object]) -> None:
    assert before["training"] == after["training"]
    assert before["requires_grad"] == after["requires_grad"]
    assert before["hooks"] == after["hooks"]
    assert before["grads"] == after["grads"]
    for (obj_before, value_before), (obj_after, value_after) in zip(before["plain"], after["plain"], strict=True):
        assert obj_before is obj_after and torch.equal(value_before, value_after)
    tensors_before, tensors_after = before["tensors"], after["tensors"]
    assert isinstance(tensors_before, dict) and isinstance(tensors_after, dict)
    assert tensors_before.keys() == tensors_after.keys()
    for key, value in tensors_before.items():
        assert torch.equal(value, tensors_after[key]), key


@pytest.mark.parametrize("execution", ["fake", "real"])
def test_model_is_unchanged_after_analysis(execution: str) -> None:
    model = Stateful().eval()
    model.conv.weight.requires_grad_(False)
    model.conv.register_forward_hook(lambda *_: None)
    before = _state(model)
    flops = FlopCountAnalysis(model, torch.randn(2, 3, 8, 8), execution=execution)  # type: ignore[arg-type]
    assert flops.by_operator() == Counter({"conv": 2 * 4 * 27 * 36, "batch_norm": 5 * 2 * 4 * 36})
    _assert_same_state(before, _state(model))


def test_model_is_unchanged_when_analysis_raises() -> None:
    class Broken(Stateful):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            super().forward(x)
            raise RuntimeError("boom")

    model = Broken().eval()
    before = _state(model)
    for execution in ("fake", "real"):
        with pytest.raises(ModelRunError, match="boom"):
            FlopCountAnalysis(model, torch.randn(1, 3, 8, 8), execution=execution).total()  # type: ignore[arg-type]
        _assert_same_state(before, _state(model))


class CachesAMask(nn.Module):
    """Keeps a tensor it makes on its first call, as models caching masks or positions do."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "mask"):
            self.mask = x.new_ones(4)
        return self.fc(x) * self.mask


@pytest.mark.parametrize("execution", ["auto", "fake", "real"])
def test_attributes_a_forward_adds_during_the_analysis_are_removed(execution: str) -> None:
    model = CachesAMask()
    flops = FlopCountAnalysis(model, torch.randn(2, 4), execution=execution)  # type: ignore[arg-type]
    assert flops.by_operator() == Counter({"linear": 2 * 4 * 4})
    assert "mask" not in vars(model)  # a stand-in left there would break the model's next real call
    assert model(torch.randn(2, 4)).shape == (2, 4)
    assert vars(model)["mask"].device.type == "cpu"


class Fallible(nn.Module):
    """Runs a layer, then raises."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.fc(x)
        raise ValueError("no")


class CatchesAFailure(nn.Module):
    """Calls a child that raises, catches it, and goes on with work of its own and of a sibling."""

    def __init__(self) -> None:
        super().__init__()
        self.fallible = Fallible()
        self.after = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with contextlib.suppress(ValueError):
            self.fallible(x)
        return self.after(x) @ torch.ones(2, 3)


def test_module_scopes_are_right_after_a_child_raised_and_was_caught() -> None:
    flops = FlopCountAnalysis(CatchesAFailure(), torch.randn(2, 4))
    # by hand: fc 2*4*4, after 2*4*2, the model's own matmul 2*2*3
    assert flops.by_module() == Counter({"": 32 + 16 + 12, "fallible": 32, "fallible.fc": 32, "after": 16})
    assert flops.by_operator("") == Counter({"linear": 48, "matmul": 12})


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = int((self.fc.weight > 0).sum().item() > -1) + 1  # always 2 with real values
        for _ in range(steps):
            x = self.fc(x)
        return x


def test_data_dependent_model_falls_back_to_real_kernels() -> None:
    flops = FlopCountAnalysis(DataDependent(), torch.randn(1, 4))
    assert flops.total() == 2 * 16
    assert flops.trace.execution == "real"
    assert any("real kernels" in a for a in flops.assumptions())
    assert FlopCountAnalysis(DataDependent(), torch.randn(1, 4), execution="real").total() == 32
    with pytest.raises(ModelRunError, match="at operator aten::item.*needs real tensor values"):
        FlopCountAnalysis(DataDependent(), torch.randn(1, 4), execution="fake").total()


class InputDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, repeats: torch.Tensor) -> torch.Tensor:
        for _ in range(int(repeats.sum().item())):  # a value of the caller's inputs, not of the weights
            x = self.fc(x)
        return x


def test_values_of_small_inputs_are_known_to_the_fake_run() -> None:
    flops = FlopCountAnalysis(InputDependent(), (torch.randn(1, 4), torch.tensor([2, 1])), execution="fake")
    assert flops.total() == 3 * 16
    assert flops.trace.execution == "fake" and flops.assumptions() == []
    with torch.device("meta"):
        model = InputDependent()
    assert FlopCountAnalysis(model, (torch.randn(1, 4), torch.tensor([2, 1]))).total() == 3 * 16


def test_meta_model_assumes_documented_placeholders_and_reports_them() -> None:
    with torch.device("meta"):
        model = DataDependent()
    flops = FlopCountAnalysis(model, torch.randn(1, 4))
    assert flops.total() == 2 * 16  # .item() read as 1 (True > -1 is True): two steps
    assert len(flops.assumptions()) == 1
    assert "assumed to be 1" in flops.assumptions()[0] and "forward" in flops.assumptions()[0]


def test_meta_model_with_cpu_inputs_and_real_model_with_meta_inputs() -> None:
    with torch.device("meta"):
        meta_model = nn.Linear(8, 3)
    assert FlopCountAnalysis(meta_model, torch.randn(5, 8)).total() == 5 * 8 * 3
    assert FlopCountAnalysis(nn.Linear(8, 3), torch.empty(5, 8, device="meta")).total() == 5 * 8 * 3
    with pytest.raises(ValueError, match="meta device"):
        FlopCountAnalysis(nn.Linear(8, 3), torch.empty(5, 8, device="meta"), execution="real").total()


def test_fake_and_real_runs_record_the_same_operators() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 36, 4))
    x = torch.randn(2, 3, 8, 8)
    fake = FlopCountAnalysis(model, x, execution="fake")
    real = FlopCountAnalysis(model, x, execution="real")
    assert fake.by_module_and_operator() == real.by_module_and_operator()
    assert [(e.op, e.inputs, e.outputs) for e in fake.trace.events] == \
        [(e.op, e.inputs, e.outputs) for e in real.trace.events]


def test_trace_holds_no_tensors() -> None:
    flops = FlopCountAnalysis(nn.Linear(4, 4), torch.randn(2, 4), execution="real")

    def walk(value: object) -> None:
        assert not isinstance(value, torch.Tensor)
        if isinstance(value, (list, tuple)):
            for v in value:
                walk(v)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)

    for event in flops.trace.events:
        walk(event.inputs)
        walk(event.outputs)
        walk(event.kwargs)


def test_activation_analysis_shares_the_api() -> None:
    model = nn.Sequential(nn.Conv2d(3, 10, 1), nn.ReLU(), nn.Flatten(), nn.Linear(1000, 10))
    acts = ActivationCountAnalysis(model, torch.randn(1, 3, 10, 10))
    assert acts.total() == 1010
    assert acts.by_module() == Counter({"": 1010, "0": 1000, "1": 0, "2": 0, "3": 10})


def test_compiled_model_is_analysed_eagerly_without_compiling() -> None:
    model = Inner()
    compiled = torch.compile(model)
    compiled_forward = vars(compiled)["forward"]  # OptimizedModule keeps its compiled forward in its __dict__
    flops = FlopCountAnalysis(compiled, torch.randn(3, 10))
    assert flops.total() == flops.total("_orig_mod") == 3 * LINEAR_FLOPS
    assert flops.total("_orig_mod.fc") == 3 * LINEAR_FLOPS
    assert vars(compiled)["forward"] is compiled_forward  # the wrapper is left as it was


@torch.library.custom_op("modelmeter_test::double", mutates_args=())
def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


class UsesCustomOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _double(self.fc(x))


def test_operator_without_fake_kernel_runs_real_and_is_reported() -> None:
    flops = quiet(FlopCountAnalysis(UsesCustomOp(), torch.randn(2, 4)))
    assert flops.total() == 2 * 16
    assert flops.unsupported_ops() == Counter({"modelmeter_test::double": 1})
    assert flops.trace.execution == "real"
    assert any("FakeTensors could not run it" in a for a in flops.assumptions())
    with pytest.raises(ModelRunError, match="modelmeter_test::double"):
        FlopCountAnalysis(UsesCustomOp(), torch.randn(2, 4), execution="fake").total()
    flops.set_op_handle("modelmeter_test::double", lambda inputs, outputs: 8)
    assert flops.by_operator() == Counter({"linear": 32, "double": 8})


class CustomOpOnIntegersAndFloats(nn.Module):
    def forward(self, x: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _double(i), _double(x), _double(i)


def test_unknown_operator_is_reported_per_call_that_computes_in_floating_point() -> None:
    # one operator, so one kind for the whole count; whether a call only did integer arithmetic is per call
    flops = quiet(FlopCountAnalysis(CustomOpOnIntegersAndFloats(), (torch.randn(2, 4), torch.arange(4))))
    assert flops.total() == 0
    assert flops.unsupported_ops() == Counter({"modelmeter_test::double": 1})


def test_distributed_data_parallel_root_and_module_get_the_full_count(tmp_path: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = nn.parallel.DistributedDataParallel(Inner())
        flops = FlopCountAnalysis(model, torch.randn(10, 10))
        assert flops.total() == flops.total("module") == flops.total("module.fc") == 1000
        assert "forward" not in vars(model)
    finally:
        dist.destroy_process_group()


def test_analyze_shares_one_run_and_quiet_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    class Pool(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return blur(x)

    from modelmeter import analyze

    with caplog.at_level(logging.WARNING, logger="modelmeter"):
        loud = analyze(Pool(), torch.randn(1, 1, 4, 4))
        loud.result()
    assert any("modelmeter_test::blur" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="modelmeter"):
        quiet = analyze(Pool(), torch.randn(1, 1, 4, 4), quiet=True)
        result = quiet.result()
    assert caplog.records == []
    assert result.unsupported == {"modelmeter_test::blur": 1}  # still reported, just not logged
    assert quiet.activations.trace is quiet.flops.trace


def test_meta_models_run_on_meta_tensors_and_fall_back_to_fake_ones() -> None:
    from torch._subclasses.fake_tensor import FakeTensor

    class MetaKernelMissing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not isinstance(x, FakeTensor):  # as an operator without a meta kernel would
                raise NotImplementedError("no Meta kernel")
            return self.fc(x)

    with torch.device("meta"):
        plain, missing = nn.Linear(4, 4), MetaKernelMissing()
    seen = []
    plain.register_forward_pre_hook(lambda _, args: seen.append(type(args[0])))
    assert FlopCountAnalysis(plain, torch.randn(2, 4)).total() == 2 * 16
    assert seen == [torch.Tensor]  # a plain meta tensor, no FakeTensor conversion
    assert FlopCountAnalysis(missing, torch.randn(2, 4)).total() == 2 * 16  # retried under FakeTensors


def test_a_cpu_model_the_meta_run_cannot_finish_runs_on_fake_tensors() -> None:
    """A model that mixes in a CPU tensor of its own cannot run on meta stand-ins (meta and CPU operands do not
    mix): it is recorded on FakeTensors instead, with the same counts as a real run and no assumption."""

    class OwnOffsets(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) + torch.ones(8, 8)  # a CPU tensor made in forward, not an input or a buffer

    model, x = OwnOffsets(), torch.randn(8, 8)
    fake = FlopCountAnalysis(model, x)
    real = FlopCountAnalysis(model, x, execution="real")
    assert fake.trace.execution == "fake" and fake.assumptions() == []
    assert fake.by_module_and_operator() == real.by_module_and_operator()
    assert all(m.device == "cpu" for e in fake.trace.events for m in e.outputs if isinstance(m, TensorMeta))
