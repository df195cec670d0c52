"""troupe.bench.chaos_summary without processes: hand-made events, faults and finals, exact figures."""

from __future__ import annotations

import gzip
import json

import pytest

from troupe.bench.chaos_summary import markdown_table, percentile, summarize


def write(path, records, extra_lines=()):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "".join(extra_lines))


def steps(group, times, committed=True):
    return [{"t": t, "group": group, "step": i, "committed": committed, "samples": 64}
            for i, t in enumerate(times)]


def one_kill_run(tmp_path, finals=None, extra_faults=(), torn_line=False):
    """Three groups, a step a second; group 2 is killed at 3.5 and commits again at 8.0.

    Survivor 0 waits 3 s (3 -> 6) and survivor 1 waits 2 s (3 -> 5) inside [3.5, 8.0];
    the median step is 1 s, so the stall is 3 - 1 = 2 s. Group 0 is killed at 10.5, after
    the last step: it never recovers.
    """
    events = (steps(0, [0, 1, 2, 3, 6, 7, 8, 9, 10]) + steps(1, [0, 1, 2, 3, 5, 6, 7, 8, 9, 10])
              + steps(2, [0, 1, 2, 3, 8, 9, 10]) + steps(0, [4.0, 5.0], committed=False))
    write(tmp_path / "events.jsonl", events, ['{"t": 10.7, "gro\n'] if torn_line else [])
    faults = [{"t": 3.5, "group": 2, "kind": "kill"}, {"t": 3.6, "group": 2, "kind": "restart"},
              {"t": 10.5, "group": 0, "kind": "kill"}, *extra_faults]
    write(tmp_path / "faults.jsonl", faults)
    write(tmp_path / "final.jsonl", finals if finals is not None else [
        {"group": g, "eval_acc": acc, "params_sha256": "ab", "exit_code": 0}
        for g, acc in enumerate([0.97, 0.98, 0.99])])
    return summarize(tmp_path)


def test_throughput_is_committed_samples_over_the_committed_span(tmp_path):
    s = one_kill_run(tmp_path)
    assert s["committed_samples"] == (9 + 10 + 7) * 64  # the uncommitted steps do not count
    assert s["span_s"] == 10
    assert s["samples_per_s"] == (9 + 10 + 7) * 64 / 10
    assert s["median_step_s"] == 1
    assert s["kept_of_own_pace"] == (9 + 10 + 7) / 10 / 3  # 3 groups at 1 step/s would commit 3/s


def test_recovery_and_stall_of_each_kill(tmp_path):
    s = one_kill_run(tmp_path)
    assert s["kills"] == 2 and s["unrecovered"] == 1
    first, second = s["per_kill"]
    assert first == {"t": 3.5, "group": 2, "recovery_s": 4.5, "stall_s": 2.0}
    assert second == {"t": 10.5, "group": 0, "recovery_s": None, "stall_s": None}
    assert s["recovery_p50"] == s["recovery_p99"] == 4.5
    assert s["stall_p50"] == s["stall_p99"] == 2.0


def test_a_killed_server_counts_until_every_group_has_committed_again(tmp_path):
    # a server killed at 3.2: group 0 commits at 6, group 1 at 5, group 2 (killed at 3.5) at 8
    s = one_kill_run(tmp_path, extra_faults=[{"t": 3.2, "group": -1, "kind": "kill-server", "rank": 4}])
    assert s["per_server_kill"] == [{"t": 3.2, "rank": 4, "all_back_s": pytest.approx(4.8), "slowest_group": 2}]
    assert s["kills"] == 2  # a server's kill is not a worker's
    s = one_kill_run(tmp_path, extra_faults=[{"t": 10.2, "group": -1, "kind": "kill-server", "rank": 4}])
    assert s["per_server_kill"] == [{"t": 10.2, "rank": 4, "all_back_s": None, "slowest_group": 0}]


def test_a_stall_shorter_than_a_step_is_zero(tmp_path):
    events = steps(0, [0, 1, 2, 3, 4]) + steps(1, [0, 1, 2, 3, 4]) + steps(2, [0, 1, 3, 4])
    write(tmp_path / "events.jsonl", events)
    write(tmp_path / "faults.jsonl", [{"t": 1.5, "group": 2, "kind": "kill"}])
    s = summarize(tmp_path)
    assert s["per_kill"] == [{"t": 1.5, "group": 2, "recovery_s": 1.5, "stall_s": 0.0}]


def test_percentiles_over_several_kills(tmp_path):
    # group 1 steps every second; group 0 is killed 5 times and comes back 1..5 s later
    kills, back = [10, 20, 30, 40, 50], [11, 22, 33, 44, 55]
    write(tmp_path / "events.jsonl", steps(1, list(range(61))) + steps(0, [0, *back, 60]))
    write(tmp_path / "faults.jsonl", [{"t": t, "group": 0, "kind": "kill"} for t in kills])
    s = summarize(tmp_path)
    assert [k["recovery_s"] for k in s["per_kill"]] == [1, 2, 3, 4, 5]
    assert s["recovery_p50"] == 3
    assert s["recovery_p99"] == pytest.approx(4.96)
    assert s["stall_p99"] == 0.0  # the survivor never waited


