"""Settings: every TROUPE_* variable read in one place, validated, with clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from troupe.runtime.settings import Settings


def test_defaults_and_reads():
    s = Settings.from_env({})
    assert s.timeout is None and s.peer_timeout == 45.0 and s.watchdog and s.resume == "no"
    s = Settings.from_env({"TROUPE_TIMEOUT": "12.5", "TROUPE_WATCHDOG": "0", "TROUPE_CHECKPOINT_DIR": "/x",
                           "TROUPE_RESUME": "auto", "TROUPE_MASTER_PORT": "2900", "TROUPE_STATS": "",
                           "TROUPE_BACKEND": "gloo"})
    assert s.timeout == 12.5 and not s.watchdog and s.checkpoint_dir == Path("/x") and s.resume == "auto"
    assert s.master_port == 2900 and s.stats is None and s.backend == "gloo"


@pytest.mark.parametrize("env,message", [
    ({"TROUPE_TIMEOUT": "soon"}, "TROUPE_TIMEOUT='soon' is not a valid float"),
    ({"TROUPE_PEER_TIMEOUT": "-1"}, "TROUPE_PEER_TIMEOUT must be > 0"),
    ({"TROUPE_RESUME": "maybe"}, "TROUPE_RESUME must be one of"),
    ({"TROUPE_BACKEND": "mpi"}, "TROUPE_BACKEND must be 'gloo' or 'nccl'"),
])
def test_bad_values_name_the_variable(env, message):
    with pytest.raises(ValueError, match=message):
        Settings.from_env(env)


def test_no_module_reads_troupe_variables_from_os_environ():
    """Every TROUPE_* read goes through Settings (the CLI only writes them for its children)."""
    root = Path(__file__).resolve().parents[2] / "src" / "troupe"
    offenders = []
    for path in root.rglob("*.py"):
        if path.name == "settings.py" or "bench" in path.parts:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if "os.environ" in line and "TROUPE_" in line and ("get(" in line or '["TROUPE_' in line):
                offenders.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_a_torchrun_restart_resumes_by_itself():
    assert Settings.from_env({"TORCHELASTIC_RESTART_COUNT": "0"}).resume == "no"
    assert Settings.from_env({"TORCHELASTIC_RESTART_COUNT": "1"}).resume == "auto"
    assert Settings.from_env({"TORCHELASTIC_RESTART_COUNT": "2", "TROUPE_RESUME": "no"}).resume == "no"
