"""The schemas of pipeplan's JSON files, in one place for every reader (:mod:`runtime.files.schema`).

profile.json (``partitioner.graph``), plan.json (``partitioner.plan`` and the runtime's
``runtime.packages.job_config``), mp_conf.json (PipeDream's, ``runtime.packages.job_config``) and metrics.json
(``partitioner.calibration.stage_times``). Each lists the fields its readers rely on and their types; files
may carry more fields (formats grow), and rules across fields (a DAG in topological order, ranks used once,
...) stay with the readers. Pure Python, no torch.
"""

from __future__ import annotations

from runtime.files.schema import AnyValue, Bool, Int, List, Map, Num, Obj, Opt, Str
from runtime.precision import PRECISIONS
from runtime.schedule import SCHEDULES

__all__ = ["METRICS_FIELDS", "MP_CONF_FIELDS", "PLAN_FIELDS", "PROFILE_FIELDS"]

_NODE = Obj(
    {"id": Str(), "op": Str(), "inputs": List(Str()), "forward_ms": Num(), "backward_ms": Num()},
    {
        **{key: Str() for key in ("name", "target", "description")},
        **{key: Num() for key in ("output_bytes", "saved_bytes", "cast_bytes", "param_bytes")},
        **{key: Num() for key in ("forward_fixed_ms", "backward_fixed_ms")},
        **{key: Int(0) for key in ("tp_param_bytes", "tp_comm_bytes", "tp_max", "largest_tensor_bytes")},
        "param_names": List(Str()),
        "members": List(Str()),
        "sized": List(List(Num(0.0))),
    },
)

PROFILE_FIELDS = Obj(
    {"nodes": List(_NODE)},
    {
        **{key: Str() for key in ("model", "device", "dtype", "torch_version", "tracer")},
        "batch_size": Opt(Int(1)),
        "precision": Opt(Str(PRECISIONS)),
        "step_ms": Opt(Num()),
        "inputs": List(Obj({"shape": List(Int(0))}, {"dtype": Str()})),
        "tied": List(List(Str(), min_len=2)),
        "tracer_options": Map(AnyValue()),
        "extra": Map(AnyValue()),
    },
)
"""profile.json (``pipeplan.profile/1``)."""

_STAGE = Obj(
    {"index": Int(0), "nodes": List(Str()), "replicas": Int(1), "ranks": List(Int(0))},
    {
        "compute_s": Num(),
        "comm_s": Num(),
        "memory_bytes": Num(),
        "recompute": Bool(),
        "bubble_fraction": Opt(Num(0.0)),
        "tensor_parallel": Int(1),
        "shard": Str(("none", "optimizer", "gradients", "full")),
    },
)
_LEVEL = Obj(
    {"devices": Int(1), "bandwidth": Num(0.0, strict=True)},
    {"latency": Num(0.0), "allreduce_bandwidth": Num(0.0, strict=True), "allreduce_latency": Num(0.0)},
)

PLAN_FIELDS = Obj(
    {
        "gpus": Int(1),
        "cluster": Obj(
            {"levels": List(_LEVEL, min_len=1)},
            {
                "memory_bytes": Opt(Num()),
                "cores": Opt(Int(1)),
                "threads": Int(1),
                "action_s": Num(0.0),
                "schedule_action_s": Map(Num(0.0)),
            },
        ),
        "schedule": Str(SCHEDULES),
        "microbatches": Int(1),
        "stages": List(_STAGE, min_len=1),
        "predicted": Obj({"time_per_minibatch_s": Num()}, {}),
        "solver": Obj({"name": Str()}, {}),
    },
    {
        "batch_size": Opt(Int(1)),
        "optimizer": Str(),
        "precision": Opt(Str(PRECISIONS)),
        "model": Str(),
        "profile": Str(),
        "ties": List(Obj({"name": Str(), "members": List(List(AnyValue(), length=2), min_len=2)})),
        "extra": Map(AnyValue()),
        "virtual_stages": Opt(Int(1)),
    },
)
"""plan.json (``pipeplan.plan/1``)."""

MP_CONF_FIELDS = Obj(
    {"stage_to_rank_map": Map(List(Int(0), min_len=1)), "module_to_stage_map": List(Int(0), min_len=2)},
)
"""mp_conf.json (PipeDream's ``module_to_stage_map`` and ``stage_to_rank_map``)."""

METRICS_FIELDS = Obj(
    {
        "stages": List(
            Obj(
                {"stage": Int(0), "compute_s_per_minibatch": Num(0.0, strict=True)},
                {
                    "compute_cpu_share": Opt(Num(0.0, strict=True)),
                },
            ),
            min_len=1,
        ),
    },
    {
        "batch_size": Opt(Int(1)),
        "samples_per_s": Opt(Num()),
        "time_per_minibatch_s": Opt(Num()),
        "machine": Obj({"loadavg_1min": Num(), "cpus": Int(1)}),
        "model": Str(),
        "precision": Opt(Str(PRECISIONS)),
        "schedule": Str(),
        "losses": List(AnyValue()),
    },
)
"""metrics.json (``pipeplan.metrics/1``) as calibration reads it: every stage measured, in positive
seconds (a NaN, negative or zero time would leave its layers unscaled)."""
