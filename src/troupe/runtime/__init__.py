"""Runtime: joining the job and talking to the other ranks.

`launch` decides which launcher started this process (troupe run, a Ticket, torchrun,
mpiexec, one process) and builds the process group; `comm` holds the Communicator, the
only caller of torch.distributed collectives, with its byte counters; `watchdog` the
heartbeats and the stall/failure reports every collective waits under. Nothing here
knows about optimizers, buckets or parameter servers.
"""
