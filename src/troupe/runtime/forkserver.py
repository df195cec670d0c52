"""A fork server for `troupe run`: launchers forked from one process that has already imported torch.

Every `troupe run` starts one interpreter that imports torch, torch._dynamo and troupe (its
zygote, runtime/zygote.py; an elastic launcher itself): seconds of CPU, most of a short job's
cost (docs/launching.md has the measurement). Whoever starts many short jobs one after the other (a test suite,
a notebook, a sweep of small runs) can pay it once:

    troupe fork-server /tmp/troupe.sock &          # imports once, then serves
    export TROUPE_FORK_SERVER=/tmp/troupe.sock
    troupe run -n 2 script.py                      # its launcher forked from the server: no import

With ``TROUPE_FORK_SERVER`` set, `troupe run` (the client, which never imports torch) hands
the server its arguments, environment, working directory and its stdin/stdout/stderr; the
server forks a launcher that becomes what ``python -m troupe.cli run ...`` would have been
(its own session, those descriptors and that environment, signals at Python's defaults) and,
torch being imported already, forks its zygote from itself. The client forwards the signals
it gets (SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2) to the launcher and exits with
the launcher's exit status (killed by a signal: by the same signal); if the client dies, the
server SIGKILLs its launcher, as if the launcher itself had been killed.

What cannot be the same as a fresh interpreter is refused, and the client then runs the
launcher itself as before: another Python executable, user, cgroup or Linux namespace (a
client on a simulated host, in a network namespace of its own), another value of any
``LD_*`` variable or ``PYTHON*`` variable but ``PYTHONPATH`` (its entries are put in front of
the path) and ``PYTHONUNBUFFERED`` (the streams are made unbuffered); the client's umask
is the launcher's. Torch read ``TORCH_CPP_LOG_LEVEL`` and ``OMP_NUM_THREADS`` as it loaded in
the server: start the server with the level `troupe run` gives its ranks (``ERROR``) and without
``OMP_NUM_THREADS`` (each rank sets its threads as it starts); a job whose ranks want another
level gets a zygote started afresh (`zygote.ZygoteSlot.fork`), and another node's elastic launcher,
which loads torch at ``FATAL``, executes itself afresh before it says anything. A server that
is not listening, or has gone, is the same as no server.
"""

from __future__ import annotations

import gc
import os
import selectors
import signal
import socket
import struct
import sys
from typing import TYPE_CHECKING, Any

from troupe.runtime.forking import (
    STATUS,
    ForkedChild,
    become_launcher,
    own_fd,
    read_exactly,
    recv_request,
    send_request,
)

if TYPE_CHECKING:
    from troupe.runtime.zygote import ZygoteSlot

ENV_VAR = "TROUPE_FORK_SERVER"
"""The path of the fork server's socket (`Settings.fork_server`; unset: every `troupe run` starts its own launcher)."""

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
"""Signals the client passes on to its launcher."""

HANDSHAKE_SECONDS = 60.0
"""How long a client waits for the server to take its request (the server's imports at its start included)."""

_HANDLED = ("PYTHONPATH", "PYTHONUNBUFFERED")
"""PYTHON* variables the forked launcher takes as a fresh interpreter would; any other must be the server's."""


# --- the client's side (`troupe run` with TROUPE_FORK_SERVER set) --------------------------------------------


def run_served(argv: list[str]) -> int | None:
    """Run ``troupe ARGV`` as a launcher forked by the server; its exit status. None: no server answered, or it
    refused (the caller starts the launcher itself)."""
    from troupe.runtime.settings import Settings

    try:
        path = Settings.from_env().fork_server
    except ValueError:  # a bad TROUPE_* value: the launcher started afresh says which
        return None
    if not path:
        return None
    request = {
        "argv": argv, "argv0": sys.argv[0], "env": dict(os.environ), "cwd": os.getcwd(), "umask": _umask(),
        "executable": sys.executable, "unbuffered": bool(getattr(sys.stdout, "write_through", False)),
        "uid": os.getuid(), "namespaces": namespaces(), "cgroup": _cgroup()}
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(HANDSHAKE_SECONDS)
    try:
        sock.connect(path)
        send_request(sock, request, [own_fd(0), own_fd(1), own_fd(2)])
        (pid,) = STATUS.unpack(read_exactly(sock, STATUS.size))
    except OSError:  # no server, or one that does not answer (a launcher it forked meanwhile sees us go: killed)
        sock.close()
        return None
    sock.settimeout(None)
    if pid <= 0:  # refused: not the same interpreter
        sock.close()
        return None
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: _forward(pid, signum))
    try:
        (status,) = STATUS.unpack(read_exactly(sock, STATUS.size))
    except OSError:
        print(f"troupe run: the fork server at {path} went away while it ran this job's launcher (pid {pid})",
              file=sys.stderr, flush=True)
        return 1
    if status < 0:  # the launcher was killed by a signal: so is this process
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    return status if status >= 0 else 128 - status


