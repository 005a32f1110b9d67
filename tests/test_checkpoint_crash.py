"""Crash safety and concurrency of the checkpointer: a save killed at every file-system step it takes.

A forked child runs the save with the file-system calls it makes (``os.replace``, ``os.fsync``, ``os.remove``, ...)
counted, and ends itself with ``os._exit`` at the k-th one: no ``except`` or ``finally`` of the save runs, as with
SIGKILL or a power cut at that instant. The parent then checks the directory as a restarted job would see it.
"""

from __future__ import annotations

import functools
import logging
import os
import select
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from modelmeter.checkpoint import Checkpointer, CheckpointError
from modelmeter.checkpoint import checkpointer as checkpointer_module
from modelmeter.io.cache_dir import directory_lock

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or sys.platform != "linux", reason="forks a child to kill")

_KILLED = 77
_COUNTED = ("replace", "rename", "fsync", "remove", "unlink", "rmdir", "mkdir", "link")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)


def _model(value: float) -> Net:
    model = Net()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def _kill_at(k: int, action: Callable[[], None], setup: Callable[[], None] = lambda: None) -> int:
    """Run ``action`` in a forked child that dies at its k-th counted file-system call; the child's exit code
    (``_KILLED`` if it died, 0 if the action finished first)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            setup()
            calls = [0]
            for name in _COUNTED:
                real = getattr(os, name)

                def counted(*args: object, _real: Callable[..., object] = real, **kwargs: object) -> object:
                    calls[0] += 1
                    if calls[0] == k:
                        os._exit(_KILLED)
                    return _real(*args, **kwargs)

                setattr(os, name, counted)
            logging.disable(logging.CRITICAL)
            action()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _resumed(save_dir: Path, sharded: bool) -> tuple[float, object]:
    """(the value of every weight, the saved iteration) after a fresh checkpointer resumes from ``save_dir``."""
    model = _model(-1.0)
    extra = Checkpointer(model, str(save_dir), sharded=sharded).resume_or_load("", resume=True)
    values = torch.cat([p.detach().flatten() for p in model.parameters()]).unique()
    assert len(values) == 1, f"a mix of two saves was loaded: {values}"
    return float(values[0]), extra.get("iteration")


def _no_leftovers(save_dir: Path) -> None:
    hidden = [n for n in os.listdir(save_dir) if n.startswith(".")]
    assert hidden == [], f"leftovers of killed saves: {hidden}"


def _two_step_renames() -> None:
    """Make the child rename a sharded checkpoint into place in two steps, as where no atomic swap exists."""
    checkpointer_module.exchange = lambda a, b: False  # type: ignore[attr-defined]


CASES = {
    "pth": ("pth", False, None),
    "safetensors": ("safetensors", False, None),
    "sharded": ("pth", True, None),
    "sharded_two_step_renames": ("pth", True, _two_step_renames),
}


def _sweeps() -> list[object]:
    """Every case and scenario; the sharded ones are slow (~25 steps, each a DCP save and load; the window of a
    two-step overwrite is also checked quickly by ``test_overwrite_killed_between_its_renames_...``)."""
    sweeps: list[object] = []
    for case in CASES:
        for scenario in ("first", "overwrite", "other_name"):
            slow = CASES[case][1]
            sweeps.append(pytest.param(case, scenario, marks=[pytest.mark.slow] if slow else []))
    return sweeps


@pytest.mark.parametrize(("case", "scenario"), _sweeps())
def test_save_killed_at_every_step_leaves_old_or_new(tmp_path: Path, case: str, scenario: str) -> None:
    """Killed at any step of a save, a restarted job resumes the old checkpoint or the new one, never a mix or
    nothing; ``last_checkpoint`` names a checkpoint that loads; the next save leaves no hidden leftovers."""
    fmt, sharded, setup = CASES[case]
    saved_before = scenario != "first"
    name = "other" if scenario == "other_name" else "a"
    template = tmp_path / "template"
    template.mkdir()
    if saved_before:
        Checkpointer(_model(1.0), str(template), format=fmt, sharded=sharded).save("a", iteration=1)
    k = 1
    while True:
        save_dir = tmp_path / f"k{k}"
        shutil.copytree(template, save_dir)
        saver = Checkpointer(_model(2.0), str(save_dir), format=fmt, sharded=sharded)
        code = _kill_at(k, functools.partial(saver.save, name, iteration=2), setup or (lambda: None))
        assert code in (0, _KILLED), f"the save failed at step {k} with exit code {code}"
        if (save_dir / "last_checkpoint").exists() or saved_before:
            value, iteration = _resumed(save_dir, sharded)
            assert (value, iteration) in ({(1.0, 1), (2.0, 2)} if saved_before else {(2.0, 2)}), k
            pointer = Checkpointer(_model(0.0), str(save_dir), sharded=sharded).get_checkpoint_file()
            assert os.path.exists(pointer), f"last_checkpoint names {pointer}, which is not there (step {k})"
        Checkpointer(_model(3.0), str(save_dir), format=fmt, sharded=sharded).save(name, iteration=3)
        _no_leftovers(save_dir)
        shutil.rmtree(save_dir)
        if code == 0:
            break
        k += 1
    assert k > 3  # the save took several steps, and each one was a place to die


def test_partial_of_killed_sharded_save_is_never_loaded_and_goes(tmp_path: Path) -> None:
    """A sharded save killed while writing shards leaves ``.<name>.partial/``: resuming ignores it (the old
    checkpoint loads) and removes it, and so does any later save (also of another name, also a plain one)."""
    Checkpointer(_model(1.0), str(tmp_path), sharded=True).save("a", iteration=1)
    partial = tmp_path / ".a.partial"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half a shard")
    assert _resumed(tmp_path, True) == (1.0, 1)
    assert not partial.exists()
    partial.mkdir()
    Checkpointer(_model(2.0), str(tmp_path)).save("plain", iteration=2)
    assert not partial.exists()


def test_overwrite_killed_between_its_renames_resumes_the_new_checkpoint(tmp_path: Path) -> None:
    """What a two-step replacement killed between its renames leaves (the old checkpoint aside, the complete new
    one still hidden, ``last_checkpoint`` naming the missing name) resumes from the new checkpoint."""
    Checkpointer(_model(1.0), str(tmp_path), sharded=True).save("a", iteration=1)
    Checkpointer(_model(2.0), str(tmp_path / "new"), sharded=True).save("a", iteration=2)
    os.replace(tmp_path / "a", tmp_path / ".a.old-0123abcd")
    os.replace(tmp_path / "new" / "a", tmp_path / ".a.partial")
    assert _resumed(tmp_path, True) == (2.0, 2)
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith(".a")) == []


def test_safetensors_overwrite_killed_between_its_files_loads_the_old_pair(tmp_path: Path) -> None:
    """Killed after the new weights replaced the old ones but before the new ``.pth``: the old ``.pth`` loads
    with the weights it was saved with (kept under its save id), not with the new ones."""
    Checkpointer(_model(1.0), str(tmp_path), format="safetensors").save("a", iteration=1)
    checkpointer = Checkpointer(_model(2.0), str(tmp_path), format="safetensors")
    real = os.replace

    def killed_at_the_pth(src: str, dst: str) -> None:
        if str(dst).endswith(".pth"):
            raise KeyboardInterrupt  # stands for the kill: the .pth is never replaced
        real(src, dst)

    os.replace = killed_at_the_pth  # type: ignore[assignment]
    try:
        with pytest.raises(KeyboardInterrupt):
            checkpointer.save("a", iteration=2)
    finally:
        os.replace = real
    assert _resumed(tmp_path, False) == (1.0, 1)
    visible = sorted(n for n in os.listdir(tmp_path) if not n.startswith("."))
    assert visible == ["a.pth", "a.safetensors", "last_checkpoint"]


def _child(action: Callable[[], None]) -> int:
    """Fork a child that runs ``action`` (exit code 0, or 1 if it raised); its pid."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            logging.disable(logging.CRITICAL)
            action()
            code = 0
        finally:
            os._exit(code)
    return pid


