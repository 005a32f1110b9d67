"""How much memory a training step needs, where it peaks, and what activation checkpointing saves.

Run: python examples/training_memory.py
"""

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from modelmeter import MemoryAnalysis


class Net(nn.Module):
    def __init__(self, use_checkpoint: bool) -> None:
        super().__init__()
        self.stem = nn.Linear(256, 1024)
        self.body = nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU())
        self.head = nn.Linear(1024, 10)
        self.use_checkpoint = use_checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        h = checkpoint(self.body, h, use_reentrant=False) if self.use_checkpoint else self.body(h)
        return self.head(h)


x = torch.randn(64, 256)
plain = MemoryAnalysis(Net(False), x, training=True, optimizer="adamw")
top = plain.peak_info()
print(f"peak {top.bytes / 2**20:.1f} MiB in the {top.at.phase} of {top.at.module or 'the model'} ({top.at.operator})")
print({kind: f"{n / 2**20:.2f} MiB" for kind, n in top.by_kind.items()})

params = sum(p.numel() for p in Net(False).parameters()) * 4
assert top.by_kind["parameter"] == params
assert top.by_kind["optimizer_state"] == 2 * params + 4 * 8   # AdamW: two moments and a 4-byte step per tensor

# The body saves its input (for the first Linear), both GELUs' inputs and the first GELU's output (for the second
# Linear): 4 x 64 x 1024 floats; the head saves the body's output.
row = 64 * 1024 * 4
assert plain.saved_for_backward("body") == 4 * row
ckpt = MemoryAnalysis(Net(True), x, training=True, optimizer="adamw")
assert ckpt.saved_for_backward("body") == 0          # recomputed in the backward pass instead
assert ckpt.saved_for_backward() == 2 * row          # the checkpoint keeps the body's input; the head saves its own
print("saved for backward:", plain.saved_for_backward() // 1024, "KiB ->", ckpt.saved_for_backward() // 1024, "KiB")
