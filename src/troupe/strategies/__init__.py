"""Update strategies: how gradients become a step, one class per regime.

`base` defines the `UpdateStrategy` interface DistOpt holds exactly one of; `registry` is
the one table of regimes (each registers itself: `allreduce` plain, `half` fp16/bf16,
`sparse` top-K/threshold, `partial` SINGA's partial update, `powersgd` PowerSGD (not SINGA's), `fsdp` a model troupe.shard sharded; the parameter-server worker
kinds in `troupe.cluster.regimes`, which also build DiLoCo's worker from `diloco`, `diloco_elastic`,
`diloco_shard` and `pseudograd`: synchronous inside a group, an outer step over the groups); `choice` holds a DistOpt's strategies (SINGA's
per-call options, or the one a cluster fixes). A strategy gets its communicator,
parameters and optimizer in __init__ and never reaches back into DistOpt.
"""

# Importing a regime's module registers it: every dist_option is known once this package is.
from troupe.strategies import allreduce, fsdp, half, partial, powersgd, sparse  # noqa: F401
