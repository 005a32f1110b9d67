"""Small builders of real model families, for coverage tests: each returns ``(model, inputs)``.

Tiny configurations and small inputs keep every family fast on FakeTensors and on real CPU kernels
alike; no weights are downloaded (``weights=None``, ``pretrained=False``, transformers configs).
Builders are grouped by the package they need (``FAMILIES[package][name]``) and import it only when
called, so a test can skip a group cleanly with ``pytest.importorskip(package)``. Models are left in
training mode (dropout, batch statistics): the coverage tests run the backward pass too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Family = Callable[[], tuple[nn.Module, Any]]


def _image(batch: int = 2, size: int = 64) -> torch.Tensor:
    return torch.randn(batch, 3, size, size)


def _clip(frames: int = 4, size: int = 32) -> torch.Tensor:
    return torch.randn(1, 3, frames, size, size)


def _tokens(length: int = 16, vocab: int = 100) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(0))


# --- torch alone: recurrent layers, embeddings, pooling and resampling ---------------------------
class Recurrent(nn.Module):
    """Two-layer bidirectional LSTM, GRU and tanh RNN over one sequence (fused kernels)."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, num_layers=2, batch_first=True, bidirectional=True)
        self.gru = nn.GRU(32, 16, num_layers=2, batch_first=True, bidirectional=True)
        self.rnn = nn.RNN(32, 16, num_layers=2, batch_first=True, nonlinearity="tanh")
        self.relu_rnn = nn.RNN(16, 8, batch_first=True, nonlinearity="relu")
        self.cell = nn.LSTMCell(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.rnn(self.gru(self.lstm(x)[0])[0])[0]
        y = self.relu_rnn(y)[0]
        return self.cell(y[:, 0])[0]


class Embeddings(nn.Module):
    """``nn.Embedding`` (with a padding index) and ``nn.EmbeddingBag`` in sum and mean modes."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(100, 16, padding_idx=0)
        self.bag_sum = nn.EmbeddingBag(100, 16, mode="sum")
        self.bag_mean = nn.EmbeddingBag(100, 16, mode="mean")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(ids).sum(1) + self.bag_sum(ids) + self.bag_mean(ids)


class Pooling(nn.Module):
    """Max, average, adaptive and power-average pooling of every dimension."""

    def __init__(self) -> None:
        super().__init__()
        self.pool1 = nn.ModuleList([nn.MaxPool1d(2), nn.AvgPool1d(2), nn.AdaptiveMaxPool1d(3),
                                    nn.AdaptiveAvgPool1d(3), nn.LPPool1d(2, 2)])
        self.pool2 = nn.ModuleList([nn.MaxPool2d(3, 2, 1), nn.AvgPool2d(2), nn.AdaptiveMaxPool2d(3),
                                    nn.AdaptiveAvgPool2d(3), nn.LPPool2d(2, 2)])
        self.pool3 = nn.ModuleList([nn.MaxPool3d(2), nn.AvgPool3d(2), nn.AdaptiveMaxPool3d(3),
                                    nn.AdaptiveAvgPool3d(3), nn.LPPool3d(2, 2)])

    def forward(self, x1: torch.Tensor, x2: torch.Tensor, x3: torch.Tensor) -> torch.Tensor:
        total = torch.zeros(())
        for pools, x in ((self.pool1, x1), (self.pool2, x2), (self.pool3, x3)):
            for pool in pools:
                total = total + pool(x).sum()
        return total


UPSAMPLE_MODES: tuple[tuple[str, int, dict[str, Any]], ...] = (
    ("nearest", 1, {}), ("nearest", 2, {}), ("nearest", 3, {}),
    ("nearest-exact", 1, {}), ("nearest-exact", 2, {}), ("nearest-exact", 3, {}),
    ("linear", 1, {"align_corners": False}), ("linear", 1, {"align_corners": True}),
    ("bilinear", 2, {"align_corners": False}), ("bilinear", 2, {"align_corners": True}),
    ("bilinear", 2, {"antialias": True}), ("bicubic", 2, {"align_corners": False}),
    ("bicubic", 2, {"antialias": True}), ("trilinear", 3, {"align_corners": False}),
    ("area", 1, {}), ("area", 2, {}), ("area", 3, {}),
)


class Upsampling(nn.Module):
    """Every ``F.interpolate`` mode (up by 2, and ``area`` down by 2) plus pixel (un)shuffle."""

    def forward(self, x1: torch.Tensor, x2: torch.Tensor, x3: torch.Tensor) -> torch.Tensor:
        inputs = {1: x1, 2: x2, 3: x3}
        total = torch.zeros(())
        for mode, dim, options in UPSAMPLE_MODES:
            scale = 0.5 if mode == "area" else 2.0
            total = total + F.interpolate(inputs[dim], scale_factor=scale, mode=mode, **options).sum()
        total = total + F.pixel_shuffle(F.pixel_unshuffle(x2, 2), 2).sum()
        return total


class Layers(nn.Module):
    """Transposed convolutions, group/instance norms, a transformer encoder layer and common activations."""

    def __init__(self) -> None:
        super().__init__()
        self.up1 = nn.ConvTranspose1d(4, 4, 3, stride=2)
        self.up2 = nn.ConvTranspose2d(4, 4, 3, stride=2, groups=2)
        self.up3 = nn.ConvTranspose3d(4, 4, 2, stride=2)
        self.group_norm = nn.GroupNorm(2, 4)
        self.instance_norm = nn.InstanceNorm2d(4, affine=True)
        self.encoder = nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, batch_first=True, norm_first=True)
        self.activations = nn.ModuleList([nn.GELU(), nn.GELU("tanh"), nn.SiLU(), nn.Mish(), nn.ELU(), nn.CELU(),
                                          nn.SELU(), nn.Softplus(), nn.LeakyReLU(), nn.PReLU(), nn.Hardtanh(),
                                          nn.ReLU6(), nn.Sigmoid(), nn.Tanh(), nn.LogSigmoid(), nn.Softsign(),
                                          nn.Tanhshrink(), nn.Softmax(-1), nn.LogSoftmax(-1), nn.GLU(-1)])

    def forward(self, x1: torch.Tensor, x2: torch.Tensor, x3: torch.Tensor) -> torch.Tensor:
        y = self.instance_norm(self.group_norm(self.up2(x2)))
        total = self.up1(x1).sum() + y.sum() + self.up3(x3).sum()
        tokens = self.encoder(x1.transpose(1, 2))
        for activation in self.activations:
            total = total + activation(tokens).sum()
        return total


class Reductions(nn.Module):
    """Reductions and cumulative operators of a linear layer's output."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        parts = [y.mean(-1), y.var(-1), y.std(-1), y.norm(dim=-1), y.logsumexp(-1), y.amax(-1), y.amin(-1),
                 y.max(-1).values, y.prod(-1), y.cumsum(-1), y.cumprod(-1), torch.cummax(y, -1).values,
                 y.softmax(-1).log(), y.abs().sqrt(), y.pow(3), torch.clamp(y, -1, 1)]
        return sum((p.sum() for p in parts), torch.zeros(()))


