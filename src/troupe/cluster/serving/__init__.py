"""The server side: the slices a server holds, the loop that serves them, and the master copies between groups.

Owns `shard` (`ParamShard`: slices, server-side optimizer, versions; pure state), `server` (the
loop a separate server rank runs over its shard), `mastercopies` (the master-copy fold/adopt
arithmetic, pure state, shared by both kinds of synchronisation between groups), `serversync`
(separate server groups' messages with their neighbours) and `groupsync` (Distributed
Hogwild's co-located servers syncing their groups' copies).

Must not touch: the training script's model, optimizer or gradients (a server knows the job
only through `configuration.spec`), or a worker's strategy (`workers`).
"""
