"""troupe.observe.tensorboard without processes: stats rows to tags, and the error when the package is missing."""

from __future__ import annotations

import importlib.util

import pytest

from troupe import cli
from troupe.observe import trace
from troupe.observe import tensorboard as tb


def test_a_stats_row_becomes_tagged_scalars():
    row = {"rank": 1, "step": 7, "time_ms": 10.0, "forward_ms": 2.0, "backward_ms": 5.0, "comm_exposed_ms": 2.5,
           "comm_overlapped_ms": 1.0, "optimizer_ms": 0.5, "bytes_sent": 1000, "option": "sparseTopK",
           "ratio": 0.02, "residual_norm": 3.0, "staleness": 2, "loss": 0.7, "compressed": True, "new_metric": 4}
    out = tb.scalars(row)
    assert out == {
        "time/step_ms": 10.0, "time/forward_ms": 2.0, "time/backward_ms": 5.0, "time/optimizer_ms": 0.5,
        "time/compute_ms": 7.5, "comm/exposed_ms": 2.5, "comm/overlapped_ms": 1.0, "comm/bytes_sent": 1000.0,
        "comm/compression_ratio": 0.02, "comm/residual_norm": 3.0, "ps/staleness": 2.0, "train/loss": 0.7,
        "stats/new_metric": 4.0,
    }


def test_rank_dirs():
    assert tb.rank_dir("runs/a", 3).endswith("runs/a/rank3")


@pytest.fixture
def no_tensorboard(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))


def test_troupe_run_says_how_to_install_tensorboard_before_starting_ranks(no_tensorboard, tmp_path, capsys):
    script = tmp_path / "never_started.py"
    script.write_text("raise SystemExit('a rank was started')\n")
    code = cli.main(["run", "-n", "2", "--tensorboard", str(tmp_path / "tb"), str(script)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("pip install tensorboard") == 1 and "a rank was started" not in err
    assert not (tmp_path / "tb").exists()


def test_the_environment_variable_fails_at_start_too(no_tensorboard, tmp_path):
    with pytest.raises(ImportError, match="pip install tensorboard"):
        trace.Recorder(0, str(tmp_path / "stats.jsonl"), None, str(tmp_path / "tb"))
    assert not (tmp_path / "stats.jsonl").exists()
