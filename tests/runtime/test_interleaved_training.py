"""interleaved (a rank hosts v stages, Megatron's order) trains exactly as plain training with
gradient accumulation: same weights, parameter for parameter, on 2 and 4 ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.errors import RunError
from runtime.packages.job_config import load_job
from runtime.packages.load import import_package
from tests.runtime.helpers import (
    assert_one_step_is_the_plain_gradient,
    assert_stages_equal,
    plain_training,
    run,
    stage_state,
)
from tests.runtime.packages import write_package

pytestmark = pytest.mark.slow
torch.set_num_threads(1)


def test_interleaved_on_2_ranks_gives_plain_gradients(tmp_path: Path) -> None:
    """4 stages on 2 ranks (rank 0: stages 0 and 2), one SGD step at lr 1: the weights moved by
    exactly the gradient of plain accumulation."""
    pkg = write_package(tmp_path / "pkg", "chain", replicas=(1,) * 4, microbatches=4, batch_size=8, virtual=2)
    ckpt = tmp_path / "ckpt"
    metrics = run(pkg, steps=1, schedule="interleaved", lr=1.0, checkpoint_dir=str(ckpt))
    assert_one_step_is_the_plain_gradient(pkg, ckpt, 4, 1e-5)
    assert metrics["schedule"] == "interleaved"
    assert metrics["world_size"] == 2
    assert [list(r["hosted"]) for r in metrics["ranks"]] == [[0, 2], [1, 3]]


def test_interleaved_on_4_ranks_trains_as_plain_training(tmp_path: Path) -> None:
    """8 stages on 4 ranks, 3 steps of SGD with momentum over 8 microbatches."""
    pkg = write_package(
        tmp_path / "pkg", "chain", replicas=(1,) * 8, microbatches=8, batch_size=16, virtual=2
    )
    ckpt = tmp_path / "ckpt"
    metrics = run(pkg, steps=3, schedule="interleaved", lr=0.1, momentum=0.9, checkpoint_dir=str(ckpt))
    assert_stages_equal(ckpt, 3, plain_training(pkg, 3, 8, 16, lr=0.1, momentum=0.9), 8, atol=1e-5)
    assert len(metrics["losses"]) == 3


def test_interleaved_with_three_chunks_and_adam(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", "chain", replicas=(1,) * 6, microbatches=4, batch_size=8, virtual=3)
    ckpt = tmp_path / "ckpt"
    metrics = run(pkg, steps=2, schedule="interleaved", optimizer="adam", lr=0.01, checkpoint_dir=str(ckpt))
    assert_stages_equal(ckpt, 2, plain_training(pkg, 2, 4, 8, "adam", lr=0.01), 6, atol=1e-5)
    assert all(len(r["step_compute_s"]) == len(r["step_times_s"]) == 2 for r in metrics["ranks"])


def test_interleaved_routes_two_same_shaped_streams_between_one_pair_of_ranks(tmp_path: Path) -> None:
    """Rank 0 sends stage 0's two outputs (one shape) to stage 1 and stage 3, both on rank 1, in
    orders the ranks' lists do not share: only the per-stream tags keep them apart."""
    pkg = write_package(tmp_path / "pkg", "skip4", (1,) * 4, microbatches=4, batch_size=8, virtual=2)
    ckpt = tmp_path / "ckpt"
    run(pkg, steps=2, schedule="interleaved", lr=0.1, momentum=0.9, checkpoint_dir=str(ckpt))
    assert_stages_equal(ckpt, 2, plain_training(pkg, 2, 4, 8, lr=0.1, momentum=0.9), 4, atol=1e-5)


def test_interleaved_hands_a_tensor_between_two_stages_of_one_rank(tmp_path: Path) -> None:
    """Stage 0's second output skips to stage 2, which rank 0 hosts too (as a transformer's rotary
    tables or mask reach every layer): it goes through the rank's loopback, forward and backward."""
    pkg = write_package(tmp_path / "pkg", "skiphome", (1,) * 4, microbatches=4, batch_size=8, virtual=2)
    ckpt = tmp_path / "ckpt"
    run(pkg, steps=2, schedule="interleaved", lr=0.1, momentum=0.9, checkpoint_dir=str(ckpt))
    assert_stages_equal(ckpt, 2, plain_training(pkg, 2, 4, 8, lr=0.1, momentum=0.9), 4, atol=1e-5)


