"""Sharded DiLoCo's old import path: `troupe.strategies.diloco_shard`."""

from troupe.strategies.diloco_shard import GroupCut, ShardedOuterStep  # noqa: F401  (re-exported)