class Losses(nn.Module):
    """Classification and regression losses over a linear layer's output (what a ``loss_fn`` computes)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        soft = y.softmax(-1)
        return (F.cross_entropy(y, target) + F.cross_entropy(y, target, label_smoothing=0.1)
                + F.nll_loss(y.log_softmax(-1), target) + F.mse_loss(y, soft) + F.l1_loss(y, soft)
                + F.smooth_l1_loss(y, soft) + F.huber_loss(y, soft) + F.binary_cross_entropy(y.sigmoid(), soft)
                + F.binary_cross_entropy_with_logits(y, soft)
                + F.kl_div(y.log_softmax(-1), soft, reduction="batchmean"))


def _spatial_inputs(channels: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """1-, 2- and 3-D inputs that require grad (the modules have no parameters)."""
    shapes = ((2, channels, 12), (2, channels, 12, 12), (2, channels, 6, 6, 6))
    return tuple(torch.randn(s, requires_grad=True) for s in shapes)  # type: ignore[return-value]


TORCH: dict[str, Family] = {
    "recurrent": lambda: (Recurrent(), (torch.randn(2, 5, 8),)),
    "embeddings": lambda: (Embeddings(), (torch.randint(1, 100, (2, 6)),)),
    "pooling": lambda: (Pooling(), _spatial_inputs()),
    "upsampling": lambda: (Upsampling(), _spatial_inputs()),
    "layers": lambda: (Layers(), _spatial_inputs()),
    "reductions": lambda: (Reductions(), (torch.randn(2, 3, 8),)),
    "losses": lambda: (Losses(), (torch.randn(6, 8), torch.randint(0, 5, (6,)))),
}


# --- torchvision ------------------------------------------------------------------------------------
def _tv(name: str, **kwargs: Any) -> nn.Module:
    import torchvision

    return getattr(torchvision.models, name)(weights=None, **kwargs)


def _tv_video(name: str) -> nn.Module:
    import torchvision

    return getattr(torchvision.models.video, name)(weights=None)


def _convnext() -> tuple[nn.Module, Any]:
    """ConvNeXt-T's layers (depthwise 7x7, layer norm, layer scale, stochastic depth), two narrow stages."""
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    blocks = [CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)]
    return ConvNeXt(blocks, stochastic_depth_prob=0.1, num_classes=10), (_image(size=32),)


