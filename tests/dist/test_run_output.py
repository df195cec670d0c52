"""`troupe run`'s handling of the ranks' output: whole lines, --prefix, --log-dir, --ranks (2 real ranks)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from troupe.runtime.rankio import parse_ranks

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "dist" / "scripts" / "print_lines.py")
LINE = r"rank (\d) line (\d+) ok"


def troupe_run(*flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TROUPE_JOIN_TIMEOUT": "30", "TROUPE_TIMEOUT": "60", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "troupe.cli", "run", "-n", "2", *flags, SCRIPT]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def ranks_of(lines: list[str], pattern: str = LINE) -> dict[int, list[int]]:
    """rank -> its line numbers in order; every line must match `pattern` whole."""
    seen: dict[int, list[int]] = {}
    for line in lines:
        m = re.fullmatch(pattern, line)
        assert m, f"a line is not whole: {line!r}"
        seen.setdefault(int(m.group(1)), []).append(int(m.group(2)))
    return seen


@pytest.mark.timeout(150)
def test_lines_reach_the_terminal_whole():
    done = troupe_run()
    assert ranks_of(done.stdout.splitlines()) == {0: list(range(100)), 1: list(range(100))}
    assert sorted(line for line in done.stderr.splitlines() if "on stderr" in line) == \
        ["rank 0 on stderr", "rank 1 on stderr"]


@pytest.mark.timeout(150)
def test_prefix_ranks_and_log_dir(tmp_path):
    done = troupe_run("--prefix", "--ranks", "1", "--log-dir", str(tmp_path / "logs"))
    assert ranks_of(done.stdout.splitlines(), r"\[rank(\d)\]: rank \d line (\d+) ok") == {1: list(range(100))}
    assert "[rank1]: rank 1 on stderr" in done.stderr and "rank 0 on stderr" not in done.stderr
    assert sorted(os.listdir(tmp_path / "logs")) == ["pids.txt", "rank0.log", "rank1.log"]
    starts = [line.split() for line in (tmp_path / "logs" / "pids.txt").read_text().splitlines()]
    assert [rank for rank, _ in starts] == ["0", "1"] and all(pid.isdigit() for _, pid in starts)
    for rank in (0, 1):  # every line of every rank, shown or not, without the prefix
        log = (tmp_path / "logs" / f"rank{rank}.log").read_text().splitlines()
        assert f"rank {rank} on stderr" in log
        assert ranks_of([line for line in log if "on stderr" not in line]) == {rank: list(range(100))}


def test_ranks_are_parsed():
    assert parse_ranks("0") == {0} and parse_ranks("0,2") == {0, 2} and parse_ranks("0-2,5") == {0, 1, 2, 5}
    with pytest.raises(ValueError, match="--ranks must list ranks"):
        parse_ranks("a")
