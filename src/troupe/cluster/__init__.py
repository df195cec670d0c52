"""Clusters and parameter servers (SINGA 0.x): worker groups, server groups, and the strategies of their workers.

* `configuration/`: `ClusterConfig` (and SINGA's `cluster { }` text, presets, flags), every
  rank's `Role`, and the `TrainingSpec` a server learns from worker 0;
* `wire/`: what crosses between workers and servers (message headers, frames, top-K payloads);
* `serving/`: the server side (`ParamShard`, the `Server` loop, master copies and the
  synchronisation between server groups and between Distributed Hogwild's groups);
* `workers/`: one strategy per kind of worker (`PSClient`, `CoLocated`, `SharedMemory`);
* `bootstrap`: gives every rank its role, makes the job's groups and runs a server rank's
  whole life (also as ``python -m troupe.cluster.bootstrap``, without the training script);
* `scatter`: the AllReduce framework's bucketed reduce-scatter; `jobfile`: SINGA's job.conf text.

Sub-packages import downwards only: configuration and wire import no other sub-package,
serving imports those two, workers import serving, and bootstrap imports them all.
"""
