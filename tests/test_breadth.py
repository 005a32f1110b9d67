"""Patterns from real third-party models that the zoo probes found uncounted or miscounted, reproduced small.

Oracles: torch's own kernels (a decomposition's values equal the fused operator's before its count is used),
and composition (a fused operator's ``flops`` count equals that of its decomposition run as separate element-wise
operators and reductions, counted by the rules of docs/handles.md).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from model_helpers import Fn
from modelmeter import FlopCountAnalysis


def flops(fn: Callable[..., Any], *inputs: torch.Tensor, convention: str = "flops") -> FlopCountAnalysis:
    analysis = FlopCountAnalysis(Fn(fn), inputs, convention=convention)
    return analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False)


def _other_dims(v: torch.Tensor, dim: int) -> list[int]:
    return [d for d in range(v.dim()) if d != dim % v.dim()]


def _weight_norm(v: torch.Tensor, g: torch.Tensor, dim: int) -> torch.Tensor:
    return v * (g / torch.linalg.vector_norm(v, dim=_other_dims(v, dim), keepdim=True))


def _weight_norm_grad(grad_w: torch.Tensor, v: torch.Tensor, g: torch.Tensor, norm: torch.Tensor,
                      dim: int) -> tuple[torch.Tensor, ...]:
    """Both gradients from the saved norms, as ``_weight_norm_interface_backward`` computes them."""
    a = (grad_w * v).sum(_other_dims(v, dim), keepdim=True)
    return (g / norm) * (grad_w - v * (a / (norm * norm))), a / norm


# --- weight normalisation (wav2vec2's positional convolution, HiFi-GAN, WaveNet) ------------------------
@pytest.mark.parametrize("dim", [0, 2])
def test_fused_weight_norm_counts_its_decomposition(dim: int) -> None:
    # dim 0 and the last run the fused _weight_norm_interface, which had no handle: reported unsupported, 0 FLOPs
    v = torch.randn(6, 4, 3)
    g = torch.linalg.vector_norm(v, dim=_other_dims(v, dim), keepdim=True) * 2
    torch.testing.assert_close(torch._weight_norm(v, g, dim), _weight_norm(v, g, dim))
    fused = flops(lambda v, g: torch._weight_norm(v, g, dim), v, g)
    decomposed = flops(lambda v, g: _weight_norm(v, g, dim), v, g)
    assert fused.unsupported_ops() == Counter() == decomposed.unsupported_ops()
    assert fused.total() == decomposed.total() == 3 * v.numel() + 2 * g.numel()


def test_weight_norm_middle_dimension_runs_the_same_decomposition() -> None:
    # dim 1 of a 3-D weight is decomposed by torch itself (norm, div, mul): the handle's count agrees with it
    v = torch.randn(6, 4, 3)
    g = torch.randn(1, 4, 1)
    counted = flops(lambda v, g: torch._weight_norm(v, g, 1), v, g)
    assert counted.unsupported_ops() == Counter()
    assert counted.total() == 3 * v.numel() + 2 * g.numel()


@pytest.mark.parametrize("dim", [0, 2])
def test_weight_norm_backward_counts_its_gradient_formula(dim: int) -> None:
    v, grad_w = torch.randn(6, 4, 3), torch.randn(6, 4, 3)
    g = torch.randn(*[v.shape[d] if d == dim else 1 for d in range(3)])
    vg, gg = v.clone().requires_grad_(), g.clone().requires_grad_()
    expected = torch.autograd.grad(torch._weight_norm(vg, gg, dim), (vg, gg), grad_w)
    norms = torch.linalg.vector_norm(v, dim=_other_dims(v, dim), keepdim=True)
    for got, want in zip(_weight_norm_grad(grad_w, v, g, norms, dim), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    fused = flops(lambda *t: torch.ops.aten._weight_norm_interface_backward(*t, dim), grad_w, v, g, norms)
    decomposed = flops(lambda *t: _weight_norm_grad(*t, dim), grad_w, v, g, norms)
    assert fused.unsupported_ops() == Counter()
    assert fused.total() == decomposed.total() == 5 * v.numel() + 4 * g.numel()


@pytest.mark.parametrize("convention", ["fvcore", "macs"])
def test_weight_norm_is_known_and_free_in_the_other_conventions(convention: str) -> None:
    conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 4, 3, padding=1), dim=2)
    analysis = FlopCountAnalysis(conv, torch.randn(1, 4, 8), convention=convention, backward=True)
    assert analysis.unsupported_ops() == Counter()
    assert analysis.total() == 2 * 4 * 4 * 3 * 8  # the convolution forward, its input and weight gradients


# --- nn.Unfold / nn.Fold (ConvBERT's span-based convolution, timm's and diffusion models' patch tricks) -------
@pytest.mark.parametrize(("kernel", "dilation", "padding", "stride"), [
    ((3, 3), 1, 0, 1), ((3, 2), 1, 1, 1), ((2, 3), (2, 1), (1, 2), (2, 1)), ((4, 4), 1, 0, 4)])
def test_fold_counts_the_adds_that_land_and_unfold_is_free(kernel: Any, dilation: Any, padding: Any,
                                                          stride: Any) -> None:
    # im2col/col2im had no entry in any convention: nn.Unfold and nn.Fold were reported unsupported
    x = torch.randn(2, 3, 9, 8)
    options = {"kernel_size": kernel, "dilation": dilation, "padding": padding, "stride": stride}
    columns = nn.functional.unfold(x, **options)
    # oracle: folding ones counts, at every output position, the block elements added there
    landing = int(nn.functional.fold(torch.ones_like(columns), (9, 8), **options).sum().item())
    unfold = flops(lambda t: nn.functional.unfold(t, **options), x)
    fold = flops(lambda t: nn.functional.fold(t, (9, 8), **options), columns)
    assert unfold.unsupported_ops() == Counter() == fold.unsupported_ops()
    assert unfold.total() == 0
    assert fold.total() == landing
    for convention in ("fvcore", "macs"):
        assert flops(lambda t: nn.functional.fold(t, (9, 8), **options), columns, convention=convention).total() == 0


def test_unfold_backward_is_the_fold_of_its_gradient() -> None:
    x = torch.randn(1, 2, 6, 6, requires_grad=True)
    model = Fn(lambda t: nn.functional.unfold(t, 3, padding=1))
    analysis = FlopCountAnalysis(model, (x,), convention="flops", backward=True)
    analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False)
    columns = nn.functional.unfold(x.detach(), 3, padding=1)
    landing = int(nn.functional.fold(torch.ones_like(columns), (6, 6), 3, padding=1).sum().item())
    assert analysis.unsupported_ops() == Counter()
    assert analysis.by_operator()["col2im"] == landing


# --- what a researcher may bring that cannot be analysed: told so, not a stack trace from the cache ----------
@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit.script is deprecated
@pytest.mark.parametrize("make", [torch.jit.script, lambda m: torch.jit.trace(m, torch.randn(2, 4))],
                         ids=["script", "trace"])
def test_torchscript_module_is_refused_by_name(make: Callable[[nn.Module], nn.Module]) -> None:
    # was AttributeError "'_CachedForward' object has no attribute '__getattr__'" from the in-process cache key
    import modelmeter

    model = make(nn.Sequential(nn.Linear(4, 3), nn.ReLU()).eval())
    with pytest.raises(TypeError, match="TorchScript module .* pass the nn.Module it was made from"):
        modelmeter.analyze(model, torch.randn(2, 4), quiet=True)
    with pytest.raises(TypeError, match="TorchScript"):
        FlopCountAnalysis(model, torch.randn(2, 4)).total()


# --- attention with a learned additive mask (T5's relative position bias) on the meta device ---------------
class LearnedBiasAttention(nn.Module):
    """Self-attention whose float mask is a parameter, as T5 passes its position bias to SDPA."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.bias = nn.Parameter(torch.zeros(1, 2, 8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.proj(x).view(1, 8, 2, 8).transpose(1, 2)
        return nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=self.bias)


