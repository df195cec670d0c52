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
- ``slow``: a whole example, a long training or an installation: 15 s or more on 2 cores.

Under ``--dist loadgroup`` (pyproject.toml's addopts) the tests of a module whose fixture is
module-scoped (one world shared by several checks) go to one worker, so the world starts
once, not once per worker; slow tests are handed out first, so that no worker is left with
a long test at the end while the other is idle.
"""

from __future__ import annotations

import pytest

FAMILIES: dict[str, tuple[str, ...]] = {
    "process": (
        "tests/unit/test_docs_site.py",
        "tests/unit/test_import_graph.py::test_troupe_loads_no_torch_module_beyond_import_torch",
        "tests/unit/test_import_graph.py::test_the_command_line_starts_without_torch",
        "tests/unit/test_bench.py::test_bench_is_not_imported_by_troupe",
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
    ),
    "benchmark": (
        "tests/dist/test_bench_harness.py",
        "tests/dist/test_benchmarks_smoke.py",
        "tests/dist/test_bytes_per_step.py",
        "tests/dist/test_ps_bench.py",
        "tests/dist/test_fault_harness.py",
    ),
    "docs": ("tests/unit/test_docs_site.py",),
    "slow": (
        "tests/dist/test_checkpoint.py::test_restart_after_a_crash_matches_an_uninterrupted_run",
        "tests/dist/test_cd.py::test_the_example_pretrains_and_finetunes_to_the_bar",
        "tests/dist/test_launchers.py::test_mnist_example_reaches_accuracy",
        "tests/dist/test_examples.py::test_cifar10_resnet_memorises_a_small_synthetic_set",
        "tests/dist/test_examples.py::test_word_lm_beats_the_unigram_model",
        "tests/dist/test_server_groups.py",
        "tests/dist/test_cluster_loop.py::test_troupe_run_starts_servers_without_the_script",
        "tests/dist/test_cluster.py::test_async_worker_killed_mid_run_does_not_stop_the_others",
        "tests/dist/test_cluster.py::test_each_framework_trains_mnist",
        "tests/dist/test_cluster.py::test_half_precision_wire_to_separate_servers",
        "tests/dist/test_cluster.py::test_hogwild_master_copy_holds_every_groups_change",
        "tests/dist/test_cluster.py::test_server_checkpoint_resumes_slices_and_optimizer_state",
        "tests/dist/test_background_fetch.py",
        "tests/dist/test_cluster_topk.py::test_top_one_percent_trains_mnist",
        "tests/dist/test_install.py",
        "tests/dist/test_graph_mode.py",
        "tests/dist/test_network_faults.py",
        "tests/dist/test_fault_harness.py",
        "tests/dist/test_mpi_hosts.py",
    ),
}
"""Marker -> the test ids (or their beginnings: a file, a test's name before its parameters) it marks."""


def _families(nodeid: str) -> list[str]:
    names = [name for name, prefixes in FAMILIES.items() if nodeid.startswith(prefixes)]
    return ["dist", *names] if nodeid.startswith("tests/dist/") else names


def _shares_a_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(defs[-1].scope == "module" for defs in info.name2fixturedefs.values() if defs)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test with its families; group module-fixture modules; slow tests first."""
    for item in items:
        for name in _families(item.nodeid):
            item.add_marker(name)
        if _shares_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__ if item.module else item.nodeid))
    # A stable sort: within a rank, collection order. Every xdist worker sorts the same way.
    items.sort(key=lambda item: 0 if item.get_closest_marker("slow") else 1 if item.get_closest_marker("dist") else 2)
