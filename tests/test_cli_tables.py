"""Every table the CLI prints reads at 80 columns: rendered 80 wide it is the same text as rendered 400
wide (so rich cut no number and wrapped no row), and output that is not a terminal has no escape codes."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner
from rich.console import Console

import cli
from cli_render import plan as plan_render
from cli_render import run as run_render
from cli_render.calibrate import calibration_table
from cli_render.profile import profile_table
from cli_render.verify import ranks_table, verify_table
from partitioner.graph import Profile, save_profile
from partitioner.optimizer import solve
from partitioner.optimizer.auto import solve_auto
from partitioner.optimizer.options import SolveOptions
from partitioner.optimizer.planner import alternatives
from partitioner.plan import Cluster
from tests.partitioner.optimizer.conftest import make_profile

GPUS = 16


def _names(blocks: int) -> list[str]:
    """Hugging Face llama's module names, the longest a table meets in practice."""
    parts = ("input_layernorm", "self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")
    return ["model.embed_tokens"] + [f"model.layers.{b}.{p}" for b in range(blocks) for p in parts]


def _profile(names: list[str], model: str) -> Profile:
    costs = [(300 + 37 * i, 700 + 53 * i, 2**27, 2**29 + i) for i in range(len(names))]
    toy = make_profile(costs, [(i, i + 1) for i in range(len(names) - 1)], batch_size=64)
    renamed = {f"l{i}": name for i, name in enumerate(names)}
    nodes = tuple(replace(n, name=renamed.get(n.id, n.name), target="torch.nn.modules.linear.Linear")
                  for n in toy.nodes)  # fmt: skip
    return replace(toy, nodes=nodes, model=model)


@pytest.fixture(scope="module")
def profile() -> Profile:
    return _profile(_names(6), "llama-shaped")


@pytest.fixture(scope="module")
def plan(profile: Profile) -> Any:
    return solve(profile, Cluster.flat(GPUS))


def _render(renderable: Any, width: int) -> list[str]:
    console = Console(file=io.StringIO(), width=width, color_system=None, highlight=False)
    console.print(renderable)
    return [line.rstrip() for line in console.file.getvalue().splitlines()]  # type: ignore[attr-defined]


def _reads_at_80(renderable: Any) -> None:
    narrow, wide = _render(renderable, 80), _render(renderable, 400)
    assert narrow == wide, "\n".join(narrow)
    assert max(map(len, narrow)) <= 80


def test_profile_table(profile: Profile) -> None:
    _reads_at_80(profile_table(profile, 10))


def test_plan_and_alternatives(profile: Profile, plan: Any) -> None:
    assert len(plan.stages) > 1 and max(s.replicas for s in plan.stages) > 3
    _reads_at_80(plan_render.plan_table(plan, profile))
    assert any(
        line.startswith("stage 0: model.embed_tokens..")
        for line in _render(plan_render.plan_table(plan, profile), 80)
    )
    others = alternatives(profile, plan.cluster, plan.schedule, 4, "sgd")
    _reads_at_80(plan_render.explain_table(plan, others, "none"))


def test_short_layer_ranges_stay_in_the_stage_table() -> None:
    profile = _profile([f"features.{i}" for i in range(31)] + [f"classifier.{i}" for i in range(7)], "vgg16")
    table = plan_render.plan_table(solve(profile, Cluster.flat(4)), profile)
    _reads_at_80(table)
    assert "features.0.." in "\n".join(_render(table, 80))
    assert not any(line.startswith("stage 0:") for line in _render(table, 80))


def test_schedule_auto_table(profile: Profile) -> None:
    choice = solve_auto(
        profile, Cluster.flat(GPUS), SolveOptions("auto", 4, "sgd", False, "dp", True, "auto")
    )
    _reads_at_80(plan_render.auto_table(choice, GPUS, None))


