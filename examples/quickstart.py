"""Count a model's FLOPs, activations and parameters the way fvcore does — from one fake-tensor run.

Run: python examples/quickstart.py
"""

import torch
from torch import nn

from modelmeter import ActivationCountAnalysis, FlopCountAnalysis, parameter_count


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 10, 1)
        self.act = nn.ReLU()
        self.fc = nn.Linear(1000, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.act(self.conv(x)), 1))


model = TinyNet()
inputs = torch.randn(1, 3, 10, 10)

flops = FlopCountAnalysis(model, inputs)  # nothing runs yet
print("total flops:", flops.total())  # the model runs once here, on FakeTensors
print("by module:", dict(flops.by_module()))
print("by operator:", dict(flops.by_operator()))

# A second metric reuses the recorded trace instead of running the model again.
acts = ActivationCountAnalysis(model, inputs, trace=flops.trace)
print("activations:", acts.total())
print("parameters:", parameter_count(model)[""])

assert flops.total() == 13000 and acts.total() == 1010
