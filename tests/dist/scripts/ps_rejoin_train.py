"""A tiny Downpour job under `troupe run --elastic`: a worker killed mid-run restarts alone and rejoins.

    troupe run -n 2 --elastic --framework downpour --nworker-groups 1 --nservers-per-group 1 \
        tests/dist/scripts/ps_rejoin_train.py OUT MODE
    troupe run -n 4 --elastic --framework downpour tests/dist/scripts/ps_rejoin_train.py OUT MODE

MODE (faults in first incarnations only):
  ok
  kill        the highest-numbered worker SIGKILLs itself at step FAULT_AT (after that step's record)
  kill-twice  the same, and again 5 steps after it is back
  stop        the highest-numbered worker writes OUT/stopped (its pid) and SIGSTOPs itself at step FAULT_AT
              (the test sends SIGCONT)
  kill-server the highest-numbered worker SIGKILLs its server at step FAULT_AT (and waits until it is gone),
              then itself 5 steps later
  stop-server the highest-numbered worker SIGSTOPs its server at step FAULT_AT, and trains on
Every worker takes STEPS steps of its own shard; each writes OUT/rank{r}.json (its last incarnation:
where it resumed, the batches it took) and OUT/rank{r}.pt (its parameters after its last step, i.e.
the servers' values after its last update).
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from elastic_train import data, model_and_optimizer  # the same data and model as the synchronous jobs

import troupe

STEPS, BATCH, SAMPLES, FAULT_AT = 24, 8, 720, 7
PAUSE = float(os.environ.get("PAUSE", "0.01"))
"""Seconds each step sleeps (Hogwild's test gives its survivors time to see a new life come back)."""


def main(out: Path, mode: str) -> None:
    torch.set_num_threads(1)
    incarnation = int(os.environ.get("TROUPE_INCARNATION", "0"))
    model, sgd = model_and_optimizer()
    if incarnation:
        torch.manual_seed(1000 + incarnation)  # a restart starts from other values: the servers' must replace them
        for p in model.parameters():
            p.data.normal_()
    opt = troupe.DistOpt(sgd)
    rank, workers = opt.global_rank, opt.world_size
    fetched = [p.detach().clone() for p in model.parameters()]  # what the DistOpt's first Get gave
    train = troupe.data.loader(data(), BATCH, seed=7, tail="drop", drop_last=True)
    resumed = troupe.track(model=model, optimizer=opt, sampler=train.sampler)
    where = train.sampler.state_dict()
    per_epoch = len(data()[0]) // workers // BATCH
    log, back_at = [], opt.step_count
    epoch = where["epoch"]
    while opt.step_count < STEPS:
        train.sampler.set_epoch(epoch)
        batches = iter(train)
        first = where["position"] // (workers * BATCH) if epoch == where["epoch"] else 0
        for b in range(first, per_epoch):
            if opt.step_count >= STEPS:
                break
            fatal = rank == workers - 1 and incarnation == 0 and opt.step_count == FAULT_AT and mode != "ok"
            again = mode == "kill-twice" and rank == workers - 1 and incarnation == 1 and \
                opt.step_count == back_at + 5
            if fatal and mode == "kill-server":
                signal_my_server(opt, signal.SIGKILL)
            elif fatal and mode == "stop-server":
                signal_my_server(opt, signal.SIGSTOP)
            elif mode == "kill-server" and rank == workers - 1 and incarnation == 0 and opt.step_count == FAULT_AT + 5:
                os.kill(os.getpid(), signal.SIGKILL)
            elif fatal and mode == "stop":
                (out / "stopped").write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGSTOP)
            elif fatal or again:
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = next(batches)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            log.append([epoch, b])
            time.sleep(PAUSE)
        epoch += 1
    torch.save({"params": [p.detach() for p in model.parameters()], "fetched": fetched}, out / f"rank{rank}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "incarnation": incarnation, "resumed_at": resumed, "steps": opt.step_count, "log": log,
        "warm": os.environ.get("TROUPE_WARM_START") == "1", "failovers": getattr(opt.strategy, "failovers", []),
        "servers": sorted(set(getattr(opt.strategy, "server_of", {}).values()))}))


def signal_my_server(opt, sig: signal.Signals) -> None:
    """Send `sig` to the server of this worker's first slice (on this host); after a SIGKILL wait until its
    process has ended."""
    from troupe.cluster.serving.server import process_alive
    from troupe.runtime.world import current

    server = opt.strategy.server_of[0]
    host, pid = current().cluster_job.processes[server]
    os.kill(pid, sig)
    while sig == signal.SIGKILL and process_alive(host, pid):
        time.sleep(0.01)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
