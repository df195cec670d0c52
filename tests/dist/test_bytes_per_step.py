"""`troupe bench run bytes_per_step` in a tiny configuration: the harness's bytes, not timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from troupe.compress.topk import topk_count

pytestmark = [pytest.mark.benchmark, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]

DENSE = 2 * (431080 + 14) * 4
"""Plain step, both workers: the CNN's 2 buckets (431,080 parameters + 14 flags: used, active and two
digest slots, fp32), sent once on a 2-rank ring. SINGA's update exchanges its 12-byte agreement at its
first step only (not measured here: steps 1 to 3); from then on it rides in the digest slots."""


def bytes_per_step(tmp_path: Path, net: str, *configs: str) -> tuple[dict[str, dict], str]:
    options = [c for c in configs if not c.startswith("sandblaster")]
    frameworks = [c for c in configs if c.startswith("sandblaster")]
    data, plot = tmp_path / "bytes.json", tmp_path / "bytes.png"
    cmd = [sys.executable, "-m", "troupe.cli", "bench", "run", "bytes_per_step", "--args",
           "--options", *options, "--frameworks", *frameworks,
           "--steps", "1", "3", "--batch", "8", "--data", "synthetic", "--net", net, "--timeout", "120",
           "--json", str(data), "--plot", str(plot)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TROUPE_JOIN_TIMEOUT": "30", "TROUPE_TIMEOUT": "60"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| configuration | processes | payload B/step | wire B/step (counters) | veth B/step |" in proc.stdout
    assert plot.stat().st_size > 1000
    rows = {r["name"]: r for r in json.loads(data.read_text())["rows"]}
    assert list(rows) == list(configs)
    assert rows["plain"]["payload"] == rows["plain"]["wire"] == DENSE
    return rows, proc.stdout


def cnn_numels() -> list[int]:
    sys.path.insert(0, str(ROOT / "examples"))
    from mnist_cnn import CNN

    return [p.numel() for p in CNN().parameters()]


def test_counters_on_loopback(tmp_path):
    rows, out = bytes_per_step(tmp_path, "loopback", "plain", "sparseTopK", "sandblaster-fp16", "sandblaster-topk")
    # top-1% as (index, value) pairs, all-gathered: about 2% of dense
    assert 0.015 * DENSE < rows["sparseTopK"]["wire"] < 0.03 * DENSE
    # fp16 gradients to the server and fp16 values back (troupe run --wire-dtype fp16): what an fp32
    # all-reduce sends, where fp32 Sandblaster sends twice that (the veth test below)
    assert rows["sandblaster-fp16"]["wire"] == pytest.approx(DENSE, rel=0.01)
    # top 1% of each slice (one server: a slice per parameter) to the server (troupe run --wire-topk 0.01), per
    # worker and step: a 48-byte header and k (int32 index, fp32 value) pairs per slice, where dense updates
    # send what an all-reduce sends (DENSE); the server's replies stay dense, fp32 values to 2 workers (DENSE)
    updates = 2 * sum(48 + 8 * topk_count(0.01, n) for n in cnn_numels())
    topk = rows["sandblaster-topk"]
    assert topk["workers_wire"] == updates < 0.021 * DENSE, topk
    assert topk["wire"] - updates == pytest.approx(DENSE, rel=0.01), topk
    assert all("veth" not in r for r in rows.values())
    assert f"| plain | 2 | {DENSE:,} | {DENSE:,} | - | - | 1.0000 | - |" in out


@pytest.mark.netns
def test_veth_agrees_with_the_counters_on_simulated_hosts(tmp_path):
    from troupe.bench.netns import available, leftover

    why_not = available()
    if why_not:
        pytest.skip(f"veth counters need network namespaces, which cannot be made here: {why_not}")
    rows, _ = bytes_per_step(tmp_path, "netns", "plain", "sandblaster")
    # each worker sends its gradient to the server and gets the parameters back: twice the all-reduce
    assert rows["sandblaster"]["processes"] == 3
    assert rows["sandblaster"]["wire"] == pytest.approx(2 * DENSE, rel=0.01)
    for name, r in rows.items():
        # the interfaces send the counted bytes plus TCP/IP headers, ACKs and heartbeats; a segment
        # sent again (up to 64 KiB, in either of the two runs) moves the difference either way
        slack = 65536 * r["retransmits"]
        assert r["wire"] - slack < r["veth"] < 1.1 * r["wire"] + 5000 + slack, (name, r)
    assert leftover() == []  # another test's hosts may exist now: it looks when none does
