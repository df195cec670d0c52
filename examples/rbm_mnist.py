"""Pre-train a deep autoencoder on MNIST with Contrastive Divergence, then fine-tune it, with troupe.DistOpt.

SINGA 0.x's RBM example (Hinton & Salakhutdinov, Science 2006): four RBMs
784-1000-500-250-30 (the last with Gaussian hidden units) trained greedily, layer by
layer, with CD-1 (a global batch of 100, SGD momentum 0.8); then unrolled into a deep autoencoder
(decoder weights tied to the encoder's, as SINGA's autoencoder.conf) and fine-tuned by
back-propagation on the pixels' cross-entropy. The same script runs under every launcher
and cluster:

    troupe run -n 2 examples/rbm_mnist.py --epochs 3
    troupe run -n 2 examples/rbm_mnist.py --dist-option fp16
    troupe run --framework sandblaster examples/rbm_mnist.py --subset 6000   # parameter servers
    torchrun --nproc-per-node 2 examples/rbm_mnist.py
    python examples/rbm_mnist.py --subset 6000 --epochs 2                    # one process

One DistOpt serves the whole job: its optimizer has a param group per RBM weight and
bias, and a stage trains by giving only its groups a learning rate (the others get 0), so
every strategy, and a parameter server, sees the same parameters from start to end. CD
writes ``p.grad`` (`troupe.cd.RBM.cd_step`) and ``sgd.step()`` averages it over ranks.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

import troupe
from troupe.algorithms.cd import RBM, DeepAutoencoder, squared_error
from troupe.script.metrics import progress, reduce_variable

SIZES = (784, 1000, 500, 250, 30)
GLOBAL_BATCH = 100
"""The default batch over all ranks: the paper's and SINGA's 100, whatever the process count."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=None,
                   help="pre-training epochs per RBM and fine-tuning epochs (sets both)")
    p.add_argument("--pretrain-epochs", type=int, default=2, help="per RBM (SINGA: 6000 steps of 100 = 10)")
    p.add_argument("--finetune-epochs", type=int, default=6, help="(SINGA: 12200 steps of 100 = 20)")
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"per rank (default: {GLOBAL_BATCH} // ranks, a global batch of {GLOBAL_BATCH} as SINGA's "
                        "rbm*.conf and docs/cd.md's table)")
    p.add_argument("--lr", type=float, default=0.1, help="CD learning rate of the Bernoulli RBMs")
    # SINGA's rbm4.conf and the paper use 0.001 for 10 to 50 epochs; 0.005 learns as much in 2
    p.add_argument("--lr-gaussian", type=float, default=0.005, help="CD learning rate of the last (Gaussian) RBM")
    p.add_argument("--finetune-lr", type=float, default=0.01, help="learning rate of back-propagation (SGD)")
    p.add_argument("--momentum", type=float, default=0.8)
    p.add_argument("--weight-decay", type=float, default=2e-4, help="on the weights (not the biases)")
    p.add_argument("--cd-k", type=int, default=1)
    p.add_argument("--loss", choices=("ce", "mse"), default="ce", help="fine-tuning loss on the pixels")
    p.add_argument("--dist-option", default="plain", help=f"one of {sorted(troupe.DIST_OPTIONS)}")
    p.add_argument("--spars", type=float, default=None)
    p.add_argument("--subset", type=int, default=None, help="use only the first N training images")
    p.add_argument("--test-size", type=int, default=None, help="use only the first N test images")
    p.add_argument("--data", default=None, help="directory with the MNIST IDX files (default: offline copy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads per process")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.epochs is not None:
        args.pretrain_epochs = args.finetune_epochs = args.epochs
    for name in ("pretrain_epochs", "finetune_epochs", "batch_size", "cd_k"):
        if getattr(args, name) is not None and getattr(args, name) < (0 if name.endswith("epochs") else 1):
            p.error(f"--{name.replace('_', '-')} out of range: {getattr(args, name)}")
    return args


def param_groups(rbms, weight_decay):
    """Two groups per RBM, [weight] with weight decay and [h_bias, v_bias] without (SINGA's wd_scale: 0)."""
    groups = []
    for rbm in rbms:
        groups.append({"params": [rbm.weight], "weight_decay": weight_decay})
        groups.append({"params": [rbm.h_bias, rbm.v_bias], "weight_decay": 0.0})
    return groups


