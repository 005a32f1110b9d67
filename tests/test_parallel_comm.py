"""Collectives as plain trace data, and the communication metric: checked against CommDebugMode on the same run,
against hand arithmetic of the ring algorithms' factors, and against ZeRO's published volumes (docs/parallel.md).

The models run on torch's own machinery (FSDP2's ``fully_shard``, the FSDP2-based ``replicate``) under the fake
process group, built on meta and materialised as FakeTensors, as a parallel analysis runs them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.distributed.fake_pg import FakeStore

import modelmeter
from modelmeter.cache import TraceCache
from modelmeter.devices import DeviceError, Interconnect, get_interconnect
from modelmeter.engine.serialize import dumps, loads
from modelmeter.engine.trace import GroupMeta
from modelmeter.handles.collectives import BOOKKEEPING_OPS, FSDP_COPIES, collectives, rank_bytes
from modelmeter.metrics.communication import CollectiveCall, Communication, communication
from modelmeter.metrics.step_time import collective_time, step_time

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
WIDTH = 16  # every parameter's first dimension is a multiple of the world sizes used: FSDP2 pads none
FLOAT = 4


class Block(nn.Module):
    def __init__(self, d: int = WIDTH) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    """Blocks, and optionally a layer of the root's own (FSDP2 keeps the root's parameters unsharded for backward)."""

    def __init__(self, blocks: int = 2, own: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH) if own else nn.Identity()
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return x


BLOCK_BYTES = (8 * WIDTH * WIDTH + 5 * WIDTH) * FLOAT  # up: 4d·d + 4d, down: d·4d + d
OWN_BYTES = (WIDTH * WIDTH + WIDTH) * FLOAT


@pytest.fixture
def world(request: pytest.FixtureRequest) -> Iterator[int]:
    """A fake default process group of the parametrised size (4 when not parametrised), destroyed afterwards."""
    size = getattr(request, "param", 4)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield size
    finally:
        dist.destroy_process_group()


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _materialised(model: nn.Module, mode: FakeTensorMode) -> torch.Tensor:
    with mode:
        model.to_empty(device="cpu")
        return torch.randn(4, WIDTH)


def _fsdp(mesh: DeviceMesh, *, own: bool = False, blocks: int = 2) -> nn.Module:
    with torch.device("meta"):
        model = Stack(blocks, own)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _oracle(model: nn.Module, x: torch.Tensor, mode: FakeTensorMode) -> CommDebugMode:
    with mode, CommDebugMode() as comm:
        model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    return comm


def _analysed(model: nn.Module, x: torch.Tensor, mode: FakeTensorMode) -> modelmeter.Analysis:
    with mode:
        return modelmeter.analyze(model, x, backward=True, quiet=True)


def _short(packet: Any) -> str:
    """``c10d::_allgather_base_`` for CommDebugMode's key ``torch.ops.c10d._allgather_base_``."""
    return str(packet._qualified_op_name)


def _by_phase_and_op(calls: list[Any]) -> Counter[tuple[str, str]]:
    return Counter((call.phase, call.op) for call in calls)


def _oracle_by_phase_and_op(comm: CommDebugMode, root: str) -> Counter[tuple[str, str]]:
    counts = comm.comm_module_counts[root]
    return Counter({(phase, _short(op)): n for phase in ("forward", "backward") for op, n in counts[phase].items()})


@pytest.mark.parametrize("world", [2, 4, 8], indirect=True)
def test_fsdp2_collectives_equal_comm_debug_mode(world: int) -> None:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = _fsdp(_mesh((world,), ("fsdp",)), own=True)
    x = _materialised(model, mode)
    comm = _oracle(model, x, mode)
    analysis = _analysed(model, x, mode)
    found = communication(analysis.trace)

    assert Counter(call.op for call in found.calls) == Counter(
        {_short(op): n for op, n in comm.get_comm_counts().items()})
    root = type(model).__name__
    assert _by_phase_and_op(found.calls) == _oracle_by_phase_and_op(comm, root)
    # forward: each FSDP unit's all-gather is issued in its own module, as CommDebugMode attributes it
    for name, module in (("blocks.0", "blocks.0"), ("blocks.1", "blocks.1")):
        ours = Counter(call.op for call in found.calls if call.phase == "forward" and module in call.modules)
        theirs = comm.comm_module_counts[f"{root}.{name}"]["forward"]
        assert ours == Counter({_short(op): n for op, n in theirs.items()})
    # nothing about the collectives or FSDP2's helpers is unsupported any more
    assert not analysis.flops.unsupported_ops()
    assert not found.unsupported


