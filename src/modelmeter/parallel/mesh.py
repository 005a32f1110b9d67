"""One rank of a plan's world, simulated in this process: torch's fake process group and a DeviceMesh over it.

The fake backend (``torch.testing._internal.distributed.fake_pg``, what PyTorch's own tests use) answers every
collective at once without sending anything, so one process can be any rank of any world size — 1024 ranks set up
in milliseconds. Everything that runs on it is torch's: DeviceMesh, FSDP2, DTensor.

The mesh has a dimension for each of the plan's dimensions with more than one rank (:attr:`ParallelPlan.mesh`).
A dimension of one rank gets none: torch's data-parallel and tensor-parallel machinery on a one-rank group still
issues (trivial) collectives and wrapper operators that a run without that dimension does not have, and they would
be counted.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .._torch_compat import fake_store, kept_distributed_globals
from ..errors import ParallelPlanError
from .plan import ParallelPlan


@contextmanager
def simulated_mesh(plan: ParallelPlan) -> Iterator[DeviceMesh | None]:
    """The device mesh of ``plan``'s dimensions, as seen by ``plan.rank``, on a fake process group of
    ``plan.world_size`` ranks; None for a plan of one rank (nothing to set up).

    The default process group is torch's global state: one that is already set up (a real training job's, say)
    is refused with a clear error rather than replaced, since everything that runs here would see the fake group
    as the one of the job. On exit the group and the mesh's subgroups are destroyed, what torch keeps globally for
    them (c10d's backend name, ``sys.excepthook``, DTensor's random-number tracker) is put back and DTensor's caches
    are emptied, so torch's distributed state is as it was, also when the block raises
    (:func:`~modelmeter._torch_compat.kept_distributed_globals`)."""
    if plan.world_size == 1:
        yield None
        return
    if dist.is_initialized():
        raise ParallelPlanError("a default process group is already initialised in this process; a parallel "
                                "analysis simulates its ranks on a fake one of its own: run it where no process "
                                "group is set up (e.g. before init_process_group, or in another process)")
    with kept_distributed_globals():
        dist.init_process_group("fake", store=fake_store(), rank=plan.rank, world_size=plan.world_size)
        try:
            dims = plan.mesh
            yield init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
        finally:
            dist.destroy_process_group()


def group_names(mesh: DeviceMesh | None, flattened: Mapping[str, DeviceMesh]) -> dict[str, str]:
    """The process group of each of the mesh's dimensions, and of each ``flattened`` one-dimensional mesh, by its
    name (what a collective names) -> the dimension's name."""
    if mesh is None or mesh.mesh_dim_names is None:
        return {}
    groups = {str(mesh.get_group(name).group_name): name for name in mesh.mesh_dim_names}
    groups.update({str(flat.get_group().group_name): name for name, flat in flattened.items()})
    return groups

