"""Fewest devices reaching each state (and, backwards, from each state to the end): what the DP's
windows, the pair pruning and the synchronous search's feasibility test rest on."""

from __future__ import annotations

import itertools

import numpy as np

from partitioner.optimizer.pricing.stage import FloatArray, IntArray

__all__ = ["compute_floors", "fewest_units", "fewest_units_after", "sweep_layers"]


def fewest_units(
    ks: IntArray, offsets: IntArray, layers: IntArray, need: FloatArray, most: int | None = None
) -> FloatArray:
    """g[j] = min over stages (k, j] of g[k] + need: fewest devices reaching each state (stages CSR by
    j), one numpy pass per size layer, or Bellman-Ford rounds where ``most`` makes them cheaper."""
    g = np.full(len(offsets) - 1, np.inf)
    g[0] = 0.0
    if most is not None and _rounds_pay(most, len(ks), len(layers)):
        has = np.flatnonzero(np.diff(offsets))
        return _rounds(g, ks, need, has, offsets[has], most)
    sweep_layers(g, ks, offsets, layers, need)
    return g


def _rounds_pay(most: int, pairs: int, layers: int) -> bool:
    """Whether ``most`` passes over every pair cost less than a numpy pass per size layer (about
    25 us of call overhead each, against a few ns per pair and pass: measured on the shared profiles)."""
    return most * pairs < 6000 * layers


def _rounds(g: FloatArray, src: IntArray, need: FloatArray, dst: IntArray, starts: IntArray,
            most: int) -> FloatArray:  # fmt: skip
    """Bellman-Ford over the stages grouped by ``dst`` (runs from ``starts``): g[dst] = min(g[dst],
    g[src] + need). After r rounds, every value reached in at most r stages is exact; a stage
    takes at least one device, so ``most`` rounds settle every value up to ``most``."""
    for _ in range(most):
        best = np.minimum.reduceat(g[src] + need, starts)
        better = best < g[dst]
        if not better.any():
            break
        g[dst[better]] = best[better]
    return g


def sweep_layers(
    g: FloatArray, ks: IntArray, offsets: IntArray, layers: IntArray, need: FloatArray, lo: int = 0
) -> None:
    """``fewest_units`` in place over states lo .. lo + len(offsets) - 2 (stages CSR from lo)."""
    hi = lo + len(offsets) - 1
    inner = layers[(layers > lo) & (layers < hi)].tolist()
    for a, b in itertools.pairwise([lo, *inner, hi]):
        start, stop = int(offsets[a - lo]), int(offsets[b - lo])
        if start == stop:
            continue
        has = np.flatnonzero(offsets[a - lo + 1 : b - lo + 1] > offsets[a - lo : b - lo])
        g[a + has] = np.minimum.reduceat(g[ks[start:stop]] + need[start:stop], offsets[a - lo + has] - start)


def fewest_units_after(
    ks: IntArray, js: IntArray, layers: IntArray, need: FloatArray, most: int | None = None
) -> FloatArray:
    """h[k] = min over stages (k, j] of need + h[j]: fewest devices after each state to the end
    (``fewest_units`` run backwards, each state s numbered n - 1 - s)."""
    n = int(layers[-1])
    by_k = ks.astype(np.uint16) if n <= 1 << 16 else ks
    order = np.argsort(by_k, kind="stable")
    starts = np.searchsorted(by_k[order], np.arange(n + 1))
    back = order[::-1]
    return fewest_units(n - 1 - js[back], len(ks) - starts[::-1], (n - layers)[::-1], need[back], most)[::-1]


def compute_floors(compute: FloatArray, devices: int, upper: float) -> tuple[IntArray, IntArray]:
    """Units a plan as fast as ``upper`` surely has before / after each state: a stage carries at
    most its units x ``devices`` x upper of compute (1e-9: a plan exactly at upper stays inside)."""
    w = compute / (devices * upper)
    before = np.maximum(np.ceil(w - 1e-9), 0.0)
    before[0] = 0.0
    return before.astype(np.int64), np.maximum(np.ceil((w[-1] - w) - 1e-9), 0.0).astype(np.int64)
