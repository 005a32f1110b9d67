"""Subprocess targets for tests/test_checkpoint.py: a SIGKILL loop and 2-rank gloo workers (DDP, FSDP2).

Kept out of the test module so that spawned / forked processes import only this file.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from typing import Any

import torch
from torch import nn

from modelmeter.checkpoint import Checkpointer, PeriodicCheckpointer


class TinyNet(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, width)
        self.fc2 = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def batch(step: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


# --- SIGKILL during save ------------------------------------------------------------------------------------------


class KillNet(nn.Module):
    """Small, but large enough (~1 MB) that a save takes a while and kills land inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("big", torch.zeros(256 * 1024))

    def fill(self, value: float) -> None:
        with torch.no_grad():
            self.fc.weight.fill_(value)
            self.fc.bias.fill_(value)
            self.big.fill_(value)


def _writer(save_dir: str, fmt: str) -> None:
    """Child: resume from the last checkpoint, then save iteration after iteration until killed."""
    model = KillNet()
    checkpointer = Checkpointer(model, save_dir, format=fmt)
    extra = checkpointer.resume_or_load("", resume=True)
    periodic = PeriodicCheckpointer(checkpointer, period=1, max_to_keep=2, file_prefix="model")
    iteration = int(extra["iteration"]) + 1
    while True:
        model.fill(float(iteration))
        periodic.step(iteration)
        iteration += 1


def _check(save_dir: str) -> tuple[int, str]:
    """The last checkpoint exists and is complete and self-consistent; returns its iteration and file name."""
    model = KillNet()
    checkpointer = Checkpointer(model, save_dir)
    path = checkpointer.get_checkpoint_file()
    assert os.path.isfile(path), f"last_checkpoint names {path!r}, which does not exist"
    extra = checkpointer.load(path)  # no fallback here: the named file itself must load
    iteration = int(extra["iteration"])
    assert os.path.basename(path) == f"model_{iteration:07d}.pth", (path, iteration)
    for tensor in (model.fc.weight, model.fc.bias, model.big):
        assert torch.all(tensor == float(iteration)), f"{path}: weights do not belong to iteration {iteration}"
    return iteration, os.path.basename(path)


def kill_loop(save_dir: str, trials: int, seed: int, fmt: str) -> dict[str, Any]:
    # Children are forked from this process: keep torch off OpenMP threads, which do not survive fork().
    torch.set_num_threads(1)
    rng = random.Random(seed)
    model = KillNet()
    model.fill(0.0)
    Checkpointer(model, save_dir, format=fmt).save("model_0000000", iteration=0)
    iterations = [0]
    interrupted = 0  # trials whose kill left a fresh temp file: the child died inside an atomic write
    temp_files: set[str] = set()
    for _ in range(trials):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            try:
                _writer(save_dir, fmt)
            finally:
                os._exit(0)
        time.sleep(rng.uniform(0.0, 0.12))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        now = {n for n in os.listdir(save_dir) if n.endswith(".tmp")}
        interrupted += bool(now - temp_files)
        temp_files = now
        iteration, _ = _check(save_dir)
        iterations.append(iteration)
    # Under load a child may die after every save but before its retention step, so leftovers pile up; one save
    # that runs to completion must bring them down to max_to_keep.
    model = KillNet()
    checkpointer = Checkpointer(model, save_dir, format=fmt)
    final = int(checkpointer.resume_or_load("", resume=True)["iteration"]) + 1
    model.fill(float(final))
    PeriodicCheckpointer(checkpointer, period=1, max_to_keep=2, file_prefix="model").step(final)
    checkpoints = sorted(n for n in os.listdir(save_dir) if n.endswith(".pth"))
    return {
        "iterations": iterations,
        "checkpoints": checkpoints,
        "interrupted_writes": interrupted,
        "final_iteration": final,
    }


# --- 2-rank gloo workers ------------------------------------------------------------------------------------------