def test_crashes_hangs_finals_and_torn_lines(tmp_path):
    s = one_kill_run(tmp_path, torn_line=True, extra_faults=[
        {"t": 5.0, "group": 1, "kind": "crash"}, {"t": 70.0, "group": 1, "kind": "hang"},
        {"t": 6.0, "group": 0, "kind": "stop"}, {"t": 7.0, "group": 0, "kind": "cont"}])
    assert (s["crashes"], s["hangs"], s["stops"], s["bad_event_lines"]) == (1, 1, 1, 1)
    assert s["final_acc"] == pytest.approx(0.98)
    assert s["bit_identical"] and s["groups_final"] == 3 and s["nonzero_exits"] == 0


def test_groups_differ_or_one_has_no_result(tmp_path):
    differ = one_kill_run(tmp_path, finals=[
        {"group": 0, "eval_acc": 0.5, "params_sha256": "ab", "exit_code": 0},
        {"group": 1, "eval_acc": 0.7, "params_sha256": "cd", "exit_code": 0}])
    assert not differ["bit_identical"] and differ["final_acc"] == pytest.approx(0.6)
    missing = one_kill_run(tmp_path, finals=[
        {"group": 0, "eval_acc": 0.5, "params_sha256": "ab", "exit_code": 0},
        {"group": 1, "eval_acc": None, "params_sha256": None, "exit_code": -9}])
    assert not missing["bit_identical"] and missing["final_acc"] == 0.5
    assert missing["nonzero_exits"] == 1


def test_a_stopped_group_rejoins_after_its_cont(tmp_path):
    # group 1 is stopped at 2.5, continued at 6.0 and commits at 7.0; group 0 waits 2.0 -> 5.0
    events = steps(0, [0, 1, 2, 5, 6, 7, 8]) + steps(1, [0, 1, 2, 7, 8])
    write(tmp_path / "events.jsonl", events)
    write(tmp_path / "faults.jsonl", [{"t": 2.5, "group": 1, "kind": "stop"},
                                      {"t": 6.0, "group": 1, "kind": "cont"}])
    s = summarize(tmp_path)
    assert s["per_stop"] == [{"t": 2.5, "group": 1, "cont_t": 6.0, "rejoin_s": 1.0, "stall_s": 2.0}]
    assert s["stops"] == 1 and s["stop_rejoin_p99"] == 1.0 and s["stop_stall_p50"] == 2.0
    assert s["kills"] == 0 and s["recovery_p50"] is None


def test_progress_lost_when_every_group_restarts_from_scratch(tmp_path):
    healed = steps(0, [0, 1, 2, 3]) + [{"t": 5, "group": 1, "step": 4, "committed": True, "samples": 64}]
    write(tmp_path / "events.jsonl", healed)
    assert summarize(tmp_path)["progress_lost_steps"] == 0  # a healed group jumps ahead, never back
    reset = [{"t": t, "group": g, "step": s, "committed": True, "samples": 64}
             for t, g, s in [(0, 0, 5), (0, 1, 5), (1, 0, 6), (1, 1, 6), (9, 0, 1), (9, 1, 1), (10, 1, 2)]]
    write(tmp_path / "events.jsonl", reset)
    assert summarize(tmp_path)["progress_lost_steps"] == 5


def test_a_compressed_events_file_reads_the_same(tmp_path):
    plain = one_kill_run(tmp_path)
    events = tmp_path / "events.jsonl"
    (tmp_path / "events.jsonl.gz").write_bytes(gzip.compress(events.read_bytes()))
    events.unlink()
    assert summarize(tmp_path) == plain


def test_an_empty_run(tmp_path):
    s = summarize(tmp_path)
    assert s["samples_per_s"] == 0.0 and s["kills"] == 0 and s["recovery_p50"] is None
    assert s["final_acc"] is None and not s["bit_identical"]


def test_percentile_interpolates_between_ranks():
    assert percentile(list(range(101)), 99) == 99
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="q must be in"):
        percentile([1], 101)


def test_markdown_table_keeps_throughput_relative_to_the_reference(tmp_path):
    s = one_kill_run(tmp_path)
    ref = dict(s, samples_per_s=2 * s["samples_per_s"], kept_of_own_pace=4 * s["kept_of_own_pace"])
    table = markdown_table({"fault-free": ref, "kill 30 s": s}, reference="fault-free")
    lines = table.splitlines()
    assert len(lines) == 4 and lines[1].count("---") == lines[0].count("|") - 1
    assert "| kill 30 s | 166 | 0.50 | 0.25 | 2 | 4.5 / 4.5 | 2.0 / 2.0 | 0 | 0 | 0 | 98.00 | yes |" in table
    with pytest.raises(ValueError, match="reference 'x'"):
        markdown_table({"a": s}, reference="x")
