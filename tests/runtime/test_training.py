"""Multi-process gloo runs of hand-written packages against single-process training.

Synchronous schedules must equal plain training with gradient accumulation parameter for parameter;
pipedream must equal a replay of its semantics in which every backward uses its forward's weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from partitioner.optimizer.pricing.schedules import in_flight
from tests.runtime.helpers import assert_stages_equal, pipedream_reference, plain_training, run, stage_state
from tests.runtime.packages import write_package

pytestmark = pytest.mark.slow
torch.set_num_threads(1)


def test_1f1b_equals_plain_training_with_gradient_accumulation(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", "chain", replicas=(1, 1, 1), microbatches=4, batch_size=8)
    ckpt = tmp_path / "ckpt"
    metrics = run(pkg, steps=3, schedule="1f1b", lr=0.1, momentum=0.9, checkpoint_dir=str(ckpt))
    model = plain_training(pkg, 3, 4, 8, lr=0.1, momentum=0.9)
    assert_stages_equal(ckpt, 3, model, 3)
    assert len(metrics["losses"]) == 3
    assert (pkg / "run" / "metrics.json").is_file()


def test_gpipe_with_skip_connection_and_adam_equals_plain_training(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", "skip", replicas=(1, 1, 1), microbatches=2, batch_size=6)
    ckpt = tmp_path / "ckpt"
    run(pkg, steps=3, schedule="gpipe", optimizer="adam", lr=0.01, checkpoint_dir=str(ckpt))
    assert_stages_equal(ckpt, 3, plain_training(pkg, 3, 2, 6, "adam", lr=0.01), 3)


def test_3_1_replicated_stage_trains_exactly_and_replicas_agree(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", "chain", replicas=(3, 1), microbatches=4, batch_size=8)
    ckpt = tmp_path / "ckpt"
    metrics = run(pkg, steps=3, schedule="1f1b", lr=0.1, checkpoint_dir=str(ckpt))
    assert_stages_equal(ckpt, 3, plain_training(pkg, 3, 4, 8, lr=0.1), 2)
    replicas = [r["param_sq_sum"] for r in metrics["ranks"] if r["stage"] == 0]
    assert len(replicas) == 3 and len(set(replicas)) == 1


def test_tied_weights_stay_equal_and_match_the_shared_parameter(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", "tied", replicas=(1, 1), microbatches=2, batch_size=4)
    ckpt = tmp_path / "ckpt"
    run(pkg, steps=3, schedule="1f1b", lr=0.1, checkpoint_dir=str(ckpt))
    model = plain_training(pkg, 3, 2, 4, lr=0.1)
    assert_stages_equal(ckpt, 3, model, 2)
    torch.testing.assert_close(
        stage_state(ckpt, 3, 0)["fc.weight"], stage_state(ckpt, 3, 1)["w"], rtol=0, atol=0
    )


@pytest.mark.parametrize(("replicas", "micro"), [((1, 1, 1), 1), ((2, 1), 2)])
def test_pipedream_backward_uses_the_weights_of_its_own_forward(
    tmp_path: Path, replicas: tuple[int, ...], micro: int
) -> None:
    steps, batch = 4, 4
    pkg = write_package(tmp_path / "pkg", "chain", replicas=replicas, microbatches=micro, batch_size=batch)
    ckpt = tmp_path / "ckpt"
    metrics = run(
        pkg, steps=steps, schedule="pipedream", microbatches=micro, lr=0.2, checkpoint_dir=str(ckpt)
    )
    want, versions = pipedream_reference(pkg, replicas, steps, micro, batch, lr=0.2)
    stale = [u for u, v in versions[0].items() if v < u // micro // replicas[0]]
    assert stale, "stage 0 must run some forwards on weights older than their minibatch's"
    _assert_weights(ckpt, steps, want)
    # The runtime's own log agrees: rank 0 ran backwards after newer weights existed, on the old ones.
    log = metrics["stash_log"]["0"] if "0" in metrics["stash_log"] else metrics["stash_log"][0]
    mine = {u: v for u, v in versions[0].items() if (u // micro) % replicas[0] == 0}
    assert [(u, v) for u, v, _ in log] == sorted(mine.items())
    assert any(now > used for _, used, now in log)
    # And staleness matters: synchronous training ends elsewhere.
    sync = plain_training(pkg, steps, micro, batch, lr=0.2)
    assert not torch.allclose(sync.stages[0].fc.weight, want[0]["fc.weight"])


def _assert_weights(ckpt: Path, step: int, want: list[dict[str, torch.Tensor]]) -> None:
    for k, weights in enumerate(want):
        got = stage_state(ckpt, step, k)
        for name, tensor in weights.items():
            torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=f"stage{k}.{name}")


def test_pipedream_3_1_stashes_what_the_memory_model_prices_and_all_reduces_one_version(
    tmp_path: Path,
) -> None:
    """PipeDream's replication: whole minibatches round-robin to stage 0's three replicas, each
    keeping warm-up + 1 = 2 versions in flight (cost.in_flight), all-reducing gradients of one
    version; 10 minibatches end on a round that only replica 0 ran."""
    replicas, steps, batch = (3, 1), 10, 4
    pkg = write_package(tmp_path / "pkg", "chain", replicas=replicas, microbatches=1, batch_size=batch)
    ckpt = tmp_path / "ckpt"
    metrics = run(pkg, steps=steps, schedule="pipedream", lr=0.2, checkpoint_dir=str(ckpt))
    want, _ = pipedream_reference(pkg, replicas, steps, 1, batch, lr=0.2)
    _assert_weights(ckpt, steps, want)
    held = {r["rank"]: r["versions_in_flight_max"] for r in metrics["ranks"]}
    assert held == {rank: in_flight("pipedream", int(rank >= 3), replicas, 1) for rank in range(4)}
    assert held == {0: 2, 1: 2, 2: 2, 3: 1}
    logs = {int(rank): log for rank, log in metrics["step_versions"].items()}
    for step in (0, 3, 6, 9):
        used = [set(dict(logs[rank])[step]) for rank in (0, 1, 2)]
        assert len(set().union(*used)) == 1, f"step {step} all-reduced versions {used}"
    assert dict(logs[0])[6] == (1,) and dict(logs[2])[9] == ()  # a round stale; replica 2 idle in the last
    assert metrics["steps"] == steps and len({r["param_sq_sum"] for r in metrics["ranks"][:3]}) == 1


def test_one_stage_two_replicas_is_data_parallel_training(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", "chain", replicas=(2,), microbatches=2, batch_size=4)
    ckpt = tmp_path / "ckpt"
    metrics = run(pkg, steps=3, schedule="gpipe", lr=0.1, momentum=0.5, checkpoint_dir=str(ckpt))
    assert_stages_equal(ckpt, 3, plain_training(pkg, 3, 2, 4, lr=0.1, momentum=0.5), 1)
    assert len({r["param_sq_sum"] for r in metrics["ranks"]}) == 1


def test_replicated_middle_stage_routes_skip_connections(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", "skip", replicas=(1, 2, 1), microbatches=4, batch_size=8)
    ckpt = tmp_path / "ckpt"
    run(pkg, steps=2, schedule="1f1b", lr=0.1, checkpoint_dir=str(ckpt))
    assert_stages_equal(ckpt, 2, plain_training(pkg, 2, 4, 8, lr=0.1), 3)


def test_integer_tensors_cross_stages_without_gradients(tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "pkg", "int", replicas=(1, 1), microbatches=2, batch_size=4)
    ckpt = tmp_path / "ckpt"
    run(pkg, steps=2, schedule="1f1b", lr=0.1, checkpoint_dir=str(ckpt))
    assert_stages_equal(ckpt, 2, plain_training(pkg, 2, 2, 4, lr=0.1), 2)


@pytest.mark.parametrize("schedule", ["1f1b", "zb1p"])
def test_a_float_made_from_buffers_crosses_without_a_gradient(tmp_path: Path, schedule: str) -> None:
    """Stage 0 sends a float computed from a buffer alone (as a rotary embedding's cos and sin): its
    consumer takes it as a constant, as autograd does in one process, so an in-place operation on it
    runs (on a tensor marked as needing a gradient it raises), the activations that multiply it are
    not kept for a gradient that goes nowhere, and training is exact."""
    pkg = write_package(tmp_path / "pkg", "buffer", replicas=(1, 1), microbatches=2, batch_size=4)
    ckpt = tmp_path / "ckpt"
    run(pkg, steps=2, schedule=schedule, lr=0.1, checkpoint_dir=str(ckpt))
    assert_stages_equal(ckpt, 2, plain_training(pkg, 2, 2, 4, lr=0.1), 2)


@pytest.mark.parametrize(("schedule", "steps"), [("1f1b", 4), ("pipedream", 12)])
def test_sent_tensors_are_freed_during_a_long_segment(tmp_path: Path, schedule: str, steps: int) -> None:
    """gloo reports no send complete until it is waited for; the runtime must still let go of each
    sent tensor once the schedule proves it was received, not keep every one until the run ends,
    nor one minibatch's until the next ends."""
    pkg = write_package(tmp_path / "pkg", "chain", replicas=(1, 1, 1), microbatches=2, batch_size=4)
    peaks = []
    for n in (steps, 2 * steps):
        metrics = run(pkg, steps=n, schedule=schedule, lr=0.1)
        peaks.append([r["sends_in_flight_max"] for r in metrics["ranks"]])
    assert peaks[0] == peaks[1]
    assert max(peaks[1]) < 2 * steps * 2 * 2  # far below every send of the longer run
    if schedule == "1f1b":  # an activation ends when its gradient is back, the rest at the step:
        assert max(peaks[1]) <= 2  # a minibatch's sends of one kind at most (4 and 8 kept them a step)
    else:  # a gradient ends when its producer's next forward arrives: at most the first stage's units
        assert max(peaks[1]) <= 2 * 2 + 1  # in flight (38 when sends waited 2 (ranks + 1) steps)
    for r in metrics["ranks"]:
        assert 0 < r["compute_cpu_s"] <= r["compute_s"] + 0.05
        assert r["cpu_s"] > 0
