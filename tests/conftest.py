"""The suite's families as pytest markers, and the order pytest-xdist hands tests out in.

    make test                                   everything (2 pytest workers)
    make test-fast                              tests/unit without the ones that start a process
    pytest -m "not slow and not netns"          skip whole examples and simulated hosts
    pytest -m mpi                               only what runs under mpiexec

Markers (registered in pyproject.toml) are given here by test id, in one table, so a test
file names no family and a family can be read in one place:

- ``dist``: a real multi-process world (everything under tests/dist).
- ``process``: a tests/unit test that starts a process (a fresh interpreter, Chromium).
- ``netns``: simulated hosts (network namespaces: root, one set at a time).
- ``mpi``: mpiexec and mpi4py.
- ``benchmark``: a benchmark script run in a tiny configuration (the harness, not the timing).
- ``docs``: builds the documentation site.
- ``slow``: 15 s or more on 2 cores (measured under ``make test``): a whole example trained to its
  bar, a job under a launcher, an installation.

Under ``-n N`` the tests of a module whose fixture is module-scoped (one world shared by
several checks) go to one worker, so the world starts once, not once per worker; slow tests
are handed out first, so that no worker is left with a long test at the end while the other
is idle.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

FAMILIES: dict[str, tuple[str, ...]] = {
    "process": (
        "tests/unit/test_docs_site.py",
        "tests/unit/test_import_graph.py::test_troupe_loads_no_torch_module_beyond_import_torch",
        "tests/unit/test_import_graph.py::test_the_command_line_starts_without_torch",
        "tests/unit/test_bench.py::test_bench_is_not_imported_by_troupe",
        "tests/unit/test_zygote.py",
        "tests/unit/test_forkserver.py",
        "tests/unit/test_suite_scheduler.py",
        "tests/unit/test_shard_layout.py::test_troupe_run_refuses_shard_with_elastic_or_a_framework",
    ),
    "netns": (
        "tests/dist/test_fault_harness.py",
        "tests/dist/test_network_faults.py",
        "tests/dist/test_mpi_hosts.py",
        "tests/dist/test_bench_harness.py::test_throughput_benchmark_runs_on_loopback_and_simulated_hosts",
        "tests/dist/test_bytes_per_step.py::test_veth_agrees_with_the_counters_on_simulated_hosts",
    ),
    "mpi": (
        "tests/dist/test_mpi_hosts.py",
        "tests/dist/test_launchers.py::test_mpiexec",
        "tests/dist/test_conformance_matrix.py",
    ),
    "benchmark": (
        "tests/dist/test_bench_harness.py",
        "tests/dist/test_benchmarks_smoke.py",
        "tests/dist/test_bytes_per_step.py",
        "tests/dist/test_ps_bench.py",
        "tests/dist/test_fault_harness.py",
        "tests/dist/test_conformance_matrix.py",
    ),
    "docs": ("tests/unit/test_docs_site.py",),
    "slow": (  # a subprocess per rank (each imports torch), or an example trained to its bar
        "tests/dist/test_conformance_matrix.py",
        "tests/dist/test_checkpoint.py::test_restart_after_a_crash_matches_an_uninterrupted_run",
        "tests/dist/test_bytes_per_step.py",
        "tests/dist/test_ps_bench.py::test_ps_benchmark_times_ddp_and_a_parameter_server",
        "tests/dist/test_partition_example.py",
        "tests/dist/test_launchers.py::test_mnist_example_reaches_accuracy",
        "tests/dist/test_launchers.py::test_ticket_multiprocessing",
        "tests/dist/test_faults.py::test_hung_peer_gets_stall_reports_then_a_named_timeout",
        "tests/dist/test_faults.py::test_silent_peer_is_declared_dead_after_peer_timeout",
        "tests/dist/test_mpi_hosts.py",
        "tests/dist/test_cd.py::test_the_example_pretrains_and_finetunes_to_the_bar",
        "tests/dist/test_checkpoint_reshard.py::test_four_ranks_write_once_and_resume_on_three_two_and_one",
        "tests/dist/test_cluster.py::test_async_worker_killed_mid_run_does_not_stop_the_others",
        "tests/dist/test_server_groups.py::test_mnist_example_trains_under_two_separate_server_groups",
        "tests/dist/test_bench_harness.py::test_throughput_benchmark_runs_on_loopback_and_simulated_hosts",
        "tests/dist/test_cluster_loop.py::test_troupe_run_starts_servers_without_the_script",
        "tests/dist/test_bad_input.py::test_world_size_larger_than_processes_started",
        "tests/dist/test_examples.py::test_cifar10_resnet_memorises_a_small_synthetic_set",
        "tests/dist/test_examples.py::test_word_lm_beats_the_unigram_model",
        "tests/dist/test_observability.py::test_tensorboard_alone_writes_every_steps_scalars_per_rank",
        "tests/dist/test_benchmarks_smoke.py::test_ddp_vs_troupe_prints_its_table",
        "tests/dist/test_network_faults.py",
        "tests/dist/test_bucket_view.py",
    "tests/dist/test_checkpoint_shard.py",
    "tests/dist/test_fsdp_shard.py",
        "tests/dist/test_graph_mode.py",
        "tests/dist/test_install.py",
    ),
}
"""Marker -> the test ids (or their beginnings: a file, a test's name before its parameters) it marks."""


def _families(nodeid: str) -> list[str]:
    names = [name for name, prefixes in FAMILIES.items() if nodeid.startswith(prefixes)]
    return ["dist", *names] if nodeid.startswith("tests/dist/") else names


SHARED_WORLDS = (
    "tests/dist/test_bucket_view.py",
    "tests/dist/test_checkpoint_shard.py",
    "tests/dist/test_fsdp_shard.py",
        "tests/dist/test_graph_mode.py",
    "tests/dist/test_install.py",
    "tests/dist/test_native_loop.py",
    "tests/dist/test_network_faults.py",
    "tests/dist/test_options.py",
    "tests/dist/test_shard_zero.py",
    "tests/unit/test_docs_site.py",
    "tests/unit/test_partition.py",
    "tests/unit/test_zygote.py",
)
"""The modules whose tests share a module-scoped fixture (a world, an installation, the site): under
-n N their tests go to one worker, which builds the fixture once. A module that gains such a
fixture must be listed (collection fails until it is)."""


def _shares_a_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(defs[-1].scope == "module" for defs in info.name2fixturedefs.values() if defs)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test with its families; check SHARED_WORLDS; slow tests first."""
    for item in items:
        for name in _families(item.nodeid):
            item.add_marker(name)
        module = item.nodeid.split("::")[0]
        if _shares_a_module_fixture(item) and module not in SHARED_WORLDS:
            raise pytest.UsageError(f"{module} shares a module-scoped fixture: add it to SHARED_WORLDS "
                                    "in tests/conftest.py")
    # A stable sort: otherwise collection order. Every xdist worker sorts the same way.
    items.sort(key=lambda item: 0 if item.get_closest_marker("slow") else 1 if item.get_closest_marker("dist") else 2)


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Load scheduling, but one work unit per SHARED_WORLDS module (pytest-xdist's own loadgroup
    cannot group under pytest 9: it renames `item._nodeid`, which pytest no longer reads), and one for
    all the netns tests: simulated hosts exist one set at a time (a file lock), so on several workers
    they took turns while holding a worker each (the throughput harness's test took 20 s in one run of
    the suite and 89 s in another)."""
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

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            if nodeid.startswith(FAMILIES["netns"]):
                return "netns"
            return module if module in SHARED_WORLDS else nodeid

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
