"""Rendezvous: the job Ticket, launcher detection and process-group setup.

`join()` does the rendezvous and returns what it made; `troupe.init()` (runtime/world.py)
wraps that in the World. Nothing here is kept in module state.

Five launchers reach the same `init()`:

* an explicit `Ticket` (the reference's multiprocessing pattern),
* `troupe run` (sets ``TROUPE_TICKET``, ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``),
* `torchrun` (its own rendezvous; ``env://``), or any launcher that sets torch's
  ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` alone (Kubernetes' PyTorchJob),
* Slurm's `srun` (ranks from ``SLURM_*``; rank 0 listens on the job's first node),
* `mpiexec` (ranks from the MPI environment; rank 0 broadcasts a Ticket with mpi4py).

With none of them the process is a world of one.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import os
import re
import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import NoReturn

import torch
import torch.distributed as dist

from troupe.runtime import envrdv, netif
from troupe.runtime.membership import Membership
from troupe.runtime.quorum import refusal_key
from troupe.runtime.settings import Settings
from troupe.runtime.ticket import LOOPBACK, Ticket, first_host, free_port, slurm_ticket  # noqa: F401  (re-exported)
from troupe.util import LostLauncher, Refusal, one_line_refusals

log = logging.getLogger("troupe")

DEFAULT_JOIN_TIMEOUT = 60.0
"""Seconds every rank waits for the whole world to join before giving up."""
DEFAULT_TIMEOUT = 300.0
"""Seconds a collective may wait before the backend gives up."""


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    global_rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str
    launcher: str
    """One of "single", "ticket", "troupe", "torchrun", "env" (torch's variables alone), "slurm", "mpi"."""

    @property
    def rank(self) -> int:
        return self.global_rank


REFUSED_KEY = "troupe/refused"
"""The store's count of join attempts refused for a wrong token."""
@dataclass
class SideStore:
    """The watchdog's own connection to the job's store (never blocked by the main thread), and
    how to make a new one after a network fault broke it."""

    addr: str
    port: int
    prefix: str
    timeout: float
    """TROUPE_STORE_TIMEOUT: short, so a heartbeat lost to a network fault is retried on a fresh
    connection well within TROUPE_PEER_TIMEOUT."""
    store: dist.Store = field(init=False)
    base: dist.Store = field(init=False)

    def __post_init__(self) -> None:
        self.store = self.connect()

    def connect(self) -> dist.Store:
        # Knock first: a TCPStore that cannot connect logs a C++ stack trace per try.
        socket.create_connection((self.addr, self.port), timeout=self.timeout).close()
        client = dist.TCPStore(self.addr, self.port, is_master=False, timeout=datetime.timedelta(seconds=self.timeout))
        self.base = client
        return dist.PrefixStore(self.prefix, client)

    def refused(self) -> int:
        """Join attempts with a wrong token so far (counted outside the job's key prefix, which only
        token holders know)."""
        return int(self.base.add(REFUSED_KEY, 0))

    @property
    def where(self) -> str:
        return f"the job's rendezvous at {self.addr}:{self.port} (rank 0's host)"


@dataclass
class Joined:
    """What `join()` made: this rank's facts and what must stay alive while it is in the job."""

    info: DistInfo
    side_store: SideStore | None
    """The watchdog's own connection to the job's store (None: no store to beat through)."""
    keep: list = field(default_factory=list)
    """Rank 0's TCP store: the job's rendezvous lives as long as it does."""
    membership: Membership | None = None
    """Under `troupe run --elastic`: an `Elastic` quorum member or a `Rejoining` parameter-server worker
    (None: the processes never change, the World's `Fixed`)."""


def _env_int(*names: str) -> int | None:
    for name in names:
        if os.environ.get(name, "") != "":
            return int(os.environ[name])
    return None


def _seconds(value: float | None, from_env: float | None, default: float) -> float:
    if value is None:
        value = from_env if from_env is not None else default
    if value <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {value}")
    return float(value)


def join(
    env: Settings,
    ticket: Ticket | str | None = None,
    local_rank: int | None = None,
    world_size: int | None = None,
    *,
    rank: int | None = None,
    backend: str | None = None,
    timeout: float | None = None,
    join_timeout: float | None = None,
) -> Joined:
    """Find the launcher, meet the other ranks and build the process group (`troupe.init()` documents the arguments)."""
    if dist.is_initialized():
        if env.elastic or env.rejoin:  # adopting the script's group would leave the job silently not elastic
            _refuse(env, dist.get_rank(), "under troupe run --elastic troupe makes the process groups (a restarted "
                    "worker joins the running job through them), but the script made its own with "
                    "init_process_group: leave init_process_group/destroy_process_group out of the script under "
                    "--elastic (troupe.DistOpt joins the job), or run it without --elastic")
        return Joined(_adopt_existing_group(), None)
    timeout = _seconds(timeout, env.timeout, DEFAULT_TIMEOUT)
    join_timeout = _seconds(join_timeout, env.join_timeout, DEFAULT_JOIN_TIMEOUT)
    how = _detect(env, ticket, local_rank, world_size, rank)
    _check_ranks(how.rank, how.local_rank, how.world_size)
    backend = _pick_backend(backend or env.backend, how.local_rank, how.local_world)
    if env.elastic:
        return _join_elastic(env, how, backend, join_timeout)
    if env.rejoin:
        return _join_rejoining(env, how, backend, timeout, join_timeout)
    pg_timeout = datetime.timedelta(seconds=timeout)
    side, keep = None, []
    if how.launcher in ("torchrun", "env"):  # the store is at MASTER_ADDR:MASTER_PORT (torchrun's agent or rank 0)
        # torchrun keeps its agent's store across --max-restarts: each attempt's keys get their own prefix
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # Not env://: torch reuses the agent's store unprefixed, so after a restart a rank reads the
            # dead attempt's Gloo addresses and fails with "connectFullMesh ... Connection refused".
            agent = dist.TCPStore(addr, port, is_master=False, timeout=datetime.timedelta(seconds=join_timeout))
            store = dist.PrefixStore(f"troupe/{attempt}/pg/", agent)
            dist.init_process_group(backend, store=store, rank=how.rank, world_size=how.world_size,
                                    timeout=pg_timeout)
        else:
            dist.init_process_group(backend, init_method="env://", timeout=pg_timeout)
        side = SideStore(addr, port, f"troupe/{attempt}/", env.store_timeout)
    else:
        t = how.ticket
        store = dist.HashStore() if t is None else _join(t, how.rank, how.world_size, join_timeout, keep)
        if t is not None:
            _gloo_interface(t, backend)
        dist.init_process_group(backend, store=store, rank=how.rank, world_size=how.world_size, timeout=pg_timeout)
        if t is not None:
            side = SideStore(t.addr, t.port, f"troupe/{t.token}/", env.store_timeout)
    info = DistInfo(how.rank, how.local_rank, how.world_size, how.local_world, _device(backend, how.local_rank),
                    backend, how.launcher)
    return Joined(info, side, keep)


def _join_elastic(env: Settings, how: _Launch, backend: str, join_timeout: float) -> Joined:
    """An elastic worker: connect to the launcher's store and stand by in a group of its own until
    `troupe.track` joins the quorum (rank and world size stay the job's: this group's place among all)."""
    from troupe.runtime.elastic import Elastic
    from troupe.runtime.quorum import ElasticOptions

    if how.launcher != "troupe":
        raise ValueError(f"TROUPE_ELASTIC is set but this process was started by {how.launcher}: "
                         "elastic worker groups need `troupe run --elastic` (its launcher restarts a dead worker)")
    from troupe.runtime.failover import Failover

    ticket, options = how.ticket, ElasticOptions.decode(env.elastic)

    def open_at(host: str, port: int, timeout: float) -> dist.Store:
        base = open_store(Ticket(addr=host, port=port, token=ticket.token), False, timeout)
        return dist.PrefixStore(f"troupe/{ticket.token}/", base)

    # node 0's launcher's store, or the standby's once node 0's launcher is gone (runtime/failover.py)
    failover = Failover((ticket.addr, ticket.port), open_at, lost=lambda why: LostLauncher(
        f"rank {how.rank}: lost the elastic job's store (the launcher): {why}"), who=f"rank {how.rank}")
    failover.begin(env.standby)
    connect = failover.connect
    check_token(open_store(Ticket(*failover.target, token=ticket.token), False, join_timeout), ticket, how.rank)
    _gloo_interface(ticket, backend)
    membership = Elastic(options, how.rank, env.incarnation, backend, connect)
    membership.stand_by()  # it asks to join in troupe.track, when it is ready to step
    info = DistInfo(how.rank, how.local_rank, how.world_size, how.local_world, _device(backend, how.local_rank),
                    backend, "troupe-elastic")
    return Joined(info, None, membership=membership)


def _join_rejoining(env: Settings, how: _Launch, backend: str, timeout: float, join_timeout: float) -> Joined:
    """A parameter-server rank whose workers restart alone (`troupe run --elastic --framework downpour`):
    the job's first processes meet in one process group through the launcher's store, as usual; a
    restarted worker stands in a group of its own and rejoins through its servers (runtime/rejoin.py)."""
    from troupe.runtime.rejoin import Rejoining

    if how.launcher != "troupe":
        raise ValueError(f"TROUPE_REJOIN is set but this process was started by {how.launcher}: a worker that "
                         "restarts alone needs `troupe run --elastic` (its launcher restarts a dead worker)")
    ticket = how.ticket

    def connect(seconds: float) -> dist.Store:
        return dist.PrefixStore(f"troupe/{ticket.token}/", open_store(ticket, False, seconds))

    membership = Rejoining(how.rank, env.incarnation, connect, join_timeout)
    _gloo_interface(ticket, backend)
    pg_timeout = datetime.timedelta(seconds=timeout)
    side, keep = None, []
    if membership.rejoined:
        check_token(open_store(ticket, False, join_timeout), ticket, how.rank)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=pg_timeout)
    else:  # the launcher hosts the store: no rank is its master
        store = _join(ticket, how.rank, how.world_size, join_timeout, keep, host=False)
        dist.init_process_group(backend, store=store, rank=how.rank, world_size=how.world_size, timeout=pg_timeout)
        side = SideStore(ticket.addr, ticket.port, f"troupe/{ticket.token}/", env.store_timeout)
    info = DistInfo(how.rank, how.local_rank, how.world_size, how.local_world, _device(backend, how.local_rank),
                    backend, "troupe")
    return Joined(info, side, keep, membership=membership)


