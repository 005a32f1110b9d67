"""What one training step costs: forward and backward FLOPs by module, in the convention you choose.

Run: python examples/training_cost.py
"""

import torch
from torch import nn

from modelmeter import FlopCountAnalysis

model = nn.Sequential(
    nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
)
images, labels = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))

step = FlopCountAnalysis(model, images, convention="macs", backward=True,
                         loss_fn=lambda logits: nn.functional.cross_entropy(logits, labels))
print(step.by_phase())

conv_macs = 8 * 16 * 3 * 3 * 3 * 32 * 32   # batch x weight elements x output positions
linear_macs = 8 * 16 * 10
# The first convolution's input needs no gradient: its backward is the weight gradient only (1x forward).
# The last layer computes the gradients of its weight and of its input (2x forward).
assert step.by_phase("0") == {"forward": conv_macs, "backward": conv_macs}
assert step.by_phase("5") == {"forward": linear_macs, "backward": 2 * linear_macs}

# Freeze the convolution: its weight gradient disappears, and nothing flows back through it.
model[0].requires_grad_(False)
frozen = FlopCountAnalysis(model, images, convention="macs", backward=True)
assert frozen.by_phase("0")["backward"] == 0
print("frozen backbone:", frozen.by_phase())
