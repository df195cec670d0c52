"""DiLoCo (framework diloco) in one real world of 2 worker groups x 2 workers, against a single
process that simulates the groups with plain torch.optim: SGD and AdamW inner optimizers, the
outer Nesterov SGD; the groups bit-identical after each outer step; a resume from
DistOpt.state_dict() in the middle of an outer period equal to the uninterrupted run; Streaming
DiLoCo; and a model partitioned inside the groups."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from tests.dist.world import run_world
from troupe.cluster.configuration.config import ClusterConfig
from troupe.strategies.diloco import fragment_bounds
from troupe.strategies.pseudograd import decode, encode, wire_size

GROUPS, PER_GROUP = 2, 2
H = 3
STEPS = 8
"""Outer steps after steps 3 and 6; steps 7-8 end mid-period."""
RESUME_AT = 4
"""Mid-period: after the first outer step, before the second."""
BATCH = 4
FRAGMENTS = 3
"""Streaming DiLoCo: the model's 4 tensors in 3 fragments, syncing after steps 3k, 3k+1, 3k+2."""
OVERLAP = ({"delay": 0, "merge_alpha": 0.0}, {"delay": 1, "merge_alpha": 0.5},
           {"delay": 0, "merge_alpha": 0.0, "pseudo_grad_dtype": "int8"})
"""Streaming DiLoCo blocking, then each exchange overlapped with the next inner step and merged half-half,
then blocking with int8 pseudo-gradients."""
INT8_DRIFT = 0.02
"""How far int8 pseudo-gradients may take the run from the fp32 simulation in 8 steps (its rounding
is not reproduced: a code can flip where the simulation's Δ differs in its last bit); measured 2.0e-3."""
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9

INNER = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
}


