"""`troupe run`'s cluster flags come from `ClusterConfig`'s field metadata: names, kinds, choices, help."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Literal

import pytest

from troupe.cli import build_parser
from troupe.cluster.configuration.config import ClusterConfig, Flag, choices, flag_fields, keeps_shape, option
from troupe.cluster.configuration.flags import add_flags, given

FLAGS = ("nworker_groups", "nserver_groups", "nworkers_per_group", "nservers_per_group", "nworkers_per_procs",
         "nservers_per_procs", "server_worker_separate", "sync_freq", "share_memory", "fetch_freq",
         "staleness_bound", "group_merge", "fetch", "staleness_lr", "wire_dtype", "wire_topk", "outer_optimizer",
         "outer_lr", "outer_momentum", "pseudo_grad_dtype", "fragments", "delay", "merge_alpha")


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["run", *argv, "x.py"])


def test_every_flag_that_troupe_run_had_is_there():
    assert tuple(f.name for f in flag_fields()) == FLAGS
    args = parse()
    assert given(args) == dict.fromkeys(FLAGS)  # nothing given: the preset or file decides


def test_flag_kinds_follow_the_field_types():
    args = parse("--nworker-groups", "2", "--no-share-memory", "--server-worker-separate", "--wire-topk", "0.25",
                 "--fetch", "background", "--staleness-bound", "3", "--wire-dtype", "bf16")
    got = given(args)
    assert got["nworker_groups"] == 2 and got["staleness_bound"] == 3
    assert got["share_memory"] is False and got["server_worker_separate"] is True
    assert got["wire_topk"] == 0.25 and got["fetch"] == "background" and got["wire_dtype"] == "bf16"
    for bad in (["--nworker-groups", "0"], ["--fetch", "later"], ["--wire-dtype", "fp8"], ["--wire-topk", "all"],
                ["--group-merge", "median"]):
        with pytest.raises(SystemExit):
            parse(*bad)


def test_choices_come_from_the_literal_types_default_first():
    assert choices("fetch") == ("wait", "background", "predict")
    assert choices("staleness_lr") == ("constant", "inverse")
    assert choices("wire_dtype") == ("fp32", "fp16", "bf16")
    assert choices("group_merge") == ("mean", "sum")
    assert choices("nworker_groups") == ()
    for f in dataclasses.fields(ClusterConfig):
        if choices(f.name):
            assert choices(f.name)[0] == f.default, f.name


def test_help_text_and_metavar_travel_with_the_field():
    text = " ".join(build_parser()._subparsers._group_actions[0].choices["run"].format_help().split())
    assert "--wire-topk FRACTION" in text and "with error feedback" in text
    assert "share its parameter memory" in text and "--staleness-lr {constant,inverse}" in text


def test_fields_that_keep_a_presets_shape():
    kept = {f.name for f in dataclasses.fields(ClusterConfig) if keeps_shape(f.name)}
    assert kept == {"sync_freq", "fetch_freq", "staleness_bound", "share_memory", "group_merge", "send_updates",
                    "wire_dtype", "wire_topk", "fetch", "staleness_lr", "outer_optimizer", "outer_lr",
                    "outer_momentum", "pseudo_grad_dtype", "fragments", "delay", "merge_alpha", "shard"}
    assert not keeps_shape("no_such_field")


def test_a_new_field_needs_only_its_declaration():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Extended:
        spare_rounds: int = option(1, flag=Flag("rounds to spare"))
        damping: float | None = option(None, flag=Flag(metavar="D"))
        quality: Literal["good", "best"] = option("good", flag=Flag())
        hidden: int = option(0)

    parser = argparse.ArgumentParser()
    add_flags(parser, integer=int, config=Extended)
    args = parser.parse_args(["--spare-rounds", "4", "--damping", "0.5", "--quality", "best"])
    assert given(args, Extended) == {"spare_rounds": 4, "damping": 0.5, "quality": "best"}
    assert "rounds to spare" in parser.format_help() and "--damping D" in parser.format_help()
    with pytest.raises(SystemExit):
        parser.parse_args(["--hidden", "1"])


def test_the_scripts_own_flags_pass_through_even_where_they_abbreviate_troupe_runs():
    # `--out` is a prefix of --outer-optimizer/-lr/-momentum, `--nn` of --nnodes: they are the script's
    args = build_parser().parse_args(["run", "-n", "2", "train.py", "--out", "x", "--nn", "3"])
    assert args.script == "train.py" and args.args == ["--out", "x", "--nn", "3"] and args.nnodes == 1
