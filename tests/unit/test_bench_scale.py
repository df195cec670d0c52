"""`troupe bench scale`'s arithmetic, without processes: a job's point from its processes' reports, the
least-squares fit, the limits it gives, the table; and its bad input (troupe bench chaos's new flags too)."""

from __future__ import annotations

import argparse

import pytest

from troupe.bench import chaos, scale


def reports(n: int, steps: int, warmup: int = 1) -> list[dict]:
    """n processes' reports: process r reaches each step's vote r ms after process 0 (the skew), the last one gets
    the decision 2 ms after it arrives, the others 1 ms after that; a step every 10 ms, process r's r ms late."""
    out = []
    for r in range(n):
        arrived = [s * 0.010 + r * 0.001 for s in range(steps)]
        decided = [s * 0.010 + (n - 1) * 0.001 + 0.002 + (0.0 if r == n - 1 else 0.001) for s in range(steps)]
        ends = [d + 0.0005 for d in decided]
        out.append({"rank": r, "first_step": 3.0 + r, "arrived": arrived, "decided": decided, "ends": ends,
                    "warmup": warmup})
    return out


def test_a_point_is_the_vote_after_the_last_arrival_not_the_skew():
    p = scale.point(4, reports(4, steps=6), launcher_cpu=0.25)
    assert p["n"] == 4 and p["steps"] == 5  # the warm-up step left out
    assert p["vote_ms"] == pytest.approx(3.0)  # from the last arrival until the last decision: 2 ms + 1 ms
    assert p["step_ms"] == pytest.approx(10.0)
    assert p["start_s"] == 6.0 and p["launcher_cpu"] == 0.25  # the slowest process's first step


def test_the_fit_recovers_a_line_and_the_limits_follow_from_it():
    f = scale.Fit.of([(2, 1.2), (4, 1.4), (8, 1.8), (16, 2.6)])
    assert f.a == pytest.approx(1.0) and f.b == pytest.approx(0.1) and f(100) == pytest.approx(11.0)
    lim = scale.limits({"vote_ms": f, "launcher_cpu": scale.Fit(0.1, 0.001)})
    # 5 % of 1 s is 50 ms: (50 - 1) / 0.1 = 490 processes; the launcher reaches one core at (1 - 0.1) / 0.001 = 900
    assert lim["1 s"] == {"processes": 490, "first": "vote", "vote": 490, "launcher CPU": 900}
    assert lim["0.1 s"]["vote"] == 40 and lim["0.1 s"]["first"] == "vote"  # (5 - 1) / 0.1
    with pytest.raises(ValueError, match="at least 2 points"):
        scale.Fit.of([(2, 1.0)])


def test_the_report_checks_the_fit_on_the_points_it_did_not_see():
    points = [{"n": n, "start_s": 1.0 + n, "vote_ms": 1.0 + 0.1 * n, "step_ms": 5.0 + n, "launcher_cpu": 0.1}
              for n in (2, 4, 8)] + [{"n": 16, "start_s": 17.0, "vote_ms": 3.0, "step_ms": 21.0, "launcher_cpu": 0.1}]
    text = scale.report(points, upto=8)
    assert "| 16 | 17.00 | 3.00 | 21.0 | 0.10 |" in text
    assert "16: 3 / 2.6 (-13%)" in text  # vote: measured 3.0, the line through the first three says 2.6
    assert "| 1 s | 490 |" in text


def test_bad_sizes_are_refused_in_one_line(tmp_path):
    p = argparse.ArgumentParser()
    scale.add_arguments(p)
    with pytest.raises(ValueError, match="--sizes must be 2 or more processes each"):
        scale.run(p.parse_args(["--sizes", "1", "4", "--workdir", str(tmp_path)]))
    with pytest.raises(ValueError, match="--fit-upto 4 leaves fewer than 2 sizes to fit on"):
        scale.run(p.parse_args(["--sizes", "4", "8", "--fit-upto", "4", "--workdir", str(tmp_path)]))


def test_chaos_refuses_a_shard_without_groups_and_a_pad_with_partition(tmp_path):
    p = argparse.ArgumentParser()
    chaos.add_arguments(p)
    with pytest.raises(ValueError, match="--shard cuts the optimizer state inside worker groups of 2 or more"):
        chaos.run(p.parse_args(["--out", str(tmp_path / "a"), "--shard", "optimizer"]))
    with pytest.raises(ValueError, match="--pad-mb is a size in MiB for the synchronous jobs"):
        chaos.run(p.parse_args(["--out", str(tmp_path / "b"), "--group-size", "2", "--partition", "hybrid",
                                "--pad-mb", "8"]))


def test_control_plane_limits_from_measured_costs():
    """Store: 10,000 ops/s; a tick read 0.1 ms per rank before the fix, and 1 ms + 0.01 ms per rank after."""
    costs = {"store_ops_per_s": 10_000.0, "clients": 4,
             "sizes": {n: {"tick_before_ms": 0.1 * n, "tick_after_ms": 1.0 + 0.01 * n} for n in (64, 1024, 4096)}}
    lim = scale.control_plane_limits(costs)
    one = lim["1 s"]
    assert abs(one["vote"] - 249) <= 4  # (2n + 2) / 10,000 <= 0.05 s
    assert abs(one["lighthouse before"] - 200) <= 4  # 0.1 ms x n within one 20 ms tick
    # after: 4 reads a second of 1 + 0.01 n ms and 50 ticks of the smallest size's read (1.64 ms) <= 500 ms up
    # to n = 10,350: past the 10,000 looked at
    assert one["lighthouse after"] == 10_000
    assert abs(one["store capacity"] - 2499) <= 40  # (2n + 2) + 2n ops per second <= 10,000
    assert (one["first before"], one["first after"]) == ("lighthouse", "vote")
    assert lim["0.1 s"]["vote"] < one["vote"] / 9
    text = scale.store_report(costs)
    assert "| 1024 | 102.40 | 11.24 |" in text and "| 1 s | " in text


def test_the_vote_through_the_quorum_s_group_is_bounded_by_its_hops_not_the_store():
    """Store: 10,000 ops/s; a Gloo hop 100 us: a step's vote is 2 / 10,000 s and 2 ceil(log2 n) hops."""
    costs = {"store_ops_per_s": 10_000.0, "clients": 4, "hop_us": 100.0,
             "sizes": {n: {"tick_before_ms": 0.1 * n, "tick_after_ms": 1.0 + 0.01 * n} for n in (64, 1024, 4096)}}
    one, tenth = scale.control_plane_limits(costs)["1 s"], scale.control_plane_limits(costs)["0.1 s"]
    assert one["tree vote"] == 10_000  # 0.2 ms + 28 hops of 0.1 ms at 10,000: far within 50 ms
    # 0.1 s: 0.2 ms + 2 ceil(log2 n) x 0.1 ms <= 5 ms: ceil(log2 n) <= 24: every n looked at
    assert tenth["tree vote"] == 10_000
    # 2 a step + 2n heartbeats + 2,000 reads of waiting members a second <= 10,000
    assert one["store capacity now"] == 3999
    assert one["first now"] == "store capacity" and one["vote"] < 250
    slow = scale.control_plane_limits({**costs, "hop_us": 400.0})["0.1 s"]
    assert 64 <= slow["tree vote"] <= 128  # 0.2 + 0.8 ceil(log2 n) <= 5 ms: ceil(log2 n) <= 6
    assert "through the store / the group" in scale.store_report(costs)
