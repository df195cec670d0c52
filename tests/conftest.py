"""The suite's families as pytest markers, and the order pytest-xdist hands tests out in.

    make test                                   everything (2 pytest workers)
    make test-fast                              tests/unit without the ones that start a process
    pytest -m "not slow and not netns"          skip whole examples and simulated hosts
    pytest -m mpi                               only what runs under mpiexec

Markers (registered in pyproject.toml) are declared on the tests themselves (``pytestmark`` for a
module, ``@pytest.mark.slow`` on a function); only ``dist`` is given here, by folder:

- ``dist``: a real multi-process world (everything under tests/dist).
- ``process``: a tests/unit test that starts a process (a fresh interpreter, Chromium).
- ``netns``: simulated hosts (network namespaces: root, one set at a time).
- ``mpi``: mpiexec and mpi4py.
- ``benchmark``: a benchmark script run in a tiny configuration (the harness, not the timing).
- ``docs``: builds the documentation site.
- ``slow``: 15 s or more on 2 cores (measured under ``make test``): a whole example trained to its
  bar, a job under a launcher, an installation.

Under ``-n N`` the tests of a module whose fixture is module-scoped (one world shared by
several checks) go to one worker, so the world starts once, not once per worker, and all the
``netns`` tests go to one worker; slow tests are handed out first, so that no worker is left
with a long test at the end while the other is idle.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

DIST = Path(__file__).resolve().parent / "dist"
"""Every test under this folder is marked ``dist``."""

UNITS = "troupe_units"
"""The key, in a pytest-xdist worker's `workerinput`, of the file where the worker writes the tests that share a
work unit (`_units`): the controller's scheduler sees only test ids, the workers see fixtures and markers."""


def _shares_a_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(defs[-1].scope == "module" for defs in info.name2fixturedefs.values() if defs)


def _units(items: list[pytest.Item]) -> dict[str, str]:
    """Test id -> the work unit it shares with others: "netns" for every simulated-hosts test (one set of hosts at
    a time), else its module when a test of the module uses a module-scoped fixture (one world, installation or
    site, built once). Tests not named here are a unit each."""
    shared = {item.nodeid.split("::")[0] for item in items if _shares_a_module_fixture(item)}
    units = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        if item.get_closest_marker("netns"):
            units[item.nodeid] = "netns"
        elif module in shared:
            units[item.nodeid] = module
    return units


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests under tests/dist ``dist``; tell the controller's scheduler the work units; slow tests first."""
    for item in items:
        if DIST in item.path.parents:
            item.add_marker("dist")
    # A stable sort: otherwise collection order. Every xdist worker sorts the same way.
    items.sort(key=lambda item: 0 if item.get_closest_marker("slow") else 1 if item.get_closest_marker("dist") else 2)
    path = getattr(config, "workerinput", {}).get(UNITS)
    if path:  # every worker collects the same tests: each writes the same file, whole (a rename)
        Path(f"{path}.{os.getpid()}").write_text(json.dumps(_units(items)))
        os.replace(f"{path}.{os.getpid()}", path)


def _units_file() -> Path:
    return Path(f"/tmp/troupe-test-units-{os.getpid()}.json")


