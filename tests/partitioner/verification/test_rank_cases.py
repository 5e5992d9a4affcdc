"""The plain stages' files for a 3D stage's ranks: each copy's part is the runtime's split of the
minibatch, and the gradients summed over the parts are the parts' own, added."""

from __future__ import annotations

from pathlib import Path

import torch

from partitioner.generation.codegen import write_package
from partitioner.verification.rank_cases import case_file, grads_file, write_cases
from runtime.packages.load import import_package
from tests.partitioner.codegen_support import plan_for, profile_for


def _cases(package: Path, copies: dict[int, int], out: Path) -> None:
    pkg = import_package(package, fresh=True)
    criterion = pkg.criterion()
    with torch.device("meta"):
        entries = pkg.model(criterion)
    wiring = [(list(e[1]), list(e[2])) for e in entries[:-1]]
    out.mkdir()
    write_cases(pkg, wiring, 0, criterion, pkg.example_inputs(4), pkg.example_targets(4), copies, out)


def test_parts_split_the_minibatch_and_their_gradients_add(tmp_path: Path) -> None:
    """tiny-mlp in 2 stages (no batch statistics: a sample's result does not depend on the others):
    two copies' inputs, outputs and input gradients are the whole minibatch's halves, and their
    summed weight gradients twice the whole minibatch's (each part's loss is its own mean)."""
    torch.set_num_threads(1)
    profile = profile_for("tiny-mlp", batch_size=4)
    package = tmp_path / "pkg"
    write_package(profile, plan_for(profile, [len(profile.nodes) // 2]), package)
    _cases(package, {0: 1, 1: 1}, tmp_path / "one")
    _cases(package, {0: 2, 1: 2}, tmp_path / "two")
    for k in (0, 1):
        whole = torch.load(case_file(tmp_path / "one", k, 0), weights_only=True)
        halves = [torch.load(case_file(tmp_path / "two", k, i), weights_only=True) for i in (0, 1)]
        for key in ("inputs", "outputs") + (("input_grads",) if k else ()):
            assert whole[key], key
            for name, value in whole[key].items():
                joined = torch.cat([h[key][name] for h in halves])
                scale = 2.0 if key == "input_grads" else 1.0  # (each half's mean loss: twice the share)
                torch.testing.assert_close(joined, value * scale, msg=f"stage {k} {key} {name}")
        summed = torch.load(grads_file(tmp_path / "two", k), weights_only=True)
        once = torch.load(grads_file(tmp_path / "one", k), weights_only=True)
        assert summed.keys() == once.keys() and once
        for name, grad in once.items():
            torch.testing.assert_close(summed[name], 2 * grad, msg=f"stage {k} {name}")
    last = torch.load(case_file(tmp_path / "two", 1, 1), weights_only=True)
    assert "targets" in last and "output_grads" not in last
    first = torch.load(case_file(tmp_path / "two", 0, 1), weights_only=True)
    assert first["output_grads"] and first["needs_grad"] == []  # (the model's inputs need none)
