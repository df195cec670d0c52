"""troupe.shard without processes: the blocks it finds, and its bad input (one line naming the value)."""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import troupe
from troupe.cluster.configuration.presets import preset
from troupe.sharding.fsdp import _groups, _policy, block_names, repeated_blocks
from troupe.strategies import fsdp, registry
from troupe.strategies.fsdp import SHARDED_BY, Sharding, check_cluster, claim_params


class Block(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.inner = nn.Sequential(nn.Linear(width, 2), nn.Linear(2, width))  # repeated too, but smaller


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.mixed = nn.Sequential(nn.Linear(8, 8), nn.ReLU())  # not one class: not blocks
        self.head = nn.Linear(8, 10)


def test_default_blocks_are_the_largest_repeated_children():
    assert repeated_blocks(Net()) == ["layers.0", "layers.1", "layers.2"]
    assert repeated_blocks(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3))) == ["0", "1"]
    assert repeated_blocks(nn.Linear(2, 2)) == []  # one unit: the model itself


def test_blocks_by_name_or_class():
    assert block_names(Net(), "head") == ["head"]
    assert block_names(Net(), ["layers.0", "layers.0.inner", "layers.0"]) == ["layers.0", "layers.0.inner"]
    assert block_names(Net(), Block) == ["layers.0", "layers.1", "layers.2"]
    assert block_names(Net(), (nn.Embedding, Block)) == ["embed", "layers.0", "layers.1", "layers.2"]


def test_unknown_blocks_name_the_value_and_the_candidates():
    with pytest.raises(ValueError, match=r"blocks names 'layers\.7', which is not a module of Net; candidates: "
                                         r"\['layers\.0', 'layers\.1', 'layers\.2'\]"):
        troupe.shard(Net(), blocks="layers.7")  # refused before joining any job
    with pytest.raises(ValueError, match=r"blocks=Conv2d matches no module of Net; its module classes are \['Block'"):
        block_names(Net(), nn.Conv2d)
    with pytest.raises(TypeError, match="blocks must be module names or a module class, got 3"):
        block_names(Net(), [3])


def test_bad_mixed_precision_and_groups():
    with pytest.raises(ValueError, match="mixed_precision must be 'bf16', a torch MixedPrecisionPolicy or None, "
                                         "got 'fp16'"):
        troupe.shard(Net(), mixed_precision="fp16")
    policy = _policy("bf16")
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    four = SimpleNamespace(world_size=4)
    assert _groups(four, 2) == 2
    for bad in (3, 0, True, "2"):
        with pytest.raises(ValueError, match=f"groups must be a positive divisor of the world size .4., got {bad!r}"):
            _groups(four, bad)
    with pytest.raises(TypeError, match="troupe.shard takes a torch.nn.Module, got list"):
        troupe.shard([])


def test_shard_after_the_distopt_is_refused():
    model = Net()
    assert claim_params(torch.optim.SGD(model.parameters(), lr=0.1), "plain") is None  # what DistOpt asks
    with pytest.raises(ValueError, match=r"troupe.shard\(model\) must come before the DistOpt"):
        troupe.shard(model)


def sharded_looking(model):
    """Parameters marked as troupe.shard marks them (no process group needed for the checks)."""
    sharding = Sharding(weakref.ref(model), 1, 1)
    for p in model.parameters():
        setattr(p, SHARDED_BY, sharding)
    return model


def test_a_sharded_model_picks_its_regime_and_refuses_other_options():
    model = sharded_looking(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert claim_params(opt, "plain") is fsdp.FullySharded
    assert claim_params(opt, "fsdp") is fsdp.FullySharded
    assert claim_params(opt, "plain", preset("allreduce")) is fsdp.FullySharded  # SINGA's AllReduce framework
    for option in ("fp16", "sparseTopK", "partialUpdate", "powerSGD"):
        with pytest.raises(ValueError, match=f"^dist_option '{option}' cannot run on a model sharded by troupe.shard: "
                                             "make the DistOpt with the default dist_option"):
            claim_params(opt, option)
    with pytest.raises(ValueError, match=r"DistOpt\(shard='optimizer'\) on a model troupe.shard already sharded"):
        claim_params(opt, "plain", shard="optimizer")  # ZeRO-1/2's DistOpt(shard=...) over a sharded model
    with pytest.raises(ValueError, match="cannot train under the cluster's 'ps-client' workers: leave the cluster out"):
        claim_params(opt, "plain", preset("downpour"))
    with pytest.raises(ValueError, match=r"use troupe.shard\(model, groups=G\) \(HSDP\)"):
        check_cluster(preset("hogwild"))  # asynchronous groups
    with pytest.raises(ValueError, match=r"mixes parameters of the model troupe.shard sharded with 1 other"):
        claim_params(torch.optim.SGD([*model.parameters(), nn.Parameter(torch.zeros(1))]), "plain")


def test_fsdp_is_a_regime_that_only_a_sharded_model_runs():
    regime = registry.lookup("fsdp")
    assert regime is fsdp.FullySharded and not regime.replicated
    assert not (regime.supports.graph_mode or regime.supports.partition)
    assert regime.supports.elastic  # inside each elastic worker group (tests/dist/test_elastic.py)
    world = SimpleNamespace(membership=SimpleNamespace(elastic=False))
    setup = SimpleNamespace(world=world, optimizer=torch.optim.SGD(Net().parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"dist_option 'fsdp' trains a model sharded by troupe.shard: call model = "
                                         r"troupe.shard\(model\) before"):
        regime.choose(setup)
    with pytest.raises(ValueError, match="dist_option 'fsdp' trains a model sharded by troupe.shard"):
        regime.build(None)  # SINGA's update(loss, "fsdp") on a DistOpt over a plain model
    with pytest.raises(ValueError, match="dist_option 'bf16' cannot run on a model sharded by troupe.shard"):
        regime.accept(registry.lookup("bf16"))
    regime.accept(registry.lookup("fp32"))
