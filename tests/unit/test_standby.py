"""The standby's rules without processes: which groups can go on without node 0, which keys are mirrored."""

from __future__ import annotations

from troupe.launcher.standby import groups_without_node_0
from troupe.runtime.failover import _DECISION
from troupe.runtime.quorum import ElasticOptions, round_key


def test_groups_without_node_0_leave_out_every_group_with_a_process_there():
    one = ElasticOptions(groups=4, min_groups=2)
    assert groups_without_node_0(one, nproc=2, nnodes=2) == {2, 3}
    assert groups_without_node_0(one, nproc=1, nnodes=4) == {1, 2, 3}
    pairs = ElasticOptions(groups=3, group_size=2, min_groups=2)
    assert groups_without_node_0(pairs, nproc=2, nnodes=3) == {1, 2}


def test_only_a_round_s_decision_is_mirrored():
    assert _DECISION.search(round_key(12, 345, "d"))
    assert _DECISION.search("troupe/tok/" + round_key(1, 1, "d"))
    for key in (round_key(1, 1, "n"), round_key(1, 1, "bad"), "latest", "proposal", "ready/3", "heal/2/r0/0",
                "pg/1/r0/d", "xq1/r1/d"):
        assert not _DECISION.search(key), key
