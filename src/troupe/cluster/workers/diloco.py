"""DiLoCo's old import path: it lives with the synchronous algorithms, `troupe.strategies.diloco`."""

from troupe.strategies.diloco import (  # noqa: F401  (re-exported)
    DILOCO_STATE,
    DiLoCo,
    OuterStep,
    fragment_bounds,
    group_step,
    outer_optimizer,
    sync_offset,
)
from troupe.strategies.diloco_elastic import ElasticDiLoCo, Flight  # noqa: F401  (re-exported)
