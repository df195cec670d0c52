"""What the zygote (runtime/zygote.py: forks ranks) and the fork server (runtime/forkserver.py: forks
launchers) share: one request over a Unix socket, carrying the descriptors the forked process takes as
its stdin, stdout and stderr, and how a forked process adopts them.

    send_request(sock, {"argv": [...], ...}, [own_fd(0), own_fd(1), own_fd(2)])
    request, fds = recv_request(sock)          # in the server; None when the client closed the socket
    ... os.fork() ...; own_group(fds)          # in the forked rank (own_session(fds): a forked launcher)

A request is a 4-byte length, then that many bytes of JSON; a reply is one 4-byte integer (`STATUS`).
"""

from __future__ import annotations

import json
import os
import socket
import struct
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


def own_session(fds: list[int]) -> None:
    """In a forked launcher (the fork server's): a session of its own, and `fds` as its stdin, stdout and
    stderr."""
    os.setsid()
    adopt(fds)


def own_group(fds: list[int]) -> None:
    """In a forked rank: what ``subprocess.Popen(..., **rank_leader(stdin))`` gives a rank started afresh."""
    if "start_new_session" in rank_leader(os.isatty(fds[0])):
        os.setsid()
    else:
        os.setpgid(0, 0)
    adopt(fds)


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
