"""The built wheel, installed into an environment that already has torch, runs a 2-rank job.

Offline throughout: the wheel is built with this environment's setuptools (no build
isolation), and pip installs it with `--no-index` and no configuration, so if troupe's
requirements were not met by the torch already there, pip would fail instead of fetching
another build. The test environment is a fresh venv that sees this one's packages (torch,
numpy, ...) through a .pth line pointing at a folder of links, minus troupe's own
editable install, so the only troupe it can import is the one the wheel installed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TINY = str(Path(__file__).parent / "scripts" / "tiny_train.py")
SITES = dict.fromkeys(Path(p) for p in (sysconfig.get_path("purelib"), sysconfig.get_path("platlib"),
                                         Path(torch.__file__).parents[1]))
"""Where this environment's packages (torch among them) live."""
TIMEOUT = 120
"""Seconds for one command: importing torch alone can take 30 s on a loaded 2-core machine."""


def _clean_env(**extra: str) -> dict[str, str]:
    """No PYTHONPATH, no pip configuration (indexes, find-links, constraints) from the machine."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith(("PIP_", "TROUPE_"))}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "OMP_NUM_THREADS": "1", "TROUPE_JOIN_TIMEOUT": "60",
            "TROUPE_TIMEOUT": "60", **extra}


def _run(cmd: list[str], cwd: Path, timeout: float = TIMEOUT, env: dict[str, str] | None = None):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env or _clean_env())
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _build_wheel(tmp: Path) -> Path:
    """`pip wheel` on a copy of the source tree (building in place would write into the checkout)."""
    src = tmp / "src-copy"
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "--disable-pip-version-check", "-w", str(tmp / "wheels"), str(src)], cwd=tmp)
    (wheel,) = (tmp / "wheels").glob("*.whl")
    return wheel


def _venv_with_torch(tmp: Path) -> Path:
    """A fresh venv that sees this environment's packages, except troupe (the editable install)."""
    deps = tmp / "deps"
    deps.mkdir()
    for site in SITES:
        for entry in site.iterdir():
            skip = "troupe" in entry.name or entry.name.startswith("__editable__") or entry.suffix == ".pth"
            if not skip and not (deps / entry.name).exists():
                (deps / entry.name).symlink_to(entry)
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp)
    query = "import sysconfig; print(sysconfig.get_path('purelib'))"
    purelib = _run([str(venv / "bin" / "python"), "-c", query], cwd=tmp).stdout.strip()
    # A path line in a .pth extends sys.path; .pth files inside that folder are not run.
    Path(purelib, "existing-env.pth").write_text(f"{deps}\n")
    return venv


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("install")
    wheel = _build_wheel(tmp)
    venv = _venv_with_torch(tmp)
    pip = _run([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-index", "--disable-pip-version-check",
                str(wheel)], cwd=tmp)
    return tmp, wheel, venv, pip.stdout


def test_wheel_contents(installed):
    _, wheel, _, _ = installed
    names = zipfile.ZipFile(wheel).namelist()
    assert "troupe/py.typed" in names and "troupe/__main__.py" in names
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert re.search(r"^\[console_scripts\]\s*\ntroupe = troupe\.cli:main$", text, re.M), text


def test_pip_leaves_torch_alone(installed):
    tmp, _, venv, pip_out = installed
    (done,) = re.findall(r"^Successfully installed (.*)$", pip_out, re.M)
    assert done.split() == ["torch-troupe-0.1.0"], pip_out
    where = _run([str(venv / "bin" / "python"), "-c", "import troupe, torch; print(troupe.__file__); "
                  "print(torch.__file__); print(torch.__version__)"], cwd=tmp).stdout.split()
    assert Path(where[0]).is_relative_to(venv), f"troupe imported from {where[0]}, not the installed copy"
    assert Path(where[1]).resolve() == Path(torch.__file__).resolve() and where[2] == torch.__version__


def test_installed_copy_runs_a_job(installed):
    tmp, _, venv, _ = installed
    bin_ = venv / "bin"
    env = _clean_env(PATH=f"{bin_}{os.pathsep}{os.environ.get('PATH', '')}")
    assert "{run,info" in _run([str(bin_ / "troupe"), "--help"], cwd=tmp, env=env).stdout
    # python -m troupe passes the exit code through (argparse's 2 for a bad argument).
    bad = subprocess.run([str(bin_ / "python"), "-m", "troupe", "run", "-n", "0", TINY], capture_output=True,
                         text=True, timeout=TIMEOUT, cwd=tmp, env=env)
    assert bad.returncode == 2 and "--nproc" in bad.stderr, bad.stderr
    out = tmp / "job"
    out.mkdir()
    _run([str(bin_ / "python"), "-m", "troupe", "run", "-n", "2", "--threads", "1", TINY, str(out)], cwd=tmp,
         env=env, timeout=2 * TIMEOUT)
    states = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    assert [s["launcher"] for s in states] == ["troupe", "troupe"] and states[0]["world_size"] == 2
    for a, b in zip(states[0]["params"], states[1]["params"]):
        assert torch.equal(a, b)
