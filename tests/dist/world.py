"""The tests' worlds: `troupe.runtime.spawn.run_ranks` with the tests' defaults.

    results = run_world(check_something, 2, arg)   # check_something(rank, world_size, arg) -> picklable

Each rank runs with one torch thread, joins through a fresh Ticket on loopback, and
returns its result; the first failing rank's traceback is raised in the test. A world
that does not finish within `timeout` seconds is killed and the test fails (no hang).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from troupe.runtime.spawn import RankFailed, rank_entry, run_ranks


def master_port() -> int:
    """A port p for `troupe run --master 127.0.0.1:p` on several nodes: node 0's launcher listens on p and holds
    p + 1 (a script's env:// rendezvous), and refuses the job in one line when either is taken, so both are free
    now (a port the OS hands out alone may have its successor taken by another test's server)."""
    import socket

    for _ in range(100):
        with socket.create_server(("127.0.0.1", 0)) as first:
            port = first.getsockname()[1]
            try:
                socket.create_server(("127.0.0.1", port + 1)).close()
            except OSError:
                continue
            return port
    raise RuntimeError("no free port p with p + 1 free in 100 tries")

__all__ = ["RankFailed", "run_nodes", "run_world"]

_entry = rank_entry
"""For a test that starts the ranks by hand (one is meant to die): rank_entry(fn, rank, world_size, ticket,
args, results, env)."""

ENV = {"TROUPE_JOIN_TIMEOUT": "30", "TROUPE_TIMEOUT": "60"}
"""Every test world's timeouts (a test's `env` overrides them)."""


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
        # torch._dynamo: every optimizer's __init__ imports it (torch._disable_dynamo), 2-6 s a rank
        ctx.set_forkserver_preload(["torch", "torch._dynamo", "troupe.distopt", "troupe.singa.model",
                                    "troupe.runtime.world", "troupe.runtime.spawn", "tests.dist.world"])
    return ctx


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 90.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on `world_size` ranks; return results by rank."""
    return run_ranks(fn, world_size, *args, timeout=timeout, env={**ENV, **(env or {})}, context=_context())


def run_nodes(launches: list[tuple[list[str], dict[str, str]]], out: Path, cwd: Path,
              timeout: float) -> tuple[list[int], list[str]]:
    """One launcher per node, all at once (each a command and its environment; stdout dropped, stderr to
    ``out/node{i}.txt``); wait for every one, killing those still running at `timeout` (a test never leaves
    a job behind). Returns their exit codes and what each wrote to stderr."""
    nodes = []
    for i, (cmd, env) in enumerate(launches):
        err = open(out / f"node{i}.txt", "w")  # noqa: SIM115  (closed below)
        nodes.append((subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=err), err))
    try:
        codes = [proc.wait(timeout=timeout) for proc, _ in nodes]
    finally:
        for proc, err in nodes:
            if proc.poll() is None:
                proc.kill()
            err.close()
    return codes, [(out / f"node{i}.txt").read_text() for i in range(len(launches))]