def _forward(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


# --- the server's side -----------------------------------------------------------------------------------------


def namespaces() -> dict[str, str]:
    """This process's Linux namespaces (a client on a simulated host runs in a network namespace of its own,
    where its launcher must run too)."""
    found = {}
    for kind in ("net", "mnt", "pid", "uts", "ipc", "user"):
        try:
            found[kind] = os.readlink(f"/proc/self/ns/{kind}")
        except OSError:
            pass
    return found


def _cgroup() -> str:
    try:
        with open("/proc/self/cgroup") as f:
            return f.read()
    except OSError:
        return ""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def refusal(request: dict[str, Any], environ: dict[str, str] | None = None) -> str | None:
    """Why a launcher for `request` cannot be forked from this interpreter (None: it can)."""
    environ = os.environ if environ is None else environ
    if request["executable"] != sys.executable:
        return f"another Python ({request['executable']})"
    if request.get("uid", os.getuid()) != os.getuid():
        return f"another user ({request['uid']})"
    ours = namespaces()
    for kind, ns in sorted(request.get("namespaces", {}).items()):
        if ours.get(kind) != ns:
            return f"another {kind} namespace ({ns})"
    if request.get("cgroup", _cgroup()) != _cgroup():
        return "another cgroup"
    env = request["env"]
    for name in sorted({*env, *environ}):
        if name.startswith(("PYTHON", "LD_")) and name not in _HANDLED and env.get(name) != environ.get(name):
            return f"another {name}"
    return None


def serve(path: str) -> tuple[dict[str, Any], ZygoteSlot]:
    """Listen at `path` and fork a launcher per request; returns only in a forked launcher, with its request and
    its zygote slot, which knows how the server loaded torch (the server's frames gone: `troupe.cli` then runs
    the launcher at its own level, so that its exit is an interpreter's: threads joined, atexit handlers, the
    exit status of its exception)."""
    from troupe.runtime.zygote import ZygoteSlot  # here, not where the client imports this module

    server = ForkServer(path)
    try:
        server.run()
    except ForkedChild as launched:
        return launched.request, ZygoteSlot(loaded=server.loaded)
    raise AssertionError("the fork server's loop returned")  # pragma: no cover


class ForkServer:
    """The server's loop and what it holds: the listening socket, the clients, the launchers they wait for."""

    def __init__(self, path: str):
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(64)  # clients that come during the imports wait in the backlog
        self.loaded: dict[str, str | None] | None = None
        """How torch loaded here (`zygote.preload`): a forked launcher's zygote must load it the same way."""
        self.selector = selectors.DefaultSelector()
        self.wake_r, self.wake_w = os.pipe()
        self.launchers: dict[int, socket.socket | None] = {}
        """pid -> the client waiting for its status (None once the client has gone)."""
        self.clients: dict[socket.socket, int] = {}

    def run(self) -> None:
        """Import, then serve until killed (SIGTERM); a forked launcher leaves by raising `ForkedChild`."""
        from troupe.runtime.zygote import preload

        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the jobs; SIGTERM ends the server
        self.loaded = preload()
        gc.freeze()  # as the zygote: the imports are shared pages, never walked by a collection
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "children")
        while True:
            for key, _ in self.selector.select():
                if key.data == "accept":
                    conn, _ = self.listener.accept()
                    self.selector.register(conn, selectors.EVENT_READ, "request")
                elif key.data == "request":
                    self.selector.unregister(key.fileobj)
                    self._take(key.fileobj)
                elif key.data == "client":  # the client went away (it sends nothing else): its launcher goes too
                    self._client_gone(key.fileobj)
                else:
                    self._reap()

    def _take(self, conn: socket.socket) -> None:
        """Read one request and fork its launcher (which raises `ForkedChild`); the server then waits for its
        exit on the client's behalf. A request refused or unreadable closes the connection."""
        try:
            received = recv_request(conn)
        except (OSError, ValueError, struct.error):
            received = None
        if received is None:
            conn.close()
            return
        request, fds = received
        why = refusal(request)
        if why is not None:
            print(f"troupe fork server: refused {request['argv'][:4]}: {why}", flush=True)
            self._refuse(conn, fds)
            return
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the launcher: drop the server's sockets and handlers, become the client's process
            self._drop()
            become_launcher(request, fds)
            conn.close()
            raise ForkedChild(request)
        for fd in fds:
            os.close(fd)
        print(f"troupe fork server: launcher {pid} for {request['argv'][:4]}", flush=True)
        try:
            conn.sendall(STATUS.pack(pid))
        except OSError:
            _forward(pid, signal.SIGKILL)  # nobody waits for it
        self.launchers[pid] = conn
        self.clients[conn] = pid
        self.selector.register(conn, selectors.EVENT_READ, "client")

    @staticmethod
    def _refuse(conn: socket.socket, fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)
        try:
            conn.sendall(STATUS.pack(0))
        except OSError:
            pass
        conn.close()

    def _drop(self) -> None:
        """In a forked launcher: none of the server's sockets, pipes and signal wake-ups."""
        signal.set_wakeup_fd(-1)
        for key in list(self.selector.get_map().values()):
            if isinstance(key.fileobj, socket.socket):
                key.fileobj.close()
        self.selector.close()
        for fd in (self.wake_r, self.wake_w):
            os.close(fd)

    def _client_gone(self, conn: socket.socket) -> None:
        self.selector.unregister(conn)
        pid = self.clients.pop(conn)
        if self.launchers.get(pid) is conn:
            self.launchers[pid] = None
            _forward(pid, signal.SIGKILL)
        conn.close()

    def _reap(self) -> None:
        """Send each exited launcher's status to its client."""
        try:
            while os.read(self.wake_r, 512):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.launchers.pop(pid, None)
            if conn is None:
                continue
            self.clients.pop(conn, None)
            self.selector.unregister(conn)
            try:
                conn.sendall(STATUS.pack(os.waitstatus_to_exitcode(status)))
            except OSError:
                pass
            conn.close()
