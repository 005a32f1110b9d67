"""The real-process-group oracle: one training step per rank on CPU processes joined by gloo, as plain data.

``run_real(cases, world_size)`` spawns ``world_size`` processes that join one gloo process group and run each
case: a small model built deterministically (an MLP stack, or the zoo's Llama at a tiny size), a parallel plan
applied with torch's own APIs (:func:`apply_fsdp`, :func:`apply_ddp`, :func:`apply_tp`), then one forward,
``loss = output.sum()`` and backward under ``CommDebugMode``, ``FlopCounterMode`` and :class:`LocalOps` (this
module's dispatch mode, which sees each rank's local operators as ``CommDebugMode`` does). Each rank returns,
as JSON-ready dicts: the collectives in issue order with their tensors, ``CommDebugMode``'s counts, and FLOPs.

``simulate(case, rank, world_size)`` runs modelmeter on the same case in this process, the way the parallel
simulation does: a fake process group, the model built on meta, the same plan, ``to_empty`` in a
``FakeTensorMode``, ``modelmeter.analyze(..., backward=True)``. The ``assert_*`` functions compare the two.
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from modelmeter.zoo.llama import Llama, LlamaConfig

# Every piece of a step is small: a hang (a rank waiting on a collective the others never issue) fails in seconds.
COLLECTIVE_TIMEOUT = timedelta(seconds=60)
RUN_TIMEOUT_S = 120.0
LLAMA = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    max_position_embeddings=32)
MLP_WIDTH, MLP_BLOCKS = 16, 2
BATCH, SEQ = 2, 8  # per rank (data parallel) or for every rank (tensor parallel)


# ---- models ------------------------------------------------------------------------------------------------
class MLPBlock(nn.Module):
    """x + down(relu(up(x))), no biases (torch's FlopCounterMode counts no bias additions)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width, bias=False)
        self.act = nn.ReLU()
        self.down = nn.Linear(4 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(x)))


