"""torch.export keeps modules whole: the ones named by --leaf-module, and the ones found to branch on a
tensor's value; each is one call_module the stage runs eagerly, on any batch."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from partitioner.errors import TraceError
from partitioner.models.specs import ModelBundle
from partitioner.profiler.trace import trace_model


class Experts(nn.Module):
    """Loops over the experts its tokens chose, as a mixture of experts does: data-dependent."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))

    def forward(self, x: torch.Tensor, choice: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = torch.zeros_like(x)
        for e in torch.unique(choice):
            rows = torch.nonzero(choice == e).flatten()
            out[rows] = self.experts[int(e)](x[rows])
        return out, None  # (a None beside the tensor, as Hugging Face layers return)


class Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(6, 3)
        self.moe = Experts()
        self.head = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, nothing = self.moe(x, self.router(x).argmax(-1))
        assert nothing is None
        return self.head(out)


class BranchesAtTheRoot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if h.sum() > 0:
            return h * 2
        return h


class Unrolled(nn.Module):
    """A Python loop over a size: torch.fx cannot trace it, torch.export unrolls it."""

    def __init__(self) -> None:
        super().__init__()
        self.branch = BranchesAtTheRoot()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(x.shape[1] // 3):
            x = x + 1
        return self.branch(x)


def _bundle(module: nn.Module, batch: int = 4) -> ModelBundle:
    torch.manual_seed(0)
    return ModelBundle(
        spec="test", module=module, inputs=(torch.randn(batch, 6),), targets=torch.zeros(batch),
        loss_fn=lambda out, _: out.sum(), batch_size=batch, factory=lambda: module,
        input_maker=lambda b: (torch.randn(b, 6),), target_maker=torch.zeros,
    )  # fmt: skip


def test_a_module_that_branches_on_values_is_kept_whole_and_runs_any_batch() -> None:
    model = Routed()
    traced = trace_model(_bundle(model))
    assert traced.tracer == "export" and traced.options["leaf_modules"] == ["Experts"]
    calls = [n for n in traced.graph_module.graph.nodes if n.op == "call_module" and n.target != "_guards_fn"]
    assert [n.target for n in calls] == ["moe"]
    assert any(g.name == "moe" and g.target == "Experts" for g in traced.groups)
    for batch in (4, 7):  # the batch stayed dynamic through the kept module
        x = torch.randn(batch, 6)
        torch.testing.assert_close(traced.graph_module(x), model(x), rtol=0, atol=0)
    model.moe.forward(torch.randn(2, 6), torch.tensor([0, 2]))  # the module's own forward is back


def test_leaf_module_keeps_a_module_whole_under_torch_export() -> None:
    traced = trace_model(_bundle(Unrolled()), leaf_modules=["BranchesAtTheRoot"])
    assert traced.tracer == "export" and traced.options["leaf_modules"] == ["BranchesAtTheRoot"]
    assert [n.target for n in traced.graph_module.graph.nodes if n.op == "call_module"][-1:] == ["branch"]


def test_a_branch_nothing_can_hold_names_its_class_file_and_line() -> None:
    with pytest.raises(TraceError) as caught:
        trace_model(_bundle(BranchesAtTheRoot()))
    message = str(caught.value)
    lines, first = inspect.getsourcelines(BranchesAtTheRoot.forward)
    branch = first + next(i for i, line in enumerate(lines) if "if h.sum()" in line)
    assert "BranchesAtTheRoot" in message and f"test_leaf_calls.py:{branch} " in message
    assert "--leaf-module CLASS naming a module that holds BranchesAtTheRoot" in message
