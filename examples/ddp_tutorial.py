"""PyTorch's DDP tutorial (multigpu_torchrun.py) on troupe: three lines differ from the DDP version.

The shape of pytorch/examples' distributed/ddp-tutorial-series: a ``Trainer`` holding the
model, the optimizer and a ``DataLoader`` over a ``DistributedSampler``, ``_run_batch`` /
``_run_epoch``, a snapshot every ``save_every`` epochs that a restarted job resumes from, and
``ddp_setup()`` calling ``init_process_group`` itself; on CPU with Gloo. The DDP version
differs in exactly three lines (docs/examples.md shows the diff):

    import troupe                                           # from torch.nn.parallel import DistributedDataParallel as DDP
    self.optimizer = troupe.DistOpt(self.optimizer)         # self.model = DDP(self.model)
    "MODEL_STATE": self.model.state_dict(),                 # self.model.module.state_dict()

Run it like the tutorial (total epochs, then how often to save), under either launcher:

    troupe run -n 2 examples/ddp_tutorial.py 50 10
    torchrun --standalone --nproc_per_node=2 examples/ddp_tutorial.py 50 10

Unlike the tutorial, the data has a learnable target (y = x.w + noise, so the MSE falls; the
tutorial's cross-entropy over one output class has a zero gradient), it is seeded (every run
and every rank draws the same data and initial model), and a snapshot stores the number of
epochs *completed*, so a resumed job does not repeat the saved epoch.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import troupe


class MyTrainDataset(Dataset):
    """`size` fixed samples (x in [0, 1)^20, y = x.w + noise), the same on every rank."""

    def __init__(self, size: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.rand(size, 20, generator=g)
        w = torch.randn(20, 1, generator=g)
        self.y = self.x @ w + 0.1 * torch.randn(size, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index):
        return self.x[index], self.y[index]


def ddp_setup() -> None:
    # torchrun and `troupe run` both set torch's env:// variables (MASTER_ADDR, RANK, ...)
    init_process_group(backend="gloo", timeout=datetime.timedelta(minutes=5))


class Trainer:
    """The tutorial's trainer: one model, one optimizer, one sharded data loader, snapshots."""

    def __init__(self, model: torch.nn.Module, train_data: DataLoader, optimizer: torch.optim.Optimizer,
                 save_every: int, snapshot_path: str) -> None:
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.optimizer = troupe.DistOpt(self.optimizer)

    def _load_snapshot(self, snapshot_path: str) -> None:
        snapshot = torch.load(snapshot_path, map_location="cpu")
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch: int) -> None:
        b_sz = len(next(iter(self.train_data))[0])
        self.train_data.sampler.set_epoch(epoch)  # a fresh shuffle per epoch, the same on every rank
        total = sum(self._run_batch(source, targets) for source, targets in self.train_data)
        print(f"[rank {self.local_rank}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)} | "
              f"Loss: {total / len(self.train_data):.4f}", flush=True)

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {
            "MODEL_STATE": self.model.state_dict(),
            "EPOCHS_RUN": epoch + 1,
        }
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}", flush=True)

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.local_rank == 0 and (epoch + 1) % self.save_every == 0:
                self._save_snapshot(epoch)


def load_train_objs():
    torch.manual_seed(0)  # the same initial model in every run (rank 0's is broadcast anyway)
    train_set = MyTrainDataset(2048)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    return train_set, model, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(dataset))


def main(save_every: int, total_epochs: int, batch_size: int, snapshot_path: str = "snapshot.pt") -> None:
    ddp_setup()
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path)
    trainer.train(total_epochs)
    destroy_process_group()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size on each process (default: 32)")
    parser.add_argument("--snapshot_path", default="snapshot.pt", help="Where snapshots are saved and resumed from")
    args = parser.parse_args()

    main(args.save_every, args.total_epochs, args.batch_size, args.snapshot_path)
