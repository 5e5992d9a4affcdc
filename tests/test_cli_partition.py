"""`pipeplan partition`: files written, --json, --cuts, and one-line errors with exit code 2."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import main
from partitioner.graph import save_profile, write_graph_txt
from partitioner.plan import load_plan
from tests.partitioner.optimizer.conftest import make_profile


@pytest.fixture
def graph(tmp_path: Path) -> Path:
    costs = [(5, 10, 4000, 1000), (8, 16, 2000, 200000), (3, 6, 1000, 50), (9, 18, 500, 30000)]
    profile = make_profile(costs, [(0, 1), (1, 2), (0, 2), (2, 3)])
    path = tmp_path / "toy" / "graph.txt"
    path.parent.mkdir()
    write_graph_txt(profile, path)
    return path


def _run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def test_writes_plan_and_mp_conf(graph: Path, tmp_path: Path) -> None:
    code, out, _ = _run("partition", "--profile", str(graph), "--gpus", "4", "-o", str(tmp_path / "m"),
                        "--explain", "--trace", str(tmp_path / "t.json"))  # fmt: skip
    assert code == 0, out
    folder = tmp_path / "m" / "toy" / "gpus=4"
    plan = load_plan(folder / "plan.json")
    conf = json.loads((folder / "mp_conf.json").read_text())
    assert sum(s.replicas for s in plan.stages) <= 4
    assert conf["module_to_stage_map"] == [s.index for s in plan.stages] + [plan.stages[-1].index]
    assert conf["stage_to_rank_map"] == {str(s.index): list(s.ranks) for s in plan.stages}
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert "stage" in out and "predicted" in out and "data parallel" in out


def test_json_prints_only_the_plan(graph: Path, tmp_path: Path) -> None:
    rates = "10GB/s,100Gbit/s"
    code, out, _ = _run("partition", "--profile", str(graph), "--topology", "2,2", "--bandwidth", rates,
                        "--json", "-o", str(tmp_path))  # fmt: skip
    assert code == 0
    doc = json.loads(out)
    assert doc["schema"] == "pipeplan.plan/1" and doc["cluster"]["levels"][1]["bandwidth"] == 12.5e9
    assert [lv["latency"] for lv in doc["cluster"]["levels"]] == [5.7e-6] * 2  # a GPU profile's default
    code, out, _ = _run("partition", "--profile", str(graph), "--topology", "2,2", "--latency", "2us,20ms",
                        "--json", "-o", str(tmp_path))  # fmt: skip
    assert code == 0 and [lv["latency"] for lv in json.loads(out)["cluster"]["levels"]] == [2e-6, 0.02]


def test_cuts_and_replicas_are_evaluated(graph: Path, tmp_path: Path) -> None:
    code, out, _ = _run("partition", "--profile", str(graph), "--gpus", "4", "--cuts", "l1",
                        "--replicas", "3,1", "--json", "-o", str(tmp_path))  # fmt: skip
    assert code == 0
    doc = json.loads(out)
    assert [s["replicas"] for s in doc["stages"]] == [3, 1]
    assert doc["stages"][0]["nodes"] == ["x", "l0", "l1"]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb1p"])
def test_synchronous_schedules(graph: Path, tmp_path: Path, schedule: str) -> None:
    code, out, _ = _run("partition", "--profile", str(graph), "--gpus", "3", "--schedule", schedule,
                        "--microbatches", "4", "--json", "-o", str(tmp_path))  # fmt: skip
    assert code == 0
    plan = json.loads(out)
    m = plan["microbatches"]  # raised to a count every replica can use, if needed
    assert m % 4 == 0 and all(m % s["replicas"] == 0 for s in plan["stages"])
    assert m == 4 or plan["extra"]["microbatches_asked"] == 4
    assert plan["schedule"] == schedule


def test_a_plan_whose_next_minibatch_overlaps_says_its_timeline_is_one_minibatch(tmp_path: Path) -> None:
    """zb1p, the heavier stage last: stage 0 starts the next minibatch while stage 1 finishes its Ws,
    so the predicted time (the steady period, 12 ms) is shorter than the timeline shown (13 ms);
    partition says so. The same stages in the other order overlap nothing and say nothing."""
    for costs, said in (([(2, 4, 0, 10), (4, 8, 0, 10)], True), ([(4, 8, 0, 10), (2, 4, 0, 10)], False)):
        path = tmp_path / f"p{said}" / "graph.txt"
        path.parent.mkdir()
        write_graph_txt(make_profile(costs, [(0, 1)]), path)
        code, out, _ = _run("partition", "--profile", str(path), "--gpus", "2", "--schedule", "zb1p",
                            "--microbatches", "2", "--cuts", "l0", "--replicas", "1,1",
                            "-o", str(path.parent))  # fmt: skip
        assert code == 0
        text = " ".join(out.split())
        assert ("the timeline is one minibatch (13.000 ms)" in text) is said, text
        assert ("the steady state a minibatch takes 12.000 ms" in text) is said


@pytest.mark.parametrize(
    "args",
    [
        ["--gpus", "0"],
        ["--topology", "2,2", "--bandwidth", "1e9"],
        ["--gpus", "4", "--bandwidth", "0"],
        ["--gpus", "4", "--bandwidth", "fast"],
        ["--gpus", "4", "--latency", "soon"],
        ["--topology", "2,2", "--latency", "1ms"],
        ["--cluster", "dgx-h100", "--latency", "1ms"],
        ["--gpus", "4", "--memory", "1KiB"],
        ["--gpus", "4", "--cuts", "nosuchlayer", "--replicas", "1,1"],
        ["--gpus", "8", "--cuts", "l0,l1,l2,l3", "--replicas", "1,1,1,1,1"],
        ["--gpus", "4", "--cuts", "l1", "--replicas", "1"],
        ["--gpus", "4", "--gpus", "2", "--topology", "2,2"],
        ["--gpus", "4", "--batch-size", "0"],
        ["--gpus", "4", "--schedule", "1f1b", "--microbatches", "0"],
        ["--gpus", "4", "--host-cores", "2"],
        [
            "--gpus",
            "4",
            "--schedule",
            "auto",
            "--cuts",
            "l1",
            "--replicas",
            "3,1",
        ],  # a PipeDream (GPU) profile: its devices share no cores
    ],
)
def test_bad_input_is_one_line_and_exit_2(graph: Path, tmp_path: Path, args: list[str]) -> None:
    code, _, err = _run("partition", "--profile", str(graph), "-o", str(tmp_path), *args)
    assert code == 2
    assert err.strip().startswith("error:") and len(err.strip().splitlines()) == 1


def test_foreign_or_missing_profile_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "something/else"}')
    for path in (bad, tmp_path / "missing.json"):
        code, _, err = _run("partition", "--profile", str(path), "--gpus", "2")
        assert code == 2 and "error:" in err


def test_memory_infeasible_names_the_smallest_that_fits(graph: Path, tmp_path: Path) -> None:
    code, _, err = _run(
        "partition", "--profile", str(graph), "--gpus", "2", "--memory", "410KB", "-o", str(tmp_path)
    )
    assert code == 2
    assert "about 0.44 MiB would" in err  # not "0.00 GiB": small limits in small units


def test_a_layer_that_fits_no_device_is_named(graph: Path, tmp_path: Path) -> None:
    """layer1 holds 200 kB of weights: with its gradients 391 KiB, more than a 100 kB device."""
    code, _, err = _run(
        "partition", "--profile", str(graph), "--gpus", "2", "--memory", "100KB", "-o", str(tmp_path)
    )
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "layer l1 needs 0.38 MiB for its 0.19 MiB of float32 weights" in err  # (graph.txt: ids)
    assert "more than a device's 97.66 KiB" in err


def test_cluster_presets_and_files_set_the_topology(graph: Path, tmp_path: Path) -> None:
    _, out, _ = _run(
        "partition", "--profile", str(graph), "--cluster", "dgx-h100:2", "-o", str(tmp_path), "--json"
    )
    _, same, _ = _run(
        "partition", "--profile", str(graph), "--topology", "8,2", "--bandwidth", "450GB/s,50GB/s",
        "--latency", "3.4us,9.6us", "--memory", "80GiB", "-o", str(tmp_path), "--json",
    )  # fmt: skip
    assert json.loads(out)["cluster"] == json.loads(same)["cluster"]
    assert json.loads(out)["stages"] == json.loads(same)["stages"]
    _, lower, _ = _run("partition", "--profile", str(graph), "--cluster", "dgx-h100", "--memory", "1GiB",
                       "-o", str(tmp_path), "--json")  # fmt: skip
    assert json.loads(lower)["cluster"]["memory_bytes"] == 2**30
    for bad in (["--cluster", "dgx-h100", "--gpus", "2"], ["--cluster", "nope"]):
        code, _, err = _run("partition", "--profile", str(graph), "-o", str(tmp_path), *bad)
        assert code == 2 and err.startswith("error:") and len(err.strip().splitlines()) == 1


def test_weights_and_init_reach_the_package(tmp_path: Path) -> None:
    """--weights makes the stages load a state_dict; --init is recorded; both refuse a graph.txt plan."""
    import torch

    from partitioner.graph import save_profile
    from partitioner.models.specs import load_model
    from tests.partitioner.codegen_support import profile_for

    save_profile(profile_for("tiny-mlp"), tmp_path / "p.json")
    torch.save(load_model("tiny-mlp").build(seed=7).state_dict(), tmp_path / "w.pt")
    common = ("partition", "--profile", str(tmp_path / "p.json"), "--gpus", "2", "--straight", "--json")
    code, out, _ = _run(*common, "--weights", str(tmp_path / "w.pt"), "-o", str(tmp_path / "a"))
    assert code == 0
    assert json.loads(out)["extra"]["init"] == f"checkpoint {(tmp_path / 'w.pt').resolve()}"
    code, out, _ = _run(*common, "--init", "seeded", "-o", str(tmp_path / "b"))
    assert code == 0 and json.loads(out)["extra"]["init"] == "seeded"
    code, _, err = _run(*common, "--weights", str(tmp_path / "none.pt"), "-o", str(tmp_path / "c"))
    assert code == 2 and "no such file" in err and not (tmp_path / "c").exists()


def test_init_refused_for_a_graph_txt_profile(graph: Path, tmp_path: Path) -> None:
    code, _, err = _run("partition", "--profile", str(graph), "--gpus", "2", "--init", "exact")
    assert code == 2 and "graph.txt" in err


def test_microbatch_note_names_the_profile_to_take(tmp_path: Path) -> None:
    from partitioner.graph import save_profile
    from tests.partitioner.codegen_support import profile_for

    save_profile(profile_for("tiny-mlp", batch_size=8), tmp_path / "p.json")
    args = (
        "partition",
        "--profile",
        str(tmp_path / "p.json"),
        "--gpus",
        "2",
        "--straight",
        "-o",
        str(tmp_path),
    )
    code, out, _ = _run(*args, "--schedule", "1f1b", "--microbatches", "4")
    assert code == 0 and "--microbatch-size 2" in out
    code, out, _ = _run(*args)
    assert code == 0 and "--microbatch-size" not in out  # pipedream runs whole minibatches


def test_cpu_profile_prices_ranks_sharing_this_machines_cores(tmp_path: Path) -> None:
    """A CPU profile's cluster has this machine's cores (or --host-cores; 0: none) and its threads."""
    import os

    from partitioner.graph import save_profile
    from tests.partitioner.codegen_support import profile_for

    save_profile(profile_for("tiny-mlp"), tmp_path / "p.json")
    common = (
        "partition",
        "--profile",
        str(tmp_path / "p.json"),
        "--gpus",
        "3",
        "--json",
        "-o",
        str(tmp_path),
    )
    code, out, _ = _run(*common)
    plan = json.loads(out)
    assert code == 0 and plan["cluster"]["cores"] == len(os.sched_getaffinity(0))
    code, out, _ = _run(*common, "--host-cores", "1")
    plan = json.loads(out)
    work = sum(s["compute_s"] for s in plan["stages"])  # one core runs every rank's share in turn
    assert plan["predicted"]["host_bound_s"] == pytest.approx(work)
    assert plan["predicted"]["time_per_minibatch_s"] == pytest.approx(
        max(work, plan["predicted"]["pipeline_s"])
    )
    code, out, _ = _run(*common, "--host-cores", "0")
    assert code == 0 and json.loads(out)["cluster"]["cores"] is None
    code, _, err = _run(*common, "--host-cores", "-1")
    assert code == 2 and err.startswith("error: --host-cores must be >= 0")


def test_recompute_is_recorded_and_shown(graph: Path, tmp_path: Path) -> None:
    code, out, _ = _run("partition", "--profile", str(graph), "--gpus", "2", "--schedule", "gpipe",
                        "--recompute", "all", "--explain", "-o", str(tmp_path / "m"))  # fmt: skip
    assert code == 0, out
    plan = load_plan(tmp_path / "m" / "toy" / "gpus=2" / "plan.json")
    assert all(s.recompute for s in plan.stages) and plan.extra["recompute"] == "all"
    assert "recompute" in out and "alternatives (--recompute all)" in out
    code, out, _ = _run("partition", "--help")
    assert "--recompute [none|all|auto]" in out


def test_schedule_auto_shows_every_schedule_and_records_its_choice(graph: Path, tmp_path: Path) -> None:
    code, out, _ = _run("partition", "--profile", str(graph), "--gpus", "4", "--schedule", "auto",
                        "-o", str(tmp_path / "m"))  # fmt: skip
    assert code == 0, out
    plan = load_plan(tmp_path / "m" / "toy" / "gpus=4" / "plan.json")
    times = plan.extra["schedule_auto"]
    assert (
        set(times) == {"pipedream", "1f1b", "gpipe", "zb1p", "interleaved", "zbv"} and plan.schedule in times
    )
    assert times["interleaved"] is None and times["zbv"] is None  # 4 layers cannot make 4 GPUs x 2 stages
    assert plan.predicted.time_per_minibatch_s == min(t for t in times.values() if t is not None)
    assert "each schedule's best plan" in out and f"{plan.schedule} (chosen)" in out
    assert "microbatches not searched: the profile has no fixed per-call times" in out


def test_schedule_auto_searches_microbatches_of_a_profile_with_fixed_times(tmp_path: Path) -> None:
    chain = make_profile([(4, 8, 100, 100)] * 8, [(i, i + 1) for i in range(7)], batch_size=16)
    nodes = tuple(replace(n, forward_fixed_ms=n.forward_ms / 20, backward_fixed_ms=n.backward_ms / 20)
                  for n in chain.nodes)  # fmt: skip
    path = save_profile(replace(chain, nodes=nodes), tmp_path / "p" / "profile.json")
    code, out, _ = _run("partition", "--profile", str(path), "--gpus", "2", "--schedule", "auto",
                        "--host-cores", "0", "-o", str(tmp_path / "m"))  # fmt: skip
    assert code == 0, out
    plan = load_plan(tmp_path / "m" / "toy" / "gpus=2" / "plan.json")
    assert plan.extra["microbatches_searched"] == [1, 2, 4, 8]
    assert "microbatches searched: 1, 2, 4, 8" in out
    code, out, _ = _run("partition", "--profile", str(path), "--gpus", "2", "--schedule", "auto",
                        "--microbatches", "2", "-o", str(tmp_path / "m2"))  # fmt: skip
    assert code == 0 and "searched" not in out  # a count the user gave is kept
    assert load_plan(tmp_path / "m2" / "toy" / "gpus=2" / "plan.json").extra["microbatches_searched"] == [2]


def test_schedule_auto_recomputes_by_default_and_a_fixed_schedule_does_not(
    graph: Path, tmp_path: Path
) -> None:
    for schedule, want in (("auto", "auto"), ("1f1b", "none")):
        code, out, _ = _run("partition", "--profile", str(graph), "--gpus", "4", "--schedule", schedule,
                            "-o", str(tmp_path / schedule))  # fmt: skip
        assert code == 0, out
        assert load_plan(next((tmp_path / schedule).glob("*/gpus=4/plan.json"))).extra["recompute"] == want


def test_partitioning_over_a_trained_package_says_where_its_runs_are_kept(tmp_path: Path) -> None:
    """The replaced plan's runs move to runs.<time>/ in the new package, and the last line says so
    (only when something was moved: a second partition over it keeps quiet about the old names)."""
    from tests.partitioner.codegen_support import profile_for

    save_profile(profile_for("tiny-mlp"), tmp_path / "p.json")
    args = ("partition", "--profile", str(tmp_path / "p.json"), "--gpus", "2", "--straight")
    args += ("-o", str(tmp_path))
    code, out, _ = _run(*args)
    package = tmp_path / "tiny-mlp" / "gpus=2"
    assert code == 0 and "kept" not in out
    (package / "runs" / "20260101-000000").mkdir(parents=True)
    (package / "runs" / "20260101-000000" / "metrics.json").write_text("{}")
    (package / "run").symlink_to("runs/20260101-000000")
    code, out, _ = _run(*args)
    (kept,) = [p.name for p in package.glob("runs.*")]
    last = out.strip().splitlines()[-1]
    assert code == 0 and last.startswith(f"wrote {package}/plan.json")
    assert last.endswith(f"; the replaced plan's runs are kept in {kept}/"), last
    assert (package / kept / "20260101-000000" / "metrics.json").read_text() == "{}"
    code, out, _ = _run(*args)
    assert code == 0 and "kept" not in out.strip().splitlines()[-1] and (package / kept).is_dir()


def _imported_by_partition(tmp_path: Path, profile: Path, *names: str) -> list[str]:
    """Which of ``names`` a fresh ``pipeplan partition --profile PROFILE --gpus 2`` imported."""
    import ast
    import subprocess
    import sys

    code = (
        "import sys\nfrom cli import main\n"
        f"sys.argv = ['pipeplan', 'partition', '--profile', {str(profile)!r}, '--gpus', '2',"
        f" '-o', {str(tmp_path / 'm')!r}]\n"
        "try:\n    main()\nfinally:\n"
        f"    print(sorted(m for m in {names!r} if m in sys.modules), file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return list(ast.literal_eval(done.stderr.strip().splitlines()[-1]))


def test_partition_writing_an_fx_package_imports_no_sympy_or_dynamo(tmp_path: Path) -> None:
    """What partition runs is small; its time is imports. sympy (torch.export's symbolic shapes, half a
    CPU second) and torch._dynamo (torch's meta random fills) serve nothing an fx package needs."""
    from tests.partitioner.codegen_support import profile_for

    save_profile(profile_for("tiny-mlp"), tmp_path / "p.json")
    assert _imported_by_partition(tmp_path, tmp_path / "p.json", "sympy", "torch._dynamo") == []
    assert (tmp_path / "m" / "tiny-mlp" / "gpus=2" / "stage0.py").is_file()


def test_partition_of_a_graph_txt_profile_imports_no_torch(graph: Path, tmp_path: Path) -> None:
    """A PipeDream profile has no model to write code for: its plan needs no torch (2 s of CPU)."""
    assert _imported_by_partition(tmp_path, graph, "torch") == []
    assert (tmp_path / "m" / "toy" / "gpus=2" / "plan.json").is_file()
