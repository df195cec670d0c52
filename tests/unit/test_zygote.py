"""Ranks forked from the launcher's zygote (troupe.runtime.zygote) behave as ``python SCRIPT`` would:
argv, path, environment, session, descriptors, exit codes, signals; and they are this process's children."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from troupe.runtime import zygote

pytestmark = [pytest.mark.process, pytest.mark.skipif(not zygote.available(), reason="ranks are forked on Linux only")]

SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    deadline = time.monotonic() + 10
    while os.getppid() != int(os.environ["PARENT"]) and time.monotonic() < deadline:
        time.sleep(0.01)  # the zygote's intermediate process may not have exited yet
    print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "rank": os.environ.get("RANK"),
                      "zygote_only": os.environ.get("ONLY_IN_ZYGOTE"), "ppid": os.getppid(),
                      "leader": os.getpgid(0) == os.getpid(), "session": os.getsid(0), "tty": os.isatty(0),
                      "draw": int(np.random.randint(1 << 30)),
                      "cwd": os.getcwd(), "name": __name__}), flush=True)
    print("on stderr", file=sys.stderr)
    what = sys.argv[1]
    if what == "exit":
        sys.exit(int(sys.argv[2]))
    if what == "raise":
        raise ValueError("boom")
    if what == "sleep":
        time.sleep(60)
""")


