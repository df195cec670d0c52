"""The output of the ranks `troupe run` starts: whole lines to the terminal, rank prefixes, log files.

    out = RankOutput(prefix=True, ranks={0}, log_dir="logs")
    proc = subprocess.Popen(cmd, **out.pipes())
    out.attach(rank, proc)
    ...
    out.drain()          # every line the ranks wrote has been passed on

Each rank's stdout and stderr are read line by line and passed on to this process's stdout
and stderr one whole line at a time (two ranks printing at once no longer interleave inside a
line), with ``[rank0]: `` in front when `prefix` is set, only for the ranks in `ranks` (all
when None), and every line of rank R also goes to ``log_dir/rankR.log`` (stdout and stderr
together, in the order they arrive), as torchrun's ``--tee``/``--log-dir`` do.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import IO


def parse_ranks(text: str) -> set[int]:
    """'0', '0,2' or '0-3,6' -> the set of ranks."""
    ranks: set[int] = set()
    for part in text.split(","):
        first, sep, last = part.strip().partition("-")
        if not first.isdigit() or (sep and not last.isdigit()):
            raise ValueError(f"--ranks must list ranks such as '0', '0,2' or '0-3', got {text!r}")
        ranks.update(range(int(first), int(last if sep else first) + 1))
    return ranks


class RankOutput:
    """Passes the ranks' output on whole lines at a time (see the module docstring)."""

    def __init__(self, *, prefix: bool = False, ranks: set[int] | None = None, log_dir: str | None = None):
        self.prefix, self.ranks, self.log_dir = prefix, ranks, log_dir
        self._lock = threading.Lock()  # one line at a time, across ranks and streams
        self._threads: list[threading.Thread] = []
        self._logs: dict[int, IO[bytes]] = {}
        self._last: dict[int, bytes] = {}
        """Per process id, the last line it wrote to stderr."""
        self._stderr: dict[int, threading.Thread] = {}
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)

    def clear_logs(self, ranks: range) -> None:
        """Start the logs of these ranks afresh (a restart of the job appends to them)."""
        for rank in ranks:
            path = self._log_path(rank)
            if path and os.path.exists(path):
                os.remove(path)

    def pipes(self) -> dict[str, int]:
        """Popen's keyword arguments: both streams to this process."""
        return {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}

    def attach(self, rank: int, proc: subprocess.Popen) -> None:
        """Start passing on `proc`'s output as rank `rank`'s."""
        log = None
        if self.log_dir:
            log = self._logs[rank] = open(self._log_path(rank), "ab")  # noqa: SIM115  (closed in drain)
            with open(os.path.join(self.log_dir, "pids.txt"), "a") as f:  # which process is which rank
                f.write(f"{rank} {proc.pid}\n")
        shown = self.ranks is None or rank in self.ranks
        tag = f"[rank{rank}]: ".encode() if self.prefix else b""
        for pipe, sink, pid in ((proc.stdout, sys.stdout, None), (proc.stderr, sys.stderr, proc.pid)):
            thread = threading.Thread(target=self._pump, args=(pipe, sink if shown else None, tag, log, pid),
                                      name=f"troupe-rank{rank}-output", daemon=True)
            thread.start()
            self._threads.append(thread)
        self._stderr[proc.pid] = thread

    def last_error_line(self, proc: subprocess.Popen, wait: float = 1.0) -> str:
        """The last line an exited `proc` wrote to stderr (its error), once its stream has ended (at most
        `wait` seconds from now); "" if none."""
        thread = self._stderr.pop(proc.pid, None)
        if thread is not None:
            thread.join(wait)
        return self._last.pop(proc.pid, b"").decode(errors="replace").strip()

    def drain(self, timeout: float = 10.0) -> None:
        """Wait until the ranks' streams are closed and passed on (at most `timeout` seconds each)."""
        for thread in self._threads:
            thread.join(timeout)
        self._threads = []
        for log in self._logs.values():
            log.close()
        self._logs = {}

    def _log_path(self, rank: int) -> str | None:
        return os.path.join(self.log_dir, f"rank{rank}.log") if self.log_dir else None

    def _pump(self, pipe: IO[bytes], sink: IO[str] | None, tag: bytes, log: IO[bytes] | None,
              pid: int | None = None) -> None:
        with pipe:
            for line in pipe:  # a last line without its newline comes at the end of the stream
                if not line.endswith(b"\n"):
                    line += b"\n"
                if pid is not None and line.strip():
                    self._last[pid] = line
                with self._lock:
                    if sink is not None:
                        _write(sink, tag + line)
                    if log is not None:
                        log.write(line)
                        log.flush()


def _write(sink: IO[str], data: bytes) -> None:
    sink.flush()  # what this process wrote itself goes first
    raw = getattr(sink, "buffer", None)
    if raw is None:  # a text-only stream (a test's capture)
        sink.write(data.decode(errors="replace"))
        sink.flush()
        return
    raw.write(data)
    raw.flush()
