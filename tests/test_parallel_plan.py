"""Parallel plans: the plan's text, the fake process group's set-up and tear-down, and one rank's run recorded by the
engine on PyTorch's own FSDP2 / replicate / DTensor machinery.

Oracles: hand arithmetic (a plan's ranks and coordinates; FSDP2's dim-0 shards, ``torch.chunk``'s sizes, padding
included; the collectives FSDP2 issues per parameter group), the single-device analysis of the same per-rank input
(data parallelism changes no rank's computation), torch's own global state before and after, and the oracle walk of
tests/test_model_unchanged.py for the user's model.
"""

from __future__ import annotations

import math
import sys
import time
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import modelmeter
from modelmeter import ParallelPlan, ParallelPlanError
from modelmeter.cache import cache_key
from modelmeter.engine.serialize import trace_from_dict, trace_to_dict
from modelmeter.engine.spec import RunSpec
from modelmeter.parallel.mesh import simulated_mesh
from modelmeter.zoo.llama import llama2_tiny
from test_model_unchanged import differences, reachable


# --- the plan's text -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "expected"), [
    ("dp=2,fsdp=64,tp=8,pp=4", ParallelPlan(dp=2, fsdp=64, tp=8, pp=4)),
    (" fsdp = 8 , TP=2 ", ParallelPlan(fsdp=8, tp=2)),
    ("fsdp=8,zero=2,mp=bf16", ParallelPlan(fsdp=8, zero=2, param_dtype="bfloat16", reduce_dtype="float32")),
    ("tp=4,sp", ParallelPlan(tp=4, sequence_parallel=True)),
    ("tp=4,sequence_parallel=false", ParallelPlan(tp=4)),
    ("pp=4,mb=8,rank=3", ParallelPlan(pp=4, micro_batches=8, rank=3)),
    ("fsdp=2,param_dtype=fp16", ParallelPlan(fsdp=2, param_dtype="float16")),
    ("dp=1", ParallelPlan()),
])
def test_a_plan_is_parsed_and_written_back_as_the_same_plan(text: str, expected: ParallelPlan) -> None:
    plan = ParallelPlan.parse(text)
    assert plan == expected
    assert ParallelPlan.parse(str(plan)) == plan


def test_the_world_is_the_product_of_the_dimensions_and_a_rank_has_coordinates_in_it() -> None:
    plan = ParallelPlan.parse("dp=2,fsdp=64,tp=8,pp=4,rank=1234")
    assert plan.world_size == 2 * 64 * 8 * 4
    assert plan.mesh == {"pp": 4, "dp": 2, "fsdp": 64, "tp": 8}  # outermost first, tensor parallel innermost
    # 1234 = ((pp * 2 + dp) * 64 + fsdp) * 8 + tp with pp=1, dp=0, fsdp=26, tp=2: 1024 + 26 * 8 + 2
    assert plan.coordinates() == {"pp": 1, "dp": 0, "fsdp": 26, "tp": 2}
    assert str(ParallelPlan.parse("tp=2,fsdp=4")) == "fsdp=4,tp=2"


@pytest.mark.parametrize(("text", "named"), [
    ("fsdp=8,cp=2", "'cp=2'"),  # an unknown dimension
    ("fsdp=0", "'fsdp=0'"),
    ("tp=-2", "'tp=-2'"),
    ("fsdp=8,fsdp=4", "'fsdp=4'"),  # a duplicate
    ("sp,tp=2,sequence_parallel=1", "'sequence_parallel=1'"),  # a duplicate by another name
    ("fsdp=2,mp=bf16,param_dtype=fp16", "'param_dtype=fp16'"),
    ("fsdp=two", "'fsdp=two'"),
    ("fsdp", "'fsdp'"),
    ("fsdp=8,,tp=2", "empty part"),
    ("", "empty"),
    ("fsdp=8,zero=4", "zero=4"),
    ("dp=8,zero=1", "zero=1"),
    ("fsdp=8,sp", "sequence_parallel"),
    ("fsdp=8,mb=4", "micro_batches=4"),
    ("fsdp=8,rank=8", "rank=8"),
    ("fsdp=8,mp=int8", "int8"),
    ("tp=2,mp=bf16", "param_dtype"),
    ("fsdp=2,param_dtype=fp17", "param_dtype='fp17'"),  # the option's name, not the part, before the value
    ("fsdp=99999999999999999999", "at most 4194304"),  # a world no device mesh can hold: refused, not a TypeError
    ("dp=4096,fsdp=2048", "8388608 ranks"),  # nor an out-of-memory kill
])
def test_a_bad_plan_is_refused_naming_the_part_that_is_wrong(text: str, named: str) -> None:
    with pytest.raises(ParallelPlanError, match=named.replace("(", r"\(")):
        ParallelPlan.parse(text)


