"""A co-located worker's slices with a partitioned model (`troupe.cluster.workers.colocated.colocated_slices`)."""

from __future__ import annotations

from troupe.cluster.serving.shard import Slice, plan_slices
from troupe.cluster.workers.colocated import colocated_slices


def test_replicated_parameters_are_cut_over_the_servers_and_own_ones_stay_whole_on_this_worker():
    slices = colocated_slices([6, 4, 5], [False, True, False], nservers=2, index=1)
    assert slices == [
        Slice(0, 0, 0, 5, 0),  # the replicated parameters 0 and 2 (11 elements) cut 5 + 6
        Slice(1, 0, 5, 6, 1),
        Slice(2, 2, 0, 5, 1),
        Slice(3, 1, 0, 4, 1),  # parameter 1 only this worker holds: whole, on its own server
    ]


def test_without_partition_it_is_the_plain_plan():
    numels = [7, 3, 9, 1]
    assert colocated_slices(numels, [False] * 4, nservers=3, index=2) == plan_slices(numels, 3)


def test_every_parameter_partitioned_leaves_nothing_to_share():
    assert colocated_slices([4, 2], [True, True], nservers=2, index=0) == [Slice(0, 0, 0, 4, 0), Slice(1, 1, 0, 2, 0)]


def test_replicated_slices_agree_across_the_group():
    # worker 0 holds a dim -1 layer (parameter 1) that worker 1 lacks; their replicated slices are the same
    w0 = colocated_slices([8, 3, 8], [False, True, False], nservers=2, index=0)
    w1 = colocated_slices([8, 8], [False, False], nservers=2, index=1)
    shared0 = [(s.id, s.start, s.stop, s.server) for s in w0 if s.param != 1]
    shared1 = [(s.id, s.start, s.stop, s.server) for s in w1]
    assert shared0 == shared1