@pytest.fixture(scope="module")
def house(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zygote")
    (folder / "script.py").write_text(SCRIPT)
    (folder / "probe_mod.py").write_text("import json, sys\nprint(json.dumps({'argv': sys.argv, 'path0': sys.path[0], "
                                         "'name': __name__}), flush=True)\n")
    z = zygote.Zygote.start({**os.environ, "ONLY_IN_ZYGOTE": "1"})
    yield z, folder
    z.close()


def run(house, *args, module=False, env=None, stdin=None):
    """Fork `script.py ARGS` (or `-m probe_mod`); returns (the process, its stdout lines, its stderr)."""
    z, folder = house
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    argv = ["probe_mod", *args] if module else [str(folder / "script.py"), *args]
    here = os.getcwd()
    os.chdir(folder)  # the rank runs in the launcher's working directory
    try:
        proc = z.spawn(argv, {**os.environ, "PARENT": str(os.getpid()), **(env or {})}, module=module,
                       stdin=stdin, stdout=out_w, stderr=err_w)
    finally:
        os.chdir(here)
        os.close(out_w)
        os.close(err_w)
    return proc, os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb")


def test_a_forked_rank_is_what_python_script_would_be(house):
    _, folder = house
    proc, out, err = run(house, "exit", "0", env={"RANK": "3"})
    assert proc.wait(30) == 0
    seen = json.loads(out.readline())
    assert seen["argv"] == [str(folder / "script.py"), "exit", "0"]
    assert seen["path0"] == str(folder) and seen["cwd"] == str(folder) and seen["name"] == "__main__"
    assert seen["rank"] == "3" and seen["zygote_only"] is None, "the rank's environment is exactly the one given"
    assert seen["ppid"] == os.getpid(), "the rank is this process's child (the subreaper), not the zygote's"
    assert seen["leader"], "the rank leads its own process group (killpg reaches its children)"
    if not seen["tty"]:  # in the launcher's session: the job is one scheduling autogroup (zygote.rank_leader)
        assert seen["session"] == os.getsid(0)
    assert err.read() == b"on stderr\n"


def test_a_rank_whose_stdin_is_a_terminal_takes_a_session_of_its_own(house):
    import pty

    leader, follower = pty.openpty()
    try:
        proc, out, _ = run(house, "exit", "0", stdin=follower)
        assert proc.wait(30) == 0
        seen = json.loads(out.readline())
    finally:
        os.close(leader)
        os.close(follower)
    assert seen["tty"] and seen["leader"]
    assert seen["session"] != os.getsid(0), "job control would stop a background group that reads its terminal"


@pytest.mark.parametrize("args, code", [(("exit", "3"), 3), (("raise",), 1)])
def test_exit_codes_are_the_scripts(house, args, code):
    proc, _, err = run(house, *args)
    assert proc.wait(30) == code
    if code == 1:
        assert b"ValueError: boom" in err.read()


def test_a_signal_reaches_the_group_and_gives_a_negative_code_and_wait_times_out(house):
    proc, out, _ = run(house, "sleep")
    json.loads(out.readline())  # it runs
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(10) == -signal.SIGKILL and proc.poll() == -signal.SIGKILL


def test_every_rank_draws_its_own_numpy_seed_and_module_mode_runs_as_dash_m(house):
    _, folder = house
    draws = {json.loads(run(house, "exit", "0")[1].readline())["draw"] for _ in range(3)}
    assert len(draws) == 3, "numpy's global generator was not seeded again after the fork"
    proc, out, _ = run(house, "a", module=True)
    assert proc.wait(30) == 0
    seen = json.loads(out.readline())
    assert seen == {"argv": [str(folder / "probe_mod.py"), "a"], "path0": str(folder), "name": "__main__"}


def test_closing_the_zygote_leaves_its_ranks_running(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    z = zygote.Zygote.start(dict(os.environ))
    proc = z.spawn([str(tmp_path / "script.py"), "sleep"], {**os.environ, "PARENT": str(os.getpid())},
                   stdout=os.open(os.devnull, os.O_WRONLY))
    z.close()
    assert z.proc.returncode == 0 and proc.poll() is None, "a rank ended with its zygote"
    proc.kill()
    assert proc.wait(10) == -signal.SIGKILL
    with pytest.raises(OSError):
        z.spawn([str(tmp_path / "script.py")], dict(os.environ))


def test_troupe_fork_0_starts_ranks_afresh(monkeypatch):
    monkeypatch.setenv(zygote.ENV_VAR, "0")
    assert not zygote.available()
    assert zygote.ZygoteSlot().shared(dict(os.environ)) is None


def test_a_job_under_troupe_run_forks_its_ranks_and_says_the_same_as_afresh(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import os, sys, torch\nprint(os.environ['RANK'], sys.argv[1:], torch.get_num_threads(), "
                      "'forked' if 'torch._dynamo' in sys.modules else 'afresh', flush=True)\n")
    outputs = []
    for fork in ("1", "0"):
        done = subprocess.run([sys.executable, "-m", "troupe", "run", "-n", "2", "--threads", "1", str(script), "x"],
                              capture_output=True, text=True, timeout=120, env={**os.environ, zygote.ENV_VAR: fork})
        assert done.returncode == 0, done.stderr
        outputs.append(sorted(done.stdout.splitlines()))
    assert outputs == [["0 ['x'] 1 forked", "1 ['x'] 1 forked"], ["0 ['x'] 1 afresh", "1 ['x'] 1 afresh"]]


def test_the_orphans_a_forked_rank_leaves_are_reaped_and_nothing_else(house, tmp_path):
    """A rank that dies before its own child: the child is re-parented to this process (the subreaper); once
    it has exited, `reap_orphans` reaps it, and never a process this process started itself."""
    z, _ = house
    script = tmp_path / "parent.py"
    script.write_text("import os, sys, time\npid = os.fork()\nif pid == 0:\n    time.sleep(0.5)\n    os._exit(0)\n"
                      "print(pid, flush=True)\nos._exit(0)\n")
    out_r, out_w = os.pipe()
    rank = z.spawn([str(script)], dict(os.environ), stdout=out_w)
    os.close(out_w)
    orphan = int(os.fdopen(out_r).readline())
    assert rank.wait(30) == 0
    deadline = time.monotonic() + 10
    reaped: list[int] = []
    while orphan not in reaped and time.monotonic() < deadline:
        time.sleep(0.1)
        reaped += zygote.reap_orphans({z.proc.pid, rank.pid})
    # (earlier tests' ranks nobody waited for are this process's unknown zombies too: reaped as well)
    assert orphan in reaped and rank.pid not in reaped and z.proc.pid not in reaped
    assert z.alive(), "the zygote (a known child) was left alone"


def test_an_elastic_launcher_forks_its_zygote_from_itself_and_a_rank_is_still_its_script(tmp_path):
    """Node 0's elastic launcher imports torch for the job's store anyway: its zygote is forked from it (no
    second interpreter importing torch). A rank is still what ``python SCRIPT`` would be: its argv and
    ``__main__``, its own traceback and exit code; the launcher's frames it was forked inside do not catch
    its exception (the launcher says "troupe run: X" of a ValueError of its own)."""
    script = tmp_path / "job.py"
    script.write_text("import os, sys\nprint(os.environ['RANK'], sys.argv[1:], __name__, 'troupe.cli' in sys.modules, "
                      "flush=True)\nif os.environ['RANK'] == '1':\n    raise ValueError('boom')\n")
    done = subprocess.run([sys.executable, "-m", "troupe", "run", "-n", "2", "--elastic", "--restarts-per-rank", "0",
                           str(script), "x"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    # forked from the launcher: its modules (troupe.cli) are there, as a zygote started afresh's are not
    assert sorted(done.stdout.splitlines()) == ["0 ['x'] __main__ True", "1 ['x'] __main__ True"]
    assert 'job.py", line 4, in <module>' in done.stderr and "ValueError: boom" in done.stderr
    assert "During handling" not in done.stderr and "troupe run: boom" not in done.stderr
    assert "troupe run: rank 1 exited with code 1" in done.stderr


def test_a_module_the_zygote_imported_already_runs_as_main_without_runpy_s_warning(tmp_path, monkeypatch):
    """A zygote forked from its launcher may hold the rank's module already (a server's troupe.cluster.bootstrap):
    `run_rank` runs it as __main__ again, as `python -m` would, and says nothing about it on the rank's stderr."""
    import importlib
    import warnings

    (tmp_path / "already_here").mkdir()
    (tmp_path / "already_here" / "__init__.py").write_text("")
    (tmp_path / "already_here" / "job.py").write_text("import sys\nRAN_AS = __name__\nsys.modules['__main__'].ran = RAN_AS\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    importlib.import_module("already_here.job")  # what the launcher had imported before forking
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zygote.run_rank({"module": True, "argv": ["already_here.job"]})
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]
    monkeypatch.delitem(sys.modules, "already_here.job")
    monkeypatch.delitem(sys.modules, "already_here")
