"""DiLoCo's old import path: it lives with the synchronous algorithms, `troupe.strategies.diloco`."""

from troupe.strategies.diloco import (  # noqa: F401  (re-exported)
    DILOCO_STATE,
    DiLoCo,
    ElasticDiLoCo,
    Flight,
    OuterStep,
    fragment_bounds,
    group_step,
    outer_optimizer,
    sync_offset,
)
