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
level gets a zygote started afresh (`zygote.Zygote.fork`), and another node's elastic launcher,
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
from typing import Any

from troupe.runtime.forking import STATUS, own_fd, own_session, read_exactly, recv_request, send_request

ENV_VAR = "TROUPE_FORK_SERVER"
"""The path of the fork server's socket (`Settings.fork_server`; unset: every `troupe run` starts its own launcher)."""

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
"""Signals the client passes on to its launcher."""

HANDSHAKE_SECONDS = 60.0
"""How long a client waits for the server to take its request (the server's imports at its start included)."""

_HANDLED = ("PYTHONPATH", "PYTHONUNBUFFERED")
"""PYTHON* variables the forked launcher takes as a fresh interpreter would; any other must be the server's."""


# --- the client's side (`troupe run` with TROUPE_FORK_SERVER set) --------------------------------------------


def launch(argv: list[str]) -> int | None:
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


class ForkedLauncher(BaseException):
    """Raised in a forked launcher to leave the server's loop (`serve`)."""

    def __init__(self, request: dict[str, Any]):
        super().__init__("a forked launcher")
        self.request = request


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


def serve(path: str) -> dict[str, Any]:
    """Listen at `path` and fork a launcher per request; returns only in a forked launcher, with its request
    (the server's frames gone: `troupe.cli` then runs the launcher at its own level, so that its exit is an
    interpreter's: threads joined, atexit handlers, the exit status of its exception)."""
    try:
        _serve(path)
    except ForkedLauncher as launched:
        return launched.request
    raise AssertionError("the fork server's loop returned")  # pragma: no cover


def _serve(path: str) -> None:
    from troupe.runtime import zygote

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)  # clients that come during the imports wait in the backlog
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the jobs; SIGTERM ends the server
    zygote.preload()
    gc.freeze()  # as the zygote: the imports are shared pages, never walked by a collection
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "children")
    launchers: dict[int, socket.socket | None] = {}
    """pid -> the client waiting for its status (None once the client has gone)."""
    clients: dict[socket.socket, int] = {}
    while True:
        for key, _ in selector.select():
            if key.data == "accept":
                conn, _ = listener.accept()
                selector.register(conn, selectors.EVENT_READ, "request")
            elif key.data == "request":
                conn = key.fileobj
                selector.unregister(conn)
                pid = _take(conn, selector, wake_r, wake_w)
                if pid is None:
                    continue
                launchers[pid] = conn
                clients[conn] = pid
                selector.register(conn, selectors.EVENT_READ, "client")
            elif key.data == "client":  # the client went away (it sends nothing else): its launcher goes too
                conn = key.fileobj
                selector.unregister(conn)
                pid = clients.pop(conn)
                if launchers.get(pid) is conn:
                    launchers[pid] = None
                    _forward(pid, signal.SIGKILL)
                conn.close()
            else:
                _reap(wake_r, launchers, clients, selector)


def _take(conn: socket.socket, selector, wake_r: int, wake_w: int) -> int | None:
    """Read one request and fork its launcher (which raises `ForkedLauncher`); its pid in the server, None when
    refused or unreadable."""
    try:
        received = recv_request(conn)
    except (OSError, ValueError, struct.error):
        received = None
    if received is None:
        conn.close()
        return None
    request, fds = received
    why = refusal(request)
    if why is not None:
        print(f"troupe fork server: refused {request['argv'][:4]}: {why}", flush=True)
        for fd in fds:
            os.close(fd)
        try:
            conn.sendall(STATUS.pack(0))
        except OSError:
            pass
        conn.close()
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the launcher: drop the server's sockets and handlers, become the client's process
        signal.set_wakeup_fd(-1)
        for key in list(selector.get_map().values()):
            if isinstance(key.fileobj, socket.socket):
                key.fileobj.close()
        selector.close()
        for fd in (wake_r, wake_w):
            os.close(fd)
        _become(request, fds)
        conn.close()
        raise ForkedLauncher(request)
    for fd in fds:
        os.close(fd)
    print(f"troupe fork server: launcher {pid} for {request['argv'][:4]}", flush=True)
    try:
        conn.sendall(STATUS.pack(pid))
    except OSError:
        _forward(pid, signal.SIGKILL)  # nobody waits for it
    return pid


def _reap(wake_r: int, launchers: dict, clients: dict, selector) -> None:
    """Send each exited launcher's status to its client."""
    try:
        while os.read(wake_r, 512):
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
        conn = launchers.pop(pid, None)
        if conn is None:
            continue
        clients.pop(conn, None)
        selector.unregister(conn)
        try:
            conn.sendall(STATUS.pack(os.waitstatus_to_exitcode(status)))
        except OSError:
            pass
        conn.close()


def _become(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked launcher: what ``python -m troupe.cli ARGV`` started by the client would be."""
    own_session(fds)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    server_pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    os.umask(request.get("umask", _umask()))
    sys.argv = [request["argv0"], *request["argv"]]
    rest = [p for p in sys.path[1:] if p not in server_pythonpath]
    sys.path[:] = [request["cwd"], *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p), *rest]
    unbuffered = request["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED"))
    for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
        stream.reconfigure(line_buffering=unbuffered or os.isatty(fd) or fd == 2,  # type: ignore[union-attr]
                           write_through=unbuffered or fd == 2)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # a fresh process would have drawn its own seed
