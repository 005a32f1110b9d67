"""Attention is counted, and a model built on the meta device is analysed without any memory for weights.

Run: python examples/attention_on_meta.py
"""

import torch
from torch import nn

from modelmeter import FlopCountAnalysis

with torch.device("meta"):  # no parameter memory is allocated
    layer = nn.TransformerEncoderLayer(d_model=512, nhead=8, dim_feedforward=2048, batch_first=True)

batch, seq, dim = 2, 128, 512
tokens = torch.empty(batch, seq, dim, device="meta")
flops = FlopCountAnalysis(layer, tokens).uncalled_modules_warnings(False)
print(dict(flops.by_operator()))

# softmax(q kᵀ) v is two products: (seq x dim) @ (dim x seq) and (seq x seq) @ (seq x dim) per sample.
assert flops.by_operator()["scaled_dot_product_attention"] == 2 * batch * seq * seq * dim
# q, k, v and output projections (4 dim x dim) and the two feed-forward layers (2 dim x 2048), per token.
assert flops.by_operator()["linear"] == batch * seq * (4 * dim * dim + 2 * dim * 2048)
