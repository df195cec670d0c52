"""A worker process kept warm: Python started and torch imported before any rank needs it.

Most of an elastic restart is the new process's start-up (measured: about 5 of the 6-7 s from
a kill to the restarted worker's first step, on a loaded 2-core machine), and most of that is
starting Python and importing torch, which does not depend on the rank. `troupe run --elastic`
therefore keeps `--spares` processes that have done exactly that and wait; a restart hands
one of them its rank (a line of JSON on its stdin: the environment variables that differ per
rank) and it runs the script as ``python SCRIPT ARGS`` would, while the launcher starts the
next spare. The script still builds its model and loads its data: only the part that is the
same for every rank is done in advance. The script sees ``TROUPE_WARM_START=1``.

    python -m troupe.runtime.spare SCRIPT [ARGS...]     (started by troupe run, never by hand)
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import subprocess
import sys
from collections.abc import Callable

WARM_VAR = "TROUPE_WARM_START"
"""Set to "1" in a script that runs in a spare (for logs and tests: it started warm)."""


class Spares:
    """The launcher's side: processes started in advance, handed a rank when one is needed."""

    def __init__(self, count: int, start: Callable[[], subprocess.Popen]):
        self.count, self._start = count, start
        self._waiting: list[subprocess.Popen] = []
        self.fill()

    def fill(self) -> None:
        """Start spares until `count` are waiting (a spare that died waiting is replaced)."""
        self._waiting = [p for p in self._waiting if p.poll() is None]
        while len(self._waiting) < self.count:
            self._waiting.append(self._start())

    def take(self, env: dict[str, str]) -> subprocess.Popen | None:
        """A waiting spare, told to run as the rank `env` describes; None when none is waiting."""
        while self._waiting:
            proc = self._waiting.pop(0)
            try:
                proc.stdin.write((json.dumps(env) + "\n").encode())
                proc.stdin.close()
            except (BrokenPipeError, OSError, ValueError):  # it died waiting: try the next one
                continue
            return proc
        return None

    def waiting(self) -> list[subprocess.Popen]:
        return list(self._waiting)

    def stop(self) -> None:
        """End the spares nobody needed (their stdin closes: they exit without running the script)."""
        for proc in self._waiting:
            try:
                proc.stdin.close()
            except OSError:
                pass
        for proc in self._waiting:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
        self._waiting = []


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m troupe.runtime.spare SCRIPT [ARGS...] (started by troupe run --elastic)")
    # The point: imported before a rank is needed. torch.optim's optimizers import torch._dynamo when the
    # first one is made (1 s on a quiet 2-core host, 3.5 s beside a busy job's workers).
    for module in ("torch", "torch.distributed", "torch._dynamo", "troupe"):
        importlib.import_module(module)
    line = sys.stdin.readline()
    if not line:  # the launcher closed our stdin without a rank: the job is over
        return
    os.environ.update(json.loads(line))
    os.environ[WARM_VAR] = "1"
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` would have it
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
