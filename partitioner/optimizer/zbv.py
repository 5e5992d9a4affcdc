"""Cost model of ``zbv`` (ZB-V, :mod:`runtime.schedule_zbv`): ``2p`` one-device stages on ``p``
GPUs laid out as a V, rank ``r`` hosting stages ``r`` and ``2p - 1 - r``, every backward split into
B and W (:data:`partitioner.optimizer.pricing.schedules.W_SHARE`).

What a stage holds is counted from the runtime's own lists (:func:`zbv_held`), its time bounded
from below in closed form (:func:`zbv_time`) to rank candidate cuts; a plan's predicted time is the
event simulation of the same lists (``partitioner.optimizer.interleaved.played``), as interleaved's.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from partitioner.errors import PlanError
from partitioner.optimizer.pricing.schedules import W_SHARE, StageLoad, StageTimes, _microbatch_parts
from runtime.schedule_zbv import zbv_placement, zbv_rank, zbv_stages

__all__ = ["zbv_held", "zbv_time", "zbv_times"]


def zbv_held(position: int, ranks: int, microbatches: int) -> int:
    """Units whose graph stage ``position`` holds at once at most under zbv: from a unit's F to its
    W (a split backward keeps the graph for W), played from its rank's own list
    (``runtime.schedule_zbv.zbv_rank``). Once ``M >= 2p`` stage ``k`` holds ``2p - k``: rank ``r``'s
    chunks ``2p - r`` and ``r + 1``. A device's memory sums its chunks' peaks, ``2p + 1`` units
    of half a 1f1b stage, one more than the ``2p`` its list holds at once (the chunks do not peak
    together): an upper bound by one unit of one chunk, as interleaved's."""
    rank = zbv_placement(ranks)[position]
    return _chunk_peaks(rank, ranks, microbatches)[zbv_stages(rank, ranks).index(position)]


@functools.lru_cache(maxsize=256)
def _chunk_peaks(rank: int, ranks: int, microbatches: int) -> tuple[int, int]:
    stages = zbv_stages(rank, ranks)
    live, peak = [0, 0], [0, 0]
    for a in zbv_rank(rank, ranks, microbatches):
        if a.kind in "FW":
            chunk = stages.index(a.stage)
            live[chunk] += 1 if a.kind == "F" else -1
            peak[chunk] = max(peak[chunk], live[chunk])
    return peak[0], peak[1]


def zbv_time(
    forward: Sequence[float], backward: Sequence[float], link: Sequence[float], microbatches: int
) -> float:
    """A lower bound on zbv's time for one minibatch (no all-reduce) from one microbatch's per-stage
    times on ``2p`` stages; ``link``: a stage's activation traffic per microbatch, out and back (half
    each way, as the simulation sends it; none after stage ``p - 1``: the turn of the V is inside
    one rank). The larger of:

    - rank ``r`` works ``M`` times its two stages' F + B + W and cannot start before microbatch 0's
      forwards through stages ``0 .. r - 1`` have reached it;
    - one microbatch's trip: its forwards and input backwards (B) through every stage, then stage
      0's W.

    With equal stages of F = B = W = t it is ``6Mt + (p - 1)t``, the unit-time slots of
    ``runtime.schedule_zbv.build_zbv`` once ``M >= 2p - 1``; on unequal stages the simulation
    prices what this bound misses.
    """
    stages = len(forward)
    if stages % 2:
        raise PlanError(f"zbv needs an even number of stages (2 per GPU), got {stages}")
    p = stages // 2
    hop = [0.0 if k == p - 1 else a / 2 for k, a in enumerate(link)]  # one way: half the traffic
    fill = [0.0]
    for f, a in zip(forward, hop, strict=True):
        fill.append(fill[-1] + f + a)
    by_rank = max(
        microbatches * sum(forward[k] + backward[k] for k in zbv_stages(r, p)) + fill[r] for r in range(p)
    )
    b = [t * (1.0 - W_SHARE) for t in backward]
    trip = (
        fill[stages - 1]
        + forward[-1]
        + sum(bi + a for bi, a in zip(b, hop, strict=True))
        + backward[0] * W_SHARE
    )
    return max(by_rank, trip)


def zbv_times(
    loads: Sequence[StageLoad], replicas: Sequence[int], bandwidths: Sequence[float], m: int
) -> StageTimes:
    """:func:`zbv_time` (no all-reduce: no replicas); per-stage times as the other schedules'; the
    bubble is the GPUs' idle share."""
    if any(r != 1 for r in replicas) or len(loads) % 2:
        raise PlanError("zbv needs one device per stage and 2 stages per GPU")
    fwd, bwd, link, micro, compute, comm, _ = _microbatch_parts(loads, replicas, bandwidths, m)
    time = zbv_time(fwd, bwd, link, m)
    bubble = 1.0 - sum(compute) / (len(loads) // 2 * time) if time > 0 else 0.0
    return StageTimes(tuple(compute), tuple(comm), tuple(micro), time, bubble)
