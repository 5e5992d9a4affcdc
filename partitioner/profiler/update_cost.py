"""Charge each layer its optimizer update, from the rates the profiler measured.

The profiler times forward and backward per layer and, separately, the optimizer step per parameter
byte (``profile.extra["update_s_per_byte"]``, one rate per optimizer). A run's stage compute includes
the update, so the planner adds ``param_bytes x rate`` of the training optimizer to each layer's
backward before any solver, the simulation or calibration sees the profile: one place, so they all
price the same step. Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import replace

from partitioner.graph import Profile

__all__ = ["UPDATE_KEY", "update_ms", "with_update_time"]

UPDATE_KEY = "update_s_per_byte"


def update_ms(profile: Profile, optimizer: str) -> float:
    """Milliseconds of one update of the whole model with ``optimizer`` (0 when not measured)."""
    rate = float(profile.extra.get(UPDATE_KEY, {}).get(optimizer, 0.0))
    return sum(n.param_bytes for n in profile.nodes) * rate * 1e3


def with_update_time(profile: Profile, optimizer: str) -> Profile:
    """The profile with each layer's backward also paying its weights' update under ``optimizer``.

    The rates are dropped from the result, so adding twice is impossible (a calibrated profile,
    scaled to measured stage times that include the update, has none left either). A profile
    without rates (PipeDream's graph.txt, older profiles) comes back unchanged.
    """
    rates = profile.extra.get(UPDATE_KEY)
    if not rates:
        return profile
    rate = float(rates.get(optimizer, 0.0))
    nodes = tuple(
        replace(n, backward_ms=n.backward_ms + n.param_bytes * rate * 1e3) if n.param_bytes else n
        for n in profile.nodes
    )
    extra = {k: v for k, v in profile.extra.items() if k != UPDATE_KEY}
    extra["update_charged"] = {"optimizer": optimizer, "s_per_byte": rate}
    return replace(profile, nodes=nodes, extra=extra)