def dist_worker(rank: int, world: int, workdir: str) -> None:
    """DDP save/load then FSDP2 sharded save/load on a 2-rank CPU gloo group; results go to result_<rank>.json."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from modelmeter.checkpoint import checkpointer as ckpt_module

    if sys.platform.startswith("linux") and os.path.isdir("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # stay on loopback whatever the hostname resolves to
    dist.init_process_group(
        "gloo", init_method=f"file://{os.path.join(workdir, 'rendezvous')}", rank=rank, world_size=world
    )
    result: dict[str, Any] = {}
    writes: list[str] = []
    original_write = ckpt_module.atomic_write

    def counting_write(path: str, write: Any) -> None:
        writes.append(os.path.basename(path))
        original_write(path, write)

    ckpt_module.atomic_write = counting_write  # type: ignore[assignment]
    try:
        # --- DDP: rank 0 writes, every rank waits and loads
        ddp_dir = os.path.join(workdir, "ddp")
        torch.manual_seed(0)
        ddp = DistributedDataParallel(TinyNet())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        for step in range(2):
            x, y = batch(step, rank)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        Checkpointer(ddp, ddp_dir, optimizer=opt).save("ddp_model", iteration=2)
        result["ddp_file_visible_after_save"] = os.path.isfile(os.path.join(ddp_dir, "ddp_model.pth"))
        result["ddp_writes"] = list(writes)
        torch.manual_seed(100 + rank)
        fresh = DistributedDataParallel(TinyNet())
        fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
        extra = Checkpointer(fresh, ddp_dir, optimizer=fresh_opt).resume_or_load("", resume=True)
        result["ddp_extra"] = extra
        result["ddp_loaded_equal"] = all(
            torch.equal(a, b)
            for a, b in zip(ddp.module.state_dict().values(), fresh.module.state_dict().values(), strict=True)
        )
        result["ddp_momentum_equal"] = all(
            torch.equal(opt.state[p]["momentum_buffer"], fresh_opt.state[q]["momentum_buffer"])
            for p, q in zip(ddp.parameters(), fresh.parameters(), strict=True)
        )
        dist.barrier()

        # --- FSDP2 (fully_shard on a 1-D CPU mesh): every rank writes its shards through DCP
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        writes.clear()
        sharded_dir = os.path.join(workdir, "sharded")
        mesh = init_device_mesh("cpu", (world,))

        def sharded_model(seed: int) -> nn.Module:
            torch.manual_seed(seed)
            model = TinyNet(width=8)
            fully_shard(model.fc1, mesh=mesh)
            fully_shard(model.fc2, mesh=mesh)
            fully_shard(model, mesh=mesh)
            return model

        model = sharded_model(0)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for step in range(2):
            x, y = batch(step, rank)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            sched.step()
        result["param_type"] = type(model.fc1.weight).__name__
        Checkpointer(model, sharded_dir, optimizer=opt, scheduler=sched).save("sharded", iteration=7)
        result["sharded_writes"] = list(writes)
        full = StateDictOptions(full_state_dict=True)
        reference = {"model": get_model_state_dict(model, options=full)}
        reference["optimizer"] = get_optimizer_state_dict(model, opt, options=full)
        if rank == 0:
            torch.save(reference, os.path.join(workdir, "sharded_reference.pt"))

        # reload on the same two ranks into a differently initialised sharded model
        model2 = sharded_model(1)
        opt2 = torch.optim.Adam(model2.parameters(), lr=0.01)
        sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
        extra = Checkpointer(model2, sharded_dir, optimizer=opt2, scheduler=sched2).resume_or_load("", resume=True)
        result["sharded_extra"] = extra
        reloaded = get_model_state_dict(model2, options=full)
        result["sharded_reload_equal"] = all(torch.equal(reference["model"][k], v) for k, v in reloaded.items())
        result["sharded_sched_equal"] = sched2.state_dict() == sched.state_dict()
        reloaded_opt = get_optimizer_state_dict(model2, opt2, options=full)
        result["sharded_opt_equal"] = all(
            torch.equal(reference["optimizer"]["state"][k]["exp_avg"], v["exp_avg"])
            for k, v in reloaded_opt["state"].items()
        )
        dist.barrier()
    finally:
        ckpt_module.atomic_write = original_write  # type: ignore[assignment]
        with open(os.path.join(workdir, f"result_{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.destroy_process_group()


if __name__ == "__main__":
    command = sys.argv[1]
    if command == "kill-loop":  # kill-loop '[{"dir": ..., "trials": 30, "seed": 0, "format": "pth"}, ...]'
        runs = json.loads(sys.argv[2])
        print(json.dumps([kill_loop(r["dir"], r["trials"], r["seed"], r["format"]) for r in runs]))
    else:
        raise SystemExit(f"unknown command {command}")
