"""Train a tiny model while rank 1 misbehaves at step 5; every rank reports how it ended.

    python fault_train.py MODE              # under troupe run
    python fault_train.py MODE --ticket N   # the Ticket + multiprocessing pattern, no supervisor

With --ticket the ranks are forked from this process once it has imported torch and torch._dynamo (every
optimizer imports it), as `troupe run` forks its ranks from its zygote: a spawned rank imported both again (about
6 s of CPU a rank). What is tested is how the ranks see each other's faults, not how they were started (the
launchers' tests start the Ticket pattern with spawn, as a user's script does).

MODE: ok | kill (SIGKILL) | raise | stop (SIGSTOP: alive but silent) | hang (sleeps in Python) |
      nan | nan-skip
"""

import multiprocessing
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import troupe


def train(mode, ticket=None, local_rank=None, world_size=None):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    policy = "skip" if mode == "nan-skip" else "raise"
    opt = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), ticket=ticket, local_rank=local_rank,
                         world_size=world_size, nan_policy=policy)
    rank = opt.global_rank
    g = torch.Generator().manual_seed(rank)
    for step in range(12):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        if rank == 1 and step == 5 and mode != "ok":
            print(f"FAULT {mode} at {time.time():.3f}", flush=True)
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            if mode == "raise":
                raise ValueError("boom")
            if mode == "hang":
                time.sleep(600)
            if mode in ("nan", "nan-skip"):
                x[0, 0] = float("nan")
        opt(F.cross_entropy(model(x), y))
        time.sleep(0.05)
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    line = (f"rank {rank} finished: steps={opt.step_count} skipped={opt.skipped_steps} finite={finite} "
            f"checksum={sum(float(p.sum()) for p in model.parameters()):.6f}\n")
    sys.stdout.flush()
    os.write(1, line.encode())  # one write: the ranks share the pipe, and print's parts can interleave


if __name__ == "__main__":
    mode = sys.argv[1]
    if len(sys.argv) > 2 and sys.argv[2] == "--ticket":
        import torch._dynamo  # noqa: F401  (once here, not in each rank; it starts no thread)

        ticket, n = troupe.Ticket(), int(sys.argv[3])
        ctx = multiprocessing.get_context("fork")
        procs = [ctx.Process(target=train, args=(mode, ticket, r, n)) for r in range(n)]
        for p in procs:
            p.start()
        # Once a rank has failed, survivors get 10 s to notice and report on their own; then
        # stragglers (stopped or hung ranks) are killed, as a cluster manager would. A stopped or
        # hung rank never reports: once the other has, there is nobody left to wait for.
        grace = 1 if mode in ("stop", "hang") else 10
        ended: dict[int, float] = {}
        first_failure = None
        while len(ended) < n:
            for r, p in enumerate(procs):
                if r not in ended and not p.is_alive():
                    ended[r] = time.time()
                    if p.exitcode and first_failure is None:
                        first_failure = ended[r]
            if first_failure is not None and time.time() - first_failure > grace:
                break
            time.sleep(0.02)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        print("exit codes", [p.exitcode for p in procs], flush=True)
        for r, t in sorted(ended.items()):
            print(f"EXIT rank {r} code {procs[r].exitcode} at {t:.3f}", flush=True)
        sys.exit(1 if any(p.exitcode for p in procs) else 0)
    train(mode)
