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


# --- troupe.log: the user's scalars in the same run directories ---------------------------


def read_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def fake_world(monkeypatch, recorder, dp_rank):
    from types import SimpleNamespace

    from troupe.runtime import world as world_mod

    monkeypatch.setattr(world_mod, "_current", SimpleNamespace(recorder=recorder, comm=SimpleNamespace(rank=dp_rank)))


def test_log_writes_the_users_scalars_as_tagged_events_and_stats_lines(monkeypatch, tmp_path):
    import json

    import torch

    import troupe

    pytest.importorskip("tensorboard")
    recorder = trace.Recorder(0, str(tmp_path / "stats.jsonl"), None, str(tmp_path / "tb"))
    fake_world(monkeypatch, recorder, 0)
    troupe.log({"eval/accuracy": 0.5, "train/epoch_loss": torch.tensor(2.25)}, 1)
    troupe.log({"eval/accuracy": torch.tensor([0.75], dtype=torch.float64), "lr": 3}, step=2)
    recorder.close()
    scalars = read_scalars(tmp_path / "tb" / "rank0")
    assert scalars == {"eval/accuracy": [(1, 0.5), (2, 0.75)], "train/epoch_loss": [(1, 2.25)], "lr": [(2, 3.0)]}
    lines = [json.loads(line) for line in (tmp_path / "stats.jsonl").read_text().splitlines()]
    assert lines[0] == {"rank": 0, "step": 1, "log": {"eval/accuracy": 0.5, "train/epoch_loss": 2.25}}
    assert trace.summarize(str(tmp_path / "stats.jsonl")).count("\n") == 0  # no step rows: just the header


def test_log_records_on_rank_0_unless_all_ranks(monkeypatch, tmp_path):
    import troupe

    pytest.importorskip("tensorboard")
    recorder = trace.Recorder(1, str(tmp_path / "stats.jsonl"), None, None)
    fake_world(monkeypatch, recorder, 1)
    troupe.log({"a": 1.0}, 0)
    troupe.log({"b": 2.0}, 0, all_ranks=True)
    recorder.close()
    assert (tmp_path / "stats.jsonl").read_text() == '{"rank": 1, "step": 0, "log": {"b": 2.0}}\n'


def test_log_without_a_world_or_a_recorder_checks_and_drops(monkeypatch):
    import troupe

    from troupe.runtime import world as world_mod

    monkeypatch.setattr(world_mod, "_current", None)
    troupe.log({"a": 1.0}, 0)  # before troupe.init(): nothing to write to, no error
    fake_world(monkeypatch, None, 0)
    troupe.log({"a": 1.0}, 0)  # no --stats/--tensorboard
    with pytest.raises(TypeError, match="'a' must be a real number"):
        troupe.log({"a": "high"}, 0)


@pytest.mark.parametrize("values,step,error,match", [
    ([("a", 1.0)], 0, TypeError, "dict of name -> number"),
    ({1: 1.0}, 0, TypeError, "names must be non-empty strings"),
    ({"": 1.0}, 0, TypeError, "names must be non-empty strings"),
    ({"a": None}, 0, TypeError, "'a' must be a real number"),
    ({"a": True}, 0, TypeError, "'a' must be a real number"),
    ({"a": [1.0]}, 0, TypeError, "'a' must be a real number"),
    ({"a": 1.0}, 1.5, TypeError, "step must be an int"),
    ({"a": 1.0}, -1, ValueError, "step must be >= 0"),
])
def test_log_rejects_bad_input(values, step, error, match):
    import troupe

    with pytest.raises(error, match=match):
        troupe.log(values, step)


def test_log_rejects_tensors_that_are_not_one_number():
    import torch

    import troupe

    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        troupe.log({"loss": torch.ones(3)}, 0)
    with pytest.raises(TypeError, match="torch.bool"):
        troupe.log({"ok": torch.tensor(True)}, 0)
