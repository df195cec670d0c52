"""Simulated hosts for the benchmark scripts: `troupe.bench.netns` (kept here so `from netns import Hosts` works)."""

from troupe.bench.netns import BRIDGES, LOCK, PREFIX, SWITCH, Hosts, available  # noqa: F401