def pytest_configure_node(node) -> None:
    """On the controller, before a pytest-xdist worker starts: where it writes the work units."""
    node.workerinput[UNITS] = str(_units_file())


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Load scheduling, but one work unit per module whose tests share a module-scoped fixture (pytest-xdist's
    own loadgroup cannot group under pytest 9: it renames `item._nodeid`, which pytest no longer reads), and one
    for all the netns tests (the workers tell which: `_units`): simulated hosts exist one set at a time (a file
    lock), so on several workers they took turns while holding a worker each (the throughput harness's test took
    20 s in one run of the suite and 89 s in another)."""
    if config.getvalue("dist") != "load":  # an explicit --dist loadfile, loadscope, ... as asked
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedWorldScheduling(LoadScopeScheduling):
        """pytest-xdist's LoadScopeScheduling, safe when a worker dies: its replacement is handed work only
        once it has collected (xdist 3.8 raised KeyError, or waited forever, when a second worker died
        before the first's replacement had collected), and the test a dead worker was running runs once
        more on another worker before it is reported failed (a worker killed from outside, which no test
        of ours should do, costs a rerun; a test that kills its worker fails as before)."""

        def __init__(self, config, log=None):
            super().__init__(config, log)
            self.crashes: dict[str, int] = {}
            self.units: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.units is None:  # read once, when every worker has collected (so written its units)
                written = _units_file()
                self.units = json.loads(written.read_text()) if written.exists() else {}
            return self.units.get(nodeid, nodeid)

        def _reschedule(self, node) -> None:
            """Top the node up to two pending tests (a worker runs a test once it knows the next one, or
            that there is none: then it is told to shut down). A node that has not collected yet is left to
            `schedule()`, which comes once it has."""
            if node not in self.registered_collections or node.shutting_down:
                return
            while self.workqueue and self._pending_of(self.assigned_work[node]) < 2:
                self._assign_work_unit(node)
            if not self.workqueue:
                node.shutdown()

        def remove_node(self, node):
            """xdist's, but a dead worker's finished units are not handed out again (xdist requeued them:
            workers were sent empty units)."""
            workload = self.assigned_work.pop(node)
            pending = {scope: unit for scope, unit in workload.items() if not all(unit.values())}
            if not pending:
                return None
            crashitem = next(nodeid for unit in pending.values() for nodeid, done in unit.items() if not done)
            self.crashes[crashitem] = self.crashes.get(crashitem, 0) + 1
            if self.crashes[crashitem] > 1:  # its second death: reported, not run again
                for unit in pending.values():
                    unit.pop(crashitem, None)
                pending = {scope: unit for scope, unit in pending.items() if not all(unit.values())}
            self.workqueue.update(pending)
            for other in self.assigned_work:
                self._reschedule(other)
            if self.crashes[crashitem] == 1:
                print(f"\nconftest: worker {node.gateway.id} died under {crashitem}: it runs once more",
                      file=sys.stderr, flush=True)
                return None
            return crashitem

    return SharedWorldScheduling(config, log)


def pytest_testnodedown(node, error) -> None:
    """On the controller, when a worker ends: if it died, how (its exit status) and the last tests it
    started (tests/conftest.py's trace, `pytest_runtest_logstart`), so that a death is never silent."""
    if not error:
        return
    popen = getattr(getattr(getattr(node, "gateway", None), "_io", None), "popen", None)
    code = None
    if popen is not None:
        try:
            code = popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = "still running"
    pid = getattr(popen, "pid", None)
    how = f"signal {-code}" if isinstance(code, int) and code < 0 else f"exit status {code}"
    trace = Path(f"/tmp/troupe-test-trace-{pid}.txt")
    last = trace.read_text().splitlines()[-4:] if trace.exists() else []
    trace.unlink(missing_ok=True)
    print(f"\nconftest: worker {node.gateway.id} (pid {pid}) ended with {how} ({error}); its last tests "
          f"started: {last}", file=sys.stderr, flush=True)


def pytest_runtest_logstart(nodeid: str, location) -> None:
    """In a pytest-xdist worker: one line per test it starts, for `pytest_testnodedown` to quote."""
    if _TRACE:
        _TRACE[0].write(f"{time.strftime('%H:%M:%S')} {nodeid}\n")
        _TRACE[0].flush()


_TRACE: list = []


class ForkServer:
    """The pytest worker's `troupe fork-server`: its process, socket and log (a line per launcher it forked)."""

    def __init__(self, proc: subprocess.Popen, path: Path, log: Path):
        self.proc, self.path, self.log = proc, path, log


FORK_SERVER = "TROUPE_TEST_FORK_SERVER"
"""TROUPE_TEST_FORK_SERVER=0: every `troupe run` a test starts starts its launcher afresh (as a user's does)."""
_SERVER: list[ForkServer] = []


def pytest_configure(config: pytest.Config) -> None:
    """One `troupe fork-server` per process that runs tests (each pytest-xdist worker, or pytest itself without
    -n), named in TROUPE_FORK_SERVER before any test module is imported (several build their subprocesses'
    environment at import): each `troupe run` a test starts forks its launcher from it, torch already imported,
    instead of importing torch in a zygote of its own (2 s of CPU less per job here, for about 125 jobs). A launcher
    that cannot be forked so (another Python, another PYTHON* variable, another namespace: a simulated host)
    starts afresh, as without the server."""
    from troupe.runtime.forkserver import ENV_VAR

    if hasattr(config, "workerinput"):
        _TRACE.append(open(f"/tmp/troupe-test-trace-{os.getpid()}.txt", "w"))
    controller = getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput")
    if controller or os.environ.get(FORK_SERVER, "1") == "0" or not sys.platform.startswith("linux") \
            or os.environ.get(ENV_VAR):
        return
    worker = getattr(config, "workerinput", {}).get("workerid", "main")
    path = Path(f"/tmp/troupe-test-{os.getpid()}.sock")
    path.unlink(missing_ok=True)
    log = Path(f"/tmp/troupe-test-{os.getpid()}.log")
    # torch loads in the server with the C++ logging troupe run gives its ranks, and without OMP_NUM_THREADS
    # (each rank sets its own threads as it starts)
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "-m", "troupe", "fork-server", str(path)], env=env,
                                  stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                  preexec_fn=_ends_with_parent)
    deadline = time.monotonic() + 30
    while not path.exists() and server.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # it listens before it imports: clients wait in its backlog
    if server.poll() is not None or not path.exists():
        print(f"conftest ({worker}): the fork server did not start; launchers start afresh", file=sys.stderr)
        server.kill()
        return
    os.environ[ENV_VAR] = str(path)
    _SERVER.append(ForkServer(server, path, log))


