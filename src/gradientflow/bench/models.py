"""Benchmark workloads in plain ``torch.nn`` (no torchvision), plus synthetic batches.

ResNet-50 and AlexNet follow torchvision's definitions layer for layer, so their parameter
counts (25,557,032 and 61,100,840 at 1000 classes) and gradient sizes match what the paper's
ImageNet runs communicate. They run at small inputs so that, on a CPU, communication and not
compute dominates the step, as it does on a GPU cluster.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

logger = logging.getLogger(__name__)


# ---- ResNet-50 ----------------------------------------------------------------------------
class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carries the stride, as torchvision's "v1.5"), 1x1 expand by 4."""

    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """ImageNet-style ResNet built from :class:`Bottleneck` blocks."""

    def __init__(self, layers: list[int], num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        stages: list[nn.Module] = []
        in_ch = 64
        for i, (blocks, width) in enumerate(zip(layers, (64, 128, 256, 512), strict=True)):
            stride = 1 if i == 0 else 2
            seq = []
            for b in range(blocks):
                seq.append(Bottleneck(in_ch, width, stride if b == 0 else 1))
                in_ch = width * Bottleneck.expansion
            stages.append(nn.Sequential(*seq))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(in_ch, num_classes)
        for m in self.modules():  # torchvision's init, so training behaves the same
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet50(num_classes: int = 1000) -> nn.Module:
    """Standard ResNet-50: bottleneck stages [3, 4, 6, 3]; 25,557,032 parameters at 1000 classes."""
    return ResNet([3, 4, 6, 3], num_classes)


# ---- AlexNet ------------------------------------------------------------------------------
ALEXNET_MIN_SIZE = 63
"""Smallest square input AlexNet accepts: three stride-2 max-pools after a stride-4 conv
leave 1x1 at 63x63; at 62x62 (and so at 32x32) the last pool has nothing to pool."""


class AlexNet(nn.Module):
    """torchvision's AlexNet: features 64-192-384-256-256, 6x6 adaptive pool, 4096-4096 head."""

    def __init__(self, num_classes: int = 1000, dropout: float = 0.5) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, 11, stride=4, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2),
            nn.Conv2d(64, 192, 5, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2),
            nn.Conv2d(192, 384, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(dropout),
            nn.Linear(256 * 6 * 6, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if min(x.shape[-2:]) < ALEXNET_MIN_SIZE:
            raise ValueError(
                f"AlexNet needs inputs of at least {ALEXNET_MIN_SIZE}x{ALEXNET_MIN_SIZE}, got {tuple(x.shape[-2:])}"
            )
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def alexnet(num_classes: int = 1000) -> nn.Module:
    """torchvision-style AlexNet; 61,100,840 parameters at 1000 classes; inputs >= 63x63."""
    return AlexNet(num_classes)


# ---- small CNN for 8x8 digits -------------------------------------------------------------
def small_cnn(num_classes: int = 10) -> nn.Module:
    """A small CNN for 1x8x8 images (scikit-learn digits): two 3x3 stages and a linear head."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 8x8 -> 4x4
        nn.Conv2d(64, 64, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(64 * 4 * 4, 128),
        nn.ReLU(),
        nn.Linear(128, num_classes),
    )


def digits_wide(num_classes: int = 10, width: int = 2048) -> nn.Module:
    """An AlexNet-shaped net for 1x8x8 images: one conv stage, then wide fully connected layers
    holding nearly all of its 8.4M parameters.  Little compute per byte of gradient, as AlexNet's
    FC layers: communication-bound on a 1 Gbit/s link (time to accuracy)."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),  # 32 x 8 x 8 = 2048
        nn.Linear(32 * 8 * 8, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, num_classes),
    )


# ---- tiny causal transformer LM -----------------------------------------------------------
class TinyTransformer(nn.Module):
    """Character-level causal LM: token + learned position embeddings, pre-norm encoder layers
    under a causal mask, final LayerNorm and an (untied) LM head. Returns logits [B, T, vocab]."""

    def __init__(
        self,
        vocab_size: int,
        d_model: int = 128,
        n_layers: int = 2,
        n_heads: int = 4,
        seq_len: int = 64,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d_model,
                n_heads,
                dim_feedforward=4 * d_model,
                dropout=dropout,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(d_model)
        # untied head: a shared parameter would appear twice in a gradient pool's layout
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len {self.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


def tiny_transformer(
    vocab_size: int, d_model: int = 128, n_layers: int = 2, n_heads: int = 4, seq_len: int = 64
) -> nn.Module:
    """A small causal character-level transformer LM returning logits [B, T, vocab_size]."""
    return TinyTransformer(vocab_size, d_model, n_layers, n_heads, seq_len)


# ---- registry and synthetic data ----------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """Default synthetic input for a model: ``input_shape`` is (C, H, W) for images and
    (T,) for token models; ``num_classes`` is the class count or the vocabulary size."""

    input_shape: tuple[int, ...]
    num_classes: int
    kind: str = "image"  # "image": float x, class y; "tokens": int x, next-token y


WORKLOADS: dict[str, Workload] = {
    "resnet50": Workload((3, 32, 32), 1000),
    "alexnet": Workload((3, 64, 64), 1000),  # 32x32 collapses; see ALEXNET_MIN_SIZE
    "small_cnn": Workload((1, 8, 8), 10),
    "tiny_transformer": Workload((64,), 96, kind="tokens"),
}

_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "resnet50": resnet50,
    "alexnet": alexnet,
    "small_cnn": small_cnn,
    "digits_wide": digits_wide,
    "tiny_transformer": tiny_transformer,
}


def build_model(name: str, **kw: object) -> nn.Module:
    """Build a registered model by name; ``kw`` goes to its constructor.

    ``tiny_transformer`` gets ``vocab_size`` and ``seq_len`` from :data:`WORKLOADS` when not given.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(_BUILDERS)}")
    if name == "tiny_transformer":
        w = WORKLOADS[name]
        kw.setdefault("vocab_size", w.num_classes)
        kw.setdefault("seq_len", w.input_shape[0])
    return _BUILDERS[name](**kw)


def synthetic_batch(
    name: str, batch_size: int, seed: int, device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic random batch ``(x, y)`` shaped for ``WORKLOADS[name]``.

    Images: x ~ N(0, 1) of shape [B, C, H, W], y class ids [B]. Tokens: x and y token ids
    of shape [B, T], y being x shifted by one (as a language model is trained).
    """
    if name not in WORKLOADS:
        raise ValueError(f"no workload {name!r}; choose one of {sorted(WORKLOADS)}")
    w = WORKLOADS[name]
    gen = torch.Generator().manual_seed(seed)
    if w.kind == "tokens":
        seq = torch.randint(0, w.num_classes, (batch_size, w.input_shape[0] + 1), generator=gen)
        return seq[:, :-1].contiguous().to(device), seq[:, 1:].contiguous().to(device)
    x = torch.randn((batch_size, *w.input_shape), generator=gen)
    y = torch.randint(0, w.num_classes, (batch_size,), generator=gen)
    return x.to(device), y.to(device)


def resolve_model(spec: str) -> tuple[str, Callable[[], nn.Module]]:
    """``alexnet`` | ``resnet50`` | ``package.module:factory`` -> (name, zero-argument factory)."""
    if spec in ("alexnet", "resnet50"):
        return spec, lambda: build_model(spec)
    if ":" not in spec:
        raise ValueError(f"--model must be alexnet, resnet50 or module:factory (e.g. mypkg.nets:build), got {spec!r}")
    mod_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: a module beside the user is found
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load --model {spec!r}: {exc}; is the module on PYTHONPATH?") from None
    if not callable(factory):
        raise ValueError(f"--model {spec!r} is not callable; give a function returning an nn.Module")
    return spec, factory