def test_safetensors_pair_not_mixed_by_two_savers(tmp_path: Path) -> None:
    """Process B saves the same safetensors name while process A is between its two files (A waits up to 2 s
    for B there): without the save lock B's pair lands in between and A's ``.pth`` then names B's weights."""
    go_read, go_write = os.pipe()
    done_read, done_write = os.pipe()

    def save_b() -> None:
        os.read(go_read, 1)
        Checkpointer(_model(2.0), str(tmp_path), format="safetensors").save("a", iteration=2)
        os.write(done_write, b"1")

    def save_a() -> None:
        real = os.replace

        def replace_then_let_b_in(src: str, dst: str) -> None:
            real(src, dst)
            if str(dst).endswith(".safetensors"):
                os.write(go_write, b"1")
                select.select([done_read], [], [], 2.0)

        os.replace = replace_then_let_b_in  # type: ignore[assignment]
        Checkpointer(_model(1.0), str(tmp_path), format="safetensors").save("a", iteration=1)

    Checkpointer(_model(0.0), str(tmp_path), format="safetensors").save("a", iteration=0)
    for pid in [_child(save_b), _child(save_a)]:
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    assert _resumed(tmp_path, False) in {(1.0, 1), (2.0, 2)}
    _no_leftovers(tmp_path)