def _densenet() -> tuple[nn.Module, Any]:
    """DenseNet-121's layers (dense blocks, transitions), two layers per block."""
    from torchvision.models.densenet import DenseNet

    return DenseNet(growth_rate=8, block_config=(2, 2, 2, 2), num_init_features=16, num_classes=10), (_image(),)


def _vit() -> tuple[nn.Module, Any]:
    from torchvision.models.vision_transformer import VisionTransformer

    return VisionTransformer(image_size=32, patch_size=16, num_layers=2, num_heads=2, hidden_dim=32,
                             mlp_dim=64, num_classes=10), (_image(size=32),)


def _swin() -> tuple[nn.Module, Any]:
    from torchvision.models.swin_transformer import SwinTransformer

    return SwinTransformer([4, 4], 16, [1, 1], [1, 2], [4, 4], num_classes=10), (_image(size=32),)


def _swin_v2() -> tuple[nn.Module, Any]:
    from torchvision.models.swin_transformer import PatchMergingV2, SwinTransformer, SwinTransformerBlockV2

    model = SwinTransformer([4, 4], 16, [1, 1], [1, 2], [4, 4], num_classes=10, block=SwinTransformerBlockV2,
                            downsample_layer=PatchMergingV2)
    return model, (_image(size=32),)


def _maxvit() -> tuple[nn.Module, Any]:
    from torchvision.models.maxvit import MaxVit

    model = MaxVit(input_size=(64, 64), stem_channels=8, partition_size=2, block_channels=[16, 32],
                   block_layers=[1, 1], head_dim=8, stochastic_depth_prob=0.1, num_classes=10)
    return model, (_image(size=64),)


def _fpn() -> tuple[nn.Module, Any]:
    from torchvision.models.detection.backbone_utils import resnet_fpn_backbone

    return resnet_fpn_backbone(backbone_name="resnet18", weights=None, trainable_layers=5), (_image(1),)


def _s3d() -> tuple[nn.Module, Any]:
    """S3D with its final (2, 7, 7) average pool shrunk to fit an 8 x 64 x 64 clip."""
    model = _tv_video("s3d")
    model.avgpool = nn.AvgPool3d(kernel_size=(1, 2, 2), stride=1)
    return model, (_clip(8, 64),)


def _mvit() -> tuple[nn.Module, Any]:
    from torchvision.models.video.mvit import MSBlockConfig, MViT

    blocks = [MSBlockConfig(num_heads=1, input_channels=16, output_channels=16, kernel_q=[3, 3, 3],
                            kernel_kv=[3, 3, 3], stride_q=[1, 1, 1], stride_kv=[1, 2, 2]),
              MSBlockConfig(num_heads=2, input_channels=16, output_channels=32, kernel_q=[3, 3, 3],
                            kernel_kv=[3, 3, 3], stride_q=[1, 2, 2], stride_kv=[1, 1, 1])]
    model = MViT(spatial_size=(32, 32), temporal_size=4, block_setting=blocks, residual_pool=True,
                 residual_with_cls_embed=False, rel_pos_embed=True, proj_after_attn=True, num_classes=10)
    return model, (_clip(4, 32),)


def _swin3d() -> tuple[nn.Module, Any]:
    from torchvision.models.video.swin_transformer import SwinTransformer3d

    model = SwinTransformer3d([2, 4, 4], 16, [1, 1], [1, 2], [2, 4, 4], num_classes=10)
    return model, (_clip(4, 32),)