def test_a_bad_plan_is_a_value_error_of_modelmeter() -> None:
    with pytest.raises(ValueError):
        modelmeter.analyze(nn.Linear(2, 2), torch.randn(1, 2), parallel="fsdp=2,fsdp=2")
    with pytest.raises(ParallelPlanError, match="ParallelPlan"):
        modelmeter.analyze(nn.Linear(2, 2), torch.randn(1, 2), parallel=8)  # type: ignore[arg-type]


# --- the fake process group ------------------------------------------------------------------------------------------
def _distributed_state() -> dict[str, Any]:
    """What torch keeps globally for torch.distributed and DTensor, as comparable text."""
    from torch.distributed import distributed_c10d
    from torch.distributed.device_mesh import _mesh_resources
    from torch.distributed.tensor import _random
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    c10d = {name: repr(getattr(distributed_c10d, name)) for name in _C10D_STATE}
    world = {k: repr(v) for k, v in vars(distributed_c10d._world).items()}
    return {"initialized": dist.is_initialized(), "world": world, "c10d": c10d,
            "meshes": list(_mesh_resources.mesh_stack), "rng": _random._rng_tracker,
            "lock": ShardingPropagator.__dict__["_fake_mode_lock"], "excepthook": sys.excepthook}


_C10D_STATE = ("_pg_map", "_pg_names", "_pg_group_ranks", "_pg_backend_config", "_group_count", "_tags_to_pg",
               "_pg_to_tag", "_backend")


@pytest.fixture
def distributed_state() -> Any:
    """Torch's global distributed state before the test; the test must leave it so (checked), and no default
    process group is left behind whatever happens."""
    from torch.distributed import distributed_c10d

    before, backend = _distributed_state(), distributed_c10d._backend
    yield before
    if dist.is_initialized():  # the test's own group: torch's init_process_group leaves its backend's name set,
        dist.destroy_process_group()  # and its traceback prefix
        distributed_c10d._backend = backend
        sys.excepthook = before["excepthook"]
    assert _distributed_state() == before


@pytest.mark.parametrize("first", ["dp=2,fsdp=2,tp=2", "tp=2,sp"])
def test_a_later_plan_on_an_equal_mesh_uses_its_own_process_groups(first: str, distributed_state: Any) -> None:
    # DTensor caches sharding decisions and redistribution plans by mesh layout: the first run's "tp" mesh equals the
    # second's, and entries left by the first would name its destroyed process groups
    model, tokens = llama2_tiny(), torch.randint(0, 100, (2, 16))
    modelmeter.analyze(model, tokens, parallel=first, quiet=True)
    later = modelmeter.analyze(model, tokens, parallel="fsdp=4,tp=2,sp", quiet=True)
    alone = modelmeter.analyze(model, tokens, parallel="fsdp=4,tp=2,sp,rank=1", quiet=True)
    assert later.flops.total() == alone.flops.total() == modelmeter.analyze(model, tokens).flops.total() // 2


def test_1024_ranks_are_set_up_in_seconds_and_torch_is_left_as_it_was(distributed_state: Any) -> None:
    started = time.perf_counter()
    with simulated_mesh(ParallelPlan.parse("fsdp=128,tp=8,rank=1023")) as mesh:
        assert mesh is not None
        assert dist.get_world_size() == 1024 and dist.get_rank() == 1023
        assert mesh.mesh_dim_names == ("fsdp", "tp") and tuple(mesh.shape) == (128, 8)
        assert mesh["tp"].size() == 8 and tuple(mesh.get_coordinate() or ()) == (127, 7)
    assert time.perf_counter() - started < 10
    assert _distributed_state() == distributed_state


