"""Scaled dot-product attention on meta tensors, run as a fused kernel rather than as its math decomposition.

On the meta device PyTorch has no fused attention kernel to choose, so ``F.scaled_dot_product_attention``
falls back to the math path: it materialises the (L, S) scores and, in training, saves them. Every real
device runs a fused kernel where it can (the CPU's flash kernel, FlashAttention or memory-efficient attention
on CUDA), which keeps only the output and the log-sum-exp. A meta run therefore takes the path a CPU run
takes — the same conditions, the same preparation of the mask, the CPU flash kernel's meta implementation —
so a model without weights needs the memory its CPU run needs (and FLOPs are counted from the call either way).
"""

from __future__ import annotations

import math

import torch

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def fused_on_meta(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                  scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor | None:
    """The output of the fused kernel a CPU run would choose for these meta tensors, or None when the CPU too
    would run the math path (dropout, a strided last dimension, flash attention switched off)."""
    tensors = (query, key, value)
    if not (all(t.is_meta and t.dtype in _FLOATS and t.dim() in (3, 4) and t.stride(-1) == 1 for t in tensors)
            and dropout_p == 0.0 and torch.backends.cuda.flash_sdp_enabled()
            and query.dtype == key.dtype == value.dtype and query.dim() == key.dim() == value.dim()
            and (enable_gqa or query.size(-3) == key.size(-3))):
        return None
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # as the CPU path converts it: 0 / -inf
        attn_mask = torch.where(attn_mask, torch.scalar_tensor(0.0, dtype=query.dtype, device=query.device),
                                torch.scalar_tensor(-math.inf, dtype=query.dtype, device=query.device))
    batched = query.dim() == 4
    if not batched:
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
    output = _FLASH(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
    return output if batched else output.squeeze(0)

