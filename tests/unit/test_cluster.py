"""ClusterConfig validation, presets, roles and the cluster-text parser."""

from __future__ import annotations

import warnings

import pytest

from troupe.cluster.configuration.config import ClusterConfig
from troupe.cluster.configuration.presets import PRESETS, preset
from troupe.cluster.configuration.roles import roles
from troupe.cluster.configuration.sources import from_env, parse_cluster_text

SEED_BLOCK = """
cluster {
    nworker_groups: 2
    nserver_groups: 1
    nworkers_per_group: 2
    nservers_per_group: 2
    server_worker_separate: true
}
"""


def test_presets_match_the_reference_table():
    shapes = {
        name: (c.nworker_groups, c.nworkers_per_group, c.nserver_groups, c.nservers_per_group, c.server_worker_separate)
        for name, c in PRESETS.items()
    }
    assert shapes == {
        "sandblaster": (1, 3, 1, 2, True),
        "allreduce": (1, 3, 1, 3, False),
        "downpour": (2, 2, 1, 2, True),
        "hogwild": (3, 1, 3, 1, False),
        "diloco": (2, 1, 2, 1, False),  # not the reference's: its servers follow the workers (it has none)
    }
    assert {n: c.nprocs for n, c in PRESETS.items()} == {"sandblaster": 5, "allreduce": 3, "downpour": 6, "hogwild": 3,
                                                         "diloco": 2}


def test_roles_cover_every_rank_workers_first():
    r = roles(PRESETS["downpour"])
    assert [x.rank for x in r] == list(range(6))
    assert [x.worker for x in r] == [(0, 0), (0, 1), (1, 0), (1, 1), None, None]
    assert [x.server for x in r] == [None] * 4 + [(0, 0), (0, 1)]
    assert r[0].describe() == "rank 0: worker 0 of group 0"
    colocated = roles(PRESETS["hogwild"])
    assert [(x.worker, x.server, x.kind) for x in colocated] == [
        ((g, 0), (g, 0), "worker+server") for g in range(3)
    ]


def test_server_group_of_worker_group():
    cfg = ClusterConfig(nworker_groups=4, nserver_groups=2, server_worker_separate=True)
    assert [cfg.server_group_of(g) for g in range(4)] == [0, 0, 1, 1]


def test_parse_seed_block_verbatim():
    assert parse_cluster_text(SEED_BLOCK) == PRESETS["downpour"]
    inside_job = "name: \"mnist\"\n" + SEED_BLOCK.replace("true", "true  # separate") + "\ntrain_steps: 10\n"
    assert parse_cluster_text(inside_job) == PRESETS["downpour"]


def test_parse_toml():
    text = "[cluster]\nnworker_groups = 3\nnserver_groups = 3\nsync_freq = 5\nshare_memory = true\n"
    cfg = parse_cluster_text(text)
    assert (cfg.nworker_groups, cfg.nserver_groups, cfg.sync_freq, cfg.share_memory) == (3, 3, 5, True)
    assert parse_cluster_text("nworkers_per_group = 2\nnservers_per_group = 2\n").nprocs == 2


