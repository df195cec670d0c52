"""The suite's own pytest-xdist scheduler (tests/conftest.py) when workers die: a test whose worker is killed
once runs again and passes; one that kills its worker every time is reported failed after its second death;
the run ends either way (xdist 3.8's LoadScopeScheduling hung, or raised KeyError, once two workers had died)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.process]

CONFTEST = '''
import sys
sys.path.insert(0, {root!r})
from tests.conftest import pytest_xdist_make_scheduler, pytest_testnodedown  # noqa: F401
'''

TESTS = '''
import os, signal, time
from pathlib import Path
import pytest

@pytest.mark.parametrize("i", range(6))
def test_quick(i):
    time.sleep(0.2)

@pytest.mark.parametrize("name", ["once", "again", "always"])
def test_dies(name, tmp_path_factory):
    mark = Path({marks!r}) / name
    time.sleep(0.5)
    if not mark.exists() or name == "always":
        mark.write_text("died")
        os.kill(os.getpid(), signal.SIGKILL)
'''


def test_killed_workers_rerun_their_test_once_and_the_run_ends(tmp_path):
    root = Path(__file__).resolve().parents[2]
    marks = tmp_path / "marks"
    marks.mkdir()
    (tmp_path / "conftest.py").write_text(CONFTEST.format(root=str(root)))
    (tmp_path / "test_dying.py").write_text(TESTS.format(marks=str(marks)))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "3", "-p", "no:cacheprovider",
                          "-p", "no:randomly", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "1 failed, 8 passed" in out, out
    assert "FAILED test_dying.py::test_dies[always]" in out, out
    assert out.count("it runs once more") == 3, out  # once, again and always died once each before a rerun
    assert "ended with signal 9" in out, out
