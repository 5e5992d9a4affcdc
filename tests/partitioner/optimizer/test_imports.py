"""The optimizer is pure Python + numpy: importing it must not import torch (or pulp, rich, click)."""

from __future__ import annotations

import subprocess
import sys


def test_optimizer_imports_no_torch() -> None:
    code = (
        "import partitioner.optimizer, partitioner.optimizer.pricing.simulate, sys; "
        "bad = [m for m in ('torch', 'pulp', 'rich', 'click') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