def test_json_round_trip(monkeypatch, tmp_path):
    cfg = PRESETS["sandblaster"]
    assert ClusterConfig.from_json(cfg.to_json()) == cfg
    monkeypatch.setenv("TROUPE_CLUSTER", cfg.to_json())
    assert from_env() == cfg
    monkeypatch.delenv("TROUPE_CLUSTER")
    assert from_env() is None
    monkeypatch.setenv("TROUPE_CLUSTER", "downpour")  # torchrun / mpiexec users name a framework
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert from_env() == preset("downpour", 4)
    conf = tmp_path / "job.conf"
    conf.write_text(SEED_BLOCK)
    monkeypatch.setenv("TROUPE_CLUSTER", str(conf))
    assert from_env() == PRESETS["downpour"]
    monkeypatch.setenv("TROUPE_CLUSTER", "ring")
    with pytest.raises(ValueError, match="neither JSON, a framework"):
        from_env()


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"nworker_groups": 3, "nserver_groups": 2}, r"nworker_groups \(3\) must be divisible by nserver_groups \(2\)"),
        ({"nworkers_per_group": 0}, r"nworkers_per_group must be an integer >= 1, got 0"),
        ({"sync_freq": 1.5}, r"sync_freq must be an integer >= 1, got 1.5"),
        ({"staleness_bound": -1}, r"staleness_bound must be an integer >= 0 or unset, got -1"),
        ({"nworkers_per_group": 3, "nworkers_per_procs": 2}, r"must divide one another"),
        ({"nworkers_per_group": 3, "nservers_per_group": 2}, r"worker processes \(3 .*server processes \(2"),
        ({"fetch": "later", "server_worker_separate": True}, r"fetch must be one of wait, background, predict, got 'later'"),
        ({"fetch": "background"}, r"fetch background needs separate servers"),
        ({"staleness_lr": "inverse"}, r"staleness_lr inverse needs separate servers"),
        ({"staleness_lr": "sqrt", "server_worker_separate": True}, r"staleness_lr must be one of constant, inverse"),
        ({"shard": "parameters"}, r"shard must be optimizer or gradients, or unset, got 'parameters'"),
        ({"shard": "optimizer", "server_worker_separate": True}, r"shard optimizer shards co-located servers"),
        ({"shard": "gradients", "nworker_groups": 2, "nserver_groups": 2},
         r"shard gradients runs in one worker group .* troupe run --nworker-groups G --shard"),
    ],
)
def test_bad_configs_name_their_values(fields, message):
    with pytest.raises(ValueError, match=message):
        ClusterConfig(**fields)


def test_a_sharded_allreduce_block_is_the_shard_regime_over_its_group():
    cfg = parse_cluster_text("cluster {\n nworkers_per_group: 4\n nservers_per_group: 4\n shard: \"gradients\"\n}")
    assert cfg.shard == "gradients" and cfg.worker_regime == "co-located-sharded"
    assert preset("allreduce", 4, shard="optimizer").worker_regime == "co-located-sharded"
    assert preset("allreduce", 4).worker_regime == "co-located"
    assert ClusterConfig.from_json(cfg.to_json()) == cfg


def test_bad_text():
    with pytest.raises(ValueError, match=r"unknown cluster field\(s\) \['nworkers'\]"):
        parse_cluster_text("cluster { nworkers: 3 }")
    with pytest.raises(ValueError, match="expected an integer or true/false, got 'three'"):
        parse_cluster_text("cluster {\n nworker_groups: three\n}")
    with pytest.raises(ValueError, match="given twice"):
        parse_cluster_text("cluster {\n nworker_groups: 1\n nworker_groups: 2\n}")
    with pytest.raises(ValueError, match="neither a `cluster"):
        parse_cluster_text("this is not = = toml")
    with pytest.raises(TypeError, match="server_worker_separate must be true or false"):
        ClusterConfig(server_worker_separate=1)


def test_resolve_for_troupe_run():
    from troupe.cluster.configuration.sources import resolve

    assert resolve() is None
    assert resolve("hogwild", nprocs=4, sync_freq=5) == ClusterConfig(nworker_groups=4, nserver_groups=4, sync_freq=5)
    assert resolve(nworker_groups=2, server_worker_separate=True).nprocs == 3
    with pytest.raises(ValueError, match="-n 4 does not fit the cluster, which needs 3 processes"):
        resolve(nworker_groups=2, server_worker_separate=True, nprocs=4)
    with pytest.raises(ValueError, match="either --framework or --cluster"):
        resolve("downpour", "job.conf")


