"""zbv (two stages per rank laid out as a V, backward split into B and W) trains exactly as plain
training with gradient accumulation: same weights, parameter for parameter, on 2 and 4 ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runtime.errors import RunError
from runtime.packages.job_config import load_job
from tests.runtime.helpers import (
    assert_one_step_is_the_plain_gradient,
    assert_stages_equal,
    plain_training,
    run,
)
from tests.runtime.packages import write_package

pytestmark = pytest.mark.slow
torch.set_num_threads(1)


def test_zbv_on_2_ranks_gives_plain_gradients(tmp_path: Path) -> None:
    """4 stages on 2 ranks (rank 0: stages 0 and 3, rank 1: 1 and 2, handing 1 -> 2 to itself),
    one SGD step at lr 1: the weights moved by exactly the gradient of plain accumulation (every
    weight moved: a W left out would leave its stage's weights where they were)."""
    pkg = write_package(
        tmp_path / "pkg", "chain", (1,) * 4, microbatches=4, batch_size=8, virtual=2, v_shape=True
    )
    ckpt, trace = tmp_path / "ckpt", tmp_path / "trace.json"
    metrics = run(pkg, steps=1, schedule="zbv", lr=1.0, checkpoint_dir=str(ckpt), trace=str(trace))
    assert_one_step_is_the_plain_gradient(pkg, ckpt, 4, 1e-5)
    assert metrics["schedule"] == "zbv"
    assert [list(r["hosted"]) for r in metrics["ranks"]] == [[0, 3], [1, 2]]
    # Every backward ran split: per rank, a B and a W span for each of 4 units of each of 2 chunks.
    spans = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "compute"]
    for rank in (0, 1):
        names = [e["name"] for e in spans if e["pid"] == rank]
        assert sorted(n for n in names if n[0] in "BW") == sorted(
            [f"B{u}" for u in range(4)] * 2 + [f"W{u}" for u in range(4)] * 2
        )


def test_zbv_on_4_ranks_trains_as_plain_training(tmp_path: Path) -> None:
    """8 stages on 4 ranks, 3 steps of SGD with momentum over 8 microbatches (m = 2p: the full V)."""
    pkg = write_package(
        tmp_path / "pkg", "chain", (1,) * 8, microbatches=8, batch_size=16, virtual=2, v_shape=True
    )
    ckpt = tmp_path / "ckpt"
    metrics = run(pkg, steps=3, schedule="zbv", lr=0.1, momentum=0.9, checkpoint_dir=str(ckpt))
    assert_stages_equal(ckpt, 3, plain_training(pkg, 3, 8, 16, lr=0.1, momentum=0.9), 8, atol=1e-5)
    assert len(metrics["losses"]) == 3


def test_zbv_with_adam_a_skip_and_few_microbatches(tmp_path: Path) -> None:
    """Adam, stage 0's second output skipping to stage 2 (on the other rank), 2 microbatches on 2
    ranks (fewer than 2p - 1: the order leaves the missing units out)."""
    pkg = write_package(
        tmp_path / "pkg", "skiphome", (1,) * 4, microbatches=2, batch_size=4, virtual=2, v_shape=True
    )
    ckpt = tmp_path / "ckpt"
    run(pkg, steps=2, schedule="zbv", optimizer="adam", lr=0.01, checkpoint_dir=str(ckpt))
    assert_stages_equal(ckpt, 2, plain_training(pkg, 2, 2, 4, "adam", lr=0.01), 4, atol=1e-5)


def test_zbv_and_its_layout_go_together(tmp_path: Path) -> None:
    v = write_package(
        tmp_path / "v", "chain", (1,) * 4, microbatches=4, batch_size=8, virtual=2, v_shape=True
    )
    cyclic = write_package(tmp_path / "c", "chain", (1,) * 4, microbatches=4, batch_size=8, virtual=2)
    with pytest.raises(RunError, match="as only --schedule zbv runs them"):
        load_job(v, schedule="interleaved")
    with pytest.raises(RunError, match="partitioned with --schedule zbv"):
        load_job(cyclic, schedule="zbv")
    assert load_job(v, schedule="zbv").hosted_stages(1) == (1, 2)


