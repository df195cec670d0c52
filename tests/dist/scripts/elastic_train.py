"""A tiny elastic job: every worker group logs which groups each of its steps averaged over.

    troupe run -n 3 --elastic tests/dist/scripts/elastic_train.py OUT MODE [DIST_OPTION]
    troupe run -n 4 --elastic --nworker-groups 2 tests/dist/scripts/elastic_train.py OUT group-kill
    troupe run -n 3 --elastic --framework diloco --sync-freq 4 tests/dist/scripts/elastic_train.py OUT kill

MODE (faults in first incarnations only, unless said otherwise):
  ok
  kill          rank 1 SIGKILLs itself at step 6; once it is back, rank 0 raises
  kill-once     rank 1 SIGKILLs itself at step 6
  kill-in-step  rank 1 SIGKILLs itself in its optimizer's step of step 6 (after the step's agreement: under
                partialUpdate, the others have stepped and wait in the chunk's averaging)
  kill-member   the highest-numbered group of the last step's quorum SIGKILLs itself at step 6
  two-down      at step 6 rank 1 SIGKILLs itself and rank 2 raises: too few groups until one is back (the same
                step: a restart forked from the launcher's zygote is back within a step or two)
  stop          rank 2 SIGSTOPs itself at step 6 and writes OUT/stopped (the test sends SIGCONT)
  always-raise  rank 1 raises at step 6, and at its first step back every time
  group-kill    rank 3 (group 1's second process) SIGKILLs itself at step 6: its whole group restarts
  nodes-kill    on 2 nodes of 2: rank 3 (node 1) SIGKILLs itself at step 6; once it is back, rank 0 raises
  node0-dies    on several nodes: rank 0 writes OUT/node0 at step 6 (the test SIGKILLs node 0's launcher); after 3
                steps of the other nodes' groups alone the last rank SIGKILLs itself (its launcher restarts it);
                the job ends after FULL_STREAK steps of the other nodes' groups
  group-stop    rank 3 (group 1's second process) SIGSTOPs itself at step 6 and writes OUT/stopped
  group-kill-in-step  rank 3 SIGKILLs itself in its optimizer's step of step 6 (after the step's vote committed it)
ELASTIC_TEST_CHUNK: partialUpdate's chunk size. ELASTIC_TEST_PARTITION (a JSON troupe.partition plan, e.g. {"0": 1, "2": -1},
or "auto-job": plan "auto" with link "job") partitions the model inside each worker group; ELASTIC_TEST_ADAMW=1: AdamW
(weight decay 0.1) instead of SGD with momentum; ELASTIC_TEST_FSDP=1: the model sharded by troupe.shard inside each
worker group (its parameters written whole); OUT/rank{r}.pt then holds the whole model, put together from the group's slices.
The job trains until it has taken MIN_STEPS steps and the last FULL_STREAK of them had every group (or
--max-groups of them)
(the same verdict on every member: they commit the same steps); under DiLoCo, until such a step is
also an outer step (the groups hold the same parameters only then). Each rank writes OUT/rank{r}.json
(its last incarnation) and OUT/rank{r}.pt (parameters).
"""

import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import troupe

EPOCHS, BATCH, SAMPLES, MIN_STEPS, FULL_STREAK = 100, 8, 720, 30, 8
FAULT_AT = int(os.environ.get("ELASTIC_TEST_FAULT_AT", "6"))
"""The step count at which the faults come (a test may move it, e.g. into an outer step)."""
CLIP = float(os.environ.get("ELASTIC_TEST_CLIP", "0"))
"""Clip each step's gradients to this total norm (troupe.clip_grad_norm_; 0: no clipping)."""


def fault(mode: str, rank: int, incarnation: int, step: int, log: list, out: Path, groups: int) -> None:
    if incarnation == 0 and step == FAULT_AT:
        if mode == "kill-member" and log and rank == max(log[-1][2] or [-1]):
            os.kill(os.getpid(), signal.SIGKILL)
        if (mode in ("kill", "kill-once", "two-down") and rank == 1) or (mode in ("group-kill", "nodes-kill") and rank == 3):
            os.kill(os.getpid(), signal.SIGKILL)
        if (mode, rank) in (("stop", 2), ("group-stop", 3)) and not (out / "stopped").exists():
            (out / "stopped").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
    if mode in ("kill", "nodes-kill") and rank == 0 and incarnation == 0 and step > FAULT_AT \
            and log[-1][2] == list(range(groups)):
        raise RuntimeError("boom")  # a second failure, of another kind, once the first is back: rank 0 is not special
    if mode == "node0-dies" and rank == 0 and step == FAULT_AT:
        (out / "node0").write_text(str(os.getpid()))
    if mode == "node0-dies" and rank == groups - 1 and incarnation == 0 and [m for _, _, m in log].count(
            without_node_0(groups)) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "two-down" and rank == 2 and incarnation == 0 and step == FAULT_AT:
        raise RuntimeError("boom")  # as rank 1 dies
    if mode == "always-raise" and rank == 1 and (incarnation > 0 or step == FAULT_AT):
        raise RuntimeError("boom, every time")


def without_node_0(groups: int) -> list[int]:
    """The groups (of one process) on every node but node 0, which runs the first LOCAL_WORLD_SIZE ranks."""
    return list(range(int(os.environ["LOCAL_WORLD_SIZE"]), groups))