def test_preset_rescaled_to_nprocs():
    assert preset("sandblaster", 3).nworkers_per_group == 1
    assert preset("downpour", 8).nworkers_per_group == 3
    assert preset("hogwild", 2).nprocs == 2
    assert preset("allreduce", 4).nservers_per_group == 4
    with pytest.raises(ValueError, match="leaves 1 worker"):
        preset("downpour", 3)
    with pytest.raises(ValueError, match=r"leaves 0 worker.*-n 4, 6, 8, ... fit \(the smallest: -n 4\)"):
        preset("downpour", 2)
    with pytest.raises(ValueError, match=r"the smallest: -n 3\)"):
        preset("sandblaster", 2)
    with pytest.raises(ValueError, match="unknown framework 'ring'"):
        preset("ring")
    # --framework hogwild --nworker-groups G -n N: G groups of N / G workers, each with its server group
    from troupe.cluster.configuration.sources import resolve

    grouped = resolve("hogwild", None, 4, nworker_groups=2)
    assert (grouped.nworker_groups, grouped.nworkers_per_group, grouped.nserver_groups, grouped.nservers_per_group) \
        == (2, 2, 2, 2)
    assert resolve("hogwild", None, 4, nworker_groups=4) == resolve("hogwild", None, 4) == preset("hogwild", 4)
    with pytest.raises(ValueError, match="-n 5 processes do not divide into 2 worker groups"):
        resolve("hogwild", None, 5, nworker_groups=2)
    with pytest.raises(ValueError, match="nservers_per_procs must be 1"):
        roles(ClusterConfig(nworkers_per_group=2, nworkers_per_procs=2, nservers_per_group=2, nservers_per_procs=2))


def test_in_memory_hogwild_roles():
    # 4 worker groups, 2 per process sharing its server group's memory: 4 OS processes, the first of each
    # process hosting the server group
    cfg = ClusterConfig(nworker_groups=4, nserver_groups=2, nworkers_per_procs=2, share_memory=True)
    assert cfg.in_memory and cfg.nprocs == 4
    assert [(r.worker, r.server) for r in roles(cfg)] == [((0, 0), (0, 0)), ((1, 0), None), ((2, 0), (1, 0)),
                                                          ((3, 0), None)]
    with pytest.raises(ValueError, match="in-memory Hogwild.*share_memory False"):
        roles(ClusterConfig(nworker_groups=4, nserver_groups=2, nworkers_per_procs=2))
    with pytest.raises(ValueError, match="in-memory Hogwild.*server_worker_separate True"):
        roles(ClusterConfig(nworker_groups=2, nworkers_per_procs=2, share_memory=True, server_worker_separate=True))


# SINGA 0.x's example job files, reconstructed (protocol-buffer text: nested blocks, `field: {`,
# repeated fields, enum values, comments); troupe takes the cluster block and skips the rest.
SINGA_CIFAR10 = """name: "cifar10-convnet"
train_steps: 1000
test_steps: 100
test_freq: 300
disp_freq: 30
train_one_batch {
  alg: kBP
}
updater{
  type: kSGD
  weight_decay:0.004
  learning_rate {
    type: kFixedStep
    fixedstep_conf:{
      step:0
      step:60000
      step_lr:0.001
      step_lr:0.0001
    }
  }
}
neuralnet {
  layer{
    name: "data"
    type: kRecordInput
    store_conf {
      backend: "kvfile"
      path: "examples/cifar10/train_data.bin"
      mean_file: "examples/cifar10/image_mean.bin"
      batchsize: 64
      shape: 3
      shape: 32
      shape: 32
    }
    include: kTrain
  }
  layer {
    name: "conv1"
    type: kCConvolution
    srclayers: "data"
    convolution_conf {
      num_filters: 32
      kernel: 5
      stride: 1
      pad:2
    }
    param { name: "w1" init { type:kGaussian std:0.0001 } }
  }
}
cluster {
  nworker_groups: 1
  nserver_groups: 1
  nworkers_per_group: 1
  nworkers_per_procs: 1
  workspace: "examples/cifar10"
}
"""

SINGA_MNIST = """name: "mlp"
train_steps: 1000
test_steps:10
test_freq:60
disp_freq:10
train_one_batch {
  alg: kBP
}
updater{
  type: kSGD
  learning_rate{
    type : kStep
    base_lr: 0.001
    step_conf{
      change_freq: 60
      gamma: 0.997
    }
  }
}
neuralnet {
  layer {
    name: "data"
    type: kRecordInput
    store_conf { backend: "kvfile" path: "examples/mnist/train_data.bin" batchsize: 64 std_value: 127.5 mean_value: 127.5 shape: 784 }
    include: kTrain
  }
  layer{
    name: "fc1"
    type: kInnerProduct
    srclayers:"data"
    innerproduct_conf{ num_output: 2500 }
    param{ name: "w1" init { type: kUniform low:-0.05 high:0.05 } }
  }
}
cluster {
  nworker_groups: 1
  nserver_groups: 1
  workspace: "examples/mnist"
}
"""

