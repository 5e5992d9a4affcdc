"""What a resumed run changes: refused, accepted with a line per change, or another plan (a note)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from runtime.checkpoints.resume_settings import compare
from runtime.errors import RunError

WHERE = Path("ck/step-4")


def _record(**changes: Any) -> dict[str, Any]:
    optim = {
        "optimizer": "adam",
        "lr": 0.01,
        "momentum": 0.0,
        "nesterov": False,
        "weight_decay": 0.0,
        "betas": [0.9, 0.999],
        "lr_schedule": "cosine",
        "warmup_steps": 3,
        "clip_grad_norm": None,
    }
    optim.update(changes.pop("optim", {}))
    doc = {
        "model": "m",
        "package": "pkg",
        "fingerprint": "f",
        "stage_ranks": [[0], [1]],
        "keys": "original",
        "seed": 0,
        "schedule": "1f1b",
        "microbatches": 4,
        "batch_size": 8,
        "precision": "fp32",
        "data": "synthetic",
        "seq_len": None,
        "tokenizer": None,
        "shuffle": False,
        "optim": optim,
        "total_steps": 8,
    }
    return {**doc, **changes}


def test_the_same_run_resumes_silently() -> None:
    verdict = compare(_record(), _record(), 4, WHERE)
    assert verdict.same_layout and verdict.lines(accept=False) == []


@pytest.mark.parametrize(
    ("changed", "words"),
    [
        ({"seed": 1}, "--seed 0 -> 1 (minibatches after step 4 are not the first run's)"),
        ({"microbatches": 2}, "--microbatches 4 -> 2"),
        ({"schedule": "zb1p"}, "--schedule 1f1b -> zb1p"),
        ({"data": "text:a.txt"}, "--data synthetic -> text:a.txt"),
        ({"optim": {"lr": 0.02}}, "--lr 0.01 -> 0.02"),
        ({"optim": {"betas": [0.9, 0.95]}}, "--betas 0.9,0.999 -> 0.9,0.95"),
        ({"total_steps": 12}, "the learning rate's horizon 8 -> 12 steps (the cosine decay ends"),
    ],
)
def test_a_change_is_refused_in_one_line_or_accepted_and_named(changed: dict[str, Any], words: str) -> None:
    verdict = compare(_record(), _record(**changed), 4, WHERE)
    with pytest.raises(RunError, match="resuming would change the run: ") as refused:
        verdict.lines(accept=False)
    assert words in str(refused.value) and "--accept-changes" in str(refused.value)
    assert any(words in line for line in verdict.lines(accept=True))


def test_a_constant_rate_has_no_horizon_to_move() -> None:
    constant = {"optim": {"lr_schedule": "constant"}}
    assert compare(_record(**constant), _record(**constant, total_steps=12), 4, WHERE).lines(False) == []


@pytest.mark.parametrize(
    ("changed", "words"),
    [
        ({"total_steps": 2}, "is at step 4 and this run ends at step 2: nothing is left to train"),
        ({"total_steps": 4}, "this run ends at step 4: nothing is left to train"),
        ({"optim": {"optimizer": "sgd"}}, "holds adam's optimizer state, which sgd cannot continue"),
        ({"fingerprint": "g", "keys": "per-stage"}, "keyed per stage"),
    ],
)
def test_what_cannot_resume_is_refused_even_when_changes_are_accepted(
    changed: dict[str, Any], words: str
) -> None:
    with pytest.raises(RunError, match=words):
        compare(_record(), _record(**changed), 4, WHERE).lines(accept=True)


def test_another_plan_is_a_note_and_restarts_the_generators() -> None:
    other = _record(fingerprint="g", stage_ranks=[[0], [1, 2], [3]])
    verdict = compare(_record(), other, 4, WHERE)
    assert not verdict.same_layout
    (note,) = verdict.lines(accept=False)
    assert (
        "another plan (2 stages on 2 ranks, replicas 1x1); resuming on 3 stages on 4 ranks, replicas 1x2x1"
        in note
    )
