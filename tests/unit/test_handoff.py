"""The hand-off codec shared by elastic heals and parameter-server records (runtime/handoff.py), without processes."""

from __future__ import annotations

import torch

from troupe.runtime import handoff


def test_a_packed_state_loads_into_fresh_objects_and_brings_the_rng_along():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    torch.manual_seed(7)
    blob = handoff.pack({"model": model.state_dict(), "optimizer": opt.state_dict(), "extra": {"epoch": 3}})
    expected_draw = torch.rand(3)

    torch.manual_seed(99)  # the receiving process: other values, another RNG
    other = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.1)
    states = handoff.unpack(blob)
    assert set(states) == {"model", "optimizer", "extra"} and states["extra"] == {"epoch": 3}
    torch.testing.assert_close(torch.rand(3), expected_draw)  # the sender's RNG, as it was when it packed
    handoff.load_states({"model": other, "optimizer": other_opt}, states)
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for p, q in zip(model.parameters(), other.parameters()):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(opt.state[p][k], other_opt.state[q][k], rtol=0, atol=0)
    assert not handoff.is_dtensor(next(other.parameters()))