def _ends_with_parent() -> None:
    """In the fork server before it starts: SIGTERM when this pytest process ends, whichever way (a pytest-xdist
    worker may leave without pytest_unconfigure), so that no server outlives its tests."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


def pytest_unconfigure(config: pytest.Config) -> None:
    from troupe.runtime.forkserver import ENV_VAR

    _units_file().unlink(missing_ok=True)
    while _TRACE:
        trace = _TRACE.pop()
        trace.close()
        Path(trace.name).unlink(missing_ok=True)

    while _SERVER:
        served = _SERVER.pop()
        os.environ.pop(ENV_VAR, None)
        served.proc.terminate()
        try:
            served.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            served.proc.kill()
        served.path.unlink(missing_ok=True)
        served.log.unlink(missing_ok=True)


@pytest.fixture
def fork_server() -> ForkServer | None:
    """This pytest process's fork server (None: launchers start afresh here)."""
    return _SERVER[0] if _SERVER else None


CPU_LOG = "TROUPE_TEST_CPU"
"""TROUPE_TEST_CPU=FILE: each test's CPU seconds (all of its processes, however started) and wall seconds, a line
per test appended to FILE (``cpu<TAB>wall<TAB>nodeid``). The CPU of a test is robust to the machine's load where its
wall time is not: the suite's budget on 2 cores is 2 x its wall-time goal."""
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _descendants_cpu() -> float:
    """CPU seconds of this process and of every live process below it, each with its reaped children's: what a
    test's processes used lands here whichever way they were started (fork servers, launchers, namespaces, mpiexec),
    as each reaps its children."""
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(entry)] = int(fields[1])
        ticks[int(entry)] = sum(int(v) for v in fields[11:15])  # utime stime cutime cstime
    mine, total, frontier = {os.getpid()}, 0, [os.getpid()]
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    while frontier:
        pid = frontier.pop()
        total += ticks.get(pid, 0)
        for child in children.get(pid, []):
            if child not in mine:
                mine.add(child)
                frontier.append(child)
    return total / _TICK


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    path = os.environ.get(CPU_LOG)
    if not path or not sys.platform.startswith("linux"):
        yield
        return
    cpu, wall = _descendants_cpu(), time.monotonic()
    yield
    cpu, wall = _descendants_cpu() - cpu, time.monotonic() - wall
    with open(path, "a") as out:
        out.write(f"{cpu:.2f}\t{wall:.2f}\t{item.nodeid}\n")
