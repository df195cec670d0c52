"""Contestants with torch.compile: troupe's graph mode, a user's compiled model, DDP + compile.

Each one measures, besides its step time, how long the step waits for communication
once the gradient math is done ("exposed_time": from the end of autograd's backward
computation to the moment the optimizer step can start). A hook on the loss queues an
autograd callback before any reducer does, so it runs first when the backward's
computation ends; the time until ``backward()`` returns is what the reducer (troupe's or
DDP's) still waited for. Graph mode has no such boundary (its reduction is inside the
backward's graph), so it reports only step times.

* ``troupe_eager``:    DistOpt, PyTorch loop (``loss.backward(); step; zero_grad``), eager model;
* ``troupe_compiled``: the same with ``torch.compile(model)`` (`split` False: DistOpt(split_compiled=False));
* ``troupe_graph``:    ``DistOpt.compile_step`` (forward, backward + in-graph all-reduce, update);
* ``ddp_compiled``:    ``torch.compile(DDP(model))`` (dynamo's DDPOptimizer splits the graph).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from troupe.bench.contestants import make_sgd
from troupe.observe.turns import Contestant
from troupe.bench.workloads import Batch, Workload


def _exposed_backward(loss: Tensor) -> float:
    """``loss.backward()``; returns seconds from the end of the gradient computation to its return."""
    marks: list[float] = []

    def at_start(grad: Tensor) -> Tensor:
        torch.autograd.Variable._execution_engine.queue_callback(lambda: marks.append(time.perf_counter()))
        return grad

    loss.register_hook(at_start)
    loss.backward()
    return time.perf_counter() - marks[0]


def _torch_loop(workload: Workload, model: nn.Module, opt: Any, batches: list[Batch]) -> Callable[[int], dict]:
    def step(i: int) -> dict[str, float]:
        exposed = _exposed_backward(workload.loss(model, batches[i % len(batches)]))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return {"exposed_time": exposed}

    return step


def _distopt(model: nn.Module, **kwargs: Any):
    import troupe

    sgd = troupe.DistOpt(make_sgd(model.parameters()), **kwargs)
    sgd.sync_parameters(model)
    return sgd


def troupe_eager(workload: Workload, batches: list[Batch], *, seed: int = 0,
                 name: str = "troupe (eager model)") -> Contestant:
    model = workload.model(seed)
    sgd = _distopt(model)
    return Contestant(name, _torch_loop(workload, model, sgd, batches), {"option": "no"})


def troupe_compiled(workload: Workload, batches: list[Batch], *, seed: int = 0, split: bool = True,
                    name: str | None = None) -> Contestant:
    model = workload.model(seed)
    sgd = _distopt(model, split_compiled=split)
    from troupe.sync.compiled import unsplit

    loop = _torch_loop(workload, torch.compile(model), sgd, batches)

    def step(i: int) -> dict[str, float]:
        if split:  # compiled (in the burn-in) while this or another DistOpt splits graphs at buckets
            return loop(i)
        with unsplit():  # as if no DistOpt split graphs: one graph, one backward node
            return loop(i)

    label = name or ("troupe + torch.compile(model)" if split else "troupe + torch.compile(model), unsplit")
    return Contestant(label, step, {"option": "model, split at buckets" if split else "model, one graph"})


def troupe_graph(workload: Workload, batches: list[Batch], *, seed: int = 0, sequential: bool = False,
                 name: str | None = None, trial: int = 0) -> Contestant:
    """Graph mode's compiled step (`trial` 0: always compiled), or with a trial what a user gets by
    default: the compiled or the eager step, whichever the trial found faster (burn-in must cover it)."""
    model = workload.model(seed)
    sgd = _distopt(model, split_compiled=False)
    step_fn = sgd.compile_step(model, lambda x, y: workload.loss(model, (x, y)), sequential=sequential, trial=trial)

    facts = {"option": "whole step", "trial": trial}

    def step(i: int) -> None:
        step_fn(*batches[i % len(batches)])
        if step_fn.failed is not None:
            raise RuntimeError(f"graph mode fell back to eager: {step_fn.failed}")
        facts["chosen"] = step_fn.chosen  # the records are made after the run: they carry the choice

    label = name or ("troupe graph mode (trial)" if trial else
                     "troupe graph mode (sequential)" if sequential else "troupe graph mode")
    return Contestant(label, step, facts)


def ddp_compiled(workload: Workload, batches: list[Batch], *, seed: int = 0,
                 name: str = "DDP + torch.compile") -> Contestant:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(workload.model(seed), broadcast_buffers=False)
    opt = make_sgd(model.parameters())
    compiled = torch.compile(model)
    return Contestant(name, _torch_loop(workload, compiled, opt, batches), {"option": "DDP module"})


def ddp_eager(workload: Workload, batches: list[Batch], *, seed: int = 0, name: str = "DDP") -> Contestant:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(workload.model(seed), broadcast_buffers=False)
    opt = make_sgd(model.parameters())
    return Contestant(name, _torch_loop(workload, model, opt, batches), {"option": "no"})