@pytest.mark.parametrize("backward", [False, True])
def test_meta_run_takes_the_math_path_for_a_mask_that_requires_grad(backward: bool) -> None:
    # the CPU runs the math path when the mask requires a gradient (its fused kernel has none); the meta run chose
    # the fused kernel and failed the training step ("not differentiable with respect to argument 'attn_mask'")
    import modelmeter

    def ops(device: str) -> list[tuple[str, str]]:
        with torch.device(device):
            model, x = LearnedBiasAttention(), torch.randn(1, 8, 16)
        analysis = modelmeter.analyze(model, x, backward=backward, quiet=True, execution="fake")
        return [(e.op, e.phase) for e in analysis.trace.events if e.level == "dispatch"]

    on_cpu = ops("cpu")
    assert ("aten::_scaled_dot_product_flash_attention_for_cpu", "forward") not in on_cpu
    assert ops("meta") == on_cpu


# --- a meta model that reads its own values (Encodec's padding from tensor buffers) ---------------------------
class PaddingFromBuffer(nn.Module):
    """Pads by an amount kept in a tensor buffer, as HF's Encodec computes its convolutions' padding."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("pad", torch.tensor(3), persistent=False)
        self.conv = nn.Conv1d(1, 1, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(nn.functional.pad(x, (0, int(self.pad) * 2 - 6)))


def test_failure_after_a_guessed_meta_value_names_the_guess() -> None:
    # the error was torch's alone ("Kernel size can't be greater than actual input size"), hiding its cause: the run
    # had read the meta buffer's value as 1
    import modelmeter

    cpu = modelmeter.analyze(PaddingFromBuffer(), torch.randn(1, 1, 7), quiet=True)
    assert cpu.flops.total() == 7  # on the CPU the buffer's value is read: no padding, one output
    with torch.device("meta"):
        model = PaddingFromBuffer()
    with pytest.raises(modelmeter.ModelRunError, match=r"before it, .* meta tensor read with \.item\(\) assumed to be 1"
                       r".* build it on the CPU"):
        modelmeter.analyze(model, torch.randn(1, 1, 7, device="meta"), quiet=True)
