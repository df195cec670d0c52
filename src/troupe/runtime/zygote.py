"""Ranks forked from one process that has imported torch: a job's start costs one import, not N.

Starting a rank afresh is mostly the same work on every rank: Python starts, imports torch,
and the first optimizer imports torch._dynamo (seconds of CPU, more beside a busy job; what
forking saves: docs/chaos.md and docs/launching.md). `troupe run` on Linux therefore starts one *zygote* per launcher, with the
environment every rank shares, which does that once and then forks each rank, first ones and
restarts alike, in milliseconds:

    zygote = Zygote.start(env)                           # python -m troupe.runtime.zygote
    # (a launcher keeps its own in a ZygoteSlot: made at its first rank, used by every attempt)
    proc = zygote.spawn(["script.py", "--epochs", "3"], rank_env, stdout=w1, stderr=w2)
    proc.poll(); proc.wait(5); os.killpg(proc.pid, signal.SIGTERM)      # as a subprocess.Popen

A forked rank is what ``python script.py`` would be: its own process group (`forking.rank_leader`), the
environment it was given, ``sys.argv`` and ``sys.path[0]`` as Python sets them, stdin/stdout/
stderr on the descriptors the launcher passed, signals at their defaults, the script run as
``__main__``, the interpreter's own exit (atexit, flushing, the exit code of an exception or a
signal). It is the launcher's child, not the zygote's: the zygote forks twice and the launcher
is the child subreaper (``PR_SET_CHILD_SUBREAPER``), so the launcher waits for it as for a
process it started. What cannot be the same: modules the zygote imported are already imported
(torch reads ``OMP_NUM_THREADS`` and ``TORCH_CPP_LOG_LEVEL`` as it loads: the zygote gets the
ranks' shared values), and numpy's global generator, seeded once in the zygote, is seeded again
in every rank.

Node 0's launcher of an elastic job imports torch itself (it keeps the job's store), so there the zygote
is not a second interpreter: the launcher imports what a zygote preloads, with the ranks' shared
environment, and forks the zygote from itself before it starts any thread (`ZygoteSlot.fork`): the job's
start costs one import of torch, not two. A rank forked from
it leaves the launcher's frames by raising `forking.ForkedChild`, which `troupe.cli.main` catches to run the
program at its own level, so the program's exceptions, exit code and traceback are its own.

``TROUPE_FORK=0`` (or a platform without fork and subreapers) starts every rank afresh, as before.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import IO, Any

from troupe.runtime.forking import LENGTH, ForkedChild, become_rank, own_fd, read_exactly, recv_request, send_request

ENV_VAR = "TROUPE_FORK"
"""TROUPE_FORK=0: start every rank as a fresh interpreter instead of forking it from the zygote."""

PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "troupe")
"""What the zygote imports before the first rank (torch.optim's optimizers import torch._dynamo)."""

IMPORT_ENV = ("OMP_NUM_THREADS", "TORCH_CPP_LOG_LEVEL")
"""What torch reads from the environment as it loads: a zygote forked from a process that imported it
(`ZygoteSlot.fork`) must have imported it with the ranks' values."""

_PR_SET_CHILD_SUBREAPER = 36


def available() -> bool:
    """Whether ranks may be forked here: Linux (fork, subreapers, fd passing) and not TROUPE_FORK=0."""
    return sys.platform.startswith("linux") and os.environ.get(ENV_VAR, "1") != "0"


def become_subreaper() -> bool:
    """Make this process the child subreaper: orphans below it are re-parented to it (Linux >= 3.4)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class ForkedRank:
    """A rank forked by the zygote, with the part of `subprocess.Popen`'s interface the launcher uses."""

    def __init__(self, pid: int, args: list[str], stdin: IO[bytes] | None = None, stdout: IO[bytes] | None = None,
                 stderr: IO[bytes] | None = None):
        self.pid, self.args = pid, args
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: nothing more can be known (Popen says 0 too)
                pid, status = self.pid, 0
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.0005
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __repr__(self) -> str:
        return f"<ForkedRank pid {self.pid} returncode {self.returncode}>"


class Zygote:
    """The launcher's side: one process that imported torch, asked over a socket to fork ranks."""

    def __init__(self, proc: subprocess.Popen, sock: socket.socket):
        self.proc, self._sock = proc, sock
        self._lock = threading.Lock()  # one request and its reply at a time

    @classmethod
    def start(cls, env: dict[str, str], cwd: str | None = None) -> Zygote:
        """Start a zygote with the environment every rank shares (it imports torch in the background)."""
        if not become_subreaper():
            raise OSError("cannot become the child subreaper (prctl)")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = subprocess.Popen([sys.executable, "-m", "troupe.runtime.zygote", str(theirs.fileno())], env=env,
                                    cwd=cwd, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        return cls(proc, ours)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(self, argv: list[str], env: dict[str, str], *, module: bool = False, stdin: int | None = None,
              stdout: int | None = None, stderr: int | None = None) -> ForkedRank:
        """Fork a rank running ``python SCRIPT ARGS`` (``python -m MODULE ARGS`` with `module`); the three
        descriptors default to this process's own (the child gets copies). Raises OSError when the zygote
        is gone (the caller then starts the rank afresh)."""
        fds = [own_fd(0) if stdin is None else stdin, own_fd(1) if stdout is None else stdout,
               own_fd(2) if stderr is None else stderr]
        request = {"argv": argv, "env": env, "module": module, "cwd": os.getcwd()}
        with self._lock:
            send_request(self._sock, request, fds)
            reply = read_exactly(self._sock, LENGTH.size)
        (pid,) = LENGTH.unpack(reply)
        if pid == 0:
            raise OSError("the zygote could not fork")
        return ForkedRank(pid, argv)

    def close(self) -> None:
        """End the zygote (its end of the socket closes: it exits); forked ranks are not touched."""
        try:
            self._sock.close()
        finally:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class ZygoteSlot:
    """A launcher's zygote, made at its first use (started afresh, or forked from the launcher) and used by every
    attempt of its job; None where ranks start afresh. It also knows how torch was loaded in this process."""

    def __init__(self, loaded: dict[str, str | None] | None = None):
        self.loaded = loaded
        """IMPORT_ENV's values (None: unset) when `preload` imported torch in this process (a fork server's, for
        the launchers it forks); None if it did not (not yet, or torch was imported otherwise)."""
        self.zygote: Zygote | None = None
        self._made = False

    def current(self) -> Zygote | None:
        """The zygote if one was made and is still used (without making it)."""
        return self.zygote

    def shared(self, env: dict[str, str], say: Callable[[str], None] | None = None) -> Zygote | None:
        """The zygote, started on first use with `env` (the ranks' shared environment); None where ranks are not
        forked (TROUPE_FORK=0, not Linux) or the zygote could not start or has died (`say` is told once, and every
        later rank starts afresh)."""
        if not self._made:
            self._made = True
            if available():
                try:
                    self.zygote = Zygote.start(env)
                except OSError as e:
                    if say is not None:
                        say(f"troupe run: ranks start afresh (no zygote: {e})")
        zygote = self.zygote
        if zygote is not None and not zygote.alive():
            if say is not None:
                say(f"troupe run: the zygote exited with code {zygote.proc.returncode}; ranks start afresh from now on")
            self.zygote = zygote = None
        return zygote

    def fork_shared(self, env: dict[str, str], say: Callable[[str], None] | None = None) -> Zygote | None:
        """The zygote, forked from this process now (`fork`) where ranks are forked at all; where that cannot be,
        `shared` starts one afresh on first use as before (`say` is told why)."""
        if not self._made and available():
            try:
                self.zygote, self._made = self.fork(env), True
            except OSError as e:
                if say is not None:
                    say(f"troupe run: the zygote starts afresh (it cannot be forked from the launcher: {e})")
        return self.shared(env, say)

    def forget(self, zygote: Zygote) -> None:
        """Stop using `zygote` (a request failed): later ranks start afresh."""
        if self.zygote is zygote:
            self.zygote = None

    def fork(self, env: dict[str, str]) -> Zygote:
        """A zygote forked from this process, which first imports what a zygote preloads, with `env` as the
        environment while torch loads (what a zygote started afresh would load it with). For a launcher that
        needs torch itself (an elastic job's keeps the job's store): the job's start then costs one import
        of torch, not two. Only before this process starts a thread (OSError otherwise)."""
        if threading.active_count() > 1:
            raise OSError("the launcher already runs threads: a fork would copy their locks")
        if not become_subreaper():
            raise OSError("cannot become the child subreaper (prctl)")
        if "torch" in sys.modules and not self._imported_as(env):
            raise OSError(f"torch was imported here with {self.loaded}, not with the ranks' "
                          f"{ {name: env.get(name) for name in IMPORT_ENV} }")
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(env)
        try:
            self.loaded = preload() or self.loaded
        finally:
            os.environ.clear()
            os.environ.update(saved)
        if sys.modules["torch"].cuda.is_initialized():
            raise OSError("CUDA was initialized while importing")
        if threading.active_count() > 1:
            raise OSError("importing torch started a thread: a fork would copy its locks")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            ours.close()
            _forked_zygote(theirs)  # returns only in a rank, by raising ForkedChild
        theirs.close()
        return Zygote(ForkedRank(pid, ["troupe zygote (forked from the launcher)"]), ours)  # type: ignore[arg-type]

    def _imported_as(self, env: dict[str, str]) -> bool:
        """Whether torch, imported here by `preload`, loaded as it would with `env` (unknown: assumed so). Imported
        without OMP_NUM_THREADS it has torch's default threads, a fresh rank's; a rank given the variable sets its
        threads as it starts (`forking.become_rank`)."""
        if self.loaded is None:
            return True
        return all(env.get(name) == had or (name == "OMP_NUM_THREADS" and had is None)
                   for name, had in self.loaded.items())


def reap_orphans(known: set[int]) -> list[int]:
    """Reap this process's exited children that it did not start (`known`: the pids it did): as the child
    subreaper it inherits its ranks' orphans (a DataLoader worker of a killed rank exits once it sees its
    parent gone, and would stay a zombie until the launcher ends). Returns the pids reaped."""
    me, reaped = os.getpid(), []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return reaped
    for entry in entries:
        if not entry.isdigit() or int(entry) in known:
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, IndexError, ValueError):
            continue
        if state == "Z" and int(ppid) == me:
            try:
                os.waitpid(int(entry), os.WNOHANG)
                reaped.append(int(entry))
            except ChildProcessError:
                pass
    return reaped


# --- the zygote's side -------------------------------------------------------------------------------------


def _fork_ranks(sock: socket.socket) -> dict[str, Any] | None:
    """Fork a rank per request until the launcher closes the socket. Returns the request in the forked rank
    (which then runs it at top level, see `main`), None in the zygote when it is done."""
    while True:
        try:
            received = recv_request(sock)
        except (ConnectionResetError, OSError):  # the launcher is gone
            return None
        if received is None:
            return None
        request, fds = received
        sys.stdout.flush()
        sys.stderr.flush()
        readable, writable = os.pipe()
        middle = os.fork()
        if middle == 0:  # the intermediate: forks the rank and exits, so that it is re-parented to the launcher
            os.close(readable)
            rank = os.fork()
            if rank == 0:
                os.close(writable)
                sock.close()
                become_rank(request, fds)
                return request
            os.write(writable, LENGTH.pack(rank))
            os._exit(0)
        os.close(writable)
        for fd in fds:
            os.close(fd)
        os.waitpid(middle, 0)
        got = os.read(readable, LENGTH.size)
        os.close(readable)
        sock.sendall(got if len(got) == LENGTH.size else LENGTH.pack(0))


def run_rank(request: dict[str, Any]) -> None:
    """Run the rank's program as ``python`` would, in this (top-level) frame's interpreter (the zygote's
    `main`, or `troupe.cli.main` for a rank of a zygote forked from the launcher: see `forking.ForkedChild`)."""
    import runpy

    argv = request["argv"]
    if request["module"]:
        sys.argv = [argv[0], *argv[1:]]
        sys.path[0] = os.getcwd()
        with warnings.catch_warnings():
            # A zygote forked from its launcher (`ZygoteSlot.fork`) may have imported the module already (a server
            # rank's troupe.cluster.bootstrap): it runs again as __main__, as `python -m` would, without
            # runpy's warning on every such rank's stderr.
            warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package",
                                    category=RuntimeWarning)
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def preload() -> dict[str, str | None] | None:
    """Import what every rank imports (PRELOAD); the IMPORT_ENV values torch loaded with (None: it was imported
    before)."""
    import importlib

    loaded = None if "torch" in sys.modules else {name: os.environ.get(name) for name in IMPORT_ENV}
    for module in PRELOAD:
        importlib.import_module(module)
    return loaded


