"""profile.json and PipeDream graph.txt: every published profile loads and survives a round trip."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from partitioner.errors import ProfileFormatError
from partitioner.graph import (
    Node,
    Profile,
    TensorSpec,
    at_microbatches,
    load_profile,
    read_graph_txt,
    save_profile,
    scale_batch,
    write_graph_txt,
)
from tests.data import PIPEDREAM_GRAPHS

GRAPHS = PIPEDREAM_GRAPHS


def test_all_pipedream_profiles_are_here() -> None:
    assert len(GRAPHS) == 14


def _edges(profile: Profile) -> set[tuple[str, str]]:
    return {(src, n.id) for n in profile.nodes for src in n.inputs}


@pytest.mark.parametrize("path", GRAPHS, ids=lambda p: p.parent.name)
def test_pipedream_profile_loads_and_round_trips(path: Path, tmp_path: Path) -> None:
    profile = load_profile(path)
    assert profile.tracer == "pipedream" and len(profile.nodes) > 1
    assert any(n.op == "input" for n in profile.nodes)
    position = {n.id: i for i, n in enumerate(profile.nodes)}
    assert all(position[src] < position[n.id] for n in profile.nodes for src in n.inputs)
    assert profile.total_compute_ms > 0

    again = read_graph_txt(write_graph_txt(profile, tmp_path / "graph.txt"))
    assert [n.id for n in again.nodes] == [n.id for n in profile.nodes]
    assert _edges(again) == _edges(profile)
    for a, b in zip(again.nodes, profile.nodes, strict=True):
        assert (a.forward_ms, a.backward_ms) == pytest.approx((b.forward_ms, b.backward_ms), abs=1e-3)
        assert (a.output_bytes, a.param_bytes) == (b.output_bytes, b.param_bytes)
        assert a.description == b.description

    as_json = load_profile(save_profile(profile, tmp_path / "profile.json"))
    assert as_json == profile


def test_pipeplan_profile_round_trips(tmp_path: Path) -> None:
    profile = Profile(
        nodes=(
            Node("x", "x", "input", "input", output_bytes=64),
            Node(
                "fc",
                "fc",
                "call_module",
                "Linear",
                ("x",),
                1.5,
                2.5,
                32,
                64,
                40,
                ("fc.weight", "fc.bias"),
                forward_fixed_ms=0.25,
                backward_fixed_ms=0.5,
            ),
            Node("output", "output", "output", "output", ("fc",), 0.1, 0.2, members=("output",)),
        ),
        model="tiny-mlp",
        batch_size=4,
        inputs=(TensorSpec((4, 16)),),
        tracer_options={"leaf_modules": ["Block"]},
        step_ms=4.0,
        tied=(("a.weight", "b.weight"),),
    )
    loaded = load_profile(save_profile(profile, tmp_path / "p" / "profile.json"))
    assert loaded == profile
    assert loaded.fidelity == pytest.approx(4.3 / 4.0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"schema": "other/2", "nodes": []}', "not a pipeplan profile"),
        ('{"schema": "pipeplan.profile/1", "nodes": [{"id": "a"}]}', "corrupt"),
        ('{"schema": "pipeplan.profile/1", ', "not valid JSON"),
        ("hello world\n", "neither a graph.txt node nor an edge"),
        ("", "no nodes"),
    ],
)
def test_corrupt_or_foreign_files_are_rejected(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "profile.json"
    path.write_text(text)
    with pytest.raises(ProfileFormatError, match=message):
        load_profile(path)


def test_missing_file_is_a_profile_error(tmp_path: Path) -> None:
    with pytest.raises(ProfileFormatError, match="cannot read"):
        load_profile(tmp_path / "absent.json")


def test_json_document_is_plain_data(tmp_path: Path) -> None:
    path = save_profile(Profile(nodes=(Node("x", "x", "input", "input"),)), tmp_path / "profile.json")
    doc = json.loads(path.read_text())
    assert doc["schema"] == "pipeplan.profile/1" and doc["nodes"][0]["id"] == "x"


def test_scale_batch_scales_times_and_activations_not_parameters() -> None:
    node = Node("l0", "fc", "call_module", "Linear", ("x",), 2.0, 4.0, 100, 60, 1000)
    profile = Profile(nodes=(node,), batch_size=2, inputs=(TensorSpec((2, 3)),), step_ms=6.0)
    scaled = scale_batch(profile, 8)
    assert scaled.nodes[0] == replace(
        node, forward_ms=8.0, backward_ms=16.0, output_bytes=400, saved_bytes=240
    )
    assert scaled.batch_size == 8 and scaled.inputs[0].shape == (8, 3) and scaled.step_ms == 24.0
    assert scaled.extra["measured_batch_size"] == 2 and scaled.fidelity == profile.fidelity
    with pytest.raises(ProfileFormatError, match="batch size"):
        scale_batch(replace(profile, batch_size=None), 8)


def test_at_microbatches_charges_each_call_its_fixed_time_once() -> None:
    node = Node("l0", "fc", "call_module", "Linear", ("x",), 10.0, 20.0, 100, 60, 1000,
                cast_bytes=7, forward_fixed_ms=1.0, backward_fixed_ms=2.0)  # fmt: skip
    whole = Profile(nodes=(node,), batch_size=8)
    four = at_microbatches(whole, 4)  # measured once at 8 samples: three more calls
    assert (four.nodes[0].forward_ms, four.nodes[0].backward_ms) == (13.0, 26.0)
    assert four.nodes[0].saved_bytes == 60 + 4 * 7 and four.nodes[0].cast_bytes == 0
    assert at_microbatches(four, 4) == four and at_microbatches(four, 8) == four  # charged once
    # measured at 2 samples and scaled to 8: the times hold four calls' fixed time already
    scaled = scale_batch(
        replace(whole, nodes=(replace(node, forward_ms=2.5, backward_ms=5.0),), batch_size=2), 8
    )
    assert scaled.nodes[0].forward_fixed_ms == 1.0  # a per-call time does not scale with samples
    assert at_microbatches(scaled, 4).nodes[0].forward_ms == pytest.approx(10.0)
    assert at_microbatches(scaled, 1).nodes[0].forward_ms == pytest.approx(10.0 - 3 * 1.0)
    plain = Profile(
        nodes=(replace(node, cast_bytes=0, forward_fixed_ms=0.0, backward_fixed_ms=0.0),), batch_size=8
    )
    assert at_microbatches(plain, 4) is plain


def test_tensor_parallel_fields_round_trip_and_stay_out_of_unsplit_nodes() -> None:
    """docs/layout-3d.md: only nodes tensor parallelism splits carry tp_* fields in profile.json."""
    from partitioner.graph import Node, Profile, profile_from_json, profile_to_json, scale_batch

    split = Node(
        "fc", "fc", "call_module", "Linear", param_bytes=64, tp_param_bytes=48, tp_comm_bytes=8, tp_max=4
    )
    profile = Profile(nodes=(Node("x", "x", "input", ""), replace(split, inputs=("x",))), batch_size=2)
    doc = profile_to_json(profile)
    assert "tp_max" not in doc["nodes"][0] and doc["nodes"][1]["tp_max"] == 4
    assert profile_from_json(doc).nodes == profile.nodes
    assert scale_batch(profile, 4).nodes[1].tp_comm_bytes == 16


def test_a_layers_largest_weight_round_trips_and_stays_out_where_not_measured() -> None:
    """``largest_tensor_bytes`` (the most gradient a layer's backward makes at once) is written where
    measured and read back; a node without it (0: older profiles, PipeDream's) writes nothing."""
    from partitioner.graph import Node, Profile, profile_from_json, profile_to_json

    layer = Node("fc", "fc", "call_module", "Linear", inputs=("x",), param_bytes=96, largest_tensor_bytes=64)
    profile = Profile(nodes=(Node("x", "x", "input", ""), layer), batch_size=2)
    doc = profile_to_json(profile)
    assert "largest_tensor_bytes" not in doc["nodes"][0] and doc["nodes"][1]["largest_tensor_bytes"] == 64
    assert profile_from_json(doc).nodes == profile.nodes