def sync_freq() -> int | None:
    """DiLoCo's H when troupe run gives this job framework diloco, else None."""
    cluster = json.loads(os.environ.get("TROUPE_CLUSTER") or "{}")
    return cluster.get("sync_freq", 10) if cluster.get("framework") == "diloco" else None


def data():
    g = torch.Generator().manual_seed(123)
    return torch.randn(SAMPLES, 8, generator=g), torch.randint(0, 4, (SAMPLES,), generator=g)


def model_and_optimizer(plan=None, shard=False):
    """The model (partitioned inside the worker group by `plan`, a troupe.partition plan; sharded by troupe.shard
    with `shard`) and its optimizer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    if plan == "auto-job":  # planned with the step's costs timed in this job
        model = troupe.partition(model, "auto", sample=torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(5)),
                                 link="job")
    elif plan is not None:
        model = troupe.partition(model, plan)
    if shard:
        model = troupe.shard(model)
    if os.environ.get("ELASTIC_TEST_ADAMW") == "1":
        return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor (troupe.shard's), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def main(out: Path, mode: str, dist_option: str = "plain") -> None:
    torch.set_num_threads(1)
    incarnation = int(os.environ.get("TROUPE_INCARNATION", "0"))
    plan = json.loads(os.environ["ELASTIC_TEST_PARTITION"]) if os.environ.get("ELASTIC_TEST_PARTITION") else None
    model, sgd = model_and_optimizer(plan, shard=os.environ.get("ELASTIC_TEST_FSDP") == "1")
    if incarnation:
        torch.manual_seed(1000 + incarnation)  # a restart starts from other values: the heal must overwrite them
        with torch.no_grad():
            for p in model.parameters():
                local(p).normal_()
    chunk = int(os.environ.get("ELASTIC_TEST_CHUNK", "0"))  # partialUpdate's chunk size
    opt = troupe.DistOpt(sgd, dist_option=dist_option, spars=0.25 if dist_option.startswith("sparse") else None,
                         **({"compression": troupe.CompressionConfig(chunk_size=chunk)} if chunk else {}))
    rank = opt.global_rank
    if (mode, rank) in (("kill-in-step", 1), ("group-kill-in-step", 3)) and not incarnation:
        step = sgd.step

        def dying_step(*args, **kwargs):
            if opt.step_count == FAULT_AT:
                os.kill(os.getpid(), signal.SIGKILL)
            return step(*args, **kwargs)

        sgd.step = dying_step
    train = troupe.data.loader(data(), BATCH, seed=7, tail="drop", drop_last=True,
                               num_workers=int(os.environ.get("LOADER_WORKERS", "0")))
    per_epoch = len(train)  # before the heal: a resumed sampler counts what is left of its epoch
    steps = troupe.track(model=model, optimizer=opt, sampler=train.sampler)
    where = train.sampler.state_dict()
    start_epoch, start_batch = where["epoch"], where["position"] // (opt.world_size * BATCH)
    membership = opt.world.membership
    healed = {"steps": steps, "params": [local(p).detach().clone() for p in model.parameters()],
              # the optimizer's state as held (a sharded DistOpt's: its parts' only), every tensor of it
              "momentum": [local(v).clone() for g in opt.param_groups for p in g["params"]
                           for v in opt.state[p].values() if torch.is_tensor(v) and v.dim()],
              "strategy": opt.state_dict()["strategies"]} if incarnation else None
    log: list = []
    streak = 0
    for epoch in range(start_epoch, EPOCHS):
        train.sampler.set_epoch(epoch)
        batches = iter(train)
        for b in range(start_batch if epoch == start_epoch else 0, per_epoch):
            x, y = next(batches)
            fault(mode, rank, incarnation, opt.step_count, log, out, membership.options.groups)
            F.cross_entropy(model(x), y).backward()
            if CLIP:
                opt.synchronize()
                troupe.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
            members = list(membership.stepped_with) if membership.stepped_with else None
            log.append([epoch, b, members])
            full = without_node_0(membership.options.groups) if mode == "node0-dies" \
                else list(range(membership.options.cap))  # (or max_groups of them)
            streak = streak + 1 if members and len(members) == len(full) and (mode != "node0-dies" or members == full) \
                else 0
            if opt.step_count >= MIN_STEPS and streak >= FULL_STREAK and opt.step_count % (sync_freq() or 1) == 0:
                break
            time.sleep(0.05)
        else:
            continue
        break
    if plan is not None:
        params = list(troupe.partition.full_state_dict(model).values())  # the group's slices put together
    else:  # a sharded model's shards gathered inside the group
        params = [p.full_tensor().detach() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]
    digest = hashlib.sha256(b"".join(p.numpy().tobytes() for p in params)).hexdigest()
    torch.save({"params": params, "healed": healed}, out / f"rank{rank}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "incarnation": incarnation, "heals": membership.heals, "steps": opt.step_count,
        "heal_bytes": membership.heal_bytes,
        "resumed_at": steps, "log": log, "sha256": digest, "warm": os.environ.get("TROUPE_WARM_START") == "1",
        "plan": None if plan is None else [r.partition_dim for r in troupe.partition.describe(model)]}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:])
