"""Synchronous worker groups from the command line (``troupe run --nworker-groups G`` without a cluster):
how the launcher's flags resolve to TROUPE_GROUPS, and bad input in one line. No processes."""

from __future__ import annotations

import pytest

from troupe.cli import build_parser, main
from troupe.launcher.flags import Flags
from troupe.launcher.resolve import cluster_for, worker_groups
from troupe.runtime.settings import Settings
from troupe.runtime.world import check_groups


def parse(*argv: str) -> Flags:
    return Flags.from_args(build_parser().parse_args(["run", *argv, "x.py"]))


@pytest.mark.parametrize("argv,groups,nproc", [
    (["-n", "4", "--nworker-groups", "2", "--shard", "gradients"], "2", 4),
    (["-n", "4", "--nworker-groups", "2"], "2", 4),
    (["--nworker-groups", "2"], "2", 2),  # -n defaults to 2: groups of one rank
    (["-n", "2", "--nnodes", "2", "--nworker-groups", "4"], "4", 2),
])
def test_nworker_groups_alone_is_synchronous_groups_without_a_cluster(argv, groups, nproc):
    args, env = worker_groups(parse(*argv))
    assert env == {"TROUPE_GROUPS": groups}
    assert cluster_for(args) is None  # no parameter-server cluster: plain data parallelism over every rank
    assert args.place.nproc == nproc


@pytest.mark.parametrize("argv", [
    ["-n", "4", "--nworker-groups", "2", "--framework", "diloco"],
    ["-n", "4", "--nworker-groups", "2", "--nserver-groups", "2"],
    ["-n", "4", "--nworker-groups", "2", "--elastic"],
    ["-n", "4"],
])
def test_with_a_framework_another_cluster_flag_or_elastic_nothing_changes(argv):
    args = parse(*argv)
    assert worker_groups(args) == (args, {})  # the same flags, unchanged


def test_groups_that_do_not_divide_the_job_are_refused_in_one_line(tmp_path, capsys):
    script = tmp_path / "x.py"
    script.write_text("")
    assert main(["run", "-n", "3", "--nworker-groups", "2", "--shard", "optimizer", str(script)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("troupe run: --nworker-groups 2 must divide the job's processes (-n 3 = 3) into groups of "
                   "equal size")
    with pytest.raises(ValueError, match="TROUPE_GROUPS must be >= 1"):
        Settings.from_env({"TROUPE_GROUPS": "0"})
    with pytest.raises(ValueError, match="TROUPE_GROUPS='two' is not a valid int"):
        Settings.from_env({"TROUPE_GROUPS": "two"})
    assert Settings.from_env({"TROUPE_GROUPS": "2"}).groups == 2
    with pytest.raises(ValueError, match=r"^DistOpt: groups must be a positive divisor of the world size \(4\), "
                                         r"got 3$"):
        check_groups(3, 4, "DistOpt: groups")


def test_distopt_groups_without_a_shard_mode_is_refused_before_joining():
    import torch

    import troupe

    with pytest.raises(ValueError, match=r"DistOpt\(groups=2\) shards inside worker groups: give shard="):
        troupe.DistOpt(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), groups=2)
