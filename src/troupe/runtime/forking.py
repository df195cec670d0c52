"""What the zygote (runtime/zygote.py: forks ranks) and the fork server (runtime/forkserver.py: forks
launchers) share: one request over a Unix socket, carrying the descriptors the forked process takes as
its stdin, stdout and stderr; how a forked process becomes what a fresh interpreter would have been; and
how it leaves its parent's frames.

    send_request(sock, {"argv": [...], ...}, [own_fd(0), own_fd(1), own_fd(2)])
    request, fds = recv_request(sock)          # in the server; None when the client closed the socket
    ... os.fork() ...; become_rank(request, fds)  # in the forked rank (become_launcher: a forked launcher)
    raise ForkedChild(request)                 # where the parent's loop must not go on in the child

A request is a 4-byte length, then that many bytes of JSON; a reply is one 4-byte integer (`STATUS`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys
from typing import Any

LENGTH = struct.Struct("!I")
"""A request's length in bytes, before its JSON."""
STATUS = struct.Struct("!i")
"""A reply: a pid, or an exit status (negative: killed by that signal)."""


def own_fd(fd: int) -> int:
    """This process's descriptor `fd` when open, else /dev/null's (a launcher started with stdin closed)."""
    try:
        os.fstat(fd)
        return fd
    except OSError:
        return os.open(os.devnull, os.O_RDWR)


def read_exactly(sock: socket.socket, n: int) -> bytes:
    """`n` bytes from `sock`; OSError when the other end closes it first."""
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise OSError("the other end closed its socket")
        data += chunk
    return data


def send_request(sock: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    """Send `request` (JSON) with the descriptors `fds` (stdin, stdout, stderr of the process to fork)."""
    data = json.dumps(request).encode()
    socket.send_fds(sock, [LENGTH.pack(len(data)) + data], fds)


def recv_request(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """A request and its descriptors; None when the client closed the socket before sending one. A
    request cut short raises OSError; one that is not JSON, ValueError."""
    header, fds, _flags, _addr = socket.recv_fds(sock, LENGTH.size, 3)
    if not header:
        return None
    (length,) = LENGTH.unpack(header + read_exactly(sock, LENGTH.size - len(header)))
    return json.loads(read_exactly(sock, length)), fds


class ForkedChild(BaseException):
    """Raised in a process just forked from a serving loop to leave its parent's frames: a launcher forked by
    the fork server (caught by `forkserver.serve`), a rank forked by a zygote that was itself forked from its
    launcher (caught by `troupe.cli.main`, which runs the rank's program at its own level). A BaseException,
    so that no ``except Exception`` on the way takes it."""

    def __init__(self, request: dict[str, Any]):
        super().__init__("a forked child leaving its parent's frames")
        self.request = request
        """What the child becomes (its argv, environment, working directory)."""


def become_launcher(request: dict[str, Any], fds: list[int]) -> None:
    """In a launcher forked by the fork server: what ``python -m troupe.cli ARGV`` started by the client would
    be (a session of its own, the client's descriptors, environment, directory, umask, argv, path and stream
    buffering; signals at Python's defaults)."""
    os.setsid()
    adopt(fds)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    server_pythonpath = _pythonpath()
    _take_over(request)
    if "umask" in request:
        os.umask(request["umask"])
    sys.argv = [request["argv0"], *request["argv"]]
    rest = [p for p in sys.path[1:] if p not in server_pythonpath]
    sys.path[:] = [request["cwd"], *_pythonpath(), *rest]
    unbuffered = request["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED"))
    for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
        stream.reconfigure(line_buffering=unbuffered or os.isatty(fd) or fd == 2,  # type: ignore[union-attr]
                           write_through=unbuffered or fd == 2)


def become_rank(request: dict[str, Any], fds: list[int]) -> None:
    """In a rank forked by a zygote: what ``subprocess.Popen(..., **rank_leader(stdin))`` gives a rank started
    afresh (its process group, descriptors, environment, directory, SIGINT and stdout buffering as Python sets
    them, its OMP_NUM_THREADS); argv and path are set as it runs (`zygote.run_rank`)."""
    if "start_new_session" in rank_leader(os.isatty(fds[0])):
        os.setsid()
    else:
        os.setpgid(0, 0)
    adopt(fds)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as Python starts (SIGPIPE stays ignored)
    _take_over(request)
    line_buffered = os.isatty(1) or bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdout.reconfigure(line_buffering=line_buffered)  # type: ignore[union-attr]
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))


def _take_over(request: dict[str, Any]) -> None:
    """The requester's environment and working directory; numpy's global generator seeded anew (a fresh
    process would have drawn its own seed)."""
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _pythonpath() -> list[str]:
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def rank_leader(terminal_stdin: bool) -> dict[str, Any]:
    """Popen's keywords for a rank: a process group of its own (the launcher's ``killpg`` reaches the
    rank's children) in the launcher's session. One session keeps the whole job in one of the kernel's
    scheduling autogroups: a session per rank made each rank a group of its own, and ranks that
    outnumber the cores then drifted apart between DiLoCo's exchanges (docs/time_to_accuracy.md,
    "troupe's DiLoCo beside torchft's"). A rank whose stdin is a terminal takes a session of its own instead:
    job control stops a background process group that reads its terminal."""
    return {"start_new_session": True} if terminal_stdin else {"process_group": 0}


def adopt(fds: list[int]) -> None:
    """`fds` as this process's stdin, stdout and stderr."""
    for target, fd in enumerate(fds):
        if fd != target:
            os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
