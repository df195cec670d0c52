"""torch's env:// variables under mpiexec and in a Slurm step, as torchrun would set them.

A DDP-shaped script calls ``dist.init_process_group()`` itself, which reads RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT (and the script LOCAL_RANK for its device). torchrun sets them; mpiexec
and srun do not, so such a script died with torch's "environment variable RANK expected, but not
set". `import troupe` sets them from the launcher's own variables (`provide`), without importing
torch and without talking to the other ranks where it can:

- a Slurm step: SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, and the address and port of the ticket
  every task computes alike (`slurm_ticket`: the step's first node, a port derived from the job id);
- mpiexec on one host (Open MPI's OMPI_COMM_WORLD_*, MPICH's PMI_* / MPI_LOCAL*): loopback, and a port
  derived from the job's PMIx namespace (or the launcher's pid, the parent of every rank on the host);
- mpiexec across hosts: rank 0's address is not in any variable, so rank 0 broadcasts it with mpi4py
  (imported only here, under mpiexec).

TROUPE_MASTER_ADDR / TROUPE_MASTER_PORT choose the address and port. Nothing is set where RANK or
MASTER_ADDR already is (torchrun, a Kubernetes operator, `troupe run`), and TROUPE_ENV_FROM names the
launcher the variables came from, so that troupe's own launcher detection (`runtime/launch.py`)
still sees mpiexec or Slurm.
"""

from __future__ import annotations

import hashlib
import os

from troupe.runtime.ticket import LOOPBACK

MARK = "TROUPE_ENV_FROM"
KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _int(env, *names: str) -> int | None:
    for name in names:
        value = env.get(name, "")
        if value.strip().isdigit():
            return int(value)
    return None


def _port(job: str) -> int:
    return 20000 + int(hashlib.sha256(f"troupe-env:{job}".encode()).hexdigest(), 16) % 20000


def _slurm(env) -> dict[str, str] | None:
    rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS", "SLURM_NPROCS")
    if rank is None or world is None:
        return None
    from troupe.runtime.ticket import slurm_ticket

    port = _int(env, "TROUPE_MASTER_PORT")
    ticket = slurm_ticket(env.get("TROUPE_MASTER_ADDR") or None, port or None, "env", env)
    local = _int(env, "SLURM_LOCALID") or 0
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(_tasks_here(env) or world), "MASTER_ADDR": ticket.addr,
            "MASTER_PORT": str(ticket.port), MARK: "slurm"}


def _tasks_here(env) -> int | None:
    import re

    text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    counts: list[int] = []
    for part in filter(None, text.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    node = _int(env, "SLURM_NODEID") or 0
    return counts[node] if node < len(counts) else None


def _mpi(env) -> dict[str, str] | None:
    world = _int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")
    rank = _int(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
    if world is None or rank is None:
        return None
    local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PALS_LOCAL_RANKID")
    local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
    one_host = local_world == world
    job = env.get("PMIX_NAMESPACE") or env.get("OMPI_MCA_ess_base_jobid") or f"ppid-{os.getppid()}"
    port = _int(env, "TROUPE_MASTER_PORT") or _port(job)
    addr = env.get("TROUPE_MASTER_ADDR") or (LOOPBACK if one_host else _rank0_address(rank))
    if addr is None:
        return None
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local or 0),
            "LOCAL_WORLD_SIZE": str(local_world or 1), "MASTER_ADDR": addr, "MASTER_PORT": str(port), MARK: "mpi"}


def _rank0_address(rank: int) -> str | None:
    """Rank 0's address, broadcast with mpi4py (every rank imports troupe: the same collective on each)."""
    try:
        from mpi4py import MPI
    except ImportError:
        return None  # troupe.init says what to install; a script's own init_process_group finds no RANK
    from troupe.runtime import netif

    addr = netif.host_address() if rank == 0 else None
    return MPI.COMM_WORLD.bcast(addr, root=0)


def provide(env=None) -> str | None:
    """Set torch's env:// variables from mpiexec's or Slurm's (see the module docstring); return the launcher's
    name, or None where nothing was set."""
    env = os.environ if env is None else env
    if "RANK" in env or "MASTER_ADDR" in env or "TROUPE_TICKET" in env or "TORCHELASTIC_RUN_ID" in env:
        return None
    found = _slurm(env) or _mpi(env)
    if found is None:
        return None
    env.update(found)
    return found[MARK]


def withdraw(env=None) -> None:
    """Remove what `provide` set (troupe's launcher, `troupe run` under srun, starts its ranks without them)."""
    env = os.environ if env is None else env
    if env.pop(MARK, None) is not None:
        for key in KEYS:
            env.pop(key, None)
