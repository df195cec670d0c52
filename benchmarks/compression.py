"""What each communication-saving dist_option costs and saves, on the example's MNIST CNN.

(a) Wire bytes per step, as counted by the Communicator (ring model), for each option
    and as a fraction of the plain fp32 step, measured over real MNIST batches.
(b) Time to compress + decompress one bucket of the model's real gradient (all 431,080
    elements), and the whole compressed reduction (compress, exchange, decompress), each
    relative to the dense fp32 all-reduce of the same bucket. Dense and compressed take
    turns within every repetition (order alternating A B, B A, ...) and the ratio per
    repetition is reduced to its median.

    troupe run -n 2 --threads 1 benchmarks/compression.py
    troupe run -n 4 --threads 1 benchmarks/compression.py --skip-time

Prints markdown tables on rank 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import troupe
from troupe.sync.bucket import Bucket
from troupe.compress import Compressor, ErrorFeedback, HalfCompressor, ThresholdCompressor, TopKCompressor
from troupe.sync.reducer import mean_all_reduce
from troupe.strategies.compressed import compressed_reduce

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples"))
from mnist_cnn import CNN  # noqa: E402  (the example's model, unchanged)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--steps", type=int, default=12, help="measured steps per option for (a) (a multiple of K=4 chunks)")
    p.add_argument("--topk", type=float, default=0.01, help="spars for sparseTopK")
    p.add_argument("--threshold", type=float, default=1e-3, help="spars for sparseThreshold")
    p.add_argument("--chunk-size", type=int, default=2**17, help="partial update chunk (elements)")
    p.add_argument("--reps", type=int, default=9, help="repetitions for (b), median reported")
    p.add_argument("--skip-time", action="store_true", help="only (a)")
    return p.parse_args(argv)


def options(args: argparse.Namespace) -> list[tuple[str, float | None]]:
    return [
        ("plain", None),
        ("fp16", None),
        ("bf16", None),
        ("partialUpdate", None),
        ("sparseTopK", args.topk),
        ("sparseThreshold", args.threshold),
    ]


def wire_bytes(args: argparse.Namespace, batches: list[tuple[Tensor, Tensor]]) -> list[tuple[str, float]]:
    """(option, mean wire bytes per step sent by this rank)."""
    rows = []
    for option, spars in options(args):
        torch.manual_seed(0)
        model = CNN()
        opt = troupe.DistOpt(
            torch.optim.SGD(model.parameters(), lr=0.005, momentum=0.9),
            compression=troupe.CompressionConfig(chunk_size=args.chunk_size),
        )
        opt.sync_parameters(model)
        comm = opt.communicator
        for step, (x, y) in enumerate(batches):
            if step == 2:  # two steps of burn-in (residuals fill, partial counter moves)
                before = comm.bytes_sent()
            opt.update(F.cross_entropy(model(x), y), option, spars)
        rows.append((option, (comm.bytes_sent() - before) / (len(batches) - 2)))
    return rows


def real_gradient(batch: tuple[Tensor, Tensor]) -> Tensor:
    torch.manual_seed(0)
    model = CNN()
    F.cross_entropy(model(batch[0]), batch[1]).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def codecs(args: argparse.Namespace, world_size: int) -> dict[str, Callable[[], Compressor]]:
    return {
        "fp16": lambda: HalfCompressor("fp16", scale=1 / world_size),
        "bf16": lambda: HalfCompressor("bf16", scale=1 / world_size),
        f"top-K {args.topk} + feedback": lambda: ErrorFeedback(TopKCompressor(args.topk)),
        f"threshold {args.threshold} + feedback": lambda: ErrorFeedback(ThresholdCompressor(args.threshold)),
    }


def timed(fn: Callable[[], None]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def codec_times(args: argparse.Namespace, grad: Tensor) -> list[tuple[str, float, float, float]]:
    """(codec, dense all-reduce ms, codec ratio, end-to-end ratio), medians over repetitions."""
    comm = troupe.runtime.comm.default()
    param = nn.Parameter(torch.zeros_like(grad))
    bucket = Bucket(0, [param])
    dense_fn = mean_all_reduce(comm)

    def reduce_with(fn) -> None:
        bucket.reset()
        bucket.add_grad(param, grad)
        bucket.seal()
        fn(bucket).wait()

    rows = []
    for name, make in codecs(args, comm.world_size).items():
        compressor = make()
        sparse_fn = compressed_reduce(comm, compressor)

        def codec_only() -> None:
            payload, ctx = compressor.compress(grad, "bench")
            compressor.decompress(payload, ctx)

        dense_ms, codec_ratio, e2e_ratio = [], [], []
        for rep in range(args.reps + 1):
            order = [0, 1, 2] if rep % 2 == 0 else [2, 1, 0]
            t = {}
            for which in order:
                fn = {0: lambda: reduce_with(dense_fn), 1: codec_only, 2: lambda: reduce_with(sparse_fn)}[which]
                t[which] = timed(fn)
            if rep == 0:
                continue  # warm-up
            dense_ms.append(1e3 * t[0])
            codec_ratio.append(t[1] / t[0])
            e2e_ratio.append(t[2] / t[0])
        rows.append((name, statistics.median(dense_ms), statistics.median(codec_ratio), statistics.median(e2e_ratio)))
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    info = troupe.init()
    n, main_rank = info.world_size, info.global_rank == 0
    train_x, train_y, _, _ = troupe.data.load_mnist()
    x, y = troupe.data.partition(train_x[:20000], train_y[:20000], info.global_rank, n)
    bs = args.batch_size
    batches = [(x[i * bs : (i + 1) * bs], y[i * bs : (i + 1) * bs]) for i in range(args.steps + 2)]

    rows = wire_bytes(args, batches)
    plain = rows[0][1]
    if main_rank:
        print(f"\n(a) wire bytes per step, MNIST CNN, {n} ranks, batch {bs}/rank, mean of {args.steps} steps\n")
        print("| dist_option | spars | bytes/step/rank | / plain fp32 |")
        print("| --- | --- | ---: | ---: |")
        for (option, spars), (_, sent) in zip(options(args), rows):
            print(f"| {option} | {spars if spars is not None else ''} | {sent:,.0f} | {sent / plain:.4f} |")
    if args.skip_time:
        return
    rows = codec_times(args, real_gradient(batches[0]))
    if main_rank:
        print(f"\n(b) one 431,080-element bucket, {n} ranks, median of {args.reps} alternating repetitions\n")
        print("| codec | dense all-reduce ms | compress+decompress / dense | compressed reduce / dense |")
        print("| --- | ---: | ---: | ---: |")
        for name, dense_ms, codec, e2e in rows:
            print(f"| {name} | {dense_ms:.2f} | {codec:.2f} | {e2e:.2f} |")


if __name__ == "__main__":
    main()
