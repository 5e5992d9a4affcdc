"""Tracing: fx with leaf modules, the torch.export fallback, layer grouping and free-op folding."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from partitioner.errors import TraceError
from partitioner.models.specs import load_model
from partitioner.models.zoo import ZOO
from partitioner.profiler.trace import Traced, retrace, trace_model

torch.set_num_threads(1)


def small_shape(name: str) -> tuple[int, ...]:
    entry = ZOO[name]
    if entry.tokens:
        return (8,)
    if len(entry.input_shape) == 3:
        return (3, 64, 64) if name == "alexnet" else (3, 32, 32)
    return entry.input_shape


def check_groups(traced: Traced) -> None:
    """Groups partition the graph, ids are their first member, and edges only go forward."""
    names = [n.name for n in traced.graph_module.graph.nodes]
    members = [m for g in traced.groups for m in g.members]
    assert sorted(members) == sorted(names)
    assert all(g.id == g.members[0] for g in traced.groups)
    owner = {m: i for i, g in enumerate(traced.groups) for m in g.members}
    for node in traced.graph_module.graph.nodes:
        assert all(owner[a.name] <= owner[node.name] for a in node.all_input_nodes if a.op != "get_attr")


@pytest.mark.parametrize("name", sorted(ZOO))
def test_every_builtin_traces_with_fx(name: str) -> None:
    traced = trace_model(load_model(name, 2, small_shape(name)))
    assert traced.tracer == "fx"
    check_groups(traced)
    assert traced.groups[0].op == "input" and traced.groups[-1].op == "output"


def test_retrace_gives_the_same_names() -> None:
    first = trace_model(load_model("tiny-gpt", 2), leaf_modules=["Block"])
    again = retrace(first.options)
    assert [g.members for g in again.groups] == [g.members for g in first.groups]
    assert first.options["leaf_modules"] == ["Block"] and first.options["tracer"] == "fx"


def test_leaf_module_keeps_a_block_whole() -> None:
    traced = trace_model(load_model("tiny-gpt", 2), leaf_modules=["Block"])
    blocks = [g for g in traced.groups if g.target == "Block"]
    assert [g.name for g in blocks] == ["h.0", "h.1"]
    assert not any(g.name.startswith("h.0.") for g in traced.groups)


def test_unknown_leaf_module_is_an_error() -> None:
    with pytest.raises(TraceError, match="--leaf-module Blok matches no module"):
        trace_model(load_model("tiny-gpt", 2), leaf_modules=["Blok"])


def test_free_ops_fold_into_neighbours() -> None:
    traced = trace_model(load_model("tiny-cnn", 2))
    pool = next(g for g in traced.groups if g.name == "pool")
    assert pool.members == ("pool", "flatten")
    gpt = trace_model(load_model("tiny-gpt", 2))
    # the attention's split/unflatten/transpose views ride with the real work around them
    assert not any(g.op in ("call_method",) and g.target in ("unflatten", "transpose") for g in gpt.groups)


UNTRACEABLE = """
import torch

class Gate(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent Python control flow: fx and export both refuse it
            return x * 2
        return x

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.gate = Gate()
        self.head = torch.nn.Linear(4, 3)
    def forward(self, x):
        return self.head(self.gate(self.fc(x)))

def make():
    return Net(), torch.randn(2, 4)
"""


def test_a_module_that_branches_on_a_value_is_kept_whole_or_named(tmp_path: Path) -> None:
    """A submodule that branches on a tensor's value is found from the failed export and kept whole
    (one layer run eagerly); named with --leaf-module, fx keeps it whole; a branch in the model's own
    forward cannot be kept whole and is refused naming the class and the option."""
    path = tmp_path / "net.py"
    path.write_text(textwrap.dedent(UNTRACEABLE))
    bundle = load_model(f"{path}:make", 2)
    found = trace_model(bundle)
    assert found.tracer == "export" and [g.name for g in found.groups if g.target == "Gate"] == ["gate"]
    traced = trace_model(bundle, leaf_modules=["Gate"])
    assert traced.tracer == "fx" and any(g.target == "Gate" for g in traced.groups)
    top = tmp_path / "top.py"
    branching = UNTRACEABLE.replace("self.head(self.gate(self.fc(x)))", "self.head(x) if x.sum() > 0 else x")
    top.write_text(textwrap.dedent(branching))
    with pytest.raises(TraceError, match=r"Net.*--leaf-module"):
        trace_model(load_model(f"{top}:make", 2))


def test_hf_gpt2_falls_back_to_export_grouped_by_block() -> None:
    pytest.importorskip("transformers")
    path = Path(__file__).with_name("hf_gpt2_model.py")
    assert path.exists()
    bundle = load_model(f"{path}:make", 2)
    traced = trace_model(bundle)
    assert traced.tracer == "export" and traced.options["tracer"] == "export"
    check_groups(traced)
    blocks = [g.name for g in traced.groups if g.target == "GPT2Block"]
    assert blocks == [f"transformer.h.{i}" for i in range(4)]
    assert traced.options["static_shapes"] is False  # a dynamic batch: any microbatch runs
    again = retrace(traced.options, batch_size=4)
    assert [g.members for g in again.groups] == [g.members for g in traced.groups]
    owner = {m: g.id for g in traced.groups for m in g.members}
    for node in traced.graph_module.graph.nodes:
        for a in node.all_input_nodes:
            if owner[a.name] != owner[node.name] and a.op != "get_attr":
                # the dynamic batch size crosses layers; split reads it again from a local tensor
                value = a.meta.get("val")
                assert isinstance(value, (torch.Tensor, torch.SymInt)), f"{a.name} is not a tensor"


def test_export_records_no_stack_traces_and_puts_the_setting_back() -> None:
    """A Python stack per node is a quarter of a deep model's export, and nothing reads it."""
    lifted = Path(__file__).parents[1] / "lifted_model.py"
    traced = trace_model(load_model(f"{lifted}:make", 2))
    assert traced.tracer == "export"
    assert not any(n.meta.get("stack_trace") for n in traced.graph_module.graph.nodes)
    assert torch.fx.config.do_not_emit_stack_traces is False