def test_dry_run_shows_each_ranks_zbv_list(tmp_path: Path) -> None:
    from runtime.job.launch import schedule_preview
    from runtime.settings.run_options import RunOptions

    pkg = write_package(
        tmp_path / "pkg", "chain", (1,) * 4, microbatches=3, batch_size=6, virtual=2, v_shape=True
    )
    lines = schedule_preview(RunOptions(str(pkg), schedule="zbv"))
    assert lines[1] == (
        "rank 1 (stages 1,2): 1F0 2F0 1F1 2F1 2B0 2W0 1F2 1B0 1W0 2F2 2B1 2W1 1B1 2B2 1B2 1W1 2W2 1W2 1S0 2S0"
    )


def test_zbv_ties_the_first_and_last_stage_on_rank_0(tmp_path: Path) -> None:
    """Stage 0's weight is stage 3's too: under the V both lie on rank 0, whose first chunk sums
    the tie's gradient over its own two stages; with clipping that binds, the run equals plain
    training and the two copies stay bit for bit equal."""
    from runtime.executing.optimizer import OptimSettings
    from tests.runtime.helpers import stage_state
    from tests.runtime.test_optim import _reference

    pkg = write_package(
        tmp_path / "pkg", "tied", (1,) * 4, microbatches=4, batch_size=8, virtual=2, v_shape=True
    )
    model, norms = _reference(pkg, 3, 4, 8, OptimSettings(lr=0.5, momentum=0.5, clip_grad_norm=0.2))
    assert all(n > 0.2 for n in norms), norms
    ckpt = tmp_path / "ckpt"
    common = {"lr": 0.5, "momentum": 0.5, "clip_grad_norm": 0.2}
    run(pkg, steps=3, schedule="zbv", checkpoint_dir=str(ckpt), **common)
    assert_stages_equal(ckpt, 3, model, 4, atol=1e-5)
    torch.testing.assert_close(
        stage_state(ckpt, 3, 0)["fc.weight"], stage_state(ckpt, 3, 3)["w"], rtol=0, atol=0
    )


def _on_two_copies(pkg: Path) -> Path:
    """The package's V laid out on 2 copies: stage ranks ``r`` become ``2r`` (copy 0) and ``2r + 1``."""
    conf = json.loads((pkg / "mp_conf.json").read_text())
    conf["stage_to_rank_map"] = {
        k: [2 * r for r in rs] + [2 * r + 1 for r in rs] for k, rs in conf["stage_to_rank_map"].items()
    }
    (pkg / "mp_conf.json").write_text(json.dumps(conf))
    plan = json.loads((pkg / "plan.json").read_text())
    for stage in plan["stages"]:
        stage["ranks"] = [2 * r for r in stage["ranks"]] + [2 * r + 1 for r in stage["ranks"]]
        stage["replicas"] = 2
    (pkg / "plan.json").write_text(json.dumps(plan))
    return pkg


def test_zbv_on_copies_sums_a_tie_once_and_clips_every_chunk(tmp_path: Path) -> None:
    """The tied V on 2 copies (4 ranks; stages 0 and 3 on ranks 0 and 1): each copy plays its own V
    over half the microbatches; the tie's gradient is summed over both copies once (its group spans
    them, so the replica all-reduce leaves it out), and a rank's first chunk clips after its other
    chunk's gradients are summed over the copies too. Equal to plain training with clipping that binds."""
    from runtime.executing.optimizer import OptimSettings
    from tests.runtime.helpers import stage_state
    from tests.runtime.test_optim import _reference

    pkg = write_package(
        tmp_path / "pkg", "tied", (1,) * 4, microbatches=4, batch_size=8, virtual=2, v_shape=True
    )
    _on_two_copies(pkg)
    model, norms = _reference(pkg, 3, 4, 8, OptimSettings(lr=0.5, momentum=0.5, clip_grad_norm=0.2))
    assert all(n > 0.2 for n in norms), norms
    ckpt = tmp_path / "ckpt"
    metrics = run(
        pkg, steps=3, schedule="zbv", checkpoint_dir=str(ckpt), lr=0.5, momentum=0.5, clip_grad_norm=0.2
    )
    assert [list(r["hosted"]) for r in metrics["ranks"]] == [[0, 3], [0, 3], [1, 2], [1, 2]]
    assert_stages_equal(ckpt, 3, model, 4, atol=1e-5)
    torch.testing.assert_close(
        stage_state(ckpt, 3, 0)["fc.weight"], stage_state(ckpt, 3, 3)["w"], rtol=0, atol=0
    )