class MLPStack(nn.Module):
    """``blocks`` MLP blocks one after the other."""

    def __init__(self, width: int = MLP_WIDTH, blocks: int = MLP_BLOCKS) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MLPBlock(width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def build_model(model: str) -> nn.Module:
    """The case's model on the current default device, its values fixed by seed 0."""
    torch.manual_seed(0)
    if model == "mlp":
        return MLPStack()
    return Llama(LLAMA)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks a plan wraps one by one (FSDP units, TP'd layers)."""
    if isinstance(model, Llama):
        return list(model.model.layers)
    return list(model.layers)  # type: ignore[arg-type]


def make_inputs(model: str, data_rank: int, batch: int = BATCH) -> torch.Tensor:
    """The inputs of one rank: its own data-parallel shard (seeded by ``data_rank``)."""
    generator = torch.Generator().manual_seed(100 + data_rank)
    if model == "mlp":
        return torch.randn(batch, SEQ, MLP_WIDTH, generator=generator)
    return torch.randint(0, LLAMA.vocab_size, (batch, SEQ), generator=generator)


# ---- plans, with torch's own APIs ---------------------------------------------------------------------------
def apply_fsdp(model: nn.Module, mesh: Any, mixed_precision: bool = False) -> nn.Module:
    """FSDP2 (ZeRO-3): ``fully_shard`` on every block, then on the root; ``mixed_precision``: bfloat16 parameters
    gathered and computed with, gradients reduced in float32 (float32 shards kept)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mixed_precision else MixedPrecisionPolicy()
    for block in blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def apply_ddp(model: nn.Module, mesh: Any) -> nn.Module:
    """DDP as FSDP2's ``replicate``: parameters whole on every rank, gradients all-reduced per block."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    for block in blocks(model):
        replicate(block, mesh=mesh)
    replicate(model, mesh=mesh)
    return model


def tp_plan(model: nn.Module) -> dict[str, Any]:
    """Megatron-style column-then-row pairs: every block's first projections split by columns, its last by rows."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if isinstance(model, Llama):
        per_block = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                     "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                     "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                     "mlp.down_proj": RowwiseParallel()}
        prefix = "model.layers"
    else:
        per_block = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        prefix = "layers"
    return {f"{prefix}.{i}.{name}": style for i in range(len(blocks(model))) for name, style in per_block.items()}


def apply_tp(model: nn.Module, mesh: Any, plan: dict[str, Any]) -> nn.Module:
    """``parallelize_module`` with ``plan``; a Llama's attention then runs its share of the heads (as torchtitan
    does: the projections' local outputs hold ``heads / tp`` heads)."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, mesh, plan)
    if isinstance(model, Llama):
        for block in blocks(model):
            attention = block.self_attn  # type: ignore[union-attr]
            attention.num_heads //= mesh.size()
            attention.num_kv_heads //= mesh.size()
    return model


@dataclass(frozen=True)
class Case:
    """One model under one plan: ``"fsdp"``, ``"fsdp-bf16"`` (mixed precision), ``"ddp"``, ``"tp"``, or
    ``"fsdp+tp"`` (a (ranks / 2, 2) mesh: tensor parallel over pairs of ranks, FSDP across them)."""

    model: str
    plan: str

    @property
    def name(self) -> str:
        return f"{self.model}-{self.plan}"

    def tp_degree(self, world_size: int) -> int:
        return {"tp": world_size, "fsdp+tp": 2}.get(self.plan, 1)

    def dp_degree(self, world_size: int) -> int:
        """How many shards of the batch the ranks run (each rank's data-parallel rank is ``rank // tp``)."""
        return world_size // self.tp_degree(world_size)

    def mesh(self, world_size: int) -> Any:
        """The device mesh of the plan on the current process group."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.plan == "fsdp+tp":
            return init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
        return init_device_mesh("cpu", (world_size,))

    def apply(self, model: nn.Module, mesh: Any) -> nn.Module:
        if self.plan in ("fsdp", "fsdp-bf16"):
            return apply_fsdp(model, mesh, mixed_precision=self.plan == "fsdp-bf16")
        if self.plan == "ddp":
            return apply_ddp(model, mesh)
        if self.plan == "tp":
            return apply_tp(model, mesh, tp_plan(model))
        apply_tp(model, mesh["tp"], tp_plan(model))  # the order torchtitan applies them in
        return apply_fsdp(model, mesh["dp"])

    def inputs(self, rank: int, world_size: int) -> torch.Tensor:
        return make_inputs(self.model, rank // self.tp_degree(world_size))


@dataclass(frozen=True)
class PlannerCase(Case):
    """The model under a plan as modelmeter's planner applies it: ``plan`` is the plan's text (``"fsdp=2,tp=2"``).
    The real run builds the plan's device mesh (its dimensions, outermost first) and applies the plan to the real
    model with ``modelmeter.parallel.apply.parallelize``, the planner's own code (blocks, order, styles, policies);
    it also measures the allocator peak of an AdamW training step (``measures_memory``)."""

    measures_memory: bool = True

    @property
    def parsed(self) -> Any:
        from modelmeter.parallel.plan import ParallelPlan

        return ParallelPlan.parse(self.plan)

    def tp_degree(self, world_size: int) -> int:
        return int(self.parsed.tp)

    def mesh(self, world_size: int) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        dims = self.parsed.mesh
        return init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))

    def apply(self, model: nn.Module, mesh: Any) -> nn.Module:
        from modelmeter.parallel.apply import parallelize

        parallelize(model, self.parsed, mesh)
        return model


def training_step(model: nn.Module, x: torch.Tensor) -> None:
    """Forward, ``output.sum()`` (modelmeter's default loss) and backward."""
    model(x).sum().backward()


# ---- what a rank saw ----------------------------------------------------------------------------------------
def op_name(func: Any) -> str:
    """``c10d::_allgather_base_`` for ``torch.ops.c10d._allgather_base_.default`` (the trace's spelling)."""
    namespace, _, rest = func.name().partition("::")
    return f"{namespace}::{rest.split('.')[0]}"


# Functional collectives' helpers that move no data: waiting on a result, wrapping it for autograd.
_NOT_COMMUNICATING = frozenset({"wait_tensor", "_wrap_tensor_autograd"})


def is_collective(op: str) -> bool:
    namespace, _, name = op.partition("::")
    return namespace in ("c10d", "_c10d_functional", "c10d_functional") and name not in _NOT_COMMUNICATING


def tensor_record(shape: Any, dtype: str) -> list[Any]:
    """[shape, dtype, bytes] of one tensor of a collective."""
    nbytes = math.prod(shape) * getattr(torch, dtype).itemsize
    return [list(shape), dtype, nbytes]


class LocalOps(TorchDispatchMode):
    """Records each rank's local operators: collectives with their tensors, and FLOPs by torch's own formulas
    (``torch.utils.flop_counter``'s registry). Calls on DTensors are left to DTensor (``NotImplemented``), which
    runs them as local operators seen here, as ``CommDebugMode`` does. Calls on FakeTensors are DTensor's sharding
    propagation working out an output's global shape (on its cache misses), no work of the step: not recorded."""

    def __init__(self) -> None:
        super().__init__()
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.distributed.tensor import DTensor
        from torch.utils.flop_counter import flop_registry

        self._dtensor, self._fake, self._formulas = DTensor, FakeTensor, flop_registry
        self.collectives: list[dict[str, Any]] = []
        self.flops: Counter[str] = Counter()
        self.saw_dtensor = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if any(issubclass(t, self._dtensor) for t in types):
            self.saw_dtensor = True
            return NotImplemented
        out = func(*args, **kwargs)
        if isinstance(func, torch._ops.OpOverload) and not any(issubclass(t, self._fake) for t in types):
            name = op_name(func)
            if is_collective(name):
                tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
                self.collectives.append({"op": name, "phase": _phase(), "tensors": [
                    tensor_record(t.shape, str(t.dtype).removeprefix("torch.")) for t in tensors]})
            formula = self._formulas.get(func._overloadpacket)
            if formula is not None:
                self.flops[name] += formula(*args, **kwargs, out_val=out)
        return out


def _phase() -> str:
    """``"backward"`` while autograd's engine runs a graph (its hooks and final callbacks included), else
    ``"forward"``."""
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


def observed_step(case: Case, rank: int, world_size: int) -> dict[str, Any]:
    """Run ``case`` on this rank of the live process group; what the rank saw, as plain data."""
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.utils.flop_counter import FlopCounterMode

    model = case.apply(build_model(case.model), case.mesh(world_size))
    x = case.inputs(rank, world_size)
    comm, flop_counter, local = CommDebugMode(), FlopCounterMode(display=False), LocalOps()
    with comm, flop_counter, local:
        training_step(model, x)
    comm_counts = {_qualified(op): n for op, n in comm.get_comm_counts().items()}
    observed = {"case": case.name, "rank": rank, "world_size": world_size, "collectives": local.collectives,
                "comm_debug_counts": comm_counts, "flops_by_op": dict(local.flops), "dtensor": local.saw_dtensor,
                "flop_counter_total": flop_counter.get_total_flops(),
                "flop_counter_by_op": {_qualified(op): n for op, n in flop_counter.get_flop_counts()["Global"].items()}}
    if getattr(case, "measures_memory", False):
        model.zero_grad(set_to_none=True)
        observed["memory"] = adamw_step_peak(model, x)
    return observed


def adamw_step_peak(model: nn.Module, x: torch.Tensor) -> dict[str, int]:
    """This rank's allocator peak of a steady training step with AdamW (``foreach=False``), as
    tests/memory_oracle.py measures it: bytes resident before the step (parameter shards, buffers, the input, the
    optimizer's state) plus the lowest peak of eight identical steps: a buffer a collective's asynchronous work
    frees a moment later on gloo's thread can only add (seen now and then on busy cores: the root's gathered
    parameters under FSDP2, an embedding-sized buffer under tensor parallelism; once in three of three steps, a
    32 KiB staging buffer in a CI run of the planner's fsdp=2 case, 11% over the prediction)."""
    from memory_oracle import steady_step_peak

    return steady_step_peak(model, (x,), torch.optim.AdamW(model.parameters(), foreach=False), steps=8)


def _qualified(packet: Any) -> str:
    """``c10d::allreduce_`` for the packet ``c10d.allreduce_`` (CommDebugMode's and FlopCounterMode's keys)."""
    return str(packet).replace(".", "::", 1)


# ---- spawning ------------------------------------------------------------------------------------------------
def _worker(rank: int, world_size: int, store_path: str, cases: list[Case], out_dir: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)  # the machine's cores are shared by every rank
    out = Path(out_dir) / f"rank{rank}.json"
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
        try:
            results = [observed_step(case, rank, world_size) for case in cases]
        finally:
            dist.destroy_process_group()
        out.write_text(json.dumps(results))
    except BaseException:
        out.with_suffix(".err").write_text(traceback.format_exc())
        raise


# Imported once by the fork server, not by each rank.
_PRELOAD = ["memory_oracle", "modelmeter.parallel.apply",
            "torch.distributed.fsdp", "torch.distributed.tensor.parallel", "torch.distributed.tensor.debug",
            "torch.distributed._composable.replicate_with_fsdp", "torch.utils.flop_counter"]


def run_real(cases: list[Case], world_size: int, timeout: float = RUN_TIMEOUT_S) -> list[list[dict[str, Any]]]:
    """Run every case on ``world_size`` spawned gloo processes; ``result[rank][i]`` is rank's record of case i.

    Raises ``RuntimeError`` with the failing rank's traceback, or on a run past ``timeout`` seconds (every
    process is killed)."""
    context = multiprocessing.get_context("forkserver")
    # The ranks fork from one server that imported torch and these modules once (and ran no kernel: no threads to
    # lose in the fork); each rank then costs its own work, not a fresh interpreter's imports.
    context.set_forkserver_preload([__name__, *_PRELOAD])
    with tempfile.TemporaryDirectory(prefix="gloo_runs_") as tmp:
        store_path = str(Path(tmp) / "store")
        processes = [context.Process(target=_worker, args=(rank, world_size, store_path, cases, tmp), daemon=True)
                     for rank in range(world_size)]
        for process in processes:
            process.start()
        try:
            _join_all(processes, timeout)
        finally:
            for process in processes:
                if process.is_alive():
                    process.kill()
                    process.join()
        errors = sorted(Path(tmp).glob("rank*.err"))
        if errors:  # every failed rank's traceback: the first to fail may have made the others fail
            raise RuntimeError("gloo run failed:\n" + "\n".join(f"{e.stem}: {e.read_text()}" for e in errors))
        failed = [p.exitcode for p in processes if p.exitcode != 0]
        if failed:
            raise RuntimeError(f"gloo run: processes exited with {failed}")
        return [json.loads((Path(tmp) / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def _join_all(processes: list[Any], timeout: float) -> None:
    """Wait for every rank; stop waiting as soon as one fails (the others would wait on it until the collective
    timeout) or at ``timeout``."""
    deadline = time.monotonic() + timeout
    pending = {process.sentinel: process for process in processes}
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"gloo run did not finish in {timeout:.0f} s (a rank hung on a collective?)")
        for sentinel in multiprocessing.connection.wait(list(pending), timeout=left):
            process = pending.pop(sentinel)  # type: ignore[call-overload]
            process.join()
            if process.exitcode != 0:
                return


# ---- the simulation of the same case --------------------------------------------------------------------------
@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """A fake process group as the simulation uses (one process stands for ``rank``), destroyed after."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def simulate(case: Case, rank: int, world_size: int, **analyze_options: Any) -> Any:
    """modelmeter's analysis of ``case`` on ``rank``: meta model, same plan, fake process group and tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import modelmeter

    with fake_process_group(rank, world_size):
        with torch.device("meta"):
            model = build_model(case.model)
        case.apply(model, case.mesh(world_size))
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            x = case.inputs(rank, world_size)
            return modelmeter.analyze(model, x, backward=True, convention="flops", quiet=True, **analyze_options)


def single_device(case: Case, world_size: int) -> Any:
    """modelmeter's analysis of the same step on one device: the whole batch (every data-parallel shard), no
    plan."""
    import modelmeter

    with torch.device("meta"):
        model = build_model(case.model)
    x = make_inputs(case.model, 0, BATCH * case.dp_degree(world_size)).to("meta")
    return modelmeter.analyze(model, x, backward=True, convention="flops", quiet=True)


def trace_collectives(trace: Any) -> list[dict[str, Any]]:
    """The collectives a modelmeter trace recorded (its dispatch events of c10d operators), in the format of
    :class:`LocalOps`."""
    from modelmeter.engine.trace import TensorMeta

    found = []
    for event in trace.events:
        if event.level == "dispatch" and is_collective(event.op):
            metas = [m for m in tree_leaves(event.inputs) if isinstance(m, TensorMeta)]
            found.append({"op": event.op, "phase": event.phase,
                          "tensors": [tensor_record(m.shape, m.dtype) for m in metas]})
    return found


# ---- the comparisons -------------------------------------------------------------------------------------------
def collective_counts(collectives: list[dict[str, Any]]) -> Counter[str]:
    return Counter(c["op"] for c in collectives)


def collective_bytes(collectives: list[dict[str, Any]]) -> Counter[str]:
    """Bytes of every tensor handed to each collective operator (outputs written in place included)."""
    total: Counter[str] = Counter()
    for c in collectives:
        total[c["op"]] += sum(t[2] for t in c["tensors"])
    return total


def assert_real_run_consistent(observed: dict[str, Any]) -> None:
    """The rank's own records agree: LocalOps' collective counts are CommDebugMode's; where no DTensor ran, its
    FLOPs are FlopCounterMode's (which also counts DTensor's sharding propagation, global-shape fake runs)."""
    # CommDebugMode names functional collectives by their legacy namespace (c10d_functional, not _c10d_functional)
    local = Counter({op.removeprefix("_"): n for op, n in collective_counts(observed["collectives"]).items()})
    assert local == Counter(observed["comm_debug_counts"]), observed["case"]
    if not observed["dtensor"]:
        assert observed["flops_by_op"] == observed["flop_counter_by_op"], observed["case"]


def assert_same_collectives(observed: dict[str, Any], trace: Any) -> None:
    """The simulation issued the real rank's collectives: the same operators, in the same order and phase
    (forward, backward), on tensors of the same shapes, dtypes and bytes."""
    simulated = trace_collectives(trace)
    assert collective_counts(simulated) == collective_counts(observed["collectives"]), observed["case"]
    assert simulated == observed["collectives"], observed["case"]


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
# modelmeter's names of the same work: a bias-free linear is one matrix product (its backward: mm).
MODELMETER_MATMUL_OPS = ("linear", "matmul", "mm", "addmm", "bmm", "baddbmm")


def matmul_flops_of(analysis: Any) -> int:
    """modelmeter's FLOPs of matrix products (convention ``flops``: 2 per multiply-add, as torch counts)."""
    by_op = analysis.metrics["flops"].by_operator()
    return sum(n for op, n in by_op.items() if op in MODELMETER_MATMUL_OPS)


def real_matmul_flops(observed: dict[str, Any]) -> int:
    return sum(n for op, n in observed["flops_by_op"].items() if op in MATMUL_OPS)


def assert_same_matmul_flops(observed: dict[str, Any], analysis: Any) -> None:
    """The simulated rank's matrix-product FLOPs are the real rank's local ones (torch's formulas)."""
    assert matmul_flops_of(analysis) == real_matmul_flops(observed), observed["case"]


def run_cases(world_size: int, cases: list[Case]) -> dict[str, list[Any]]:
    """``{case name: [rank 0's record, rank 1's, ...]}`` of one spawned run of every case."""
    per_rank = run_real(cases, world_size)
    return {case.name: [per_rank[rank][i] for rank in range(world_size)] for i, case in enumerate(cases)}
