"""The benchmarks run (tiny configurations: the harness, not the timing) and the cost model fits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.benchmark]

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run(cmd, timeout=240):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_alpha_beta_fit_recovers_a_synthetic_link():
    from troupe.bench.suites.collectives import fit_alpha_beta

    sizes = [4 << 10, 64 << 10, 1 << 20, 16 << 20]
    alpha, beta = fit_alpha_beta(sizes, [50e-6 + s * 0.8e-9 for s in sizes])
    assert alpha == pytest.approx(50e-6, rel=1e-6) and beta == pytest.approx(0.8e-9, rel=1e-6)


def test_step_prediction_uses_the_slower_of_link_and_loopback():
    from troupe.bench.suites.throughput import link_beta, predict_step

    assert link_beta("100mbit", 1e-10) == pytest.approx(8e-8)
    assert link_beta("loopback", 1e-10) == 1e-10 and link_beta("none", 1e-10) == 1e-10
    assert predict_step(0.05, 1e6, 1e-4, 8e-8) == pytest.approx(0.05 + 1e-4 + 0.08)


@pytest.mark.timeout(150)
def test_collectives_benchmark_runs(tmp_path):
    """`troupe bench run collectives` on 2 ranks (spawned, Gloo, 1 thread each) with tiny sizes."""
    from troupe.bench.records import read

    out = tmp_path / "c.jsonl"
    proc = run([sys.executable, "-m", "troupe.cli", "bench", "run", "collectives", "-n", "2", "--reps", "1",
                "--steps", "2", "--burnin", "1", "--sizes", "4096", "262144", "--timeout", "120", "--out", str(out)],
               timeout=140)
    assert "| size | flat all_reduce | troupe buckets |" in proc.stdout and "alpha =" in proc.stdout
    data = read(out)
    assert {r.world_size for r in data} == {2} and len({r.params["bytes"] for r in data}) == 2
    assert {r.contestant for r in data} == {"flat all_reduce", "flat mean", "troupe buckets"}
    assert all(r.value > 0 and r.unit == "s" and r.commit and r.torch for r in data if r.metric == "step_time")


@pytest.mark.netns
@pytest.mark.slow
def test_throughput_benchmark_runs_on_loopback_and_simulated_hosts(tmp_path):
    from troupe.bench.netns import available

    links = ["loopback"] + (["none"] if available() is None else [])
    plot, data = tmp_path / "t.png", tmp_path / "t.json"
    proc = run([sys.executable, "-m", "troupe.cli", "bench", "run", "throughput", "--args",
                "--workers", "1", "2", "--links", *links, "--reps", "1",
                "--steps", "2", "--warmup", "1", "--plot", str(plot), "--json", str(data)], timeout=400)
    assert "| link | workers | samples/s" in proc.stdout
    summary = json.loads(data.read_text())
    assert set(summary) == set(links) and plot.stat().st_size > 1000
    # 2 workers all-reduce the whole CNN once per step, in 2 buckets ([linear*], [conv*]) each
    # with a used flag per tensor, an active flag and two digest slots: (431080 params + 14 flags)
    # * 4 bytes, sent once on a 2-rank ring (SINGA's sgd(loss) exchanges its 12-byte agreement at the
    # first step only, a warm-up step here: from then on it rides in the digest slots)
    for link in links:
        assert summary[link]["2"]["bytes_per_step"] == pytest.approx((431080 + 14) * 4)
    if "none" in links:
        assert "| none | 2 |" in proc.stdout
        from troupe.bench.netns import leftover

        assert leftover() == []  # another test's hosts may exist now: it looks when none does


@pytest.mark.timeout(240)
def test_time_to_accuracy_runs_the_word_lm_for_plain_and_diloco_and_tables_them(tmp_path):
    out = tmp_path / "tta.jsonl"
    proc = run([sys.executable, "-m", "troupe", "bench", "run", "time_to_accuracy", "--out", str(out), "--args",
                "-n", "2", "--workload", "word_lm", "--contestants", "diloco20", "--epochs", "1", "--max-steps", "40",
                "--eval-every", "10", "--dim", "32", "--timeout", "180"], timeout=220)
    plain, diloco = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert (plain["option"], diloco["option"]) == ("plain all-reduce", "DiLoCo H = 20, fp32")
    assert [p[0] for p in plain["curve"]] == [10, 20, 30, 40]
    assert [p[0] for p in diloco["curve"]] == [20, 40]  # evaluations on the outer steps only
    for r in (plain, diloco):  # perplexity falls from the first evaluation (a vocabulary of thousands) on
        assert r["final_ppl"] < r["curve"][0][2] and r["steps"] == 40
    target = plain["final_ppl"] * 1.02
    assert f"Time to perplexity {target:.2f}" in proc.stdout
    assert "| plain all-reduce |  |" in proc.stdout and "| DiLoCo H = 20, fp32 | `--framework diloco" in proc.stdout
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["workload"] for r in recs} == {"word_lm"}
    assert sum(r["metric"] == "perplexity" for r in recs) == 6
    assert {r["contestant"] for r in recs} == {"plain all-reduce", "DiLoCo H = 20, fp32"}


def test_troupe_bench_conformance_is_the_matrix_with_its_own_options(tmp_path):
    """`troupe bench conformance ...` (issue 47's spelling) is `troupe bench run conformance --args ...`."""
    cells = tmp_path / "cells.jsonl"
    cells.write_text(json.dumps({"regime": "plain", "shape": "ddp", "launcher": "mpiexec", "outcome": "matched",
                                 "detail": "max |diff| 0.0e+00 (tolerance 1e-05)", "seconds": 7.0}) + "\n")
    proc = subprocess.run([sys.executable, "-m", "troupe.cli", "bench", "conformance", "--render", str(cells)],
                          capture_output=True, text=True, timeout=60, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "| ddp |  |  | matched |  |  |  |" in proc.stdout and "1 cells: matched 1." in proc.stdout, proc.stdout
    proc = subprocess.run([sys.executable, "-m", "troupe.cli", "bench", "conformance", "--regimes", "nope"],
                          capture_output=True, text=True, timeout=60, env=ENV, cwd=ROOT)
    assert proc.returncode == 2 and "troupe bench: unknown regime(s) ['nope']" in proc.stderr, proc.stderr