def test_calibration_table(profile: Profile, plan: Any) -> None:
    measured = {s.index: 1234.5678 * (s.index + 1) for s in plan.stages}
    _reads_at_80(calibration_table(profile, plan, measured))


def test_verify_table() -> None:
    stage = SimpleNamespace(index=12, params=1_234_567_890, in_names=("model_layers_11_mlp_down", "mask"),
                            out_names=("model_layers_23_mlp_down",), init_error=0.0, grad_error=1.5e-7,
                            ok=True)  # fmt: skip
    _reads_at_80(verify_table(SimpleNamespace(package=Path("models/llama-shaped/gpus=16"), stages=[stage])))


def test_ranks_table() -> None:
    """A 3D package's check on its ranks, at its widest layout name and rank span."""
    stage = SimpleNamespace(index=12, layout="TP8 x DP4 zero2", ranks=tuple(range(352, 384)),
                            init_error=0.0, output_error=1.5e-7, input_grad_error=2.5e-6, grad_error=1.5e-7,
                            ok=False)  # fmt: skip
    _reads_at_80(ranks_table(SimpleNamespace(world_size=512, batch_size=1024, stages=[stage])))


def test_run_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    ranks = [{"rank": r, "stage": r // 2, "compute_s": 1234.567, "comm_s": 89.123, "idle_s": 456.789}
             for r in range(16)]  # fmt: skip
    memory = {"method": "cuda.max_memory_allocated", "window_minibatches": 3,
              "stages": [{"stage": 7, "measured_peak_bytes": 75 * 2**30, "predicted_bytes": 70 * 2**30,
                          "ratio_measured_over_predicted": 1.07}]}  # fmt: skip
    ranks[14]["hosted"] = [7, 15, 23, 31]  # (the widest label a rank hosting several stages gets)
    stages = [{"stage": k, "compute_s_per_minibatch": 1234.5678, "predicted_compute_s_per_minibatch": 999.99,
               "compute_measured_over_predicted": 12.35, "comm_s_per_minibatch": 987.654,
               "predicted_comm_s_per_minibatch": 0.000123, "bubble_fraction": 0.4567,
               "predicted_bubble_fraction": None if k == 3 else 0.1234} for k in range(8)]  # fmt: skip
    metrics = {"schedule": "interleaved", "microbatches": 32, "world_size": 16,
               "ratio_measured_over_predicted": 1.01, "time_per_minibatch_s": 12.345678,
               "predicted_time_per_minibatch_s": 12.2, "ranks": ranks, "memory": memory, "losses": [],
               "eval": [], "stages": stages}  # fmt: skip
    printed: list[Any] = []
    monkeypatch.setattr(
        run_render, "console", lambda stderr=False: SimpleNamespace(print=lambda r, **_: printed.append(r))
    )
    run_render.print_run_table(metrics, "models/x/run/metrics.json")
    tables = [r for r in printed if not isinstance(r, str)]
    assert len(tables) == 4  # the total, per stage, per rank, memory
    assert run_render.COMM_NOTE in printed  # (a note, not a ratio, for the comm that is not like for like)
    for table in tables:
        _reads_at_80(table)


def test_partition_output_has_no_escape_codes(profile: Profile, tmp_path: Path) -> None:
    save_profile(profile, tmp_path / "p.json")
    args = [
        "partition",
        "--profile",
        str(tmp_path / "p.json"),
        "--gpus",
        str(GPUS),
        "-o",
        str(tmp_path / "m"),
    ]
    result = CliRunner().invoke(
        cli.main, [*args, "--explain"], env={"COLUMNS": "80", "TERM": "xterm-256color"}
    )
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.stdout + result.stderr
    assert "wrote" in result.stdout


def test_run_header_names_the_package_ranks_schedule_and_files_at_80_columns(tmp_path: Path) -> None:
    from cli_render.run import header
    from runtime.job.run_folders import begin
    from runtime.job.run_header import run_header
    from runtime.job.worker import job_of
    from runtime.settings.run_options import RunOptions
    from tests.runtime.packages import write_package

    folder = tmp_path / "a-rather-long-folder-name" / "models" / "chain" / "gpus=3"
    pkg = write_package(folder, replicas=(1, 2))
    options = begin(RunOptions(package=str(pkg), checkpoint_every=5), checkpoints=True, create=False)
    lines = _render(header(run_header(options, job_of(options), 3, 20)), 80)
    assert max(map(len, lines)) <= 80, "\n".join(lines)
    labels = [line.split(" ", 1)[0] for line in lines if not line.startswith(" ")]
    assert labels == ["package", "ranks", "schedule", "steps", "writes", "checkpoints"], "\n".join(lines)
    text = "\n".join(lines)
    assert "3 ranks on this machine (CPUs, gloo); replicas per stage 1 2" in text
    assert "1f1b, 4 microbatches of 2 samples (minibatch 8), fp32" in text
    assert "20 steps on synthetic data" in text and "every 5 steps and the last step" in text


def test_runs_note_on_a_far_prediction_wraps_at_80_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    """The note after a run whose time is far from the plan's reads in an 80-column log."""
    ranks = [{"rank": r, "stage": r, "compute_s": 10.0, "comm_s": 1.0, "idle_s": 0.1} for r in range(2)]
    metrics = {"schedule": "pipedream", "microbatches": 1, "world_size": 2, "time_per_minibatch_s": 3.9,
               "ratio_measured_over_predicted": 6.2, "predicted_time_per_minibatch_s": 0.63, "ranks": ranks,
               "losses": [6.9, 7.0], "eval": []}  # fmt: skip
    out = io.StringIO()
    monkeypatch.setattr(
        run_render, "console", lambda stderr=False: Console(file=out, width=80, color_system=None)
    )
    run_render.print_run_table(metrics, "models/x/run/metrics.json")
    lines = out.getvalue().splitlines()
    assert "measured/predicted 6.20" in out.getvalue() and max(map(len, lines)) <= 80, out.getvalue()


def test_partitions_prose_lines_wrap_at_80_columns_when_piped(tmp_path: Path) -> None:
    """The summary, notes and the auto table's sentences wrap at 80 columns (only the last line, a
    path to copy, may run longer); no escape codes."""
    profile = _profile([f"block.{i}.linear" for i in range(12)], "toy")
    save_profile(profile, tmp_path / "toy.json")
    args = ["partition", "--profile", str(tmp_path / "toy.json"), "--gpus", "4", "--schedule", "auto"]
    result = CliRunner().invoke(cli.main, [*args, "--memory", "8GiB", "-o", str(tmp_path / "m")])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[-1].startswith("wrote ") and "\x1b" not in result.output
    assert max(map(len, lines[:-1])) <= 80, result.output
    assert "data parallel does not fit in 8.00 GiB per device" in " ".join(lines)


def test_a_one_stage_plan_is_called_data_parallel_and_a_slower_plan_says_so(profile: Profile) -> None:
    from partitioner.optimizer.pricing.schedules import priced_profile
    from partitioner.optimizer.search.candidates import data_parallel

    cluster = Cluster.flat(4)
    dp = data_parallel(priced_profile(profile, "pipedream", 1), cluster, "pipedream", 1, "sgd")
    title = _render(plan_render.plan_table(dp, profile), 400)[0]
    assert "data parallel, one stage on 4 " in title, title
    summary = plan_render.plan_summary(dp, None, profile)
    assert "no pipeline bubble (one stage)" in summary and "bubble 0.0%" not in summary
    assert "over data parallel" not in summary  # (no ratio of data parallelism to itself)
    straight = solve(profile, cluster, "1f1b", 2, "sgd", straight=True)  # every GPU its own stage
    slower = replace(straight, predicted=replace(straight.predicted, speedup_vs_data_parallel=0.8))
    text = plan_render.plan_summary(slower, SimpleNamespace(steady=True, minibatches=1, bubble_fraction=0.1),
                                    profile)  # fmt: skip
    assert "slower than data parallelism" in text and "--schedule pipedream" in text


def test_layouts_table() -> None:
    """--explain's layouts (docs/layout-3d.md) read at 80 columns, the longest names included."""
    from partitioner.optimizer.layouts import hand_layouts, solve_layouts

    base = make_profile([(10, 20, 1000, 4000)] * 6, [(i, i + 1) for i in range(5)])
    split = {"tp_param_bytes": 3000, "tp_comm_bytes": 2000, "tp_max": 8}
    profile = replace(base, nodes=tuple(replace(n, **split) if n.param_bytes else n for n in base.nodes))
    cluster = Cluster.flat(8, 1e9)
    opts = SolveOptions("1f1b", 4, "adam", True)
    best = solve_layouts(profile, cluster, opts, ("1f1b",))
    assert best is not None
    _reads_at_80(plan_render.layout_table(best.plan, hand_layouts(profile, cluster, opts, None), profile))


def test_hand_layouts_without_two_copies_run_plain_tensor_parallelism() -> None:
    """On 4 devices at TP4 nothing is left to shard over: the hand row is plain TP4 (what Megatron's
    and torchtitan's users would run), priced, and a row without a plan says why."""
    from partitioner.optimizer.layouts import hand_layouts, solve_layouts

    base = make_profile([(10, 20, 1000, 4000)] * 6, [(i, i + 1) for i in range(5)])
    split = {"tp_param_bytes": 3000, "tp_comm_bytes": 2000, "tp_max": 4}
    profile = replace(base, nodes=tuple(replace(n, **split) if n.param_bytes else n for n in base.nodes))
    cluster = Cluster.flat(4, 1e9)
    opts = SolveOptions("1f1b", 4, "adam", True)
    rows = hand_layouts(profile, cluster, opts, None)
    assert list(rows) == ["Megatron, torchtitan TP4"]
    plan = rows["Megatron, torchtitan TP4"]
    assert plan is not None and plan.extra["layout"]["tensor_parallel"] == 4
    best = solve_layouts(profile, cluster, opts, ("1f1b",))
    assert best is not None
    table = plan_render.layout_table(best.plan, {"unplanned": None}, profile)
    _reads_at_80(table)
    text = "\n".join(_render(table, 80))
    assert "no plan" in text and "does not fit" not in text


def test_partition_names_the_layers_tensor_parallelism_keeps_whole(profile: Profile, tmp_path: Path) -> None:
    """A profile whose dry run kept layers whole (partitioner/profiler/tensor_check.py) or whose
    model's plan has styles not understood: a TP plan's output says which, one note each."""
    nodes = tuple(
        replace(n, tp_param_bytes=n.param_bytes, tp_max=4) if n.param_bytes else n for n in profile.nodes
    )
    extra = {
        "tensor_parallel_whole": {"model.layers.0.self_attn": "at degree 2: RuntimeError: sizes"},
        "tensor_parallel_unknown_styles": {"layers.*.experts": "packed_colwise"},
    }
    save_profile(replace(profile, nodes=nodes, extra=extra), tmp_path / "p.json")
    args = ["partition", "--profile", str(tmp_path / "p.json"), "--gpus", "4", "--tensor-parallel", "2",
            "--schedule", "1f1b", "-o", str(tmp_path / "m")]  # fmt: skip
    result = CliRunner().invoke(cli.main, args, env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    out = " ".join(result.stdout.split())
    assert (
        "tensor parallelism keeps 1 layer whole, replicated in each tensor group (model.layers.0.self_attn)"
        in out
    )
    assert (
        "keeps layers.*.experts whole: their base_model_tp_plan styles (packed_colwise) are not understood"
        in out
    )
