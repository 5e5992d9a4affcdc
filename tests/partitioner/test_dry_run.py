"""dry_run: a traced graph's kinds and shapes without computing, the module left as it was."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from partitioner.generation.dry_run import NeedsValues, dry_run
from partitioner.generation.split import _tensor_kinds_for_real, tensor_kinds
from partitioner.models.specs import load_model
from partitioner.profiler.trace import trace_model


class ViewByBatch(nn.Module):
    """``x.view(x.size(0), -1)``: an empty batch cannot say what -1 is; meta tensors can."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.conv(x))
        return self.head(h.view(h.size(0), -1))


class ReadsValues(nn.Module):
    """A value read into Python: the maximum of an empty batch does not exist, nor of meta tensors;
    on fake tensors it is a symbol."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.max().item()


@fx.wrap
def _halve_if_positive(x: torch.Tensor) -> torch.Tensor:
    return x / 2 if x.max() > 0 else x


class BranchesOnValues(nn.Module):
    """Python that branches on a value: no symbol says which way, so only real values run it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _halve_if_positive(x) + 1


@pytest.mark.parametrize("spec", ["tiny-gpt", "tiny-cnn", "tiny-skip", "resnet18"])
def test_kinds_and_loss_node_as_a_real_run_finds_them(spec: str) -> None:
    bundle = load_model(spec, 2, (3, 32, 32) if spec == "resnet18" else None)
    gm = trace_model(bundle).graph_module
    before = {n: t.clone() for n, t in gm.state_dict().items()}
    dry = tensor_kinds(gm, bundle.inputs)
    after = gm.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)  # stand-ins put back, batch norm untouched
    assert all(m.training for m in gm.modules())
    assert dry == _tensor_kinds_for_real(gm, bundle.inputs)


def test_an_empty_batch_reads_no_weight() -> None:
    """The run holds stand-ins of one element for every weight: a model on the meta device runs too."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 4096), nn.ReLU(), nn.Linear(4096, 7))
    gm = fx.symbolic_trace(model)
    output, values = dry_run(gm, (torch.randn(3, 64),))
    assert output.shape == (0, 7) and output.device.type == "cpu"
    assert set(values) == {"input_1", "_0", "_1", "_2"}
    assert model[0].weight.device.type == "meta"


def test_batch_sized_views_fall_back_to_meta_tensors() -> None:
    gm = fx.symbolic_trace(ViewByBatch())
    output, _ = dry_run(gm, (torch.randn(2, 3, 8, 8),))
    assert output.shape == (2, 5) and output.device.type == "meta"
    assert gm.bn.running_mean.device.type == "cpu"


class MovesToTheCpu(ViewByBatch):
    """A batch-sized view and a weight moved to the CPU, as torch.export writes ``.to(cpu)`` into a
    Hugging Face model's graph: neither an empty batch nor meta tensors run it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.conv(x))
        return nn.functional.linear(h.view(h.size(0), -1), self.head.weight.to("cpu"))


def test_a_graph_that_moves_meta_weights_to_the_cpu_runs_on_fake_tensors() -> None:
    with torch.device("meta"):
        gm = fx.symbolic_trace(MovesToTheCpu())
    output, values = dry_run(gm, (torch.randn(2, 3, 8, 8),))
    assert output.shape == (2, 5) and output.device.type == "cpu" and "to" in values
    assert gm.head.weight.device.type == "meta"  # put back


def test_a_value_read_into_python_is_a_symbol() -> None:
    gm = fx.symbolic_trace(ReadsValues())
    output, values = dry_run(gm, (torch.randn(2, 3),))
    assert output.shape == (2, 3) and isinstance(values["item"], torch.SymFloat)
    kinds, loss_node = tensor_kinds(gm, (torch.randn(2, 3),))
    assert loss_node == "truediv" and kinds["truediv"] and not kinds["item"]


def test_a_graph_that_branches_on_values_says_so_and_runs_for_real() -> None:
    gm = fx.symbolic_trace(BranchesOnValues())
    with pytest.raises(NeedsValues, match="without values"):
        dry_run(gm, (torch.randn(2, 3),))
    kinds, loss_node = tensor_kinds(gm, (torch.randn(2, 3),))  # runs it for real instead
    assert loss_node == "add" and kinds["add"]


def test_running_for_real_reads_zeros_for_tensors_left_on_meta() -> None:
    """A graph re-traced without its weights holds them on meta: the real run never copies one."""
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(3, 3), BranchesOnValues()).to("meta"))
    kinds, loss_node = tensor_kinds(gm, (torch.randn(2, 3),))
    assert kinds[loss_node] and all(p.is_meta for p in gm.parameters())  # put back