@pytest.mark.parametrize("world", [2, 4, 8], indirect=True)
def test_fsdp2_payloads_are_the_units_parameters(world: int) -> None:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = _fsdp(_mesh((world,), ("fsdp",)), own=True)
    found = communication(_analysed(model, _materialised(model, mode), mode).trace)
    # forward: the root's unit (its own layer), then each block's; backward: the blocks again (the root stays
    # unsharded), and one reduce-scatter per unit, the gradients of the whole unit
    assert [(c.kind, c.phase, c.payload) for c in found.calls if c.kind == "all_gather"] == [
        ("all_gather", "forward", OWN_BYTES), ("all_gather", "forward", BLOCK_BYTES),
        ("all_gather", "forward", BLOCK_BYTES), ("all_gather", "backward", BLOCK_BYTES),
        ("all_gather", "backward", BLOCK_BYTES)]
    assert sorted(c.payload for c in found.calls if c.kind == "reduce_scatter") == sorted(
        [OWN_BYTES, BLOCK_BYTES, BLOCK_BYTES])
    for call in found.calls:
        assert call.group == GroupMeta("0", world, tuple(range(world)))  # the mesh spans the default group
        assert call.sent == call.received == call.payload * (world - 1) / world


@pytest.mark.parametrize("world", [2, 4, 8], indirect=True)
def test_zero3_moves_three_psi_per_step(world: int) -> None:
    """ZeRO (Rajbhandari et al. 2020, §7.2.2): stage 3 moves 3Ψ per step and rank — the parameters all-gathered in
    the forward and again in the backward pass, the gradients reduce-scattered — each at (n-1)/n of the buffer."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = _fsdp(_mesh((world,), ("fsdp",)), blocks=3)
    psi = 3 * BLOCK_BYTES
    found = communication(_analysed(model, _materialised(model, mode), mode).trace)
    total = found.total()
    assert total.sent == total.received == pytest.approx(3 * psi * (world - 1) / world)
    kinds = found.by_kind()
    assert kinds["all_gather"].payload == 2 * psi and kinds["reduce_scatter"].payload == psi
    assert found.by_phase()["forward"].payload == psi


@pytest.mark.parametrize("world", [1024], indirect=True)
def test_a_thousand_ranks_gather_padded_shards(world: int) -> None:
    """At 1024 ranks FSDP2 pads every parameter's first dimension to a multiple of the world size (one row, or
    none, per rank): the all-gathered buffer is the padded one, and the group crosses the network."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = _fsdp(_mesh((world,), ("fsdp",)), blocks=1)
    found = communication(_analysed(model, _materialised(model, mode), mode).trace)
    padded = (world * WIDTH + world + world * 4 * WIDTH + world) * FLOAT  # up (64, 16), (64,); down (16, 64), (16,)
    assert [(c.kind, c.payload) for c in found.calls] == [("all_gather", padded)] * 2 + [("reduce_scatter", padded)]
    assert found.calls[0].group.ranks == tuple(range(world))
    assert get_interconnect("h100").link(found.calls[0].group.ranks, world) == "inter_node"


