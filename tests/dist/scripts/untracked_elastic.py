"""An elastic job whose script never calls troupe.track: troupe heals a restarted worker at its model's first
forward (parameters, the optimizer's state, the DistOpt's step count, the RNG).

    troupe run -n 2 --elastic tests/dist/scripts/untracked_elastic.py OUT [kill]

Each process starts from a model of its own (a different seed): the job's first quorum gives every one rank 0's.
With "kill", rank 1 SIGKILLs itself at step 3 of its first life. The loop runs to the DistOpt's step count
(which the heal restores), at least STEPS steps and until a step averaged both groups again; each rank then
writes OUT/rank{r}.pt (its parameters, step count and life).
"""

import os
import signal
import sys
import time

import torch
import torch.nn.functional as F

import troupe

STEPS, MOST = 12, 400
out, kill, rank = sys.argv[1], sys.argv[2:] == ["kill"], int(os.environ["RANK"])
life = int(os.environ.get("TROUPE_INCARNATION", "0"))
torch.manual_seed(os.getpid())
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
membership = troupe.init().membership
while opt.step_count < MOST and (opt.step_count < STEPS or len(membership.stepped_with or ()) < 2):
    if kill and rank == 1 and life == 0 and opt.step_count == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    g = torch.Generator().manual_seed(1000 * rank + opt.step_count)
    x = torch.randn(16, 8, generator=g)
    loss = F.mse_loss(model(x), x.sum(1, keepdim=True))
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.01)
torch.save({"model": model.state_dict(), "steps": opt.step_count, "life": life}, f"{out}/rank{rank}.pt")
