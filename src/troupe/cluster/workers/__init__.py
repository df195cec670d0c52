"""The worker side: one `UpdateStrategy` per kind of worker, named for it, and which parameters a worker sends.

Owns `ps_client` (`PSClient`: servers in processes of their own, Sandblaster and Downpour),
`colocated` (`CoLocated`: servers sharing the workers' processes, AllReduce and Distributed
Hogwild), `in_memory` (`SharedMemory`: in-memory Hogwild, workers of one process sharing its
parameter memory) and `layout` (the job parameters of a partitioned model, and a worker's
trainable parameters). `diloco`, `diloco_shard` and `pseudograd` are the old import paths of DiLoCo,
a synchronous algorithm that lives in `troupe.strategies`.

Must not touch: a rank's role or the job's process groups (`troupe.cluster.bootstrap` decides
them and hands each strategy its communicators), or a server's loop.
"""

PS_WORKER_STATE = "parameter-server worker (the parameters and their optimizer live on the servers)"
"""Why a cluster worker's checkpoint cannot move to another number of ranks (`per_rank_state`)."""