def _forked_zygote(sock: socket.socket) -> None:
    """The zygote's life in a process forked from the launcher (`ZygoteSlot.fork`): what `main` does after its
    imports. A rank leaves by raising `ForkedChild`; the zygote itself only ever exits."""
    try:
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):  # a launcher's handlers are not a rank's
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # as `main`
        request = _live(sock)
    except BaseException:  # never back into the launcher's code
        import traceback

        traceback.print_exc()
        os._exit(1)
    raise ForkedChild(request)


def _live(sock: socket.socket) -> dict[str, Any]:
    """A zygote's life once it has imported: fork a rank per request. Returns only in a forked rank, with its
    request; the zygote itself exits here once its launcher is done, with ``os._exit`` (no module-by-module
    teardown of torch, which would cost CPU at the end of every job; it holds nothing needing finalizers)."""
    # What is imported now lives as long as any rank: out of the collector's sight, it is neither walked by
    # each collection nor torn down object by object at each rank's exit (most of a rank's exit time),
    # and forked pages stay shared.
    gc.freeze()
    request = _fork_ranks(sock)
    if request is None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return request


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m troupe.runtime.zygote FD (started by troupe run, never by hand)")
    sock = socket.socket(fileno=int(sys.argv[1]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle; it closes the socket
    preload()
    torch = sys.modules["torch"]
    if torch.cuda.is_initialized():  # a forked child could not use CUDA: let the launcher start ranks afresh
        print("troupe zygote: CUDA was initialized while importing; ranks start afresh", file=sys.stderr, flush=True)
        return
    run_rank(_live(sock))


if __name__ == "__main__":
    main()