def test_interleaved_sums_a_tied_weight_across_ranks_and_clips_it_once(tmp_path: Path) -> None:
    """Stage 0's weight is stage 3's too (rank 0 and rank 1): each rank's first chunk sums the tie's
    gradient over the ranks before clipping, which counts it once; momentum SGD with clipping that
    binds ends equal to plain training, the two copies bit for bit equal."""
    from runtime.executing.optimizer import OptimSettings
    from tests.runtime.test_optim import _reference

    pkg = write_package(tmp_path / "pkg", "tied", (1,) * 4, microbatches=4, batch_size=8, virtual=2)
    model, norms = _reference(pkg, 3, 4, 8, OptimSettings(lr=0.5, momentum=0.5, clip_grad_norm=0.2))
    assert all(n > 0.2 for n in norms), norms
    ckpt = tmp_path / "ckpt"
    run(
        pkg,
        steps=3,
        schedule="interleaved",
        lr=0.5,
        momentum=0.5,
        clip_grad_norm=0.2,
        checkpoint_dir=str(ckpt),
    )
    assert_stages_equal(ckpt, 3, model, 4, atol=1e-5)
    torch.testing.assert_close(
        stage_state(ckpt, 3, 0)["fc.weight"], stage_state(ckpt, 3, 3)["w"], rtol=0, atol=0
    )


def _held_out_loss(pkg_dir: Path, ckpt: Path, step: int, stages: int, batch: int) -> float:
    """The unsplit model with the run's weights after ``step``: mean loss over one pass of the
    held-out data (synthetic, seed 1)."""
    from runtime.datasets.minibatches import SyntheticBatches

    pkg = import_package(pkg_dir)
    model, loss_fn = pkg.full_model(0), pkg.criterion()
    for k in range(stages):
        model.stages[k].load_state_dict(stage_state(ckpt, step, k))
    data = SyntheticBatches(pkg, ["input0"], batch, seed=1)
    with torch.no_grad():
        losses = [float(loss_fn(model(*data.inputs(b)), data.targets(b)))
                  for b in range(data.steps_per_epoch)]  # fmt: skip
    return sum(losses) / len(losses)


def test_interleaved_evaluates_the_unsplit_models_loss(tmp_path: Path) -> None:
    """``--eval-data`` under interleaved: each rank walks every held-out unit through its chunks in
    stage order (the skip to a stage of the same rank included); the loss equals the unsplit
    model's with the run's weights."""
    pkg = write_package(tmp_path / "pkg", "skiphome", (1,) * 4, microbatches=4, batch_size=8, virtual=2)
    ckpt = tmp_path / "ckpt"
    metrics = run(pkg, steps=3, schedule="interleaved", lr=0.2, checkpoint_dir=str(ckpt), checkpoint_every=2,
                  eval_data="synthetic", eval_every=2)  # fmt: skip
    assert [e["step"] for e in metrics["eval"]] == [2, 3]
    for entry in metrics["eval"]:
        want = _held_out_loss(pkg, ckpt, entry["step"], 4, 8)
        assert entry["loss"] == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert metrics["eval"][0]["loss"] != metrics["eval"][1]["loss"]