def set_lrs(sgd, lrs):
    """One learning rate per RBM; 0 freezes it (the same parameters stay in every step's reduction)."""
    for i, group in enumerate(sgd.param_groups):
        group["lr"] = lrs[i // 2]


@torch.no_grad()
def features(rbms, x, chunk=2000):
    """The data as the next RBM sees it: hidden means of the RBMs below."""
    out = []
    for part in x.split(chunk):
        for rbm in rbms:
            part = rbm.hidden_mean(part)
        out.append(part)
    return torch.cat(out) if out else x


def pretrain(rbms, sgd, train_x, args, rng, main):
    """Greedy layer-wise CD-k; prints each RBM's reconstruction error per epoch (mean over every rank's batches)."""
    bs = args.batch_size
    steps = len(train_x) // bs
    g = torch.Generator().manual_seed(args.seed * 1000 + sgd.global_rank)  # each rank its own hidden samples
    for layer, rbm in enumerate(rbms):
        lrs = [0.0] * len(rbms)
        lrs[layer] = args.lr_gaussian if rbm.gaussian else args.lr
        set_lrs(sgd, lrs)
        x = features(rbms[:layer], train_x)
        start = time.perf_counter()
        for epoch in range(args.pretrain_epochs):
            idx = torch.from_numpy(rng.permutation(len(x)))
            err = torch.zeros(())
            for b in progress(range(steps), desc=f"rbm {layer + 1} epoch {epoch}", enabled=main and not args.quiet):
                sgd.zero_grad()
                err += rbm.cd_step(x[idx[b * bs : (b + 1) * bs]], args.cd_k, generator=g).error
                sgd.step()
            err = reduce_variable(err) / (steps * sgd.world_size)
            if main:
                print(f"rbm {layer + 1} ({rbm.extra_repr()}) epoch {epoch}: reconstruction error = {err:.3f} "
                      f"per sample, {time.perf_counter() - start:.1f}s", flush=True)


def finetune(ae, sgd, train_x, test_x, args, rng, main):
    """Back-propagation through the unrolled autoencoder; prints train loss and test error per epoch."""
    set_lrs(sgd, [args.finetune_lr] * len(ae.rbms))
    bs = args.batch_size
    steps = len(train_x) // bs
    start = time.perf_counter()
    for epoch in range(args.finetune_epochs):
        idx = torch.from_numpy(rng.permutation(len(train_x)))
        total = torch.zeros(())
        for b in progress(range(steps), desc=f"fine-tune epoch {epoch}", enabled=main and not args.quiet):
            x = train_x[idx[b * bs : (b + 1) * bs]]
            if args.loss == "ce":
                loss = F.binary_cross_entropy_with_logits(ae(x), x, reduction="sum") / len(x)
            else:
                loss = squared_error(x, ae.reconstruct(x)).mean()
            sgd.zero_grad()
            loss.backward()
            sgd.step()
            total += loss.detach()
        train_loss = reduce_variable(total) / (steps * sgd.world_size)
        test_err = test_error(ae, test_x)
        if main:
            print(f"fine-tune epoch {epoch}: train {args.loss} = {train_loss:.3f}, test reconstruction error = "
                  f"{test_err:.3f}, {time.perf_counter() - start:.1f}s", flush=True)


@torch.no_grad()
def test_error(ae, test_x):
    """Squared reconstruction error per image over every rank's test share."""
    total = sum(float(squared_error(x, ae.reconstruct(x)).sum()) for x in test_x.split(1000))
    return reduce_variable(total) / reduce_variable(len(test_x))


def train_rbm_mnist(args):
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rbms = [RBM(n_in, n_out, hidden="gaussian" if i == len(SIZES) - 2 else "bernoulli")
            for i, (n_in, n_out) in enumerate(zip(SIZES, SIZES[1:]))]
    ae = DeepAutoencoder(rbms)
    sgd = torch.optim.SGD(param_groups(rbms, args.weight_decay), lr=args.lr, momentum=args.momentum)
    sgd = troupe.DistOpt(sgd, dist_option=args.dist_option, spars=args.spars)  # broadcasts rank 0's parameters
    main = sgd.global_rank == 0
    if args.batch_size is None:  # the same algorithm at every process count: only the split of the batch changes
        args.batch_size = max(1, GLOBAL_BATCH // sgd.world_size)

    train_x, train_y, test_x, test_y = troupe.data.load_mnist(args.data)
    train_x, test_x = train_x.flatten(1), test_x.flatten(1)
    if args.subset:
        train_x, train_y = train_x[: args.subset], train_y[: args.subset]
    if args.test_size:
        test_x, test_y = test_x[: args.test_size], test_y[: args.test_size]
    train_x, _ = troupe.data.partition(train_x, train_y, sgd.global_rank, sgd.world_size)
    test_x, _ = troupe.data.partition(test_x, test_y, sgd.global_rank, sgd.world_size)
    if len(train_x) < args.batch_size:
        raise ValueError(f"--batch-size {args.batch_size} is larger than this rank's {len(train_x)} training images")
    rng = np.random.default_rng(args.seed + sgd.global_rank)
    if main:
        print(f"{sgd}: {len(train_x)} training images per rank, batch {args.batch_size} per rank "
              f"({args.batch_size * sgd.world_size} in all), "
              f"RBMs {'-'.join(map(str, SIZES))}", flush=True)

    start = time.perf_counter()
    pretrain(rbms, sgd, train_x, args, rng, main)
    pretrain_s = time.perf_counter() - start
    if main:
        print(f"unrolled autoencoder before fine-tuning: test reconstruction error = "
              f"{test_error(ae, test_x):.3f} per image", flush=True)
    else:
        test_error(ae, test_x)  # a collective: every rank takes part
    finetune(ae, sgd, train_x, test_x, args, rng, main)
    error = test_error(ae, test_x)
    return ae, {"test_error": error, "pretrain_s": pretrain_s, "total_s": time.perf_counter() - start}


def main(argv=None):
    args = parse_args(argv)
    _, result = train_rbm_mnist(args)
    if troupe.info().global_rank == 0:
        print(f"pre-training {result['pretrain_s']:.1f}s, total {result['total_s']:.1f}s", flush=True)
        print(f"test reconstruction error = {result['test_error']:.3f} per image", flush=True)


if __name__ == "__main__":
    main()
