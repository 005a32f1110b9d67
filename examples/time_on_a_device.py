"""Where the time goes: a bfloat16 Linear on an H100, memory-bound at a small batch, compute-bound at a large one.

The prediction is the roofline (docs/roofline.md): the layer's time is the longer of its FLOPs at the tensor
cores' bfloat16 peak and its bytes at the memory bandwidth. No GPU and no weights are needed: the layer is built
on the meta device. Run: python examples/time_on_a_device.py
"""

import torch
from torch import nn

import modelmeter

H100 = modelmeter.get_device("h100")
WIDTH = 4096
layer = nn.Linear(WIDTH, WIDTH, bias=False, device="meta", dtype=torch.bfloat16)

for batch in (16, 1024):
    x = torch.empty(batch, WIDTH, device="meta", dtype=torch.bfloat16)
    result = modelmeter.analyze(layer, x, device="h100").result()

    # by hand: 2 FLOPs per multiply-add; 2 bytes per element read (input, weight) or written (output)
    flops = 2 * batch * WIDTH * WIDTH
    moved = 2 * (batch * WIDTH + WIDTH * WIDTH + batch * WIDTH)
    compute, memory = flops / H100.peak("bfloat16", matrix=True), moved / H100.bandwidth
    assert result.total("bytes") == moved
    assert abs(result.total("time") - max(compute, memory)) <= 1e-9 * max(compute, memory)
    assert result.total("intensity") == flops / moved
    bound = "compute" if compute >= memory else "memory"
    assert (result.total("compute_bound") == 1.0) == (bound == "compute")
    print(f"batch {batch:5}: {result.total('time') * 1e6:7.2f} µs, {flops / moved:6.1f} FLOPs/byte, {bound}-bound "
          f"(the ridge is at {H100.ridge('bfloat16'):.0f} FLOPs/byte)")
