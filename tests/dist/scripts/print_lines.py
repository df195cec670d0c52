"""Two ranks print at the same time, each line in three pieces (for `troupe run`'s output tests)."""

import sys
import time

import troupe

world = troupe.init()
world.comm.barrier()  # both ranks print at once
rank = world.info.rank
for i in range(100):
    for piece in (f"rank {rank} ", f"line {i} ", "ok\n"):
        sys.stdout.write(piece)
        sys.stdout.flush()
        time.sleep(0.001)
print(f"rank {rank} on stderr", file=sys.stderr, flush=True)
world.comm.barrier()
troupe.shutdown()
