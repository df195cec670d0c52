"""troupe.bench without processes: A/B order, medians and ratios, the JSON-lines schema, tables, options."""

from __future__ import annotations

import dataclasses
import json

import pytest

from troupe.bench import records, render, stats
from troupe.observe.turns import Contestant, Schedule, order, run_ab
from troupe.bench.options import Options, bucket_label, parse_bucket, parse_size, size_label
from troupe.bench.records import Record


# --- the A/B engine ------------------------------------------------------------------------------


def test_order_alternates_every_step_and_every_repetition():
    assert [order(2, 0, i) for i in range(3)] == [[0, 1], [1, 0], [0, 1]]
    assert [order(2, 1, i) for i in range(3)] == [[1, 0], [0, 1], [1, 0]]
    assert order(3, 0, 1) == [2, 1, 0]


def test_run_ab_takes_turns_step_by_step_after_burn_in():
    calls = []
    made = [Contestant(name, lambda i, name=name: calls.append((name, i))) for name in "AB"]
    run_ab(made, Schedule(reps=2, steps=2, burnin=1))
    # burn-in (batch 0), then rep 0 (batches 1, 2: A B, B A), then rep 1 (batches 3, 4: B A, A B)
    assert calls == [("A", 0), ("B", 0),
                     ("A", 1), ("B", 1), ("B", 2), ("A", 2),
                     ("B", 3), ("A", 3), ("A", 4), ("B", 4)]


def test_run_ab_reports_per_rep_medians_and_mean_counters():
    durations = {"A": iter([1.0, 5.0, 2.0]), "B": iter([10.0, 10.0, 40.0])}  # each measured step's time
    now = [0.0]

    def stepper(name):
        def step(i):
            now[0] += next(durations[name])
            return {"wire_bytes": 100.0 * (i % 2)} if name == "A" else None

        return step

    out = run_ab([Contestant("A", stepper("A")), Contestant("B", stepper("B"))], Schedule(reps=1, steps=3, burnin=0),
                 clock=lambda: now[0], cpu_clock=lambda: 0.0)
    got = {(m.contestant, m.metric): m.value for m in out}
    assert got[(0, "step_time")] == 2 and got[(1, "step_time")] == 10  # medians of [1, 5, 2] and [10, 10, 40]
    assert got[(0, "cpu_time")] == 0
    assert got[(0, "wire_bytes")] == pytest.approx(100 / 3)  # batches 0, 1, 2: 0 + 100 + 0 over 3 steps
    assert (1, "wire_bytes") not in got  # B counted nothing: no record rather than a zero


def test_run_ab_rejects_duplicate_names_and_bad_schedules():
    with pytest.raises(ValueError, match="unique"):
        run_ab([Contestant("A", lambda i: None), Contestant("A", lambda i: None)], Schedule(reps=1, steps=1))
    with pytest.raises(ValueError, match="reps"):
        Schedule(reps=0)
    with pytest.raises(ValueError, match="burnin"):
        Schedule(burnin=-1)


# --- statistics ----------------------------------------------------------------------------------


def test_median_spread_and_ratio_of_medians():
    s = stats.summarize([3.0, 1.0, 2.0, 10.0, 2.5])
    assert (s.median, s.low, s.high, s.n) == (2.5, 1.0, 10.0, 5)
    assert stats.ratio_of_medians([2.0, 4.0, 6.0], [1.0, 2.0, 100.0]) == pytest.approx(2.0)
    # per-repetition ratios pair the same repetitions only
    assert stats.paired_ratios({0: 2.0, 1: 3.0, 2: 8.0}, {0: 1.0, 2: 4.0}) == [2.0, 2.0]
    with pytest.raises(ValueError):
        stats.summarize([])


# --- the JSON-lines schema -----------------------------------------------------------------------


def record(**kw) -> Record:
    base = dict(benchmark="ddp", contestant="DDP", workload="cnn", params={"batch_size": 8}, world_size=2, rep=0,
                metric="step_time", value=0.02, unit="s")
    return Record(**{**base, **kw})


