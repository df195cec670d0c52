"""Models larger than one worker: parameters, gradients and optimizer state sharded over the ranks.

`shard` (`troupe.shard`) applies torch's FSDP2 (`fully_shard`) block by block on a mesh made of
troupe's own process groups: one group shards the model, several worker groups each shard it
and replicate the shards (HSDP). A DistOpt over the sharded parameters then trains under the
`fsdp` regime (`troupe.strategies.fsdp`). This package owns the sharding of a model; it does
not step, reduce or checkpoint (FSDP2 reduces in backward, DistOpt steps).
"""

from troupe.sharding.fsdp import shard

__all__ = ["shard"]