TORCHVISION: dict[str, Family] = {
    "resnet18": lambda: (_tv("resnet18"), (_image(),)),
    "mobilenet_v3_small": lambda: (_tv("mobilenet_v3_small"), (_image(),)),
    "efficientnet_b0": lambda: (_tv("efficientnet_b0"), (_image(),)),
    "regnet_y_400mf": lambda: (_tv("regnet_y_400mf"), (_image(),)),
    "convnext": _convnext,
    "squeezenet1_1": lambda: (_tv("squeezenet1_1"), (_image(),)),
    "densenet": _densenet,
    "inception_v3": lambda: (_tv("inception_v3", init_weights=False), (_image(size=299),)),
    "googlenet": lambda: (_tv("googlenet", init_weights=False), (_image(),)),
    "shufflenet_v2_x0_5": lambda: (_tv("shufflenet_v2_x0_5"), (_image(),)),
    "vit": _vit,
    "swin": _swin,
    "swin_v2": _swin_v2,
    "maxvit": _maxvit,
    "resnet18_fpn": _fpn,
    "r3d_18": lambda: (_tv_video("r3d_18"), (_clip(),)),
    "r2plus1d_18": lambda: (_tv_video("r2plus1d_18"), (_clip(),)),
    "mc3_18": lambda: (_tv_video("mc3_18"), (_clip(),)),
    "s3d": _s3d,
    "mvit": _mvit,
    "swin3d": _swin3d,
}


# --- timm ---------------------------------------------------------------------------------------------
def _timm(name: str, size: int = 64, **kwargs: Any) -> tuple[nn.Module, Any]:
    import timm

    return timm.create_model(name, pretrained=False, num_classes=10, **kwargs), (_image(size=size),)


TIMM: dict[str, Family] = {
    "vit_tiny_patch16_224": lambda: _timm("vit_tiny_patch16_224", 32, img_size=32, depth=2),
    "deit_tiny_patch16_224": lambda: _timm("deit_tiny_patch16_224", 32, img_size=32, depth=2),
    "swin_tiny_patch4_window7_224": lambda: _timm("swin_tiny_patch4_window7_224", 32, img_size=32, window_size=4,
                                                  depths=(1, 1), num_heads=(1, 2), embed_dim=16),
    "convnext_atto": lambda: _timm("convnext_atto"),
    "efficientnet_b0": lambda: _timm("efficientnet_b0"),
    "regnetx_002": lambda: _timm("regnetx_002"),
    "mobilenetv3_small_100": lambda: _timm("mobilenetv3_small_100"),
}


# --- transformers (tiny configs: 2 layers, hidden 64) ------------------------------------------------
def _bert() -> tuple[nn.Module, Any]:
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64)
    mask = torch.ones(1, 16, dtype=torch.long)
    mask[:, 12:] = 0
    return BertModel(config), {"input_ids": _tokens(), "attention_mask": mask}


def _gpt2() -> tuple[nn.Module, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=100, n_positions=64, n_embd=64, n_layer=2, n_head=4, use_cache=False,
                        bos_token_id=1, eos_token_id=2)
    return GPT2LMHeadModel(config), {"input_ids": _tokens()}


def llama_config(**overrides: Any) -> Any:
    """A tiny Llama config (grouped-query attention: 4 query heads, 2 key/value heads)."""
    from transformers import LlamaConfig

    settings: dict[str, Any] = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "max_position_embeddings": 64, "use_cache": False}
    return LlamaConfig(**{**settings, **overrides})


def _llama() -> tuple[nn.Module, Any]:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config()), {"input_ids": _tokens()}


def _mistral() -> tuple[nn.Module, Any]:
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           sliding_window=8, use_cache=False)
    return MistralForCausalLM(config), {"input_ids": _tokens()}


def _mixtral() -> tuple[nn.Module, Any]:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           num_local_experts=4, num_experts_per_tok=2, sliding_window=None, use_cache=False)
    return MixtralForCausalLM(config), {"input_ids": _tokens()}


def _t5() -> tuple[nn.Module, Any]:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=100, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, use_cache=False)
    return T5ForConditionalGeneration(config), {"input_ids": _tokens(), "decoder_input_ids": _tokens(8)}


def _whisper() -> tuple[nn.Module, Any]:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(vocab_size=100, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                           decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16,
                           max_source_positions=16, max_target_positions=32, use_cache=False,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    return WhisperForConditionalGeneration(config), {"input_features": torch.randn(1, 16, 32),
                                                     "decoder_input_ids": _tokens(8)}


TRANSFORMERS: dict[str, Family] = {
    "bert": _bert,
    "gpt2": _gpt2,
    "llama": _llama,
    "mistral": _mistral,
    "mixtral": _mixtral,
    "t5": _t5,
    "whisper": _whisper,
}

FAMILIES: dict[str, dict[str, Family]] = {
    "torch": TORCH,
    "torchvision": TORCHVISION,
    "timm": TIMM,
    "transformers": TRANSFORMERS,
}
