"""Start N local ranks from Python: the one launcher behind tests, benchmarks and the planner.

    values = run_ranks(fn, 2, arg, threads=1, timeout=90)   # fn(rank, world_size, arg) on each rank

Each rank is a fresh process (the spawn start method unless the caller passes another
context) that joins through a new Ticket on loopback, runs ``fn(rank, world_size, *args)``
and sends its value back; `run_ranks` returns the values by rank. The first failing
rank's traceback is raised here as `RankFailed`, naming the rank; a world that does not
finish within `timeout` seconds is killed and `TimeoutError` raised, so a caller never
hangs. `wait_all` is the other half of the reference's multiprocessing pattern: join
processes a user started and stop the rest once one fails.

This is not `troupe run`, which starts a script N times as separate programs.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any


class RankFailed(RuntimeError):
    """A rank raised (the message carries its rank and traceback) or died without a result."""


def rank_entry(fn: Callable[..., Any], rank: int, world_size: int, ticket: Any, args: tuple, results: Any,
               env: dict[str, str], threads: int = 1) -> None:
    """What every rank runs (module level: spawn pickles it by name); reports to `results` and exits."""
    os.environ.update(env)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    code = 0
    try:
        import torch

        torch.set_num_threads(threads)
        from troupe.runtime.world import init

        init(ticket, rank, world_size)
        value = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(value, buf)  # tensors by value: a queue would pass them by shared memory
        results.put((rank, True, buf.getvalue()))
    except BaseException as e:  # report every failure to the parent first (which then stops the others)
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        code = 1
    try:
        from troupe.runtime.world import shutdown

        shutdown()  # runs the World's exit hooks (a parameter-server worker says goodbye)
    except BaseException:
        traceback.print_exc()
        code = 1
    results.close()
    results.join_thread()  # the result is in the pipe before this process goes
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter finalization: Gloo's worker thread may still be releasing the last
    # collective's tensors, which takes the GIL, and taking it while the interpreter
    # finalizes aborts the process ("terminate called without an active exception").
    os._exit(code)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    threads: int = 1,
    timeout: float = 600.0,
    env: dict[str, str] | None = None,
    context: Any = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on `world_size` new local ranks; return their values by rank.

    Args:
        threads: torch threads (and OMP_NUM_THREADS) per rank.
        timeout: seconds until the whole world is killed and `TimeoutError` raised.
        env: variables set in every rank before it joins (TROUPE_TIMEOUT, ...).
        context: a multiprocessing context (default: spawn).
    """
    import torch

    from troupe.runtime.ticket import LOOPBACK, Ticket, reserve_port

    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")
    ctx = context or mp.get_context("spawn")
    results = ctx.Queue()
    held = reserve_port(LOOPBACK)  # the port stays ours until rank 0 listens on it
    ticket = Ticket(port=held.getsockname()[1])
    procs = [ctx.Process(target=rank_entry, args=(fn, r, world_size, ticket, args, results, dict(env or {}), threads),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    finished = False
    try:
        done = _collect(procs, results, timeout)
        finished = True
    finally:
        held.close()
        for p in procs:  # after a failure or a timeout: at once, or the survivors report the dead store
            p.join(timeout=5 if finished else 0)
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join()
    return [torch.load(io.BytesIO(done[r]), weights_only=False) for r in range(world_size)]


def _collect(procs: Sequence[Any], results: Any, timeout: float) -> dict[int, bytes]:
    """Every rank's pickled value; the first failure, death or the deadline raises."""
    world_size = len(procs)
    done: dict[int, bytes] = {}
    deadline = time.monotonic() + timeout
    while len(done) < world_size:
        try:
            rank, ok, value = results.get(timeout=0.5)
        except queue.Empty:
            missing = [r for r in range(world_size) if r not in done]
            dead = [r for r in missing if procs[r].exitcode is not None]
            if dead:
                time.sleep(0.5)  # its report may still be in the pipe
                if results.empty():
                    raise RankFailed(f"rank(s) {dead} died without a result (exit codes "
                                     f"{[procs[r].exitcode for r in dead]})") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"a world of {world_size} did not finish within {timeout:g} s "
                                   f"(ranks {missing} still running)") from None
            continue
        if not ok:
            raise RankFailed(f"rank {rank} failed:\n{value}")
        done[rank] = value
    return done


def wait_all(processes: Sequence[Any], grace: float = 10.0) -> int:
    """Join the processes of a multiprocessing launch; once one fails, give the rest `grace`
    seconds to stop on their own (they usually report which peer failed), then kill them.

    Returns 0 when all succeeded, else the first failure's exit code (128 + signal for a signal).
    """
    first: tuple[float, int] | None = None
    while any(p.is_alive() for p in processes):
        failed = [p.exitcode for p in processes if not p.is_alive() and p.exitcode]
        if failed and first is None:
            first = (time.monotonic(), failed[0])
        if first is not None and time.monotonic() - first[0] > grace:
            for p in processes:
                if p.is_alive():
                    p.kill()
            break
        time.sleep(0.05)
    for p in processes:
        p.join()
    code = first[1] if first else next((p.exitcode for p in processes if p.exitcode), 0)
    return code if code >= 0 else 128 - code
