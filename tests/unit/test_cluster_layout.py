"""A partitioned model under parameter servers, without processes: the job parameters the
servers hold (`troupe.cluster.workers.layout`), the shard's holders and scaling, the cluster field."""

from __future__ import annotations

import pytest
import torch

from troupe.cluster.configuration.config import ClusterConfig
from troupe.cluster.configuration.sources import parse_cluster_text
from troupe.cluster.workers.layout import build, entries
from troupe.cluster.serving.shard import ParamShard, plan_slices
from troupe.cluster.configuration.spec import TrainingSpec

# Worker j of a 2-worker group: a replicated (5, g0), its own slice (6, g0), a replicated (3, g1);
# worker 0 also holds a dim -1 layer (4, g1).
W0 = [(5, 0, None), (6, 0, 0), (4, 1, 0), (3, 1, None)]
W1 = [(5, 0, None), (6, 0, 1), (3, 1, None)]


def test_job_parameters_are_worker_0s_then_the_others_own_slices():
    lay0 = build([W0, W1, W0, W1], k=2, me=0)
    lay3 = build([W0, W1, W0, W1], k=2, me=3)
    assert lay0.numels == (5, 6, 4, 3, 6)
    assert lay0.param_group_of == (0, 0, 1, 1, 0)
    assert lay0.owners == (None, 0, 0, None, 1)
    assert lay0.local == (0, 1, 2, 3)
    assert lay3.local == (0, 4, 3)  # worker 1 of group 1: the replicated ones and worker 1's slice
    assert lay3 == build([W0, W1, W0, W1], k=2, me=1)


def test_nothing_partitioned_keeps_each_workers_own_list():
    plain = [(5, 0, None), (3, 1, None)]
    lay = build([plain, plain], k=2, me=1)
    assert not lay.partitioned and lay.owners == () and lay.local == (0, 1) and lay.numels == (5, 3)


@pytest.mark.parametrize("every, match", [
    ([W0, [(5, 0, None), (6, 0, 0), (3, 1, None)]], "holds parameters of worker"),  # worker 1 with worker 0's slice
    ([W0, [(5, 0, None), (7, 0, 1), (3, 1, None)], W0, W1], "differ from those of worker 1 of group 0"),
    ([W0, [(9, 0, None), (6, 0, 1), (3, 1, None)]], "replicated parameters differ"),
])
def test_workers_whose_models_do_not_fit_together_are_refused(every, match):
    with pytest.raises(ValueError, match=match):
        build(every, k=2, me=0)


def test_entries_read_the_partitioners_holder_labels():
    a, b, c = torch.zeros(2), torch.zeros(3), torch.zeros(4)
    a._troupe_holders = (0, 1, 2, 3)  # everyone
    b._troupe_holders = (1, 3)  # worker 1 of each of two groups
    assert entries([a, b, c], [0, 0, 1], k=2, nworkers=4) == [(2, 0, None), (3, 0, 1), (4, 1, None)]


def test_shard_waits_for_a_partitioned_slices_holder_only_and_scales_by_the_group():
    # slice 0: replicated, sent by workers 0 and 1; slice 1: worker 1's own, its gradient sums the group's two
    slices = plan_slices([2, 2], 1)
    opt = torch.optim.SGD([torch.zeros(1)], lr=1.0)
    shard = ParamShard(slices, opt, [0, 0], {0: {0, 1}}, owners={0: None, 1: 1}, position={0: 0, 1: 1},
                       group_size=2)
    for s in slices:
        shard.put(s.id, torch.zeros(2))
    assert shard.holds(0, 0) and shard.holds(1, 0) and shard.holds(1, 1) and not shard.holds(0, 1)
    assert shard.update(1, 1, torch.tensor([4.0, 8.0])) == [1]  # complete with its one holder
    torch.testing.assert_close(shard.values[1], torch.tensor([-2.0, -4.0]))  # lr 1 x grad / k
    assert shard.update(0, 0, torch.tensor([1.0, 1.0])) == []
    assert shard.missing() == {(0, 0): {1}}
    assert shard.update(0, 1, torch.tensor([3.0, 3.0])) == [0, 1]
    torch.testing.assert_close(shard.values[0], torch.tensor([-2.0, -2.0]))  # the mean of the two


def test_training_spec_carries_owners_through_json():
    opt = torch.optim.SGD([torch.zeros(5)], lr=0.1)
    spec = TrainingSpec.from_optimizer(opt, [torch.zeros(5)], [0])
    spec = TrainingSpec((5, 6), spec.dtype, (0, 0), spec.optimizer, (None, 1))
    back = TrainingSpec.from_json(spec.to_json())
    assert back.owners == (None, 1) and back.owner(1) == 1
    assert TrainingSpec.from_json(TrainingSpec((5,), spec.dtype, (0,), spec.optimizer).to_json()).owner(0) is None


def test_partition_dim_in_the_cluster_block_and_toml():
    block = "cluster {\n nworkers_per_group: 2\n server_worker_separate: true\n partition_dim: -1\n}"
    assert parse_cluster_text(block).partition_dim == -1
    toml = '[cluster]\nnworkers_per_group = 2\nserver_worker_separate = true\n[cluster.partition_dim]\n"conv*" = 0\n"fc*" = 1\n'
    cfg = parse_cluster_text(toml)
    assert cfg.partition_dim == {"conv*": 0, "fc*": 1}
    assert ClusterConfig.from_json(cfg.to_json()) == cfg
    for bad in (2, True, {"fc*": 3}, {}, "hybrid"):
        with pytest.raises(ValueError, match="partition_dim"):
            ClusterConfig(partition_dim=bad)