SINGA_RBM = """name: "rbm1"
train_steps: 6000
test_steps:100
test_freq:500
disp_freq: 100
train_one_batch{
  alg: kCD
}
updater{
  type: kSGD
  momentum: 0.8
  weight_decay: 0.0002
  learning_rate{ base_lr: 0.1 type: kFixed }
}
neuralnet {
  layer{
    name: "RBMVis"
    type: kRBMVis
    srclayers:"data"
    srclayers:"RBMHid"
    rbm_conf{ hdim: 1000 }
    param{ name: "w1" init{ type: kGaussian mean: 0.0 std: 0.1 } }
  }
}
cluster{
  nserver_groups: 1
  nservers_per_group: 1
  nworker_groups: 1
  workspace: "examples/rbm/rbm1/"
}
"""


@pytest.mark.parametrize("text", [SINGA_CIFAR10, SINGA_MNIST, SINGA_RBM], ids=["cifar10", "mnist", "rbm"])
def test_singa_job_files_give_their_cluster_and_name_what_was_skipped(text):
    with pytest.warns(UserWarning) as caught:
        cfg = parse_cluster_text(text)
    assert cfg == ClusterConfig()  # each example runs one worker and one server
    said = " ".join(str(w.message) for w in caught)
    assert "name, train_steps, test_steps, test_freq, disp_freq, train_one_batch, updater, neuralnet" in said
    assert "workspace" in said


def test_one_line_blocks_comments_and_the_block_anywhere():
    one_line = parse_cluster_text("cluster { nworker_groups: 2 nserver_groups: 2 }")
    assert one_line == ClusterConfig(nworker_groups=2, nserver_groups=2)
    text = ('# a job\nname: "x"  # the name\nneuralnet { layer { name: "a" } }\n'
            'cluster: { nworkers_per_group: 3; nservers_per_group: 2, server_worker_separate: true }\n')
    with pytest.warns(UserWarning, match="name, neuralnet"):
        assert parse_cluster_text(text) == PRESETS["sandblaster"]


def test_malformed_cluster_blocks_give_the_line():
    with pytest.raises(ValueError, match=r"cluster block, line 3: expected `key: value`, got 'nworker_groups 1"):
        parse_cluster_text('name: "x"\ncluster {\n  nworker_groups 1\n}\n')
    with pytest.raises(ValueError, match=r"line 2: .*nservers_per_group: expected an integer"):
        parse_cluster_text("cluster {\n  nservers_per_group: two\n}")
    with pytest.raises(ValueError, match="line 1: expected `key: value`"):
        parse_cluster_text("cluster { sub { a: 1 } }")
    with pytest.raises(ValueError, match="left open"):
        parse_cluster_text("neuralnet { cluster { nworker_groups: 1 }")
    with pytest.raises(ValueError, match="2 cluster blocks"):
        parse_cluster_text("cluster { nworker_groups: 1 }\ncluster { nworker_groups: 1 }")


def test_several_servers_or_workers_per_process_become_a_process_each_with_a_warning():
    block = ("cluster {\n nworker_groups: 1\n nworkers_per_group: 4\n nworkers_per_procs: 2\n nservers_per_group: 2\n"
             " nservers_per_procs: 2\n server_worker_separate: true\n}")
    with pytest.warns(UserWarning, match=r"nservers_per_procs 2 -> 1.*nworkers_per_procs 2 -> 1"):
        cfg = parse_cluster_text(block)
    assert (cfg.nworkers_per_procs, cfg.nservers_per_procs, cfg.nprocs) == (1, 1, 6)
    assert [r.kind for r in roles(cfg)] == ["worker"] * 4 + ["server"] * 2
    # in-memory Hogwild keeps its packing, and says nothing
    hogwild = "[cluster]\nnworker_groups = 4\nnserver_groups = 2\nnworkers_per_procs = 2\nshare_memory = true\n"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert parse_cluster_text(hogwild).nworkers_per_procs == 2


