"""Parallel training plans run on PyTorch's own distributed machinery (fake process group, DeviceMesh, FSDP2,
``parallelize_module``), one rank's cost recorded as any other run."""