def test_interleaved_fp16_trains_as_1f1b_fp16_with_one_loss_scale_per_rank(tmp_path: Path) -> None:
    """The same 4 stages under fp16, 2 per rank (interleaved) and 1 per rank (1f1b): each rank's
    first chunk unscales all its chunks' gradients and votes once; the results agree."""
    kinds = {"inter": ("interleaved", 2), "plain": ("1f1b", 1)}
    got = {}
    for name, (schedule, virtual) in kinds.items():
        pkg = write_package(tmp_path / name, "chain", (1,) * 4, microbatches=4, batch_size=8, virtual=virtual)
        ckpt = tmp_path / f"{name}-ckpt"
        metrics = run(pkg, steps=3, schedule=schedule, lr=0.1, precision="fp16", checkpoint_dir=str(ckpt))
        got[name] = ([stage_state(ckpt, 3, k) for k in range(4)], metrics)
    for k in range(4):
        for key, want in got["plain"][0][k].items():
            torch.testing.assert_close(got["inter"][0][k][key], want, rtol=1e-6, atol=1e-6, msg=f"{k}.{key}")
    scales = {r["loss_scale"] for m in (got["inter"][1], got["plain"][1]) for r in m["ranks"]}
    assert len(scales) == 1 and got["inter"][1]["precision"] == "fp16"


def test_an_inf_in_one_chunk_skips_the_step_for_every_chunk_of_every_rank(tmp_path: Path) -> None:
    """Stage 0 (rank 0's first chunk) writes an inf into its gradient at step 2: rank 0 votes once
    for both its chunks, so all four stages skip step 2 and step again at 3."""
    import textwrap

    from tests.runtime.test_precision import _POISONED_STAGE0

    pkg = write_package(tmp_path / "pkg", "chain", (1,) * 4, microbatches=2, batch_size=4, virtual=2)
    (pkg / "stage0.py").write_text(textwrap.dedent(_POISONED_STAGE0).lstrip())
    ckpt = tmp_path / "ckpt"
    metrics = run(pkg, steps=4, schedule="interleaved", lr=0.1, precision="fp16", checkpoint_dir=str(ckpt),
                  checkpoint_every=1)  # fmt: skip
    assert [list(r["skipped_steps"]) for r in metrics["ranks"]] == [[2], [2]]
    assert [list(r["overflow_steps"]) for r in metrics["ranks"]] == [[2], []]
    for stage in range(4):
        before, skipped, after = (stage_state(ckpt, s, stage) for s in (1, 2, 3))
        assert all(torch.equal(before[n], skipped[n]) for n in before), f"stage {stage} stepped at 2"
        assert not all(torch.equal(skipped[n], after[n]) for n in skipped), f"stage {stage} froze at 3"


def test_interleaved_refuses_replicas_and_odd_microbatches(tmp_path: Path) -> None:
    replicated = write_package(tmp_path / "rep", "chain", replicas=(2, 1), microbatches=4, batch_size=8)
    with pytest.raises(RunError, match="replicas only as whole copies of the pipeline"):
        load_job(replicated, schedule="interleaved")
    pkg = write_package(
        tmp_path / "pkg", "chain", replicas=(1,) * 4, microbatches=4, batch_size=12, virtual=2
    )
    with pytest.raises(RunError, match="multiple of the 2 ranks"):
        load_job(pkg, schedule="interleaved", microbatches=3)
    with pytest.raises(RunError, match="only --schedule interleaved runs"):
        load_job(pkg, schedule="1f1b")
    one = write_package(tmp_path / "one", "chain", (1,) * 2, microbatches=2, batch_size=4, virtual=2)
    with pytest.raises(RunError, match="at least 2 ranks"):
        load_job(one, schedule="interleaved")
    from runtime.job.launch import check_launch
    from runtime.settings.run_options import RunOptions

    with pytest.raises(RunError, match="gloo only"):
        check_launch(RunOptions(str(pkg), schedule="interleaved", microbatches=4, backend="nccl"))


def test_dry_run_shows_each_ranks_interleaved_list(tmp_path: Path) -> None:
    from runtime.job.launch import schedule_preview
    from runtime.settings.run_options import RunOptions

    pkg = write_package(tmp_path / "pkg", "chain", (1,) * 4, microbatches=2, batch_size=4, virtual=2)
    lines = schedule_preview(RunOptions(str(pkg), schedule="interleaved"))
    assert lines == [
        "rank 0 (stages 0,2): 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1 0S0 2S0",
        "rank 1 (stages 1,3): 1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1 1S0 3S0",
    ]
