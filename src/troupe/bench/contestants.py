"""The CONTESTANTS registry: named ways to train one step of a workload.

Every factory builds its own copy of the model (same initial weights for the same
seed), its own optimizer (SGD lr 0.005, momentum 0.9, weight decay 1e-5) and returns
a `Contestant` whose step `i` trains on batch ``i % len(batches)``. With ``micro > 1``
a step is gradient accumulation: the batch is cut into `micro` micro-batches, the
first ``micro - 1`` run backward under ``no_sync()``, the last one reduces, then
``clip_grad_norm_`` (when `clip` is set) and the optimizer step: the same sequence for
DDP (its own ``no_sync``) and troupe (``DistOpt.no_sync``).

* ``ddp``:    PyTorch DistributedDataParallel (buffers not re-broadcast every forward, as troupe), optionally
              with torch's ``powerSGD_hook``;
* ``troupe``: troupe.DistOpt with a `bucket_size`, SINGA style ``sgd(loss)`` or a dist_option
              through ``sgd.update(loss, option, spars)``; PyTorch style when accumulating;
* ``flat``:   backward, then ONE all-reduce of every gradient in one flat buffer, then step;
* ``local``:  no communication at all (the floor).

Steps of troupe contestants return the wire bytes the default Communicator counted.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from troupe.observe.turns import Contestant
from troupe.bench.options import bucket_label
from troupe.bench.workloads import Batch, Workload


def make_sgd(params) -> torch.optim.SGD:
    return torch.optim.SGD(params, lr=0.005, momentum=0.9, weight_decay=1e-5)


def _train_step(workload: Workload, model: nn.Module, batches: list[Batch], backward: Callable[[Tensor], None],
                finish: Callable[[], None], micro: int, no_sync: Callable[[], Any] | None) -> Callable[[int], None]:
    """A step: forward + `backward(loss)` per micro-batch (all but the last under `no_sync`), then `finish()`."""

    def step(i: int) -> None:
        x, y = batches[i % len(batches)]
        if micro == 1:
            backward(workload.loss(model, (x, y)))
        else:
            for j, mb in enumerate(zip(x.chunk(micro), y.chunk(micro))):
                with no_sync() if j < micro - 1 else nullcontext():
                    backward(workload.loss(model, mb) / micro)
        finish()

    return step


def _clip(model: nn.Module, clip: float | None) -> None:
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)


def ddp(workload: Workload, batches: list[Batch], *, seed: int = 0, bucket_cap_mb: float = 25.0, micro: int = 1,
        clip: float | None = None, name: str = "DDP", powersgd_rank: int | None = None,
        powersgd_start: int = 2) -> Contestant:
    """PyTorch DDP; `micro` > 1 accumulates under DDP's own ``no_sync``; a `powersgd_rank` registers torch's
    ``powerSGD_hook`` (compressing from step `powersgd_start`, at least 2 under DDP)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    # troupe syncs buffers once at start, not every forward: make DDP do the same.
    no_buffer_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in
                      inspect.signature(DDP.__init__).parameters else {"broadcast_buffers": False})
    model = DDP(workload.model(seed), bucket_cap_mb=bucket_cap_mb, **no_buffer_sync)
    if powersgd_rank is not None:
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

        model.register_comm_hook(PowerSGDState(None, matrix_approximation_rank=powersgd_rank,
                                               start_powerSGD_iter=powersgd_start), powerSGD_hook)
    opt = make_sgd(model.parameters())

    def finish() -> None:
        _clip(model, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step = _train_step(workload, model, batches, lambda loss: loss.backward(), finish, micro, model.no_sync)
    params: dict[str, Any] = {"buckets": f"cap {bucket_cap_mb:g} MB"}
    if powersgd_rank is not None:
        params["powersgd_rank"] = powersgd_rank
    return Contestant(name, step, params)


def troupe_opt(workload: Workload, batches: list[Batch], *, seed: int = 0, bucket_size: int | str | None = None,
               option: str = "plain", spars: float | None = None, micro: int = 1, clip: float | None = None,
               chunk_size: int | None = None, name: str | None = None, loop: str = "singa",
               powersgd_rank: int | None = None, powersgd_start: int | None = None) -> Contestant:
    """troupe.DistOpt: SINGA style (``sgd(loss)`` / ``sgd.update``), or PyTorch style (``loss.backward();
    sgd.synchronize(); sgd.step(); sgd.zero_grad()``, under the DistOpt's `option`) with ``loop="torch"`` and
    always when accumulating."""
    import troupe
    from troupe.runtime import world

    model = workload.model(seed)
    kwargs: dict[str, Any] = {}
    if bucket_size is not None:
        total = sum(p.numel() for p in model.parameters())
        size = total if bucket_size == "all" else bucket_size
        kwargs = {"bucket_size": size, "first_bucket_size": size} if bucket_size == "all" else {"bucket_size": size}
    if chunk_size is not None:
        kwargs["compression"] = troupe.CompressionConfig(chunk_size=chunk_size)
    sgd = troupe.DistOpt(make_sgd(model.parameters()), dist_option=option, powersgd_rank=powersgd_rank,
                         powersgd_start=powersgd_start, **kwargs)
    sgd.sync_parameters(model)
    comm = world.init().comm
    if micro == 1 and clip is None and loop == "singa":
        inner = _train_step(workload, model, batches, lambda loss: sgd.update(loss, option, spars), lambda: None,
                            1, None)
    else:
        if option != "plain" and (micro > 1 or clip is not None):
            raise ValueError(f"accumulation and clipping use the plain update, not dist_option {option!r}")

        def finish() -> None:
            sgd.synchronize()  # p.grad now holds the mean over ranks (a no-op wait if backward reduced it)
            _clip(model, clip)
            sgd.step()
            sgd.zero_grad()

        inner = _train_step(workload, model, batches, lambda loss: loss.backward(), finish, micro, sgd.no_sync)

    def step(i: int) -> dict[str, float]:
        before = comm.bytes_sent()
        inner(i)
        return {"wire_bytes": float(comm.bytes_sent() - before)}

    buckets = getattr(sgd, "reducer", None) and sgd.reducer.buckets
    label = name or (f"troupe bucket {bucket_label(bucket_size)}" if bucket_size is not None else f"troupe {option}")
    if loop == "torch" and name is None:
        label += " (PyTorch loop)"
    params: dict[str, Any] = {"buckets": len(buckets) if buckets else "-", "option": option}
    if bucket_size is not None:
        params["bucket_size"] = bucket_label(bucket_size)
    if spars is not None:
        params["spars"] = spars
    if powersgd_rank is not None:
        params["powersgd_rank"] = powersgd_rank
    return Contestant(label, step, params)


def flat(workload: Workload, batches: list[Batch], *, seed: int = 0, name: str = "flat all-reduce") -> Contestant:
    """Backward, then one mean all-reduce of all gradients in one flat buffer (no overlap), then step."""
    from troupe.runtime import world

    model = workload.model(seed)
    opt = make_sgd(model.parameters())
    comm = world.init().comm
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():  # start equal, as DDP and DistOpt do
        start = torch.cat([p.reshape(-1) for p in params])
        comm.broadcast(start, src=0)
        torch.nn.utils.vector_to_parameters(start, params)

    def finish() -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        buffer = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(buffer, "mean")
        offset = 0
        for p in params:
            p.grad = buffer[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Contestant(name, _train_step(workload, model, batches, lambda loss: loss.backward(), finish, 1, None),
                      {"buckets": 1})


def local(workload: Workload, batches: list[Batch], *, seed: int = 0, micro: int = 1, clip: float | None = None,
          name: str = "local (no communication)") -> Contestant:
    """The same model and optimizer with no communication (the floor)."""
    model = workload.model(seed)
    opt = make_sgd(model.parameters())

    def finish() -> None:
        _clip(model, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Contestant(name, _train_step(workload, model, batches, lambda loss: loss.backward(), finish, micro,
                                        nullcontext), {"buckets": 0})


CONTESTANTS: dict[str, Callable[..., Contestant]] = {"ddp": ddp, "troupe": troupe_opt, "flat": flat, "local": local}
"""Factories by kind: ``CONTESTANTS[kind](workload, batches, **options)``."""


def get(kind: str) -> Callable[..., Contestant]:
    try:
        return CONTESTANTS[kind]
    except KeyError:
        raise ValueError(f"unknown contestant kind {kind!r}; choose one of {sorted(CONTESTANTS)}") from None
