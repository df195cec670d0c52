"""Distributed Hogwild answers the other groups on one pair of sync channels per process: a second
DistOpt there would take the first one's requests and hang the job at a sync, so it is refused."""

from __future__ import annotations

import pytest
import torch

from tests.dist.world import RankFailed, run_world
from troupe.cluster.configuration.config import ClusterConfig


def two_distopts(rank: int, world_size: int):
    import troupe

    model = torch.nn.Linear(4, 2)
    troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1))
    troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.timeout(120)
def test_a_second_distopt_under_hogwild_is_refused_not_hung():
    cluster = ClusterConfig(nworker_groups=2, nserver_groups=2)
    with pytest.raises(RankFailed, match="one DistOpt per process"):
        run_world(two_distopts, 2, timeout=60, env={"TROUPE_CLUSTER": cluster.to_json()})