def test_records_round_trip_through_json_lines(tmp_path):
    path = tmp_path / "r.jsonl"
    stamp = records.Stamp(commit="abc1234", torch="2.x", machine="test box", date="2026-01-01T00:00:00+00:00",
                          run="r1")
    written = [stamp.apply(record(rep=i, value=0.01 * (i + 1))) for i in range(3)]
    assert records.write(path, written) == 3
    records.write(path, [stamp.apply(record(contestant="troupe", value=None))])  # appends
    back = records.read(path)
    assert back[:3] == written and back[3].value is None and len(back) == 4
    line = json.loads(path.read_text().splitlines()[0])
    required = {"benchmark", "contestant", "workload", "params", "world_size", "rep", "metric", "value", "unit",
                "commit", "torch", "machine", "date", "run", "schema"}
    assert set(line) == required and line["commit"] == "abc1234" and line["torch"] == "2.x"


def test_bad_records_are_rejected_with_their_line(tmp_path):
    with pytest.raises(ValueError, match="unit"):
        record(unit="parsecs")
    with pytest.raises(ValueError, match="world_size"):
        record(world_size=0)
    path = tmp_path / "bad.jsonl"
    good = record().to_json()
    path.write_text(good + "\n\n" + json.dumps({"benchmark": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:3: .*lacks"):
        records.read(path)


# --- tables --------------------------------------------------------------------------------------


def ddp_records() -> list[Record]:
    out = []
    for rep, (ddp, troupe) in enumerate([(0.020, 0.022), (0.030, 0.030), (0.010, 0.012)]):
        out += [record(rep=rep, value=ddp, params={"batch_size": 8, "buckets": "cap 25 MB"}),
                record(rep=rep, contestant="troupe bucket all", value=troupe, params={"batch_size": 8, "buckets": 1}),
                record(rep=rep, metric="cpu_time", value=0.005, params={"batch_size": 8, "buckets": "cap 25 MB"})]
    return out


def test_ddp_table_gives_medians_spreads_and_ratio_of_medians():
    from troupe.bench.suites import ddp

    text = ddp.table(ddp_records())
    assert text.startswith("*Run:* ddp, cnn, 2 ranks, 3 reps; batch_size 8.")
    assert "| strategy | buckets | step ms (median) | spread (min-max) | ratio to DDP (of medians) |" in text
    assert "| DDP | cap 25 MB | 20.00 | 10.00-30.00 | 1.000 | 1.000-1.000 | 5.00 |" in text
    # troupe: median 22 ms; 22 / 20 = 1.1; per-rep ratios 1.1, 1.0, 1.2; no CPU records
    assert "| troupe bucket all | 1 | 22.00 | 12.00-30.00 | 1.100 | 1.000-1.200 | - |" in text


def collectives_records(troupe: float, mean: float | None = None) -> list[Record]:
    """1 and 4 MiB, 3 reps: the flat sum at 50 us + 1 ns/B; troupe (and the flat mean) at multiples of it."""
    from troupe.bench.suites import collectives

    recs = []
    for size in (1 << 20, 4 << 20):
        for rep in range(3):
            flat = 50e-6 + size * 1e-9
            recs += [record(benchmark="collectives", contestant=collectives.FLAT, params={"bytes": size}, rep=rep,
                            value=flat),
                     record(benchmark="collectives", contestant=collectives.TROUPE, rep=rep, value=troupe * flat,
                            params={"bytes": size, "buckets": 2})]
            if mean is not None:
                recs.append(record(benchmark="collectives", contestant=collectives.FLAT_MEAN, params={"bytes": size},
                                   rep=rep, value=mean * flat))
    return recs


def test_collectives_table_pivots_sizes_and_fits_alpha_beta():
    from troupe.bench.suites import collectives

    text = collectives.table(collectives_records(troupe=2))
    assert "| size | flat all_reduce | troupe buckets | troupe / flat (of medians) |" in text
    assert "| 1 MiB | 1.10 ms (1.10-1.10) | 2.20 ms (2.20-2.20) | 2.00 | 2.00-2.00 |" in text
    assert "alpha = 50.0 us per all-reduce, beta = 1.000 ns/byte" in text
    alpha, beta = collectives.fit_alpha_beta([1, 2, 3], [3.0, 5.0, 7.0])
    assert alpha == pytest.approx(1.0) and beta == pytest.approx(2.0)


def test_graph_table_puts_graph_mode_beside_the_eager_reference():
    from troupe.bench.suites import graph

    shared = {"batch_size": 64, "data": "synthetic", "steps": 20, "burnin": 12}
    recs = []
    for rep in range(3):
        recs += [record(benchmark="graph", contestant=graph.REFERENCE, rep=rep, value=0.030,
                        params={**shared, "option": "no"}),
                 record(benchmark="graph", contestant="troupe graph mode", rep=rep, value=0.036,
                        params={**shared, "option": "whole step", "trial": 0, "chosen": "compiled"}),
                 record(benchmark="graph", contestant="troupe graph mode (trial)", rep=rep, value=0.030,
                        params={**shared, "option": "whole step", "trial": 5, "chosen": "eager"})]
    text = graph.table(recs)
    assert text.count("*Run:*") == 1  # one section: the trial's facts describe a contestant, not the run
    assert "| troupe graph mode | whole step | in the graph | 36.00 | 36.00-36.00 | 1.200 |" in text
    assert "| troupe graph mode (trial) | whole step | in the graph | 30.00 | 30.00-30.00 | 1.000 |" in text


def test_collectives_table_adds_the_flat_mean_where_it_ran():
    from troupe.bench.suites import collectives

    text = collectives.table(collectives_records(troupe=1.5, mean=1.25))
    assert ("| size | flat all_reduce | troupe buckets | troupe / flat (of medians) | per-rep ratio (min-max) "
            "| flat mean | troupe / flat mean (of medians) | bus bandwidth (troupe) |") in text
    # 4 MiB: flat 4.244 ms, mean 5.305 ms, troupe 6.366 ms: 6.366 / 4.244 = 1.50, 6.366 / 5.305 = 1.20
    assert "| 4 MiB | 4.24 ms (4.24-4.24) | 6.37 ms (6.37-6.37) | 1.50 | 1.50-1.50 | 5.31 ms (5.31-5.31) | 1.20 |" in text
    assert "alpha = 50.0 us per all-reduce, beta = 1.000 ns/byte" in text  # fitted to the flat sum only


def test_generic_table_and_the_command_table_group_by_run(tmp_path):
    from troupe.bench import command

    path = tmp_path / "r.jsonl"
    recs = [record(benchmark="ps", contestant="downpour", metric="time_to_0.985", value=v, rep=i, run="a")
            for i, v in enumerate([10.0, None, 30.0])]
    recs += [dataclasses.replace(r, run="b") for r in ddp_records()]
    records.write(path, recs)
    text = command.table(str(path))
    assert "## ps" in text and "## ddp" in text
    assert "| downpour | time_to_0.985 | 20 s | 10-30 | 2/3 |" in text
    assert command.table(str(path), benchmark="ddp").count("## ") == 1
    with pytest.raises(ValueError, match="no records"):
        command.table(str(path), benchmark="nope")


def test_plot_writes_an_image(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "p.png"
    render.plot_bars(ddp_records(), str(out))
    assert out.stat().st_size > 1000


# --- options and the command line ----------------------------------------------------------------


def test_sizes_and_bucket_sizes_parse():
    assert [parse_size(s) for s in ("4096", "64KiB", "1MiB", "16M", "2 GiB")] == [4096, 65536, 1 << 20, 16 << 20,
                                                                                  2 << 30]
    assert size_label(1 << 20) == "1 MiB" and size_label(4096) == "4 KiB" and size_label(100) == "100 B"
    assert parse_bucket("2**16") == 65536 and parse_bucket("all") == "all" and parse_bucket("100") == 100
    assert bucket_label(65536) == "2**16" and bucket_label(100) == "100" and bucket_label("all") == "all"
    for bad in ("", "12 parsecs", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_options_fill_defaults_and_reject_what_a_benchmark_does_not_use():
    from troupe.bench.registry import get

    bench = get("collectives")
    opts = Options(reps=3, sizes=(4096,)).with_defaults(bench.defaults, bench.uses, "collectives")
    assert opts.reps == 3 and opts.sizes == (4096,) and opts.nproc == 2 and opts.steps == bench.defaults["steps"]
    with pytest.raises(ValueError, match="does not use --micro"):
        Options(micro=4).with_defaults(bench.defaults, bench.uses, "collectives")
    with pytest.raises(ValueError, match="--reps"):
        Options(reps=0)
    with pytest.raises(ValueError, match="unknown benchmark 'nope'; choose one of"):
        get("nope")


def test_cli_parses_bench_commands():
    from troupe.bench.command import options_from
    from troupe.cli import build_parser

    args = build_parser().parse_args(["bench", "run", "collectives", "-n", "2", "--sizes", "4KiB", "1MiB",
                                      "--reps", "11", "--out", "r.jsonl"])
    opts = options_from(args)
    assert (args.name, args.out, opts.sizes, opts.nproc, opts.reps) == ("collectives", "r.jsonl", (4096, 1 << 20),
                                                                        2, 11)
    assert opts.local is None and opts.micro is None  # flags not given stay unset
    args = build_parser().parse_args(["bench", "run", "ddp", "--sweep", "2**12,all", "--local"])
    assert options_from(args).sweep == (4096, "all") and options_from(args).local is True
    args = build_parser().parse_args(["bench", "run", "ps", "--out", "p.jsonl", "--args", "--steps", "800"])
    assert args.script_args == ["--steps", "800"]
    assert build_parser().parse_args(["bench", "plot", "r.jsonl", "o.png"]).out == "o.png"


@pytest.mark.process
def test_bench_is_not_imported_by_troupe():
    import subprocess
    import sys

    code = "import sys, troupe; print(any(m.startswith('troupe.bench') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


# --- time_to_accuracy's contestants and table ----------------------------------------------------------


def test_time_to_accuracy_contestants_plain_first_by_their_keys():
    from troupe.bench.suites import time_to_accuracy as tta

    names = [c.name for c in tta.chosen("diloco50-int8, topk,plain")]
    assert names == ["plain all-reduce", "DiLoCo H = 50, int8", "top-K 0.01"]
    assert len(tta.chosen("all")) == len({c.key for c in tta.CONTESTANTS}) == 12
    assert tta.chosen("streaming50-int4")[1].flags.endswith("--pseudo-grad-dtype int4 --fragments 4 --delay 5")
    with pytest.raises(ValueError, match="no contestant is called 'localsgd'"):
        tta.chosen("localsgd")
    diloco = tta.chosen("diloco20")[1]
    assert diloco.flags.format(n=4) == "--framework diloco --nworker-groups 4 --sync-freq 20"
    # evaluations fall on outer steps: the smallest multiple of H at or above --eval-every
    assert tta._every(["--eval-every", "50"], diloco) == 60
    assert tta._every(["--eval-every", "50", "--eval-every=40"], diloco) == 40
    assert tta._every([], tta.CONTESTANTS[0]) == 100


def test_time_to_accuracy_table_times_each_curve_to_the_target_against_plain():
    from troupe.bench.suites.time_to_accuracy import compare

    def result(name, curve, final, **more):
        key = "final_acc" if final < 1 else "final_ppl"
        return {"option": name, "flags": "", "curve": curve, key: final, "train_seconds": 9.0, "steps": 30, **more}

    cnn = compare([result("plain", [(10, 2.0, 0.97), (20, 4.0, 0.986)], 0.987),
                   result("fast", [(10, 1.0, 0.985)], 0.99, exchanges=3, exchange_seconds=3.0),
                   result("never", [(10, 1.0, 0.9)], 0.9)], 0.985)
    rows = cnn.splitlines()[4:]
    assert "| plain |  | 4.0 | 1.00 | 20 | 9.0 (30) | 0.300 |" in rows[0]
    # 3 exchange steps took 3 s of the 9: the 27 others 6 s
    assert "| fast |  | 1.0 | 0.25 | 10 | 9.0 (30) | 0.222 (1.000) |" in rows[1]
    assert "not reached" in rows[2] and "0.9 |" in rows[2]
    # the word LM: plain's final perplexity 100 sets the target at 102 (within 2 %)
    lm = compare([result("plain", [(10, 5.0, 150.0), (20, 10.0, 101.0)], 100.0),
                  result("diloco", [(20, 2.0, 102.0)], 104.0)], None)
    assert "perplexity 102.00" in lm.splitlines()[0]
    rows = lm.splitlines()[4:]
    assert "| 10.0 | 1.00 | 20 |" in rows[0] and rows[0].endswith("| 100 | 1.000 |")
    assert "| 2.0 | 0.20 | 20 |" in rows[1] and rows[1].endswith("| 104 | 1.040 |")
