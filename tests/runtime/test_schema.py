"""runtime.files.schema: a document that does not match is refused in one message naming the field."""

from __future__ import annotations

import math

import pytest

from runtime.files.formats import METRICS_FIELDS, MP_CONF_FIELDS, PLAN_FIELDS, PROFILE_FIELDS
from runtime.files.schema import AnyValue, Bool, Int, List, Map, Num, Obj, Opt, SchemaError, Str, check

_DOC = Obj(
    {"count": Int(1), "rate": Num(0.0, strict=True), "names": List(Str(), min_len=1)},
    {"flag": Bool(), "kind": Str(("a", "b")), "extra": Map(AnyValue()), "size": Opt(Int(0))},
)


def test_a_matching_document_passes() -> None:
    check({"count": 2, "rate": 0.5, "names": ["x"], "flag": True, "kind": "a", "size": None}, _DOC, "d")
    check({"count": 2.0, "rate": 1, "names": ("x",), "more": "fields are free"}, _DOC, "d")


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([], "d: the document must be an object"),
        ({"rate": 1, "names": ["x"]}, "d: count is missing"),
        ({"count": 0, "rate": 1, "names": ["x"]}, "d: count must be an integer >= 1, got 0"),
        ({"count": True, "rate": 1, "names": ["x"]}, "count must be an integer"),
        ({"count": 1.5, "rate": 1, "names": ["x"]}, "count must be an integer"),
        ({"count": 1, "rate": 0, "names": ["x"]}, "rate must be a finite number > 0"),
        ({"count": 1, "rate": math.nan, "names": ["x"]}, "rate must be a finite number"),
        ({"count": 1, "rate": math.inf, "names": ["x"]}, "rate must be a finite number"),
        ({"count": 1, "rate": 1, "names": "x"}, "names must be a list"),
        ({"count": 1, "rate": 1, "names": []}, "names must be a list of at least 1 items"),
        ({"count": 1, "rate": 1, "names": ["x", 2]}, "names[1] must be a string, got 2"),
        ({"count": 1, "rate": 1, "names": ["x"], "flag": "false"}, "flag must be true or false"),
        ({"count": 1, "rate": 1, "names": ["x"], "kind": "c"}, "kind must be one of a, b"),
        ({"count": 1, "rate": 1, "names": ["x"], "extra": []}, "extra must be an object"),
    ],
)
def test_a_mismatch_names_the_field(doc: object, message: str) -> None:
    with pytest.raises(SchemaError) as info:
        check(doc, _DOC, "d")
    assert message in str(info.value)


def test_the_file_schemas_accept_what_pipeplan_writes() -> None:
    node = {"id": "x", "op": "input", "inputs": [], "forward_ms": 0.0, "backward_ms": 0.0}
    check({"nodes": [node], "tied": [["a.w", "b.w"]], "batch_size": None}, PROFILE_FIELDS, "profile")
    stage = {"index": 0, "nodes": ["x"], "replicas": 1, "ranks": [0], "recompute": False}
    plan = {
        "gpus": 1, "cluster": {"levels": [{"devices": 1, "bandwidth": 1e9}]}, "schedule": "1f1b",
        "microbatches": 2, "stages": [stage], "predicted": {"time_per_minibatch_s": 0.1},
        "solver": {"name": "dp"}, "ties": [{"name": "w", "members": [[0, "w"], [1, "w"]]}],
    }  # fmt: skip
    check(plan, PLAN_FIELDS, "plan.json")
    check({"stage_to_rank_map": {"0": [0]}, "module_to_stage_map": [0, 0]}, MP_CONF_FIELDS, "mp_conf.json")
    check({"stages": [{"stage": 0, "compute_s_per_minibatch": 0.2}]}, METRICS_FIELDS, "metrics.json")
    with pytest.raises(SchemaError, match=r"plan.json: microbatches must be an integer >= 1, got 0"):
        check({**plan, "microbatches": 0}, PLAN_FIELDS, "plan.json")
