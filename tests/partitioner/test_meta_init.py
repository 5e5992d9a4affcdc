"""Building a model on the meta device skips its random fills (nothing to fill) and so never imports
torch._dynamo, which torch's meta kernels of those fills would (a second of `pipeplan partition`)."""

from __future__ import annotations

import subprocess
import sys

import torch
from torch import nn

from partitioner.models.meta_init import SkipMetaInit


def test_meta_fills_are_skipped_and_real_ones_run() -> None:
    with torch.device("meta"), SkipMetaInit():
        layer = nn.Conv2d(3, 8, 3)
        nn.init.kaiming_normal_(layer.weight)
        assert nn.init.normal_(tensor=layer.bias) is layer.bias and layer.weight.is_meta
    real = torch.zeros(4, 4)
    with SkipMetaInit():
        nn.init.normal_(real)
        torch.zeros(3).uniform_()
    assert real.abs().sum() > 0  # a real tensor is still filled


def test_building_vgg16_on_meta_does_not_import_dynamo() -> None:
    code = (
        "import sys, torch\n"
        "from partitioner.models.specs import load_model\n"
        "load_model('vgg16').build(seed=0, device='meta')\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