def _refuse(env: Settings, rank: int, why: str) -> NoReturn:
    """Raise Refusal(why) (one line, no traceback), first telling `troupe run --elastic`'s launcher through its store."""
    try:
        ticket = Ticket.decode(env.ticket)
        store = dist.PrefixStore(f"troupe/{ticket.token}/", open_store(ticket, False, 10.0))
        store.set(refusal_key(rank), why)
    except (RuntimeError, ConnectionError, OSError, ValueError):
        pass  # no launcher's store to tell: a restart fails again, and its launcher stops the job then
    one_line_refusals()
    raise Refusal(f"rank {rank}: {why}")


def meet_where_rank0_listens(env: Settings) -> None:
    """Under `troupe run`, a rank that runs no training script (a separate parameter server) meets the
    job where the workers do: troupe's rendezvous (the ticket's port), or torch's env:// one
    (MASTER_ADDR:MASTER_PORT) when the script calls ``init_process_group`` itself. Rank 0, a worker,
    listens on one of the two; the env:// group is joined here (`join` then adopts it).

    Raises TimeoutError when rank 0 listens on neither within TROUPE_JOIN_TIMEOUT."""
    master = os.environ.get("MASTER_PORT", "")
    if not env.ticket or not master or dist.is_initialized() or env.elastic:
        return  # not `troupe run`
    ticket = Ticket.decode(env.ticket)
    addr, port = os.environ.get("MASTER_ADDR", ticket.addr), int(master)
    join_timeout = _seconds(None, env.join_timeout, DEFAULT_JOIN_TIMEOUT)
    deadline = time.monotonic() + join_timeout
    if env.rejoin:  # --elastic: the launcher hosts troupe's store, where rank 0 registers as it joins
        store = dist.PrefixStore(f"troupe/{ticket.token}/", open_store(ticket, False, join_timeout))
        while not store.check(["rank/0"]) and time.monotonic() < deadline:
            if _listening(addr, port):
                _refuse(env, int(os.environ.get("RANK", "-1")), "the workers' script makes its own process group "
                        "(init_process_group), which under troupe run --elastic troupe makes: leave "
                        "init_process_group/destroy_process_group out of the script, or run it without --elastic")
            time.sleep(0.05)
        return
    while not _listening(ticket.addr, ticket.port):
        if _listening(addr, port):
            how = _detect(env, None, None, None, None)
            backend = _pick_backend(env.backend, how.local_rank, how.local_world)
            _gloo_interface(ticket, backend)
            timeout = _seconds(None, env.timeout, DEFAULT_TIMEOUT)
            dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout))
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 listened neither on troupe's rendezvous ({ticket.addr}:{ticket.port}) nor "
                               f"on torch's env:// one ({addr}:{port}) within {join_timeout:.0f}s")
        time.sleep(0.05)


