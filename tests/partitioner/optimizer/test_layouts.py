"""A --tensor-parallel degree the profile does not allow is refused with the reason its layers are
not split: the model's plan styles not understood, or layers whose traced code breaks split."""

from __future__ import annotations

from dataclasses import replace

import pytest

from partitioner.errors import PlanError
from partitioner.optimizer.layouts import check_tensor
from partitioner.plan import Cluster
from tests.partitioner.optimizer.conftest import make_profile


def test_the_refusal_names_the_styles_and_the_layers_kept_whole() -> None:
    profile = make_profile([(1, 1, 10, 10)] * 2, [(0, 1)])
    with pytest.raises(PlanError, match=r"allows 1\)$"):
        check_tensor(profile, Cluster.flat(4), 2)
    extra = {
        "tensor_parallel_unknown_styles": {"layers.*.mlp.gate_up_proj": "colwise_gather_output"},
        "tensor_parallel_whole": {"model.layers.0.self_attn": "at degree 2: RuntimeError: size"},
    }
    with pytest.raises(PlanError) as caught:
        check_tensor(replace(profile, extra=extra), Cluster.flat(4), 2)
    assert "styles colwise_gather_output are not understood, so layers.*.mlp.gate_up_proj stay whole" in str(
        caught.value
    )
    assert "1 layer stay whole because their traced code breaks split (model.layers.0.self_attn)" in str(
        caught.value
    )
