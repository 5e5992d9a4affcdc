"""Every plan bit-identical to the golden file (tests/golden/plans.json, see ``golden.py``).

The suite checks the quick cases (``golden.QUICK``, seconds); ``python -m
tests.partitioner.optimizer.golden`` checks all of them (minutes). The ILP cases are HiGHS's answers
(``.[dev]`` installs highspy): another solver may break a tie between plans of equal time otherwise."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from partitioner.optimizer.pricing.simulate import Simulation
from partitioner.plan import Plan
from tests.partitioner.optimizer.golden import GOLDEN, cases, outcome

GOLDEN_PLANS = json.loads(GOLDEN.read_text())
QUICK_CASES = cases(everything=False)


def test_golden_file_covers_every_case() -> None:
    assert sorted(GOLDEN_PLANS) == sorted(name for name, _ in cases())


@pytest.mark.parametrize(("name", "make"), QUICK_CASES, ids=[name for name, _ in QUICK_CASES])
def test_plan_is_bit_identical(name: str, make: Callable[[], Plan | Simulation]) -> None:
    assert outcome(make) == GOLDEN_PLANS[name]