def _listening(addr: str, port: int) -> bool:
    """Whether a process listens on addr:port (a knock: a TCPStore that cannot connect logs C++ frames)."""
    try:
        socket.create_connection((addr, port), timeout=1.0).close()
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class _Launch:
    launcher: str
    ticket: Ticket | None
    rank: int
    local_rank: int
    world_size: int
    local_world: int


def _detect(env: Settings, ticket: Ticket | str | None, local_rank: int | None, world_size: int | None,
            rank: int | None) -> _Launch:
    """Which launcher started this process, and where it puts this rank."""
    if ticket is None and env.ticket:
        world = _env_int("WORLD_SIZE")
        return _Launch("troupe", Ticket.decode(env.ticket), _env_int("RANK"),
                       _env_int("LOCAL_RANK"), world, _env_int("LOCAL_WORLD_SIZE") or world)
    if ticket is not None:
        if local_rank is None or world_size is None:
            raise ValueError("a ticket needs local_rank and world_size too")
        local_world = world_size if rank is None else _env_int("LOCAL_WORLD_SIZE") or world_size
        ticket = Ticket.decode(ticket) if isinstance(ticket, str) else ticket
        return _Launch("ticket", ticket, local_rank if rank is None else rank, local_rank, world_size, local_world)
    # (Under mpiexec or Slurm, `import troupe` set these variables too: envrdv.MARK says so.)
    if "TORCHELASTIC_RUN_ID" in os.environ or (
            {"RANK", "WORLD_SIZE", "MASTER_ADDR"} <= os.environ.keys() and envrdv.MARK not in os.environ):
        # torchrun sets all five variables; a Kubernetes operator (PyTorchJob) sets MASTER_ADDR/PORT,
        # RANK and WORLD_SIZE only, one process per pod: local rank 0 of a local world of one (so a
        # one-GPU pod still picks NCCL).
        world, local_rank = _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK")
        local_world = _env_int("LOCAL_WORLD_SIZE") or (world if local_rank is not None else 1)
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "env"
        return _Launch(launcher, None, _env_int("RANK"), local_rank or 0, world, local_world)
    if _env_int("SLURM_PROCID") is not None and _env_int("SLURM_NTASKS", "SLURM_NPROCS") is not None:
        return _slurm(env)
    if _env_int("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE") is not None:
        return _Launch("mpi", *_mpi_ticket(env))
    if (world_size or 1) > 1 or local_rank or rank:
        raise ValueError(
            f"local_rank={local_rank}, world_size={world_size} were given without a ticket: make "
            "ticket = troupe.Ticket() in the parent process and pass it to every rank"
        )
    return _Launch("single", None, 0, 0, 1, 1)