def test_zbv_evaluates_the_unsplit_models_loss(tmp_path: Path) -> None:
    """``--eval-data`` under zbv: each rank walks every held-out unit through its two stages in
    stage order (rank 0 scores, holding the last stage); the loss equals the unsplit model's."""
    from tests.runtime.test_interleaved_training import _held_out_loss

    pkg = write_package(
        tmp_path / "pkg", "chain", (1,) * 4, microbatches=4, batch_size=8, virtual=2, v_shape=True
    )
    ckpt = tmp_path / "ckpt"
    metrics = run(
        pkg, steps=2, schedule="zbv", lr=0.2, checkpoint_dir=str(ckpt), eval_data="synthetic", eval_every=2
    )
    assert [e["step"] for e in metrics["eval"]] == [2]
    want = _held_out_loss(pkg, ckpt, 2, 4, 8)
    assert metrics["eval"][0]["loss"] == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_zbv_on_one_rank_hands_everything_through_the_loopback(tmp_path: Path) -> None:
    """p = 1: both stages on rank 0, every message a loopback; still plain training's weights."""
    pkg = write_package(
        tmp_path / "pkg", "chain", (1,) * 2, microbatches=4, batch_size=8, virtual=2, v_shape=True
    )
    ckpt = tmp_path / "ckpt"
    run(pkg, steps=2, schedule="zbv", lr=0.1, momentum=0.9, checkpoint_dir=str(ckpt))
    assert_stages_equal(ckpt, 2, plain_training(pkg, 2, 4, 8, lr=0.1, momentum=0.9), 2, atol=1e-5)


def test_a_rank_of_several_stages_is_held_to_its_devices_prediction(tmp_path: Path) -> None:
    """metrics.json's memory: rank 0 of a zbv job (stages 0 and 3) reports under stage 0, against
    the prediction of both its stages (the planner's per-device check), not stage 0's alone."""
    from dataclasses import replace

    from runtime.job.worker import _rank_predictions
    from runtime.observing.metrics import RankMetrics

    pkg = write_package(
        tmp_path / "pkg", "chain", (1,) * 4, microbatches=4, batch_size=8, virtual=2, v_shape=True
    )
    job = replace(load_job(pkg, schedule="zbv"), predicted_memory_bytes=(10, 20, 30, 40))
    ranks = [
        RankMetrics(0, 0, 0.0, 0.0, 0.0, (), hosted=(0, 3)),
        RankMetrics(1, 1, 0.0, 0.0, 0.0, (), hosted=(1, 2)),
    ]
    assert _rank_predictions(job, ranks) == (50, 50, 30, 40)
    assert _rank_predictions(job, [RankMetrics(0, 0, 0.0, 0.0, 0.0, ())]) == (10, 20, 30, 40)


def test_zbv_fp16_trains_as_1f1b_fp16_with_one_loss_scale_per_rank(tmp_path: Path) -> None:
    """The same 4 stages under fp16, 2 per rank as a V (zbv) and 1 per rank (1f1b): each rank's
    first chunk unscales both its chunks' gradients and votes once; the results agree."""
    from tests.runtime.helpers import stage_state

    got = {}
    for name, (schedule, v_shape) in {"zbv": ("zbv", True), "plain": ("1f1b", False)}.items():
        virtual = 2 if v_shape else 1
        pkg = write_package(
            tmp_path / name, "chain", (1,) * 4, microbatches=4, batch_size=8, virtual=virtual, v_shape=v_shape
        )
        ckpt = tmp_path / f"{name}-ckpt"
        metrics = run(pkg, steps=3, schedule=schedule, lr=0.1, precision="fp16", checkpoint_dir=str(ckpt))
        got[name] = ([stage_state(ckpt, 3, k) for k in range(4)], metrics)
    for k in range(4):
        for key, want in got["plain"][0][k].items():
            torch.testing.assert_close(got["zbv"][0][k][key], want, rtol=1e-6, atol=1e-6, msg=f"{k}.{key}")
    scales = {r["loss_scale"] for m in (got["zbv"][1], got["plain"][1]) for r in m["ranks"]}
    assert len(scales) == 1 and got["zbv"][1]["precision"] == "fp16"
