"""Clusters and parameter servers (SINGA 0.x): worker groups, server groups, ParamShard.

`config` is the ClusterConfig (and SINGA's `cluster { }` text); `shard` is the pure
state (slices, server-side optimizer, versions), `messages` the wire format, `server`
the loop a server rank runs, `worker` the worker side (joining a cluster, the
separate-server and co-located strategies), `groupsync` Distributed
Hogwild's asynchronous master copies, `shared` in-memory Hogwild, `scatter` the AllReduce
framework's bucketed reduce-scatter.
"""