@pytest.mark.parametrize("world", [2, 4], indirect=True)
def test_data_parallel_all_reduces_two_psi(world: int) -> None:
    """ZeRO §7.1: data parallelism's all-reduce of the gradients moves 2Ψ per step and rank ((n-1)/n each of its
    reduce-scatter and all-gather halves). ``replicate`` here is FSDP2's (replicate_with_fsdp): the DDP-based one
    needs real collectives' results (its comm hook reads them), which the fake process group does not make."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with torch.device("meta"):
        model = Stack(2, own=True)
    replicate(model, mesh=_mesh((world,), ("dp",)))
    x = _materialised(model, mode)
    comm = _oracle(model, x, mode)
    found = communication(_analysed(model, x, mode).trace)
    psi = 2 * BLOCK_BYTES + OWN_BYTES
    assert Counter(call.op for call in found.calls) == Counter(
        {_short(op): n for op, n in comm.get_comm_counts().items()})
    assert [(c.kind, c.phase) for c in found.calls] == [("all_reduce", "backward")]
    assert found.total().payload == psi
    assert found.total().sent == pytest.approx(2 * psi * (world - 1) / world)


@pytest.mark.parametrize("world", [8], indirect=True)
def test_groups_of_a_two_dimensional_mesh_are_told_apart(world: int) -> None:
    """HSDP on a (replicate 2, shard 4) mesh: all-gathers and reduce-scatters over the shard groups, the
    all-reduce of the shards' gradients over the replicate group; each call names its group, and the mesh's
    dimension names replace the groups' names when the trace's parallel description maps them."""
    mesh = _mesh((2, 4), ("dp", "fsdp"))
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = _fsdp(mesh)
    analysis = _analysed(model, _materialised(model, mode), mode)
    shard, replicas = mesh.get_group("fsdp"), mesh.get_group("dp")
    found = communication(analysis.trace)
    groups = {(call.kind, call.group) for call in found.calls}
    assert groups == {("all_gather", GroupMeta(shard.group_name, 4, (0, 1, 2, 3))),
                      ("reduce_scatter", GroupMeta(shard.group_name, 4, (0, 1, 2, 3))),
                      ("all_reduce", GroupMeta(replicas.group_name, 2, (0, 4)))}
    # the gradient shards all-reduced across the replicas: a quarter of each unit's gradients
    assert found.by_kind()["all_reduce"].payload == 2 * BLOCK_BYTES // 4
    assert set(found.by_group()) == {shard.group_name, replicas.group_name}

    # what a parallel analysis records (Trace.parallel, set by hand until that field is merged)
    vars(analysis.trace)["parallel"] = {"groups": {shard.group_name: "fsdp", replicas.group_name: "dp"}}
    by_dim = communication(analysis.trace).by_group()
    assert by_dim["dp"].count == 2 and by_dim["fsdp"].count == 6


def test_a_functional_collective_names_its_group(world: int) -> None:
    """DTensor's collectives are functional ones, naming their group: the name becomes the group's GroupMeta."""
    import torch.distributed._functional_collectives as funcol

    mesh = _mesh((2, 2), ("dp", "tp"))

    class Reduces(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(WIDTH, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return funcol.all_reduce(self.proj(x), "sum", (mesh, 1))

    found = communication(modelmeter.analyze(Reduces(), torch.randn(3, WIDTH), quiet=True).trace)
    tp = mesh.get_group("tp")
    assert [(c.op, c.kind, c.module, c.payload) for c in found.calls] == [
        ("_c10d_functional::all_reduce", "all_reduce", "", 3 * WIDTH * FLOAT)]
    assert found.calls[0].group == GroupMeta(tp.group_name, 2, (0, 1))
    assert found.calls[0].sent == 3 * WIDTH * FLOAT  # 2(n-1)/n = 1 for n = 2


def test_groups_survive_the_trace_file_and_the_disk_cache(world: int, tmp_path: Any) -> None:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = _fsdp(_mesh((world,), ("fsdp",)))
    trace = _analysed(model, _materialised(model, mode), mode).trace
    again = loads(dumps(trace))
    assert [e.inputs for e in again.events] == [e.inputs for e in trace.events]
    assert any(isinstance(value, GroupMeta) for event in again.events for value in event.inputs)
    assert communication(again).calls == communication(trace).calls
    cache = TraceCache(tmp_path)  # the disk cache's own entry format around it
    assert cache.store("c" * 64, trace)
    stored = cache.load("c" * 64)
    assert stored is not None and communication(stored).calls == communication(trace).calls


@pytest.mark.parametrize(("kind", "n", "sent", "received"), [
    # all-gather / reduce-scatter: each rank passes on n-1 of the n shards (S/n each)
    ("all_gather", 4, 3 * 1024 / 4, 3 * 1024 / 4), ("reduce_scatter", 8, 7 * 1024 / 8, 7 * 1024 / 8),
    # all-reduce: a reduce-scatter then an all-gather of the result
    ("all_reduce", 4, 2 * 3 * 1024 / 4, 2 * 3 * 1024 / 4), ("all_reduce", 2, 1024, 1024),
    ("all_to_all", 4, 3 * 1024 / 4, 3 * 1024 / 4), ("broadcast", 4, 1024, 1024),
    ("send", 2, 1024, 0), ("recv", 2, 0, 1024),
    ("all_reduce", 1, 0, 0), ("all_gather", 1, 0, 0),  # a group of one has no peer
])
def test_ring_factors_by_hand(kind: str, n: int, sent: float, received: float) -> None:
    assert rank_bytes(kind, 1024, n) == (sent, received)


def test_fsdp_copies_move_what_they_copy(world: int) -> None:
    """FSDP2's copy-in reads a rank's shards and writes them into the all-gather buffer; the copy-out reads the
    gathered buffer and writes the parameters; chunk_cat copies the gradients into the reduce-scatter buffer."""
    from modelmeter.metrics.traffic import count_bytes

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = _fsdp(_mesh((world,), ("fsdp",)), blocks=1)
    trace = _analysed(model, _materialised(model, mode), mode).trace
    moved = count_bytes(trace).by_phase
    forward, backward = moved["forward"][""], moved["backward"][""]
    assert forward["all_gather_copy_in"] == 2 * BLOCK_BYTES // world
    assert forward["split_with_sizes_copy"] == 2 * BLOCK_BYTES
    assert backward["chunk_cat"] == 2 * BLOCK_BYTES  # the gradients read, the (unpadded) buffer written
    assert "_allgather_base_" not in forward  # a collective's time is the communication metric's


# --- interconnects and the step time --------------------------------------------------------------------
def test_interconnect_catalog_is_per_gpu_and_per_direction() -> None:
    h100 = get_interconnect("h100-sxm")  # an alias finds its device's links
    assert (h100.intra_node, h100.inter_node, h100.node_size) == (450e9, 50e9, 8)  # 900 GB/s bidir.; 400 Gb/s
    assert get_interconnect("a100").intra_node == 300e9 and get_interconnect("a100").inter_node == 25e9
    assert get_interconnect("b200").intra_node == 900e9
    assert get_interconnect(modelmeter.get_device("h200")) == get_interconnect("h200")
    with pytest.raises(DeviceError, match="no interconnect is known for device 'l4'"):
        get_interconnect("l4")
    with pytest.raises(DeviceError, match="node_size"):
        Interconnect("bad", intra_node=1e9, inter_node=1e9, node_size=0)


@pytest.mark.parametrize(("ranks", "size", "link"), [
    ((0, 1, 2, 3, 4, 5, 6, 7), 8, "intra_node"), ((0, 4), 2, "intra_node"), ((8, 12), 2, "intra_node"),
    ((0, 8), 2, "inter_node"), (tuple(range(16)), 16, "inter_node"), ((), 8, "intra_node"), ((), 9, "inter_node")])
def test_a_group_crosses_the_network_when_its_ranks_span_nodes(ranks: tuple[int, ...], size: int,
                                                               link: str) -> None:
    assert get_interconnect("h100").link(ranks, size) == link


def _call(kind: str, payload: int, ranks: tuple[int, ...], op: str = "c10d::x", phase: str = "forward") -> Any:
    sent, received = rank_bytes(kind, payload, len(ranks))
    return CollectiveCall(0, op, kind, phase, "", GroupMeta("g", len(ranks), ranks), "g", payload, sent, received)


def test_collective_time_by_hand() -> None:
    h100 = get_interconnect("h100")
    gb = 10**9
    assert collective_time(_call("all_gather", 8 * gb, tuple(range(8))), h100) == pytest.approx(5e-6 + 7 * gb / 450e9)
    assert collective_time(_call("all_reduce", 2 * gb, (0, 8)), h100) == pytest.approx(10e-6 + 2 * gb / 50e9)
    assert collective_time(_call("all_reduce", gb, (0,)), h100) == 0.0  # a group of one moves nothing


def test_step_time_hides_process_group_collectives_behind_compute_and_exposes_functional_ones() -> None:
    h100 = get_interconnect("h100")
    ranks = tuple(range(8))
    fsdp = _call("all_gather", 9 * 10**9, ranks)  # 7/8 of 9 GB at 450 GB/s: 17.5 ms
    tp = _call("all_reduce", 10**9, ranks, op="_c10d_functional::all_reduce")  # 2·7/8 GB: 3.89 ms
    rs = _call("reduce_scatter", 9 * 10**9, ranks, phase="backward")
    t_fsdp, t_tp, t_rs = (collective_time(c, h100) for c in (fsdp, tp, rs))
    compute = {"forward": 0.010, "backward": 0.030, "total": 0.040}
    step = step_time(Communication([fsdp, tp, rs]), compute, h100)
    # forward: the all-gather outlasts the compute by t_fsdp - 10 ms, the TP all-reduce is exposed in full;
    # backward: the reduce-scatter hides behind 30 ms of compute
    assert step.phase("forward") == pytest.approx(0.010 + t_tp + (t_fsdp - 0.010))
    assert step.phase("backward") == pytest.approx(0.030)
    assert step.total == pytest.approx(step.phase("forward") + 0.030)
    assert step.communication == pytest.approx(t_fsdp + t_tp + t_rs)
    assert "exposed" in step.to_dict()["assumption"] and step.to_dict()["total"] == step.total


def test_analysis_step_time_of_fsdp(world: int) -> None:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = _fsdp(_mesh((world,), ("fsdp",)))
    x = _materialised(model, mode)
    with mode:
        analysis = modelmeter.analyze(model, x, backward=True, quiet=True, device="h100")
    step = analysis.step_time()
    assert step is not None and analysis.roofline is not None
    times = analysis.roofline.summary["time"]
    assert step.compute == {phase: times[phase] for phase in ("forward", "backward")}
    calls = analysis.communication.calls
    h100 = get_interconnect("h100")
    assert step.overlapped["forward"] == pytest.approx(sum(collective_time(c, h100) for c in calls
                                                           if c.phase == "forward"))
    assert not step.exposed  # FSDP2's collectives are all process-group operators
    assert step.total >= times["total"]
    assert analysis.step_time(Interconnect("slow", intra_node=1e6, inter_node=1e6)).total > step.total


def test_every_operator_the_tables_name_exists() -> None:
    """A misspelt name in the collectives' table would silently count nothing: each is an operator of this torch."""
    for name in [*collectives(), *FSDP_COPIES, *BOOKKEEPING_OPS]:
        namespace, _, op = name.partition("::")
        assert getattr(getattr(torch.ops, namespace), op).overloads(), name


def test_a_run_without_collectives_steps_in_its_compute_time() -> None:
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU())
    analysis = modelmeter.analyze(model, torch.randn(4, WIDTH), backward=True, quiet=True, device="a100")
    step = analysis.step_time()
    assert step is not None and analysis.roofline is not None
    assert not analysis.communication.calls and step.communication == 0
    assert step.total == pytest.approx(analysis.roofline.summary["time"]["total"])
    assert modelmeter.analyze(model, torch.randn(4, WIDTH), quiet=True).step_time() is None  # no device, no time
