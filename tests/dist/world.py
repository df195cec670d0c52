"""Real multi-process worlds for tests: spawn N ranks on Gloo, collect results, re-raise failures.

    results = run_world(check_something, 2, arg)   # check_something(rank, world_size, arg) -> picklable

Each rank runs with one torch thread, joins through a fresh Ticket on loopback, and
returns its result; the first failing rank's traceback is raised in the test. A world
that does not finish within `timeout` seconds is killed and the test fails (no hang).
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any


class RankFailed(AssertionError):
    """A rank raised; the message carries its traceback."""


def _entry(fn, rank, world_size, ticket, args, results, env):
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)
    try:
        import troupe

        troupe.init(ticket, rank, world_size, timeout=env.get("TROUPE_TIMEOUT") and float(env["TROUPE_TIMEOUT"]))
        value = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(value, buf)  # tensors by value: a queue would pass them by shared memory
        results.put((rank, True, buf.getvalue()))
    except BaseException as e:  # report every failure to the parent, then exit non-zero
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise SystemExit(1)
    finally:
        troupe.shutdown()


def _context():
    """Fresh processes, as spawn makes them, but without each importing torch again.

    A forkserver started once per test session imports torch and troupe and nothing else
    (no tensor op runs, so no thread pool exists to be forked); every rank is forked from
    it and starts in milliseconds instead of the 2 s an import of torch costs a spawned
    process. TROUPE_TEST_START=spawn goes back to spawning.
    """
    method = os.environ.get("TROUPE_TEST_START", "forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["torch", "troupe.distopt", "troupe.singa.model", "troupe.runtime.world", "tests.dist.world"])
    return ctx


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 90.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on `world_size` spawned ranks; return results by rank."""
    import torch

    import troupe

    ctx = _context()
    results = ctx.Queue()
    ticket = troupe.Ticket()
    env = {"TROUPE_JOIN_TIMEOUT": "30", "TROUPE_TIMEOUT": "60", **(env or {})}
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, ticket, args, results, env), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(out))
                dead = [r for r in missing if procs[r].exitcode is not None]
                if dead and results.empty():
                    time.sleep(0.5)  # a result may still be in flight
                    if results.empty():
                        raise RankFailed(f"rank(s) {dead} died without a result (exit codes "
                                         f"{[procs[r].exitcode for r in dead]})") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"world of {world_size} did not finish in {timeout}s; ranks {missing} hung")
                continue
            if not ok:
                raise RankFailed(f"rank {rank} failed:\n{value}")
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world_size)]