def _check_ranks(rank: int, local_rank: int, world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank!r} is out of range for world_size {world_size}")
    if not isinstance(local_rank, int) or local_rank < 0 or local_rank > rank:
        raise ValueError(f"local_rank {local_rank!r} is out of range (rank {rank}, world_size {world_size})")


def _pick_backend(backend: str | None, local_rank: int, local_world: int) -> str:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend is None:
        return "nccl" if gpus >= local_world and dist.is_nccl_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and gpus <= local_rank:
        raise ValueError(
            f"backend 'nccl' needs a CUDA GPU for local rank {local_rank}, but this machine has {gpus} GPU(s)"
        )
    return backend


def _device(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _digest(salt: str, token: str) -> str:
    return hashlib.sha256(f"{salt}:{token}".encode()).hexdigest()


def open_store(ticket: Ticket, is_master: bool, timeout: float) -> dist.TCPStore:
    """The job's store (on rank 0: hosted here)."""
    td = datetime.timedelta(seconds=timeout)
    if not is_master:
        try:
            return dist.TCPStore(ticket.addr, ticket.port, is_master=False, timeout=td)
        except Exception as e:  # torch raises DistNetworkError / RuntimeError
            raise ConnectionError(
                f"could not reach the job's rendezvous at {ticket.addr}:{ticket.port} within {timeout:.0f}s "
                f"(is rank 0 running with this ticket?): {e}"
            ) from None
    # Bind the listening socket ourselves: TCPStore alone listens on every interface.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((ticket.addr, ticket.port))
        sock.listen(1024)
    except OSError as e:
        sock.close()
        raise OSError(
            f"rank 0 cannot listen on {ticket.addr}:{ticket.port} for the rendezvous: {e.strerror} "
            "(port already in use? pick another with --master HOST:PORT or Ticket(port=...))"
        ) from None
    # The store serves on this fd for the rest of the process: Python must never close it
    # (a peer may still be reading from the store while this rank leaves).
    return dist.TCPStore(
        ticket.addr, ticket.port, is_master=True, timeout=td, wait_for_workers=False, master_listen_fd=sock.detach()
    )


def token_digest_record(token: str) -> str:
    """What the store's host publishes so that a joining process can prove it holds the token."""
    salt = secrets.token_hex(16)
    return f"{salt}:{_digest(salt, token)}"


def check_token(base: dist.Store, ticket: Ticket, rank: int) -> None:
    """Refuse to join a job whose store was opened with another token."""
    salt, digest = base.get("troupe/digest").decode().split(":")
    if not hmac.compare_digest(digest, _digest(salt, ticket.token)):
        base.add(REFUSED_KEY, 1)
        raise PermissionError(
            f"rank {rank}: refused by the job at {ticket.addr}:{ticket.port}: wrong ticket token "
            "(only processes given this job's Ticket may join)"
        )


def _join(ticket: Ticket, rank: int, world_size: int, join_timeout: float, keep: list,
          host: bool | None = None) -> dist.Store:
    """Check the token, register this rank and wait for the whole world; return the job's store
    (what must outlive the rendezvous is appended to `keep`). Rank 0 hosts the store unless `host`
    says otherwise (False: the launcher does)."""
    host = rank == 0 if host is None else host
    base = open_store(ticket, host, join_timeout)
    keep.append(base)
    if host:
        base.set("troupe/digest", token_digest_record(ticket.token))
    check_token(base, ticket, rank)
    store = dist.PrefixStore(f"troupe/{ticket.token}/", base)
    if store.add(f"rank/{rank}/count", 1) > 1:
        raise ValueError(f"rank {rank} was started twice (world_size {world_size})")
    store.set(f"rank/{rank}", f"{socket.gethostname()}:{os.getpid()}")
    store.add("joined", 1)
    deadline = time.monotonic() + join_timeout
    try:
        while store.add("joined", 0) < world_size:
            if store.check(["abort"]):  # another rank gave up first: report the same reason
                raise TimeoutError(f"rank {rank}: {store.get('abort').decode()}")
            if time.monotonic() > deadline:
                missing = [r for r in range(world_size) if not store.check([f"rank/{r}"])]
                why = (f"{len(missing)} of {world_size} ranks did not join within {join_timeout:.0f}s: "
                       f"missing ranks {missing} (does world_size={world_size} match the processes started?)")
                store.set("abort", why)
                if host:
                    time.sleep(1.0)  # the store lives in this process: let the others read why
                raise TimeoutError(f"rank {rank}: {why}")
            time.sleep(0.02)
    except RuntimeError:  # torch's DistNetworkError: the store is gone
        raise ConnectionError(
            f"rank {rank}: lost the job's rendezvous at {ticket.addr}:{ticket.port} while waiting for all "
            f"{world_size} ranks to join (rank 0 gave up or died)"
        ) from None
    refused = int(base.add(REFUSED_KEY, 0))
    if host and refused:
        log.warning("troupe: refused %d join attempt(s) with a wrong ticket token", refused)
    return store


def _slurm(env: Settings) -> _Launch:
    """Ranks from srun's environment; every task computes the same Ticket (`slurm_ticket`)."""
    rank, world = _env_int("SLURM_PROCID"), _env_int("SLURM_NTASKS", "SLURM_NPROCS")
    ticket = slurm_ticket(env.master_addr, env.master_port, env.token)
    local_world = _tasks_on_this_node() or world
    return _Launch("slurm", ticket, rank, _env_int("SLURM_LOCALID") or 0, world, local_world)


def _tasks_on_this_node() -> int | None:
    """This node's task count from SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE ("2(x3),1")."""
    text = os.environ.get("SLURM_STEP_TASKS_PER_NODE") or os.environ.get("SLURM_TASKS_PER_NODE")
    node = _env_int("SLURM_NODEID") or 0
    if not text:
        return None
    counts = []
    for part in text.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node] if node < len(counts) else None


