"""Clusters and parameter servers (SINGA 0.x): worker groups, server groups, ParamShard.

`config` is the ClusterConfig (and SINGA's `cluster { }` text); `bootstrap` gives every
rank its role, makes the job's groups and runs a server rank's whole life (also as
``python -m troupe.cluster.bootstrap``, without the training script); `spec` is what a
server learns from worker 0 (parameter sizes, the optimizer's class path and
hyper-parameters, as JSON); `shard` is the pure state (slices, server-side optimizer,
versions), `messages` the wire format (`sparse`: top-K updates, `ClusterConfig.wire_topk`),
`server` the loop a server rank runs; the worker
strategies are `ps_client` (separate servers), `worker` (co-located servers) and `shared`
(in-memory Hogwild); `groupsync` is Distributed Hogwild's asynchronous master copies and
`scatter` the AllReduce framework's bucketed reduce-scatter.
"""
