"""Test data kept in the repository: PipeDream's published V100 layer profiles (data/pipedream-profiles)."""

from __future__ import annotations

from pathlib import Path

PIPEDREAM_PROFILES = Path(__file__).resolve().parents[1] / "data" / "pipedream-profiles"
PIPEDREAM_GRAPHS = sorted(PIPEDREAM_PROFILES.glob("*/graph.txt"))