def _mpi_ticket(env: Settings) -> tuple[Ticket, int, int, int, int]:
    try:
        from mpi4py import MPI
    except ImportError:
        raise ImportError(
            "launched by mpiexec, but mpi4py is not installed: pip install 'torch-troupe[mpi]'"
        ) from None
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank, local_world = node.Get_rank(), node.Get_size()
    ticket = None
    spans_hosts = local_world < world  # the same on every rank: a collective below depends on it
    # Every rank's addresses, so that rank 0 can pick one of its own that the other hosts route to.
    peers = comm.allgather(sorted(netif.addresses().values())) if spans_hosts else []
    if rank == 0:
        try:
            addr = env.master_addr or (_master_address(peers) if spans_hosts else LOOPBACK)
            ticket = Ticket(addr=addr, port=env.master_port)
        except Exception as e:  # sent on: the other ranks would wait in bcast for ever
            ticket = e
    # SINGA broadcasts its NCCL id the same way.
    ticket = comm.bcast(ticket, root=0)
    if isinstance(ticket, Exception):
        raise ticket if rank == 0 else RuntimeError(f"rank {rank}: rank 0 could not make the job's ticket: {ticket}")
    return ticket, rank, local_rank, world, local_world


def _master_address(peers: list[list[str]]) -> str:
    """Rank 0's address for a job on several hosts: the hostname's, unless that is loopback or
    unknown; then the address that routes to the other hosts' ranks."""
    addr = netif.host_address() or netif.reachable_address(a for ranks in peers for a in ranks)
    if addr is None:
        raise RuntimeError(
            f"rank 0 ({socket.gethostname()}) found no address of its own that the other hosts can reach "
            "(its hostname resolves to loopback or not at all): set TROUPE_MASTER_ADDR to rank 0's address"
        )
    return addr


def _gloo_interface(ticket: Ticket, backend: str) -> None:
    """Gloo picks its interface from the hostname: keep a local job on loopback, and a job on several
    hosts on the interface that reaches rank 0's (unless GLOO_SOCKET_IFNAME says)."""
    if ticket.addr in (LOOPBACK, "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    elif backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
        _gloo_interface_towards(ticket.addr)


def _gloo_interface_towards(master: str) -> None:
    """Gloo binds to the hostname's address; where that is loopback or unknown (a job on several
    hosts would then bind to loopback), bind to the interface that reaches rank 0 instead."""
    if netif.host_address() is None:
        iface = netif.interface_for(master)
        if iface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = iface


def _adopt_existing_group() -> DistInfo:
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = _env_int("LOCAL_RANK") or 0
    backend = dist.get_backend()
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    return DistInfo(rank, local_rank, world, _env_int("LOCAL_WORLD_SIZE") or world, device, backend, "external")

