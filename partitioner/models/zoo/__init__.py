"""The built-in model zoo: names a user can pass to ``pipeplan profile`` without writing any code.

Every entry says how to build the module and what its inputs look like, so the model loader can make
example inputs and targets of any batch size. Nothing here needs torchvision or transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from partitioner.models.zoo import alexnet, gpt2, resnet, tiny, vgg

__all__ = ["ZOO", "ZooEntry"]


@dataclass(frozen=True)
class ZooEntry:
    """How to build one built-in model and feed it.

    Attributes:
        factory: builds the module (call it under a seeded RNG for reproducible weights).
        input_shape: default shape of one sample, batch dimension excluded.
        tokens: True when inputs are integer token ids (targets are then the next tokens).
        classes: number of classes (image models) or the vocabulary size (token models).
        summary: one line for listings.
    """

    factory: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    tokens: bool
    classes: int
    summary: str


_IMAGE = (3, 224, 224)

ZOO: dict[str, ZooEntry] = {
    "alexnet": ZooEntry(alexnet.alexnet, _IMAGE, False, 1000, "AlexNet, 61.1M params"),
    "vgg11": ZooEntry(vgg.vgg11, _IMAGE, False, 1000, "VGG-11, 132.9M params"),
    "vgg13": ZooEntry(vgg.vgg13, _IMAGE, False, 1000, "VGG-13, 133.0M params"),
    "vgg16": ZooEntry(vgg.vgg16, _IMAGE, False, 1000, "VGG-16, 138.4M params"),
    "vgg19": ZooEntry(vgg.vgg19, _IMAGE, False, 1000, "VGG-19, 143.7M params"),
    "resnet18": ZooEntry(resnet.resnet18, _IMAGE, False, 1000, "ResNet-18, 11.7M params"),
    "resnet34": ZooEntry(resnet.resnet34, _IMAGE, False, 1000, "ResNet-34, 21.8M params"),
    "resnet50": ZooEntry(resnet.resnet50, _IMAGE, False, 1000, "ResNet-50, 25.6M params"),
    "resnet101": ZooEntry(resnet.resnet101, _IMAGE, False, 1000, "ResNet-101, 44.5M params"),
    "resnet152": ZooEntry(resnet.resnet152, _IMAGE, False, 1000, "ResNet-152, 60.2M params"),
    "gpt2": ZooEntry(gpt2.gpt2, (128,), True, 50257, "GPT-2 small, 124.4M params, tied LM head"),
    "gpt2-medium": ZooEntry(gpt2.gpt2_medium, (128,), True, 50257, "GPT-2 medium, 354.8M params"),
    "byte-gpt": ZooEntry(gpt2.byte_gpt, (64,), True, 256, "4-block GPT over bytes (vocabulary 256), 0.86M"),
    "tiny-mlp": ZooEntry(tiny.tiny_mlp, (16,), False, 10, "3 linear layers (tests)"),
    "tiny-cnn": ZooEntry(tiny.tiny_cnn, (3, 16, 16), False, 10, "CNN with a residual (tests)"),
    "tiny-skip": ZooEntry(tiny.tiny_skip, (16,), False, 10, "linears with a 3-layer skip (tests)"),
    "tiny-gpt": ZooEntry(gpt2.tiny_gpt, (16,), True, 97, "2-block GPT, tied embeddings (tests)"),
}
