"""VGG (Simonyan & Zisserman), layer for layer as torchvision builds it, so state dicts are interchangeable.

Kept here rather than imported so the built-in zoo works without torchvision (which only installs beside a
CUDA build of torch on some machines).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["VGG", "vgg11", "vgg13", "vgg16", "vgg19"]

_CONFIGS: dict[str, list[int | str]] = {
    "A": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "B": [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "D": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
    "E": [
        64,
        64,
        "M",
        128,
        128,
        "M",
        256,
        256,
        256,
        256,
        "M",
        512,
        512,
        512,
        512,
        "M",
        512,
        512,
        512,
        512,
        "M",
    ],
}


class VGG(nn.Module):
    """Convolutional features, a 7x7 adaptive pool, and a three-layer classifier with dropout."""

    def __init__(self, features: nn.Sequential, num_classes: int = 1000, dropout: float = 0.5) -> None:
        super().__init__()
        self.features = features
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(4096, num_classes),
        )
        _init_like_torchvision(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        out: torch.Tensor = self.classifier(x)
        return out


def _init_like_torchvision(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.constant_(m.bias, 0)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.constant_(m.weight, 1)
            nn.init.constant_(m.bias, 0)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0, 0.01)
            nn.init.constant_(m.bias, 0)


def _features(cfg: list[int | str], batch_norm: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    channels = 3
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            continue
        assert isinstance(v, int)
        layers.append(nn.Conv2d(channels, v, kernel_size=3, padding=1))
        if batch_norm:
            layers.append(nn.BatchNorm2d(v))
        layers.append(nn.ReLU(inplace=True))
        channels = v
    return nn.Sequential(*layers)


def vgg11(num_classes: int = 1000) -> VGG:
    """VGG-11 (configuration A)."""
    return VGG(_features(_CONFIGS["A"], False), num_classes)


def vgg13(num_classes: int = 1000) -> VGG:
    """VGG-13 (configuration B)."""
    return VGG(_features(_CONFIGS["B"], False), num_classes)


def vgg16(num_classes: int = 1000) -> VGG:
    """VGG-16 (configuration D): 138,357,544 parameters at 1000 classes."""
    return VGG(_features(_CONFIGS["D"], False), num_classes)


def vgg19(num_classes: int = 1000) -> VGG:
    """VGG-19 (configuration E): 143,667,240 parameters at 1000 classes."""
    return VGG(_features(_CONFIGS["E"], False), num_classes)