def test_a_plan_of_one_rank_sets_nothing_up(distributed_state: Any) -> None:
    with simulated_mesh(ParallelPlan()) as mesh:
        assert mesh is None and not dist.is_initialized()


def test_a_process_group_of_the_users_is_refused_and_left_alone(distributed_state: Any) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    group = dist.group.WORLD
    with pytest.raises(ParallelPlanError, match="already initialised"):
        modelmeter.analyze(nn.Linear(4, 4), torch.randn(2, 4), parallel="fsdp=2")
    assert dist.group.WORLD is group and dist.get_world_size() == 2


# --- one rank's run --------------------------------------------------------------------------------------------------
def _tiny() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return llama2_tiny(), torch.randint(0, 1000, (2, 16))


def _collectives(trace: modelmeter.Trace) -> Counter[str]:
    return Counter(e.op for e in trace.events if e.level == "dispatch" and e.op.startswith(("c10d::", "_c10d")))


@pytest.mark.parametrize("convention", ["fvcore", "flops"])
@pytest.mark.parametrize("plan", ["fsdp=4", "dp=2", "dp=2,fsdp=2", "fsdp=4,zero=2", "fsdp=4,zero=1"])
def test_data_parallelism_changes_no_ranks_flops(plan: str, convention: str, distributed_state: Any) -> None:
    model, x = _tiny()
    single = modelmeter.FlopCountAnalysis(model, x, backward=True, convention=convention)
    rank = modelmeter.FlopCountAnalysis(model, x, backward=True, convention=convention, parallel=plan)
    assert rank.by_phase() == single.by_phase()
    assert rank.by_module() == single.by_module()
    assert rank.trace.parallel is not None and rank.trace.parallel["plan"] == plan


def test_fsdp_issues_one_all_gather_and_one_reduce_scatter_per_group(distributed_state: Any) -> None:
    """llama2_tiny under fully_shard: three parameter groups (two decoder layers, the root). Forward: one all-gather
    each; backward: the two layers gather again (resharded after their forward), the root does not (FSDP2 keeps the
    root's); every group reduce-scatters its gradients once."""
    model, x = _tiny()
    trace = modelmeter.analyze(model, x, backward=True, parallel="fsdp=4", quiet=True).trace
    assert _collectives(trace) == {"c10d::_allgather_base_": 5, "c10d::_reduce_scatter_base_": 3}
    by_phase = Counter((e.phase, e.op) for e in trace.events if e.op == "c10d::_allgather_base_")
    assert by_phase == {("forward", "c10d::_allgather_base_"): 3, ("backward", "c10d::_allgather_base_"): 2}
    # ZeRO-2 keeps every layer's parameters after the forward: no gather in the backward pass
    zero2 = modelmeter.analyze(model, x, backward=True, parallel="fsdp=4,zero=2", quiet=True).trace
    assert _collectives(zero2) == {"c10d::_allgather_base_": 3, "c10d::_reduce_scatter_base_": 3}
    # DDP (and ZeRO-1) all-reduce each group's gradients; HSDP reduce-scatters, then all-reduces across replicas
    ddp = modelmeter.analyze(model, x, backward=True, parallel="dp=2", quiet=True).trace
    assert _collectives(ddp) == {"c10d::allreduce_": 3}
    hsdp = modelmeter.analyze(model, x, backward=True, parallel="dp=2,fsdp=2", quiet=True).trace
    assert _collectives(hsdp) == {"c10d::_allgather_base_": 5, "c10d::_reduce_scatter_base_": 3, "c10d::allreduce_": 3}
    assert _collectives(modelmeter.analyze(model, x, parallel="fsdp=4", quiet=True).trace) == \
        {"c10d::_allgather_base_": 3}  # inference: the forward's gathers only


