"""Image folders without torchvision: class folders in sorted order, Pillow decoding, torch resizing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.datasets.imagefolder import ImageFolder, find_images
from runtime.errors import RunError

Image = pytest.importorskip("PIL.Image")


def _folder(root: Path) -> Path:
    """dog/ (two images) and cat/ (one), different sizes and modes; a stray text file."""
    for name in ("dog", "cat"):
        (root / name).mkdir(parents=True)
    Image.new("RGB", (20, 10), (255, 0, 0)).save(root / "dog" / "b.png")
    Image.new("L", (7, 7), 128).save(root / "dog" / "a.png")
    Image.new("RGB", (8, 8), (0, 0, 255)).save(root / "cat" / "x.jpg", quality=100)
    (root / "cat" / "notes.txt").write_text("not an image")
    return root


def test_sorted_class_folders_are_the_targets(tmp_path: Path) -> None:
    found = find_images(_folder(tmp_path))
    assert found.classes == ("cat", "dog")
    assert [(p.name, label) for p, label in found.samples] == [("x.jpg", 0), ("a.png", 1), ("b.png", 1)]


def test_images_are_resized_to_the_package_shape_in_0_1(tmp_path: Path) -> None:
    data = ImageFolder(_folder(tmp_path), (3, 12, 16))
    images = [data[i] for i in range(len(data))]
    assert all(x.shape == (3, 12, 16) and x.dtype == torch.float32 for x, _ in images)
    assert [int(y) for _, y in images] == [0, 1, 1]
    red, _ = images[2]  # a uniform image stays uniform through the antialiased resize
    torch.testing.assert_close(red, torch.tensor([1.0, 0.0, 0.0]).view(3, 1, 1).expand(3, 12, 16))
    grey, _ = images[1]  # grey to RGB: three equal channels
    torch.testing.assert_close(grey, torch.full((3, 12, 16), 128 / 255))
    one_channel = ImageFolder(tmp_path, (1, 4, 4))[2][0]
    assert one_channel.shape == (1, 4, 4)


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda root: root / "missing", "no such folder"),
        (lambda root: root, "no class folders"),
        (lambda root: (root / "cat").mkdir() or root, "cat/ holds no image"),
    ],
)
def test_folders_without_images_are_one_error(tmp_path: Path, make: object, needle: str) -> None:
    with pytest.raises(RunError, match=needle):
        find_images(make(tmp_path))  # type: ignore[operator]


def test_a_broken_image_is_named(tmp_path: Path) -> None:
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "bad.png").write_bytes(b"not a png")
    with pytest.raises(RunError, match=r"bad\.png"):
        ImageFolder(tmp_path, (3, 4, 4))[0]


def test_an_input_that_is_no_image_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RunError, match="not an image"):
        ImageFolder(_folder(tmp_path), (16,))