@pytest.mark.parametrize(
    ("saved", "loaded", "says"),
    [
        (torch.optim.SGD, torch.optim.Adam, "holds no 'optimizer:optimizer.param_groups.0.betas'"),
        (torch.optim.Adam, torch.optim.Adam, "has shape (3, 4) in the checkpoint but (3, 5) here"),
    ],
)
def test_sharded_optimizer_that_does_not_fit_is_incompatible(
    tmp_path: Path, saved: type[torch.optim.Optimizer], loaded: type[torch.optim.Optimizer], says: str
) -> None:
    """Another optimizer class, or parameters of other shapes: ``reason="incompatible"`` in one line naming the key
    (was ``"corrupt"`` with DCP's multi-line traceback), and nothing is loaded."""

    def trained(model: nn.Module, optimizer_class: type[torch.optim.Optimizer]) -> torch.optim.Optimizer:
        optimizer = optimizer_class(model.parameters(), lr=0.1)
        model.fc(torch.ones(2, model.fc.in_features)).sum().backward()
        optimizer.step()
        return optimizer

    source = _model(1.0)
    Checkpointer(source, str(tmp_path), sharded=True, optimizer=trained(source, saved)).save("a")
    target = _model(2.0)
    if saved is loaded:
        target.fc = nn.Linear(5, 3)
    optimizer = trained(target, loaded)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        Checkpointer(target, str(tmp_path), sharded=True, optimizer=optimizer).load(str(tmp_path / "a"))
    assert info.value.reason == "incompatible" and says in str(info.value) and "\n" not in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_directory_lock_excludes_another_process_and_leaves_no_file(tmp_path: Path) -> None:
    """The save lock is an ``flock`` on ``save_dir`` itself: another process waits for it (here: times out), the
    kernel drops it when its holder dies, and no lock file joins fvcore's layout."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child holds the lock until killed
        with directory_lock(tmp_path) as locked:
            os.write(write, b"1" if locked else b"0")
            time.sleep(60)
        os._exit(0)
    try:
        assert os.read(read, 1) == b"1"
        with pytest.raises(TimeoutError), directory_lock(tmp_path, timeout=0.2):
            pass
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    with directory_lock(tmp_path, timeout=5) as locked:
        assert locked
    assert os.listdir(tmp_path) == []
