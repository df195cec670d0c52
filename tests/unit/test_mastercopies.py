"""The master-copy arithmetic both group synchronisations share (`troupe.cluster.serving.mastercopies`),
over values kept outside a shard (in-memory Hogwild's shared memory), without processes."""

from __future__ import annotations

import pytest
import torch

from troupe.cluster.serving.mastercopies import MasterCopies, SliceValues
from troupe.cluster.serving.shard import plan_slices

NUMELS = [7, 4]
W0 = torch.arange(11.0)


def replica() -> tuple[SliceValues, torch.Tensor]:
    """A group's values as views into one flat tensor (as in-memory Hogwild's are)."""
    flat = W0.clone()
    slices = plan_slices(NUMELS, 1)
    offsets = [0, NUMELS[0]]
    values = {s.id: flat[offsets[s.param] + s.start : offsets[s.param] + s.stop] for s in slices}
    return SliceValues.of(slices, values), flat


def sync_round(groups: list[MasterCopies]) -> None:
    """Every group, in turn, folds its own part in and merges every other part with its master (one
    message round trip each), as `GroupSync.sync` does."""
    for me in groups:
        for k, master in enumerate(groups):
            if k != me.group and me.sizes[k]:
                _, value = master.fold(me.request(k), seen=0)
                me.adopt(k, value)
        me.fold_own()


@pytest.mark.parametrize("merge", ["mean", "sum"])
def test_groups_that_sync_in_turn_hold_w0_plus_the_merged_changes(merge):
    (ra, fa), (rb, fb) = replica(), replica()
    a, b = MasterCopies(ra, 0, 2, merge), MasterCopies(rb, 1, 2, merge)
    a.start(), b.start()
    assert ra.last_sync[0] is not ra.values[0]  # last_sync is a copy: the values move on without it
    da, db = torch.linspace(-1, 1, 11), torch.linspace(3, 2, 11)
    fa.add_(da)  # each group's workers step its shared values in place
    fb.add_(db)
    sync_round([a, b])
    scale = 0.5 if merge == "mean" else 1.0
    merged = W0 + scale * (da + db)
    # b synced last: it adopted a's master copy after a had folded b's change in, and folded its own
    torch.testing.assert_close(fb, merged)
    # a synced first: both of its parts hold only its own change then
    torch.testing.assert_close(fa, W0 + scale * da)
    torch.testing.assert_close(torch.cat([a.master, b.master]), merged[part_order(a)])
    assert a.version == b.version == 2
    assert a.merges == [1] and b.merges == [0]  # b's Merge came after a's own fold; a's before b's


def part_order(copies: MasterCopies) -> torch.Tensor:
    """Indices into the flat parameters, in part order (part 0's ranges, then part 1's)."""
    offsets = [0, NUMELS[0]]
    return torch.cat([torch.arange(offsets[s.param] + lo, offsets[s.param] + hi)
                      for p in copies.parts for s, lo, hi in p])


def test_adopting_keeps_what_the_replica_took_meanwhile_and_forget_keeps_the_values():
    (ra, fa), (rb, _) = replica(), replica()
    a, b = MasterCopies(ra, 0, 2), MasterCopies(rb, 1, 2)
    a.start(), b.start()
    fa.add_(1.0)
    delta = a.request(1)
    torch.testing.assert_close(delta, torch.ones(a.sizes[1]))
    fa.add_(10.0)  # a's workers go on while the request travels
    version, value = b.fold(delta, seen=0)
    a.adopt(1, value)
    torch.testing.assert_close(a.gather(1), value + 10.0)
    torch.testing.assert_close(a.gather(1, ra.last_sync), value)
    assert version == 1 and a.drift == pytest.approx(0.5)  # |value - sent| = |(w0 + 1/2) - (w0 + 1)|
    a.request(1)
    a.forget(1)  # its master is gone: nothing changes, and a new request may leave
    torch.testing.assert_close(a.gather(1), value + 10.0)
    a.request(1)


def test_settle_and_final_set_values_and_last_sync():
    (ra, fa) = replica()
    a = MasterCopies(ra, 0, 2, "sum")
    a.start()
    fa.add_(2.0)
    a.fold_own()
    out = a.final()
    torch.testing.assert_close(out, a.gather(0))
    torch.testing.assert_close(a.gather(0, ra.last_sync), out)
    a.settle(1, torch.zeros(a.sizes[1]))
    torch.testing.assert_close(a.gather(1), torch.zeros(a.sizes[1]))


def test_empty_replica_and_bad_merge():
    empty = SliceValues.of([], {})
    copies = MasterCopies(empty, 0, 3)
    copies.start()
    assert copies.sizes == [0, 0, 0] and copies.master.numel() == 0
    with pytest.raises(ValueError, match="group_merge must be 'mean' or 'sum', got 'median'"):
        MasterCopies(empty, 0, 3, "median")
