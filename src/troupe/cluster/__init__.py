"""Clusters and parameter servers (SINGA 0.x): worker groups, server groups, and the strategies of their workers.

* `configuration/`: `ClusterConfig` (and SINGA's `cluster { }` text, presets, flags), every
  rank's `Role`, and the `TrainingSpec` a server learns from worker 0;
* `wire/`: what crosses between workers and servers (message headers, frames, top-K payloads);
* `serving/`: the server side (`ParamShard`, the `Server` loop, master copies and the
  synchronisation between server groups and between Distributed Hogwild's groups);
* `workers/`: one strategy per kind of worker (`PSClient`, `CoLocated`, `SharedMemory`);
* `regimes`: those three kinds as regimes of `troupe.strategies.registry` (which one a job's
  workers run follows from its `ClusterConfig.worker_regime`);
* `bootstrap`: gives every rank its role, makes the job's groups and runs a server rank's
  whole life (also as ``python -m troupe.cluster.bootstrap``, without the training script).

SINGA's job.conf text is read by `troupe.singa.jobfile`; the AllReduce framework's bucketed
reduce-scatter is a reduce hook (`troupe.sync.hooks.scatter`). Sub-packages import downwards
only: configuration and wire import no other sub-package, serving imports those two, workers
import serving and regimes, and bootstrap imports them all.
"""
