"""Parameter servers: slices of the parameters held by server ranks (SINGA 0.x's ParamShard).

`shard` is the pure state (slices, server-side optimizer, versions), `messages` the
wire format, `server` the loop a server rank runs, `client` the worker side (joining a
cluster, the separate-server and co-located strategies), `groupsync` Distributed
Hogwild's asynchronous master copies, `shared` in-memory Hogwild, `scatter` the AllReduce
framework's bucketed reduce-scatter.
"""
