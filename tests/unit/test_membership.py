"""The three memberships implement one protocol (runtime/membership.py): every member the World, DistOpt and the
strategies read is declared there, and a kind with nothing to do gets the protocol's default."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

from troupe.runtime.elastic import Elastic, Fixed
from troupe.runtime.membership import Membership
from troupe.runtime.rejoin import Rejoining, place_key

MEMBERS = sorted(set(Membership.__annotations__)
                 | {n for n, v in vars(Membership).items() if inspect.isfunction(v) and not n.startswith("_")})


def test_the_protocol_declares_what_the_world_and_the_strategies_read():
    assert MEMBERS == sorted(["advance", "builds_together", "close", "constant_batch", "data_place", "elastic",
                              "heal_bytes", "heals", "incarnation", "lost", "track", "track_by_default", "vote"])


@pytest.mark.parametrize("kind", [Fixed, Elastic, Rejoining])
def test_every_kind_is_a_membership_and_has_every_member(kind):
    assert Membership in kind.__mro__
    for name in MEMBERS:
        assert hasattr(kind, name), f"{kind.__name__} lacks {name}"
    # only the quorum's kind is elastic; only it survives a lost peer
    assert kind.elastic is (kind is Elastic)
    assert (kind.lost != ()) is (kind is Elastic)
    assert kind.builds_together is (kind is not Elastic)


def test_a_fixed_job_commits_what_succeeded_and_restores_nothing():
    fixed = Fixed()
    assert fixed.vote(True) is True
    assert fixed.vote(False, RuntimeError("lost")) is False
    assert fixed.track({"model": torch.nn.Linear(2, 2)}) is None
    assert (fixed.incarnation, fixed.heals, fixed.heal_bytes, fixed.data_place) == (0, 0, 0, None)
    fixed.advance()
    fixed.close()


def test_a_rejoining_worker_votes_alone_and_a_restart_gets_its_own_record_back():
    store = dist.HashStore()
    first = Rejoining(3, 0, lambda seconds: store, 5.0)
    assert first.vote(False, RuntimeError("a server went away")) is False  # no quorum: its own outcome
    model = torch.nn.BatchNorm1d(2)
    model.running_mean.fill_(7.0)
    first.track({"model": model})
    first.track_by_default([], None)  # nothing to do: advance warns a restart that the script tracks nothing
    first.advance()
    assert store.check([place_key(3)]) and first.records == 1
    again = torch.nn.BatchNorm1d(2)
    restarted = Rejoining(3, 1, lambda seconds: store, 5.0)
    assert restarted.rejoined and restarted.heal_bytes == 0
    assert restarted.track({"model": again}) == 0  # no optimizer tracked: step 0
    assert torch.equal(again.running_mean, torch.full((2,), 7.0))
