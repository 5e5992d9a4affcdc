"""``--data imagefolder:DIR``: one sub-folder per class, images decoded and resized in DataLoader workers.

The layout is torchvision's ImageFolder (``DIR/cat/1.jpg``, ``DIR/dog/7.png``; sorted folder names
are the class indices), read without torchvision: Pillow decodes, ``torch.nn.functional.interpolate``
resizes (bilinear, antialiased) to the package's input shape, pixels scaled to [0, 1]. Pillow is the
optional ``pipeplan[images]`` extra; it is imported only when an image folder is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from runtime.errors import RunError

__all__ = ["ImageFolder", "find_images", "require_pillow"]

_MODES = {1: "L", 3: "RGB", 4: "RGBA"}
"""Pillow mode giving an image of that many channels."""


def require_pillow() -> None:
    """Pillow is an optional extra: say how to get it instead of an ImportError in a rank."""
    try:
        import PIL.Image  # noqa: F401
    except ImportError as exc:
        raise RunError(
            "--data imagefolder: needs Pillow to decode images; pip install 'pipeplan[images]' (or pillow)"
        ) from exc


def _extensions() -> frozenset[str]:
    """Every file suffix Pillow can open (``.jpg``, ``.png``, ``.webp``, ...)."""
    from PIL import Image

    return frozenset(ext.lower() for ext in Image.registered_extensions())


@dataclass(frozen=True)
class Found:
    """What an image folder holds.

    Attributes:
        classes: class folder names, sorted; a sample's target is its folder's index here.
        samples: (image path, class index), sorted by class then path.
    """

    classes: tuple[str, ...]
    samples: tuple[tuple[Path, int], ...]


def find_images(root: str | Path) -> Found:
    """Scan ``root``: sorted class folders, the images in each (recursively).

    Raises:
        RunError: no such folder, no class folder, or a class folder without images.
    """
    folder = Path(root)
    if not folder.is_dir():
        raise RunError(f"--data imagefolder:{root}: no such folder")
    classes = tuple(sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")))
    if not classes:
        raise RunError(
            f"--data imagefolder:{root}: no class folders; put each class's images in DIR/<class>/"
        )
    suffixes = _extensions()
    samples: list[tuple[Path, int]] = []
    for index, name in enumerate(classes):
        images = sorted(p for p in (folder / name).rglob("*") if p.is_file() and p.suffix.lower() in suffixes)
        if not images:
            raise RunError(f"--data imagefolder:{root}: class folder {name}/ holds no image Pillow can read")
        samples += [(p, index) for p in images]
    return Found(classes, tuple(samples))


def load_image(path: Path, shape: tuple[int, int, int], dtype: torch.dtype) -> torch.Tensor:
    """One image as a (C, H, W) tensor of ``shape``, values in [0, 1]."""
    from PIL import Image

    channels, height, width = shape
    with Image.open(path) as image:
        pixels = image.convert(_MODES[channels])
        data = torch.frombuffer(bytearray(pixels.tobytes()), dtype=torch.uint8)
        hwc = data.view(pixels.height, pixels.width, channels)
    chw = hwc.permute(2, 0, 1).unsqueeze(0).float().div_(255)
    if chw.shape[-2:] != (height, width):
        chw = F.interpolate(chw, size=(height, width), mode="bilinear", antialias=True, align_corners=False)
    return chw[0].clamp_(0, 1).to(dtype)


class ImageFolder(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Samples ``(image (C, H, W), class index)`` of a folder of class folders.

    Example:
        >>> data = ImageFolder("photos", (3, 64, 64))  # doctest: +SKIP
        >>> image, label = data[0]                      # doctest: +SKIP
    """

    def __init__(self, root: str | Path, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> None:
        if len(shape) != 3 or shape[0] not in _MODES:
            raise RunError(
                f"--data imagefolder:{root}: the package's input sample is {tuple(shape)}, not an image "
                "(1, 3 or 4 channels, height, width)"
            )
        require_pillow()
        found = find_images(root)
        self.classes, self.samples = found.classes, found.samples
        self.shape = (int(shape[0]), int(shape[1]), int(shape[2]))
        self.dtype = dtype

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        path, label = self.samples[index]
        try:
            image = load_image(path, self.shape, self.dtype)
        except Exception as exc:  # a worker's error reaches the rank as one line naming the file
            raise RunError(f"cannot read image {path}: {type(exc).__name__}: {exc}") from exc
        return image, torch.tensor(label, dtype=torch.int64)
