"""One worker of `chaos_torchft`: a torchft replica group of one process training the MNIST CNN.

Started by the supervisor as ``python -m troupe.bench.chaos_torchft worker --group G ...``;
torch and torchft are imported only here, inside the functions, so the supervisor's
`summarize` and `table` run without them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any


def import_torchft() -> Any:
    """torchft, or a one-line error saying how to install it."""
    try:
        import torchft
    except ImportError:
        raise SystemExit("chaos_torchft needs torchft: pip install torchft==0.2.0") from None
    return torchft


def build_cnn() -> Any:
    """examples/mnist_cnn.py's CNN as a plain nn.Module (conv 5x5x20, pool, conv 5x5x50, pool, fc 500, fc 10)."""
    import torch.nn.functional as F
    from torch import nn

    class CNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(1, 20, 5)
            self.conv2 = nn.Conv2d(20, 50, 5)
            self.linear1 = nn.Linear(4 * 4 * 50, 500)
            self.linear2 = nn.Linear(500, 10)

        def forward(self, x):
            y = F.max_pool2d(F.relu(self.conv1(x)), 2)
            y = F.max_pool2d(F.relu(self.conv2(y)), 2)
            return self.linear2(F.relu(self.linear1(y.flatten(1))))

    return CNN()


def params_sha256(module: Any) -> str:
    """sha256 of the parameters' bytes, concatenated in the order of their sorted names."""
    h = hashlib.sha256()
    for _, p in sorted(module.named_parameters()):
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


@dataclass
class Shard:
    """Group `group`'s shard of the training set; the batch of a step is a function of the step.

    A group healed from a peer takes the peer's step, so it reads the right batch without
    any data-loader state in the checkpoint.
    """

    x: Any
    y: Any
    group: int
    groups: int
    batch_size: int
    seed: int
    _perm: tuple[int, Any] = field(default=(-1, None), repr=False)

    def batch(self, step: int) -> tuple[Any, Any]:
        import torch

        per_epoch = (len(self.y) // self.groups) // self.batch_size
        epoch, i = divmod(step, per_epoch)
        if self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch * 1000 + self.group)
            idx = torch.arange(self.group, len(self.y), self.groups)
            self._perm = (epoch, idx[torch.randperm(len(idx), generator=g)])
        take = self._perm[1][i * self.batch_size:(i + 1) * self.batch_size]
        return self.x[take], self.y[take]


def stop_step(out: Path) -> int | None:
    """The step at which every group stops, once the supervisor has written it."""
    path = out / "stop"
    return int(path.read_text()) if path.exists() else None


def make_manager(ft: Any, args: argparse.Namespace, module: Any, optimizer: Any) -> tuple[Any, Any]:
    """The group's torchft Manager over a reconfigurable Gloo group, and the group's TCPStore."""
    from torch.distributed import TCPStore

    def state_dict() -> dict[str, Any]:  # what a healing group receives from a live peer
        return {"model": module.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        module.load_state_dict(sd["model"])
        optimizer.load_state_dict(sd["optim"])

    # torchft expects one store per replica group; this group's one process hosts it.
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = ft.Manager(
        pg=ft.ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout)),
        min_replica_size=args.min_groups, load_state_dict=load_state_dict, state_dict=state_dict,
        timeout=timedelta(seconds=args.timeout), rank=0, world_size=1,
        store_addr="localhost", store_port=store.port, lighthouse_addr=args.lighthouse,
        replica_id=f"group{args.group}", hostname="localhost")
    return manager, store


def train_step(manager: Any, model: Any, optimizer: Any, grads: list, x: Any, y: Any, mode: str) -> bool:
    """One step; whether it was committed (the optimizer steps only then)."""
    import torch.nn.functional as F

    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()  # --mode ddp: torchft's comm hook all-reduces here
    if mode == "allreduce":
        works = [manager.allreduce(p.grad) for _, p in grads]
        for work in works:
            work.wait()  # a failed all-reduce is reported to the manager: should_commit says no
    committed = manager.should_commit()
    if committed:
        optimizer.step()
    return committed


def evaluate(module: Any, x: Any, y: Any) -> float:
    """Accuracy on (x, y), in batches of 1000."""
    import torch

    module.eval()
    with torch.no_grad():
        correct = sum(int((module(x[i:i + 1000]).argmax(1) == y[i:i + 1000]).sum()) for i in range(0, len(y), 1000))
    return correct / len(y)


def worker(args: argparse.Namespace) -> None:
    """Train until the stop step, then write this group's accuracy and parameter hash."""
    import torch

    from troupe.script.data import load_mnist

    ft = import_torchft()
    torch.set_num_threads(1)
    out = Path(args.out)
    train_x, train_y, test_x, test_y = load_mnist()
    shard = Shard(train_x, train_y, args.group, args.groups, args.batch_size, args.seed)
    torch.manual_seed(0)
    module = build_cnn()
    optimizer = torch.optim.SGD(module.parameters(), lr=args.lr, momentum=0.9)
    manager, _store = make_manager(ft, args, module, optimizer)
    model = ft.DistributedDataParallel(manager, module) if args.mode == "ddp" else module
    grads = sorted(module.named_parameters())  # every group reduces in the same order
    events = os.open(out / "events.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    while True:
        manager.start_quorum()  # overlaps the forward pass (torchft's async quorum)
        committed = train_step(manager, model, optimizer, grads, *shard.batch(manager.current_step()), args.mode)
        step = manager.current_step()
        line = {"t": time.time() - args.t0, "group": args.group, "step": step,
                "committed": committed, "samples": args.batch_size}
        os.write(events, (json.dumps(line) + "\n").encode())  # one write: appends do not interleave
        target = stop_step(out)
        if committed and target is not None and step >= target:
            break
    manager.shutdown(wait=False)
    result = {"group": args.group, "eval_acc": evaluate(module, test_x, test_y),
              "params_sha256": params_sha256(module), "step": step}
    (out / f"final.{args.group}.json").write_text(json.dumps(result))
    os._exit(0)  # torchft's background threads (heartbeat, checkpoint server) would hold the exit
