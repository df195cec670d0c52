"""The one table of regimes (troupe.strategies.registry): names, SINGA's methods, capabilities, errors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from troupe.cluster import regimes as _cluster_regimes  # noqa: F401  (registers them, as DistOpt does)
from troupe.cluster.workers import PS_WORKER_STATE
from troupe.cluster.configuration.config import ClusterConfig
from troupe.strategies import registry
from troupe.strategies.choice import DistOption
from troupe.strategies.registry import REGIMES, Capabilities, register

SINGA = {
    "plain": "backward_and_update",
    "fp32": "backward_and_update",
    "fp16": "backward_and_update_half",
    "bf16": "backward_and_update_half",
    "partialUpdate": "backward_and_partial_update",
    "sparseTopK": "backward_and_sparse_update",
    "sparseThreshold": "backward_and_sparse_update",
}
"""SINGA's dist_option names and the DistOpt method each calls (its opt.py)."""


def test_the_table_holds_singas_dist_options_and_the_cluster_worker_kinds():
    assert registry.dist_options() == {**SINGA, "powerSGD": "backward_and_powerSGD_update",  # troupe's own
                                       "fsdp": "backward_and_update"}  # troupe.shard's model picks it
    assert registry.graph_options() == ("plain", "fp32", "fp16", "bf16")
    assert sorted(n for n, r in REGIMES.items() if r.kind == "cluster") == \
        ["co-located", "co-located-sharded", "diloco", "elastic-diloco", "in-memory-hogwild", "ps-client"]
    assert registry.lookup("fp32") is registry.lookup("plain")
    assert registry.lookup("bf16").fixed_args == {"dtype": "bf16"}


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown dist_option 'sparse'; choose one of \['bf16', 'fp16'"):
        registry.lookup("sparse")
    with pytest.raises(ValueError, match="unknown dist_option 'ps-client'"):
        registry.lookup("ps-client")  # a cluster regime is not a dist_option
    with pytest.raises(ValueError, match=r"unknown cluster regime 'plain'; choose one of \['co-located'"):
        registry.lookup("plain", "cluster")


def test_a_name_is_taken_once():
    class Again(DistOption):
        name = "fp16"

    with pytest.raises(ValueError, match="regime name 'fp16' is already taken by Half"):
        register(Again)
    assert REGIMES["fp16"].__name__ == "Half"


def test_method_args_keep_what_the_builder_takes():
    assert registry.lookup("plain").method_args(spars=0.1) == {}
    assert registry.lookup("sparseTopK").method_args(spars=0.1) == {"topK": True, "spars": 0.1}
    assert registry.lookup("sparseThreshold").method_args(spars=None) == {"topK": False}
    assert registry.lookup("bf16").method_args(spars=0.1) == {"dtype": "bf16"}


def test_capabilities_are_declared():
    assert registry.lookup("partialUpdate").supports.partition is False
    assert registry.lookup("sparseTopK").supports == Capabilities(elastic=True)
    assert registry.lookup("partialUpdate").supports.elastic is True  # its step runs ahead of the vote
    assert registry.lookup("ps-client", "cluster").supports.elastic is False
    for name in ("ps-client", "co-located", "in-memory-hogwild"):
        caps = registry.lookup(name, "cluster").supports
        assert not (caps.add_param_group or caps.graph_mode or caps.join or caps.per_call)


@pytest.mark.parametrize("framework, regime", [("sandblaster", "ps-client"), ("downpour", "ps-client"),
                                               ("allreduce", "co-located"), ("hogwild", "co-located")])
def test_each_framework_resolves_to_its_worker_regime(framework, regime):
    from troupe.cluster.configuration.presets import preset

    cluster = preset(framework)
    assert registry.resolve("plain", cluster).name == regime
    assert registry.resolve("fp32", cluster).name == regime
    assert registry.resolve("plain", None).name == "plain"


def test_in_memory_hogwild_resolves_to_its_regime():
    cluster = ClusterConfig(nworker_groups=2, nworkers_per_procs=2, share_memory=True)
    assert registry.resolve("plain", cluster).name == "in-memory-hogwild"


@pytest.mark.parametrize("option, alternative", [
    ("fp16", "wire_dtype: fp16 .troupe run --wire-dtype fp16"),
    ("bf16", "wire_dtype: bf16"),
    ("sparseTopK", "wire_topk: 0.01 .troupe run --wire-topk 0.01"),
    ("sparseThreshold", "--wire-topk"),
    ("partialUpdate", "--sync-freq"),
])
def test_an_option_a_cluster_cannot_run_names_what_does_it_there(option, alternative):
    cluster = SimpleNamespace(worker_regime="ps-client")
    with pytest.raises(ValueError, match=f"dist_option '{option}' is not available under a parameter-server "
                                         f"cluster: use 'plain'.*{alternative}"):
        registry.resolve(option, cluster)


def test_cluster_workers_say_why_their_state_is_per_rank():
    assert "parameter-server worker" in PS_WORKER_STATE


def test_what_a_cluster_worker_refuses_and_what_it_runs_plainly():
    from troupe.strategies.choice import Fixed

    strategy = SimpleNamespace(reducer=None, per_rank_state=lambda: [PS_WORKER_STATE])
    fixed = Fixed(registry.lookup("ps-client", "cluster"), strategy)
    with pytest.raises(ValueError, match="add_param_group is not available under a parameter-server cluster"):
        fixed.add_params([])
    with pytest.raises(ValueError, match="graph mode reduces every gradient among all ranks: not available under "
                                         "a parameter-server cluster"):
        fixed.require("graph_mode")
    fixed.require("join")  # join()'s block runs, without shadowing
    assert not fixed.shadows_joins and not fixed.owns_reducer
    assert fixed.per_rank_state() == [PS_WORKER_STATE]
    with pytest.raises(ValueError, match="dist_option 'fp16' is not available"):
        fixed.select("fp16")
    assert fixed.select("fp32") is strategy
