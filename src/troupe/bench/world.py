"""Start N local ranks for a benchmark: spawn, a fresh Ticket, Gloo, results back from rank 0.

    result = launch(fn, 2, threads=1, timeout=300)   # fn(rank, world_size) -> picklable, on every rank

The Ticket + multiprocessing pattern (SINGA's NCCL-id ticket), so no launcher is
needed. Each rank runs `threads` torch threads. The first failing rank's traceback is
raised here; a world that does not finish within `timeout` seconds is killed and
`TimeoutError` raised (a benchmark never hangs its caller).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any


class RankFailed(RuntimeError):
    """A rank raised; the message carries its traceback."""


def _entry(fn: Callable[..., Any], rank: int, world_size: int, ticket: Any, threads: int,
           results: Any, args: tuple) -> None:
    os.environ["OMP_NUM_THREADS"] = str(threads)
    code = 0
    try:
        import torch

        torch.set_num_threads(threads)
        import troupe

        troupe.init(ticket, rank, world_size)
        value = fn(rank, world_size, *args)
        troupe.init().comm.barrier()  # every rank has finished its collectives before any leaves
        results.put((rank, True, value if rank == 0 else None))
    except BaseException as e:  # report every failure to the parent (the other ranks then stop)
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        code = 1
    results.close()
    results.join_thread()  # the result is in the pipe before this process goes
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter finalization: Gloo's worker thread may still be releasing the last
    # collective's tensors, which takes the GIL, and taking it while the interpreter
    # finalizes aborts the process ("terminate called without an active exception").
    os._exit(code)


def launch(fn: Callable[..., Any], world_size: int, *args: Any, threads: int = 1, timeout: float = 600.0) -> Any:
    """Run ``fn(rank, world_size, *args)`` on `world_size` spawned ranks; return rank 0's result."""
    import troupe

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ticket = troupe.Ticket()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, ticket, threads, results, args), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    done: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    finished = False
    try:
        while len(done) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r in range(world_size) if r not in done and procs[r].exitcode is not None]
                if dead:
                    time.sleep(0.5)  # its report may still be in the pipe
                    if results.empty():
                        raise RankFailed(f"rank(s) {dead} died without a result (exit codes "
                                         f"{[procs[r].exitcode for r in dead]})") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the benchmark did not finish within {timeout:g} s "
                                       f"(ranks {sorted(set(range(world_size)) - set(done))} still running)") from None
                continue
            if not ok:
                raise RankFailed(f"rank {rank} failed:\n{value}")
            done[rank] = value
        finished = True
    finally:
        for p in procs:  # after a failure or a timeout: at once, or the survivors report the dead store
            p.join(timeout=5 if finished else 0)
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join()
    return done[0]
