"""`troupe.track`: what a script hands over so that an elastic job can heal a restarted worker.

Under `troupe run --elastic` a restarted worker copies the live state of a healthy one before
its first step, and nobody else restarts. troupe reaches the optimizer's state through the
DistOpt; what else the step depends on the script names once, before its loop:

>>> step = troupe.track(model=model, optimizer=sgd, sampler=train.sampler)

On a worker that (re)joins a running job this loads the model (parameters and buffers), the
optimizer (its state, the DistOpt's step counter and strategy state), the sampler (epoch and
position) and the RNG from a healthy worker, and returns the steps taken, from which the
loop resumes; a fresh job's workers all take the first worker's state (so every group starts
bit-identical) and get 0. Outside an elastic job it does nothing and returns None.

A script that never calls it (a DDP-shaped one) still runs elastic: its worker joins at the first
forward of the module holding the DistOpt's parameters and heals that module, the DistOpt and the
RNG; its loop and data then start from the script's own beginning after a restart.
"""

from __future__ import annotations

from typing import Any

from troupe.runtime import world as world_mod


def track(*, model: Any = None, optimizer: Any = None, sampler: Any = None, **others: Any) -> int | None:
    """Keep these objects' state (each has ``state_dict``/``load_state_dict``) the same in every worker group."""
    objects = {name: obj for name, obj in dict(model=model, optimizer=optimizer, sampler=sampler, **others).items()
               if obj is not None}
    for name, obj in objects.items():
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"troupe.track: {name}={type(obj).__name__} has no state_dict()/load_state_dict()")
    if "optimizer" in objects and not hasattr(objects["optimizer"], "step_count"):
        raise TypeError("troupe.track: optimizer= must be the troupe.DistOpt (its step counter is the job's)")
    return world_mod.init().membership.track(objects)
