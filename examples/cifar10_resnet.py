"""Train a ResNet-18 on CIFAR-10 with troupe.DistOpt and the PyTorch loop.

    troupe run -n 2 examples/cifar10_resnet.py --data ~/data/cifar-10-batches-bin --epochs 30
    troupe run -n 2 examples/cifar10_resnet.py --width 16 --train-size 2048 --epochs 2   # offline: synthetic data
    torchrun --nproc-per-node 2 examples/cifar10_resnet.py --data DIR

`--data DIR` reads the standard binary batches (``data_batch_{1..5}.bin``, ``test_batch.bin``,
from cifar-10-binary.tar.gz); without it the script trains on random images with random
labels (`troupe.data.synthetic`), which only shows that everything runs: the loss falls as
the network memorises, evaluation accuracy stays at chance.

The loop: random crop (pad 4) and horizontal flip done on tensors (torchvision is not
needed), micro-batches under `sgd.no_sync()` (`--accum K`), `sgd.synchronize()`, optional
`troupe.clip_grad_norm_` (`--clip`), a OneCycle learning rate on the DistOpt.

BatchNorm: DistOpt averages gradients only, so each rank's running statistics follow its
own batches. `torch.nn.SyncBatchNorm` needs CUDA (it refuses CPU tensors), so instead the
running statistics are averaged over ranks before every evaluation (`average_buffers`): every
rank then evaluates, and checkpoints, the same model.
"""

from __future__ import annotations

import argparse
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import troupe
from troupe.script.metrics import Throughput, accuracy, progress, reduce_variable
from troupe.reliability import checkpoint

INPUT_SHAPE = (3, 32, 32)
"""One sample's shape."""

MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
STD = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a shortcut (a 1x1 convolution when the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18, CIFAR variant (3x3 stem, no max-pool): four stages of two blocks, widths w, 2w, 4w, 8w.

    The same network as benchmarks/resnet.py (copied: examples run without the repository).
    """

    def __init__(self, num_classes: int = 10, width: int = 64):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers, cin = [], width
        for i in range(4):
            cout = width * 2**i
            for j in range(2):
                layers.append(BasicBlock(cin, cout, stride=2 if i > 0 and j == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        y = self.layers(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(y, 1).flatten(1))


def augment(x: Tensor, gen: torch.Generator, pad: int = 4) -> Tensor:
    """Random crop of each image from its zero-padded copy, then a random horizontal flip."""
    n, _, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (n,), generator=gen).tolist()
    dx = torch.randint(0, 2 * pad + 1, (n,), generator=gen).tolist()
    out = torch.stack([padded[i, :, dy[i] : dy[i] + h, dx[i] : dx[i] + w] for i in range(n)])
    flip = torch.rand(n, generator=gen) < 0.5
    return torch.where(flip.view(n, 1, 1, 1), out.flip(3), out)


def average_buffers(model: nn.Module, sgd: troupe.DistOpt) -> None:
    """Replace each rank's BatchNorm running statistics by their mean over ranks."""
    for name, buf in model.named_buffers():  # the same names, in the same order, on every rank
        if buf.is_floating_point():
            sgd.communicator.all_reduce(buf, "mean")


def load_data(args) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(train_x, train_y, test_x, test_y), normalised; synthetic when --data is not given."""
    if args.data is None:
        n = args.train_size or 50_000
        train_x, train_y = troupe.data.synthetic(n, INPUT_SHAPE, seed=args.seed)
        test_x, test_y = troupe.data.synthetic(args.test_size or 1000, INPUT_SHAPE, seed=args.seed + 1)
        return train_x, train_y, test_x, test_y
    train_x, train_y, test_x, test_y = troupe.data.load_cifar10(Path(args.data).expanduser())
    if args.train_size:
        train_x, train_y = train_x[: args.train_size], train_y[: args.train_size]
    if args.test_size:
        test_x, test_y = test_x[: args.test_size], test_y[: args.test_size]
    return (train_x - MEAN) / STD, train_y, (test_x - MEAN) / STD, test_y


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None, help="directory with the CIFAR-10 binary batches (default: synthetic)")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=128, help="per rank")
    p.add_argument("--lr", type=float, default=0.1, help="OneCycle's peak learning rate")
    p.add_argument("--width", type=int, default=64, help="channels of the first stage (64: the usual ResNet-18)")
    p.add_argument("--dist-option", default="plain", help=f"one of {sorted(troupe.DIST_OPTIONS)}")
    p.add_argument("--spars", type=float, default=None)
    p.add_argument("--accum", type=int, default=1, help="micro-batches per step (the first K-1 under no_sync)")
    p.add_argument("--clip", type=float, default=None, help="clip_grad_norm_ to this")
    p.add_argument("--no-augment", action="store_true", help="no random crop and flip")
    p.add_argument("--max-steps", type=int, default=None, help="stop each epoch after this many steps")
    p.add_argument("--train-size", type=int, default=None, help="the first N training samples (synthetic: N of them)")
    p.add_argument("--test-size", type=int, default=None, help="the first N test samples (synthetic default 1000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads per process")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--checkpoint-dir", default=None, help="save a checkpoint here after every epoch")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "width", "accum"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.data is not None and not Path(args.data).expanduser().is_dir():
        p.error(f"--data {args.data}: no such directory (the CIFAR-10 binary batches: data_batch_1.bin ... "
                "test_batch.bin, or their parent holding cifar-10-batches-bin)")
    if args.batch_size % args.accum:
        p.error(f"--batch-size {args.batch_size} must divide into --accum {args.accum} micro-batches")
    return args


def train_step(model, sgd, sched, x: Tensor, y: Tensor, args) -> tuple[Tensor, float]:
    """One optimizer step on (x, y) in --accum micro-batches; returns (outputs, mean loss)."""
    outs, total = [], 0.0
    chunks = list(zip(x.chunk(args.accum), y.chunk(args.accum)))
    for i, (mx, my) in enumerate(chunks):
        with nullcontext() if i == len(chunks) - 1 else sgd.no_sync():  # only the last backward communicates
            out = model(mx)
            loss = F.cross_entropy(out, my) * (len(my) / len(y))
            loss.backward()
        outs.append(out.detach())
        total += loss.item()
    sgd.synchronize()  # p.grad: the mean over ranks
    if args.clip is not None:
        troupe.clip_grad_norm_(model.parameters(), args.clip)
    sgd.step()
    sgd.zero_grad()
    sched.step()
    return torch.cat(outs), total


def evaluate(model, x: Tensor, y: Tensor, bs: int, dev) -> tuple[int, int]:
    """(correct, total) on this rank's share of the test set."""
    model.eval()
    correct = 0
    with torch.no_grad():
        for b in range(0, len(x), bs):
            correct += accuracy(model(x[b : b + bs].to(dev)), y[b : b + bs].to(dev))
    return correct, len(x)


def train(args):
    """Train and evaluate; returns the per-epoch history (rank 0 prints)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = ResNet18(width=args.width)
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    sgd = troupe.DistOpt(sgd, dist_option=args.dist_option, spars=args.spars)  # broadcasts rank 0's parameters
    dev, main = sgd.device, sgd.global_rank == 0
    model.to(dev)
    train_x, train_y, test_x, test_y = load_data(args)
    if main and args.data is None:
        print(f"No --data: training on {len(train_x)} synthetic images with random labels (offline run; "
              "evaluation accuracy stays at chance)", flush=True)
    bs = args.batch_size
    train_set = troupe.data.loader((train_x, train_y), bs, seed=args.seed, tail="drop", drop_last=True)
    test_x, test_y = troupe.data.partition(test_x, test_y, sgd.global_rank, sgd.world_size)
    steps = min(len(train_set), args.max_steps or len(train_set))
    if steps == 0:
        raise ValueError(f"--batch-size {bs} is larger than this rank's {len(train_set.sampler)} training samples")
    sched = torch.optim.lr_scheduler.OneCycleLR(sgd, args.lr, total_steps=args.epochs * steps)
    gen = torch.Generator().manual_seed(args.seed * 1000 + sgd.global_rank)  # each rank its own crops
    if main:
        n = sum(p.numel() for p in model.parameters())
        print(f"{sgd}: ResNet-18 width {args.width} ({n / 1e6:.2f}M parameters), {len(train_set.sampler)} "
              f"training samples per rank, batch {bs}", flush=True)

    ckpt_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    start_epoch, step = 0, 0
    if args.resume:
        found = checkpoint.latest(ckpt_dir) if ckpt_dir else None
        if found is None:
            raise FileNotFoundError(f"--resume: no complete checkpoint in --checkpoint-dir {args.checkpoint_dir}")
        state = checkpoint.load(found, model, sgd)
        start_epoch, step = state["epoch"], state["step"]
        with warnings.catch_warnings():  # replayed rather than restored: --epochs may have grown
            warnings.simplefilter("ignore")
            for _ in range(min(step, sched.total_steps)):
                sched.step()
        gen.set_state(state["gen"])
        if main:
            print(f"Resumed from {found} (epoch {start_epoch})", flush=True)

    history = []
    for epoch in range(start_epoch, args.epochs):
        if main:
            print(f"Starting Epoch {epoch}:", flush=True)
        model.train()
        train_set.sampler.set_epoch(epoch)  # a fresh global permutation, the same on every rank
        batches = iter(train_set)
        correct, loss_sum, speed = 0, 0.0, Throughput()
        for _ in progress(range(steps), desc=f"epoch {epoch}", enabled=main and not args.quiet):
            x, y = next(batches)
            if not args.no_augment:
                x = augment(x, gen)
            out, loss = train_step(model, sgd, sched, x.to(dev), y.to(dev), args)
            correct += accuracy(out, y.to(dev))
            loss_sum += loss
            speed.add(bs)
            step += 1
        rate = speed.rate()
        train_loss = reduce_variable(loss_sum) / (steps * sgd.world_size)  # mean over batches and ranks
        train_acc = reduce_variable(correct) / (steps * bs * sgd.world_size)
        average_buffers(model, sgd)
        test_correct, test_total = evaluate(model, test_x, test_y, bs, dev)
        test_acc = reduce_variable(test_correct) / reduce_variable(test_total)
        if main:
            print(f"Training loss = {train_loss:f}, training accuracy = {train_acc:f}", flush=True)
            print(f"Evaluation accuracy = {test_acc:f}, {rate:.0f} samples/s (all ranks)", flush=True)
        troupe.log({"epoch/train_loss": train_loss, "epoch/train_accuracy": train_acc,
                    "epoch/eval_accuracy": test_acc, "epoch/lr": sgd.param_groups[0]["lr"]}, step)
        history.append({"epoch": epoch, "train_loss": train_loss, "train_acc": train_acc, "eval_acc": test_acc,
                        "samples_per_s": rate})
        if ckpt_dir is not None:
            checkpoint.save(ckpt_dir, step, model, sgd,
                            {"epoch": epoch + 1, "step": step, "gen": gen.get_state()})
    return history


def main(argv=None):
    start = time.perf_counter()
    history = train(parse_args(argv))
    if troupe.info().global_rank == 0:
        print(f"Finished {len(history)} epoch(s) in {time.perf_counter() - start:.1f}s", flush=True)


if __name__ == "__main__":
    main()
