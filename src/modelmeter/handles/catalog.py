"""The conventions and attention kernels by name, with what each counts: plain data, so the command's help and
the reports can name them without building a handle table (which reads torch's operator schemas)."""

from __future__ import annotations

CONVENTIONS = ("fvcore", "macs", "flops")

DESCRIPTIONS = {
    "fvcore": "one fused multiply-add = 1 flop; fvcore's per-element estimates for norms, adaptive average "
              "pooling and upsampling; everything else free",
    "macs": "multiply-adds of matrix products, convolutions and attention only",
    "flops": "real floating-point operations: a multiply-add = 2 flops, plus the documented per-element costs "
             "of element-wise operators, norms, softmax, pooling, reductions and bias adds",
}

# The kernels whose cost attention can be counted at (docs/attention.md)
ATTENTION_KERNELS = ("fused", "math")
