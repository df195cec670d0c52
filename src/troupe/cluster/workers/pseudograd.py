"""The pseudo-gradients' old import path: `troupe.strategies.pseudograd`."""

from troupe.strategies.pseudograd import (  # noqa: F401  (re-exported)
    CHUNK,
    LEVELS,
    PendingMean,
    PseudoGradDtype,
    decode,
    encode,
    mean_over_groups,
    start_mean,
    wire_size,
)