def make_model() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def batch(step: int, worker: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker `worker`'s batch of step `step` (the same here and in the reference)."""
    g = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def train(rank: int, world_size: int, streaming_clusters: list[str], cluster: str):
    import troupe

    out = {}
    for name, make in INNER.items():
        model = make_model()
        opt = troupe.DistOpt(make(model.parameters()))
        snapshots, snapshot = [], None

        def run(first: int, last: int) -> None:
            nonlocal snapshot
            for t in range(first, last):
                if t == RESUME_AT and snapshot is None:
                    snapshot = copy.deepcopy((model.state_dict(), opt.state_dict()))
                x, y = batch(t, rank)
                loss_of(model, x, y).backward()
                opt.step()
                opt.zero_grad()
                if (t + 1) % H == 0 and len(snapshots) < STEPS // H:
                    snapshots.append(flat(model))

        run(0, STEPS)
        uninterrupted = flat(model)
        model.load_state_dict(snapshot[0])
        opt.load_state_dict(snapshot[1])
        run(RESUME_AT, STEPS)
        out[name] = {"outer": snapshots, "final": uninterrupted, "resumed": flat(model),
                     "strategy": opt.strategy.name}
    out["wire"] = quantised_means(opt.strategy.place, rank // PER_GROUP)
    out["streaming"] = [streaming(c) for c in streaming_clusters]
    out["partitioned"] = partitioned(cluster)
    out["sharded"] = sharded(cluster)
    return out


PLAN = {"0": -1}
"""Inside each group: the first layer on worker 0 (its 5 outputs do not split in two), the second replicated."""


def partitioned(cluster: str) -> list[torch.Tensor]:
    """DiLoCo over a model partitioned inside each worker group (SGD inner): the whole model (the group's
    slices put together) after every step."""
    return sgd_every_step(cluster, PLAN)


def streaming(cluster: str) -> list[torch.Tensor]:
    """Streaming DiLoCo (fragments) with the SGD inner optimizer: the parameters after every step."""
    return sgd_every_step(cluster)


def sgd_every_step(cluster: str, plan: dict | None = None) -> list[torch.Tensor]:
    """A second DistOpt in the same world (it reads the cluster when it is made), SGD inner, over the model
    (partitioned by `plan` inside each group when given): the whole model after every step."""
    return sgd_run(cluster, plan)[0]


def sgd_run(cluster: str, plan: dict | None = None) -> tuple[list[torch.Tensor], object, int]:
    """`sgd_every_step`, the DistOpt, and the bytes its place communicator sent meanwhile."""
    import os

    import troupe

    os.environ["TROUPE_CLUSTER"] = cluster
    model = make_model() if plan is None else troupe.partition(make_model(), plan)
    opt = troupe.DistOpt(INNER["sgd"](model.parameters()))
    every_step, before = [], opt.strategy.place.bytes_sent()
    for t in range(STEPS):
        loss_of(model, *batch(t, opt.global_rank)).backward()
        opt.step()
        opt.zero_grad()
        every_step.append(flat(model) if plan is None else
                          torch.cat([v.reshape(-1) for v in troupe.partition.full_state_dict(model).values()]))
    return every_step, opt, opt.strategy.place.bytes_sent() - before


SHARDED = ({"fragments": 1}, {"fragments": FRAGMENTS, "delay": 1, "merge_alpha": 0.5})
"""DiLoCo with its outer state sharded over each group's 2 processes: plain, then Streaming overlapped."""


def sharded(cluster: str) -> list[dict]:
    """Each SHARDED variant (SGD inner) unsharded then sharded: the parameters after every step, the outer
    state's bytes this process holds, the place communicator's bytes, the chunk each fragment's state holds."""
    out = []
    for variant in SHARDED:
        runs = {}
        for shard in (None, "optimizer"):
            config = dataclasses.replace(ClusterConfig.from_json(cluster), shard=shard, **variant)
            every_step, opt, sent = sgd_run(config.to_json())
            state = opt.strategy.state_dict()["diloco"]
            states = state if isinstance(state, list) else [state]
            runs[shard] = {"every_step": every_step, "outer_bytes": opt.strategy.outer_bytes(),
                           "place_bytes": sent, "strategy": opt.strategy.name,
                           "chunks": [s.get("chunk") for s in states],
                           "saved": sum(s["outer"][0].numel() for s in states) if shard else None}
        out.append(runs)
    return out


DTYPES = ("fp32", "bf16", "fp8", "int8", "int4")
DELTA_SIZES = (3000, 7)


def group_deltas(group: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(50 + group)
    return [torch.randn(n, generator=g) * (group + 1) for n in DELTA_SIZES]


def quantised_means(place, group: int) -> dict[str, tuple[list[torch.Tensor], int]]:
    """Each pseudo_grad_dtype's mean of the groups' deltas over the place communicator, and its wire bytes."""
    from troupe.strategies.pseudograd import mean_over_groups

    out = {}
    for dtype in DTYPES:
        before = place.bytes_sent()
        deltas = group_deltas(group)
        mean_over_groups(place, deltas, dtype)
        out[dtype] = (deltas, place.bytes_sent() - before)
    return out


def quantised_reference(dtype: str) -> torch.Tensor:
    """The groups' decoded deltas added in group order, over the number of groups."""

    flats = [torch.cat(group_deltas(g)) for g in range(GROUPS)]
    total = torch.zeros_like(flats[0])
    for f in flats:
        total += decode(encode(f, dtype), f.numel(), dtype)
    return total / GROUPS


def reference(name: str, fragments: int = 1, delay: int = 0, alpha: float = 0.0
              ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[list[torch.Tensor]]]:
    """(Streaming) DiLoCo in one process: the first group's parameters after every outer step of
    fragment 0, each group's at the end, and every group's after every inner step (and the outer
    steps it ends with).

    Fragment j of `fragments` (`fragment_bounds`) takes Δ and its mean after each inner step t with
    (t + 1) % H == floor(j * H / fragments); `delay` inner steps later its own outer optimizer steps
    with that mean, and each group's fragment becomes alpha * its own + (1 - alpha) * θ_outer."""
    models = [make_model() for _ in range(GROUPS)]
    inner = [INNER[name](m.parameters()) for m in models]
    bounds = fragment_bounds([p.numel() for p in models[0].parameters()], fragments)
    outer_params = [p.detach().clone() for p in models[0].parameters()]
    outers = [torch.optim.SGD(outer_params[a:b], lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
              for a, b in bounds]
    after_outer, every_step, in_flight = [], [], []

    @torch.no_grad()
    def merge(j: int, means: list[torch.Tensor]) -> None:
        a, b = bounds[j]
        for o, mean in zip(outer_params[a:b], means):
            o.grad = mean
        outers[j].step()
        for m in models:
            for p, o in zip(list(m.parameters())[a:b], outer_params[a:b]):
                p.copy_(alpha * p + (1 - alpha) * o if alpha else o)
        if j == 0:
            after_outer.append(flat(models[0]))

    for t in range(STEPS):
        for g, (model, opt) in enumerate(zip(models, inner)):
            # the group's gradient: the mean of its workers' mean losses
            loss = sum(loss_of(model, *batch(t, g * PER_GROUP + j)) for j in range(PER_GROUP)) / PER_GROUP
            loss.backward()
            opt.step()
            opt.zero_grad()
        while in_flight and in_flight[0][0] == t + 1:
            merge(*in_flight.pop(0)[1:])
        for j, (a, b) in enumerate(bounds):
            if (t + 1) % H == j * H // fragments:
                with torch.no_grad():
                    means = [sum(outer_params[i] - list(m.parameters())[i] for m in models) / GROUPS
                             for i in range(a, b)]
                in_flight.append((t + 1 + delay, j, means))
                if delay == 0:
                    merge(*in_flight.pop()[1:])
        every_step.append([flat(m) for m in models])
    return after_outer, [flat(m) for m in models], every_step


@pytest.mark.timeout(120)
def test_diloco_groups_match_a_single_process_simulation_and_resume_mid_period():
    cluster = ClusterConfig(framework="diloco", nworker_groups=GROUPS, nworkers_per_group=PER_GROUP,
                            nserver_groups=GROUPS, nservers_per_group=PER_GROUP, sync_freq=H,
                            outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM)
    streaming_clusters = [dataclasses.replace(cluster, fragments=FRAGMENTS, **overlap).to_json()
                          for overlap in OVERLAP]
    ranks = run_world(train, GROUPS * PER_GROUP, streaming_clusters, cluster.to_json(), timeout=90,
                      env={"TROUPE_CLUSTER": cluster.to_json()})
    for name in INNER:
        after_outer, finals, _ = reference(name)
        got = [r[name] for r in ranks]
        assert got[0]["strategy"] == "diloco"
        for k, want in enumerate(after_outer):
            for rank, r in enumerate(got):  # every worker of every group: the same bits after an outer step
                assert torch.equal(r["outer"][k], got[0]["outer"][k]), (name, k, rank)
            torch.testing.assert_close(got[0]["outer"][k], want, rtol=0, atol=1e-5)
        for rank, r in enumerate(got):
            # mid-period the groups differ (own inner steps), the workers of one group do not
            torch.testing.assert_close(r["final"], finals[rank // PER_GROUP], rtol=0, atol=1e-5)
            assert torch.equal(r["resumed"], r["final"]), (name, rank)
        assert not torch.allclose(got[0]["final"], got[PER_GROUP]["final"])
    exact = sum(torch.cat(group_deltas(g)) for g in range(GROUPS)) / GROUPS
    fp32_bytes = ranks[0]["wire"]["fp32"][1]
    assert fp32_bytes == 2 * (GROUPS - 1) / GROUPS * 4 * sum(DELTA_SIZES)
    for dtype, bound in {"fp32": 1e-6, "bf16": 0.1, "fp8": 0.5, "int8": 0.1, "int4": 0.8}.items():
        want = quantised_reference(dtype)
        for rank, r in enumerate(ranks):  # every worker of every group: the same mean, bit for bit
            mean, sent = torch.cat(r["wire"][dtype][0]), r["wire"][dtype][1]
            torch.testing.assert_close(mean, want, rtol=0, atol=1e-6 if dtype == "fp32" else 0)
            assert torch.equal(mean, torch.cat(ranks[0]["wire"][dtype][0])), (dtype, rank)
            if dtype != "fp32":  # an all-gather of the encoded bytes: 1/2, ~1/4, ~1/8 of fp32's with 2 groups
                assert sent == (GROUPS - 1) * wire_size(sum(DELTA_SIZES), dtype), (dtype, sent, fp32_bytes)
        assert (want - exact).abs().max() < bound, dtype
    check_streaming(ranks)
    check_partitioned(ranks)
    check_sharded(ranks)


def check_sharded(ranks: list[dict]) -> None:
    """The outer state cut over each group's 2 processes: every step within 1e-5 of unsharded DiLoCo (and of
    the simulation); each process holds its chunk of theta_outer and the momentum (counted in bytes: the
    group's chunks add up to one unsharded copy) and sends only its chunk across the groups."""
    total = sum(p.numel() for p in make_model().parameters())
    for run, variant in enumerate(SHARDED):
        _, _, want = reference("sgd", variant["fragments"], variant.get("delay", 0), variant.get("merge_alpha", 0.0))
        got = [r["sharded"][run] for r in ranks]
        for rank, r in enumerate(got):
            for t in range(STEPS):
                torch.testing.assert_close(r["optimizer"]["every_step"][t], r[None]["every_step"][t], rtol=0,
                                           atol=1e-5, msg=lambda m: f"{variant} step {t} rank {rank}: {m}")
                torch.testing.assert_close(r["optimizer"]["every_step"][t], want[t][rank // PER_GROUP], rtol=0,
                                           atol=1e-5, msg=lambda m: f"{variant} step {t} rank {rank}: {m}")
            place = rank % PER_GROUP
            chunks = r["optimizer"]["chunks"]
            held = sum(hi - lo for lo, hi, _ in chunks)
            assert r["optimizer"]["saved"] == held, (variant, rank)  # the checkpoint holds the chunk, no more
            # theta_outer and the Nesterov momentum buffer, 4 bytes each per element held
            assert r[None]["outer_bytes"] == 2 * 4 * total, (variant, rank)
            assert r["optimizer"]["outer_bytes"] == 2 * 4 * held, (variant, rank)
            assert 0 < r["optimizer"]["place_bytes"] < r[None]["place_bytes"], (variant, rank)
            # the same place in every group holds the same chunks
            assert chunks == got[place]["optimizer"]["chunks"], (variant, rank)
        # a group's chunks of the state, and their bytes on the wire across groups (fp32, 2 groups: a ring
        # all-reduce sends 2(G-1)/G = 1 x each exchanged chunk), add up to one unsharded process's
        for g in range(GROUPS):
            group = got[g * PER_GROUP:(g + 1) * PER_GROUP]
            assert sum(hi - lo for r in group for lo, hi, _ in r["optimizer"]["chunks"]) == total, variant
            # beside it each process's verdict on finiteness, one fp32 flag per syncing step
            syncs = sum(any((t + 1) % H == j * H // variant["fragments"] for j in range(variant["fragments"]))
                        for t in range(STEPS))
            flags = (PER_GROUP - 1) * 4 * syncs
            assert sum(r["optimizer"]["place_bytes"] for r in group) == got[0][None]["place_bytes"] + flags, variant
            assert sum(r["optimizer"]["outer_bytes"] for r in group) == got[0][None]["outer_bytes"], variant


def check_partitioned(ranks: list[dict]) -> None:
    """A model partitioned inside the groups trains as the unpartitioned one does: after every step each
    group's whole model equals its simulation, and after an outer step every group's is the same bits."""
    _, _, want = reference("sgd")
    for t in range(STEPS):
        for rank, r in enumerate(ranks):
            torch.testing.assert_close(r["partitioned"][t], want[t][rank // PER_GROUP], rtol=0, atol=1e-5,
                                       msg=lambda m: f"partitioned, step {t}, rank {rank}: {m}")
            if (t + 1) % H == 0:
                assert torch.equal(r["partitioned"][t], ranks[0]["partitioned"][t]), (t, rank)


def check_streaming(ranks: list[dict]) -> None:
    """Streaming DiLoCo equals its simulation after every step, blocking and overlapped (int8: within
    INT8_DRIFT); blocking, a fragment is the same bits in every group after its outer step."""
    sizes = [p.numel() for p in make_model().parameters()]
    before = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    bounds = fragment_bounds(sizes, FRAGMENTS)
    assert bounds == [(0, 1), (1, 2), (2, 4)]  # 30 | 5 | 15 + 3 elements
    for run, overlap in enumerate(OVERLAP):
        _, _, want = reference("sgd", FRAGMENTS, overlap["delay"], overlap["merge_alpha"])
        got = [r["streaming"][run] for r in ranks]
        atol = INT8_DRIFT if "pseudo_grad_dtype" in overlap else 1e-5
        for t in range(STEPS):
            for rank, r in enumerate(got):
                torch.testing.assert_close(r[t], want[t][rank // PER_GROUP], rtol=0, atol=atol,
                                           msg=lambda m: f"{overlap} step {t} rank {rank}: {m}")
            assert not torch.equal(got[0][t], got[PER_GROUP][t])  # the other fragments differ
            if overlap["delay"]:
                continue
            j = [j for j in range(FRAGMENTS) if (t + 1) % H == j * H // FRAGMENTS]
            assert len(j) == 1, t  # H = FRAGMENTS: one fragment syncs after every step
            a, b = before[bounds[j[0]][0]], before[bounds[j[0]][1]]
            for rank, r in enumerate(got):
                assert torch.equal(r[t][a:b], got[0][t][a:b]), (t, rank)