def test_an_elastic_cluster_block_is_troupe_run_elastic_over_its_groups(monkeypatch, tmp_path):
    """`elastic: true` (and min_groups) in the cluster block: `troupe run --cluster FILE` runs what
    `--elastic --nworker-groups G --min-groups K` runs; a rank handed it by another launcher is refused."""
    from troupe.cli import build_parser
    from troupe.launcher.flags import Flags
    from troupe.launcher.resolve import elastic_from_cluster

    cfg = parse_cluster_text("cluster {\n  nworker_groups: 4\n  nworkers_per_group: 2\n  elastic: true\n"
                             "  min_groups: 3\n}")
    assert (cfg.elastic, cfg.min_groups, cfg.nprocs) == (True, 3, 8)
    conf = tmp_path / "job.conf"
    conf.write_text("cluster {\n  nworker_groups: 4\n  elastic: true\n  min_groups: 3\n}\n")
    args = elastic_from_cluster(Flags.from_args(build_parser().parse_args(["run", "--cluster", str(conf), "train.py"])))
    assert (args.elastic.on, args.place.nproc, args.cluster.fields["nworker_groups"], args.elastic.min_groups,
            args.cluster.file) == (True, 4, 4, 3, None)
    args = elastic_from_cluster(Flags.from_args(build_parser().parse_args(["run", "--cluster", str(conf), "--min-groups",
                                                                           "2", "train.py"])))
    assert args.elastic.min_groups == 2  # the flag wins
    monkeypatch.setenv("TROUPE_CLUSTER", str(conf))
    with pytest.raises(ValueError, match="asks for elastic worker groups .* only `troupe run --cluster FILE`"):
        from_env()


@pytest.mark.parametrize("fields,message", [
    ({"nworker_groups": 3, "min_groups": 2}, "min_groups 2 is for elastic worker groups: add elastic: true"),
    ({"nworker_groups": 1, "elastic": True}, "elastic: true needs nworker_groups >= 2"),
    ({"nworker_groups": 2, "nserver_groups": 2, "elastic": True}, "without servers.*leave out nserver_groups 2"),
    # beside separate servers (Downpour, Sandblaster) the workers restart alone: no quorum settings, no partition
    ({"nworker_groups": 2, "server_worker_separate": True, "elastic": True, "min_groups": 2},
     "with separate servers restarts each worker alone and keeps no quorum: leave out min_groups 2"),
    ({"nworker_groups": 2, "server_worker_separate": True, "elastic": True, "partition_dim": 0},
     "with separate servers runs without partition .*: leave out partition_dim 0"),
    ({"nworker_groups": 2, "partition_dim": 1, "elastic": True}, "leave out partition_dim 1"),
])
def test_bad_elastic_cluster_blocks_name_their_values(fields, message):
    with pytest.raises(ValueError, match=message):
        ClusterConfig(**fields)


def test_an_elastic_block_with_separate_servers_is_troupe_run_elastic_over_that_job(tmp_path):
    """`elastic: true` beside Downpour's servers: `troupe run --cluster FILE` runs `--elastic` over the
    parameter-server job as given (its workers restart alone), the cluster kept."""
    from troupe.cli import build_parser
    from troupe.launcher.flags import Flags
    from troupe.launcher.resolve import elastic_from_cluster

    conf = tmp_path / "job.conf"
    conf.write_text("cluster {\n  nworker_groups: 2\n  nserver_groups: 2\n  server_worker_separate: true\n"
                    "  elastic: true\n}\n")
    args = elastic_from_cluster(Flags.from_args(build_parser().parse_args(["run", "--cluster", str(conf), "train.py"])))
    assert args.elastic.on and args.cluster.file == str(conf) and args.cluster.fields["nworker_groups"] is None
    assert ClusterConfig(nworker_groups=2, nserver_groups=2, server_worker_separate=True, elastic=True).nprocs == 4


def test_elastic_diloco_is_its_own_worker_regime():
    cfg = ClusterConfig(nworker_groups=3, nserver_groups=3, framework="diloco", elastic=True)
    assert cfg.worker_regime == "elastic-diloco" and cfg.nprocs == 3
    pairs = ClusterConfig(nworker_groups=2, nserver_groups=2, nworkers_per_group=2, nservers_per_group=2,
                          framework="diloco", elastic=True)
    assert pairs.worker_regime == "elastic-diloco" and pairs.nprocs == 4
    assert ClusterConfig(nworker_groups=3, nserver_groups=3, framework="diloco").worker_regime == "diloco"