def test_a_sequential_model_is_grouped_by_its_layers(distributed_state: Any) -> None:
    """The model itself a Sequential of Linear layers, activations between them: each Linear is a group (one
    reduce-scatter each); the activations, without parameters, belong to the root's group, which holds nothing."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    trace = modelmeter.analyze(model, torch.randn(2, 8), backward=True, parallel="fsdp=4", quiet=True).trace
    assert _collectives(trace)["c10d::_reduce_scatter_base_"] == 3
    assert sorted(s.nbytes for s in trace.storages if s.kind == "gradient") == sorted(
        4 * (out * inp + out) // 4 for inp, out in ((8, 16), (16, 16), (16, 4)))  # float32 shards of 4 ranks


def test_a_ranks_parameters_are_its_shards(distributed_state: Any) -> None:
    model, x = _tiny()
    whole = modelmeter.parameter_count(model)[""]
    for plan, shards in (("fsdp=4", 4), ("dp=2,fsdp=2", 2), ("fsdp=4,zero=2", 4), ("fsdp=4,zero=1", 1), ("dp=2", 1)):
        analysis = modelmeter.analyze(model, x, parallel=plan, quiet=True)
        assert analysis.parameters[""] == whole // shards, plan  # every llama2_tiny dim 0 divides by 4
        assert sum(info.global_params for info in analysis.trace.modules) == whole
        assert analysis.result().modules[0].params == whole // shards
        assert sum(s.nbytes for s in analysis.trace.storages if s.kind == "parameter") == whole // shards * 4


def test_a_memory_analysis_of_a_rank_holds_its_parameter_shards(distributed_state: Any) -> None:
    """Only the view's option is tested here: what FSDP2 gathers and frees is the memory analysis's to follow."""
    model, x = _tiny()
    memory = modelmeter.MemoryAnalysis(model, x, training=True, optimizer="adamw", parallel="fsdp=4")
    assert memory.trace.parallel is not None
    assert memory.peak_info().by_kind["parameter"] == modelmeter.parameter_count(model)[""] * 4 // 4  # float32


@pytest.mark.parametrize(("rank", "rows"), [(0, 2), (1, 2), (2, 1), (3, 0)])
def test_an_uneven_shard_is_torch_chunks_share(rank: int, rows: int, distributed_state: Any) -> None:
    """FSDP2 shards dim 0 as ``torch.chunk`` does (padding the last shards' storage): 5 rows on 4 ranks are chunks of
    ceil(5 / 4) = 2, so ranks 0 and 1 hold 2 rows, rank 2 the last one and rank 3 none."""
    model = nn.Sequential(nn.Linear(10, 5), nn.ReLU(), nn.Linear(5, 3))
    trace = modelmeter.analyze(model, torch.randn(2, 10), backward=True, parallel=f"fsdp=4,rank={rank}",
                               quiet=True).trace
    first = {p.name: p for p in trace.module_table()["0"].parameters}
    assert first["weight"].shape == (rows, 10) and first["weight"].global_shape == (5, 10)
    assert first["bias"].shape == (rows,) and first["weight"].nbytes == rows * 10 * 4
    chunk = math.ceil(3 / 4)  # the second layer: 3 rows on 4 ranks, chunks of 1
    assert trace.module_table()["2"].parameters[0].shape == (max(0, min(chunk, 3 - rank * chunk)), 5)
    assert trace.parallel is not None and trace.parallel["rank"] == rank
    # every rank's storage is padded to the longest shard: 2 x 10 and 2 floats, 1 x 5 and 1 float (bytes of float32)
    # (a rank whose shard FSDP2 pads at the first forward holds the padded storage from the start: the one it
    # replaced is gone before the first event)
    padded = [2 * 10 * 4, 2 * 4, 1 * 5 * 4, 1 * 4]
    held = [s.nbytes for s in trace.storages if s.kind == "parameter" and s.died != 0]
    assert sorted(held) == sorted(padded)
    # each Linear is a group of its own (the model is a Sequential of them): FSDP2 reduce-scatters a group's gradients
    # into one buffer, of its padded shards' size — the last layer's first, in the backward pass
    assert [s.nbytes for s in trace.storages if s.kind == "gradient"] == [sum(padded[2:]), sum(padded[:2])]


def test_the_trace_describes_the_plan_and_names_the_groups_mesh_dimensions(distributed_state: Any) -> None:
    model, x = _tiny()
    trace = modelmeter.analyze(model, x, backward=True, parallel="dp=2,fsdp=4,rank=5", quiet=True).trace
    parallel = trace.parallel
    assert parallel is not None
    assert parallel["plan"] == "dp=2,fsdp=4,rank=5" and parallel["world_size"] == 8 and parallel["rank"] == 5
    assert parallel["mesh"] == {"dp": 2, "fsdp": 4} and parallel["coordinates"] == {"dp": 1, "fsdp": 1}
    assert sorted(parallel["groups"].values()) == ["dp", "fsdp"]
    assert parallel["options"]["zero"] == 3
    # the module table keeps the model's classes (fully_shard gives each module a class of its own)
    assert trace.model == "Llama" and trace.module_table()["model.layers.0"].type == "LlamaDecoderLayer"
    assert trace_from_dict(trace_to_dict(trace)).parallel == parallel
    assert trace_from_dict(trace_to_dict(trace)).modules == trace.modules


def test_zero1_over_both_data_parallel_dimensions_replicates_over_their_flattened_group(
        distributed_state: Any) -> None:
    model, x = _tiny()
    trace = modelmeter.analyze(model, x, backward=True, parallel="dp=2,fsdp=2,zero=1", quiet=True).trace
    assert trace.parallel is not None and sorted(trace.parallel["groups"].values()) == ["dp", "dp_fsdp", "fsdp"]
    assert _collectives(trace) == {"c10d::allreduce_": 3}
    assert sum(info.params for info in trace.modules) == modelmeter.parameter_count(model)[""]


def test_the_pipeline_dimension_is_carried_and_the_rank_runs_the_model_it_is_given(distributed_state: Any) -> None:
    model, x = _tiny()
    analysis = modelmeter.analyze(model, x, backward=True, parallel="pp=2,fsdp=2,rank=3", quiet=True)
    parallel = analysis.trace.parallel
    assert parallel is not None and parallel["mesh"] == {"pp": 2, "fsdp": 2}
    assert parallel["coordinates"] == {"pp": 1, "fsdp": 1} and sorted(parallel["groups"].values()) == ["fsdp", "pp"]
    assert analysis.flops.total() == modelmeter.FlopCountAnalysis(model, x, backward=True).total()
    assert analysis.parameters[""] == modelmeter.parameter_count(model)[""] // 2


def test_mixed_precision_gathers_and_computes_in_bfloat16(distributed_state: Any) -> None:
    model, x = _tiny()
    trace = modelmeter.analyze(model, x, backward=True, parallel="fsdp=4,mp=bf16", quiet=True).trace
    linears = [e for e in trace.events if e.level == "function" and e.op == "aten::linear"]
    assert linears and all(e.inputs[1].dtype == "bfloat16" for e in linears)
    assert all(p.dtype == "float32" for m in trace.modules for p in m.parameters)  # the master weights


def test_tensor_parallel_runs_the_ranks_share_of_every_product(distributed_state: Any) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    x = torch.randn(4, 16)
    plan = ParallelPlan.parse("tp=4", tp_plan={"0": ColwiseParallel(), "2": RowwiseParallel()})
    rank = modelmeter.FlopCountAnalysis(model, x, backward=True, parallel=plan)
    single = modelmeter.FlopCountAnalysis(model, x, backward=True)
    # forward 4*16*64 + 4*64*16 = 8192, backward (no input gradient) 4096 * 3: each a quarter per rank
    assert single.by_phase() == {"forward": 8192, "backward": 12288}
    assert rank.by_phase() == {"forward": 2048, "backward": 3072}
    assert _collectives(rank.trace) == {"_c10d_functional::all_reduce": 1, "_c10d_functional::wait_tensor": 1}
    table = rank.trace.module_table()
    assert table["0"].parameters[0].shape == (16, 16) and table["0"].parameters[0].global_shape == (64, 16)


def test_tensor_parallel_without_a_plan_for_the_model_is_refused(distributed_state: Any) -> None:
    with pytest.raises(ParallelPlanError, match=r"'0' \(Linear\)"):
        modelmeter.analyze(nn.Sequential(nn.Linear(4, 4)), torch.randn(2, 4), parallel="tp=2")


class _Fails(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.calls: list[Any] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x)
        self.fc.weight.requires_grad_(False)
        raise RuntimeError("broken model")


@pytest.mark.parametrize("build", [_tiny, lambda: (_Fails(), torch.randn(2, 4))])
def test_the_users_model_and_torch_are_left_as_found(build: Any, distributed_state: Any) -> None:
    model, x = build()
    model.train()
    before = reachable(model)
    try:
        modelmeter.analyze(model, x, backward=True, parallel="dp=2,fsdp=2", quiet=True)
    except modelmeter.ModelRunError as exc:
        assert isinstance(model, _Fails) and "broken model" in str(exc)
    assert differences(before, reachable(model)) == []
    assert _distributed_state() == distributed_state


def test_a_model_on_meta_is_copied_too(distributed_state: Any) -> None:
    with torch.device("meta"):
        model = llama2_tiny()
    before = reachable(model)
    analysis = modelmeter.analyze(model, torch.randint(0, 1000, (2, 16)), parallel="fsdp=4", quiet=True)
    assert analysis.parameters[""] == modelmeter.parameter_count(model)[""] // 4
    assert differences(before, reachable(model)) == []


def test_1024_ranks_are_analysed(distributed_state: Any) -> None:
    model, x = _tiny()
    started = time.perf_counter()
    analysis = modelmeter.analyze(model, x, backward=True, parallel="dp=8,fsdp=128,rank=1023", quiet=True)
    assert time.perf_counter() - started < 30
    assert analysis.trace.parallel is not None and analysis.trace.parallel["world_size"] == 1024
    assert analysis.flops.total() == modelmeter.FlopCountAnalysis(model, x, backward=True).total()


def test_the_cache_keys_tell_plans_apart(distributed_state: Any) -> None:
    model, x = _tiny()
    keys = {cache_key(RunSpec.of(model, x, parallel=plan)).digest
            for plan in (None, "fsdp=4", "fsdp=8", "fsdp=4,rank=1", "fsdp=4,zero=2", "fsdp=4,mp=bf16")}
    assert len(keys) == 6
    assert cache_key(RunSpec.of(model, x, parallel="fsdp=4")).digest == \
        cache_key(RunSpec.of(model, x, parallel=ParallelPlan(fsdp=4))).digest
    # the in-process key too: the second analysis is not answered with the first one's trace
    assert modelmeter.analyze(model, x, parallel="fsdp=2", quiet=True).parameters[""] != \
        modelmeter.analyze(model, x, parallel="fsdp=4", quiet=True).parameters[""]


def test_a_parallel_trace_is_cached_on_disk(tmp_path: Any, distributed_state: Any) -> None:
    model, x = _tiny()
    first = modelmeter.analyze(model, x, parallel="fsdp=4", cache_dir=tmp_path, quiet=True)
    modelmeter.cache.shared.SHARED.clear()
    again = modelmeter.analyze(model, x, parallel="fsdp=4", cache_dir=tmp_path, quiet=True)
    assert again.from_cache and again.trace.parallel == first.trace.parallel
    assert again.flops.total() == first.flops.total()


def test_execution_real_cannot_run_a_plan() -> None:
    with pytest.raises(ParallelPlanError, match="execution='real'"):
        modelmeter.analyze(nn.Linear(2, 2), torch.randn(1, 2), parallel="fsdp=2", execution="real")


@pytest.mark.parametrize("plan", ["tp=2", "tp=2,sp", "dp=2,fsdp=2,tp=2"])
def test_every_operator_of_a_parallel_step_is_known(plan: str, distributed_state: Any) -> None:
    # collectives, FSDP2's copies, the profiler's markers and DTensor's redistributions are all in the tables
    step = modelmeter.analyze(llama2_tiny(), torch.randint(0, 100, (2, 16)), backward=True, parallel=plan, quiet=True)
    assert step.flops.unsupported_ops() == Counter()
    assert step.flops.by_operator()["redistribute"] == 0
