"""Runtime: joining the job and talking to the other ranks.

`world` is what `troupe.init()` returns: one object per job holding the rank facts, the
settings, the communicators (the job, the data-parallel one, named subgroups), the
recorder and the watchdog. `launch` decides which launcher started this process (troupe
run, a Ticket, torchrun, mpiexec, one process) and builds the process group; `spawn` starts
N local ranks from Python (tests, benchmarks, the planner's link probe); `rankio` passes
the output of the ranks `troupe run` starts on, whole lines at a time; `ticket` is
the Ticket (address, port, token), torch-free for the command line; `comm`
holds the Communicator, the only caller of torch.distributed collectives, with its byte
counters; `watchdog` the heartbeats and the stall/failure reports every collective waits
under; `liveness` the beat counters a launcher or a server watches to tell a frozen process
from a slow one; `settings` every TROUPE_* variable. Nothing here knows about optimizers, buckets,
partitions or parameter servers.
"""
