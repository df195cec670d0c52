"""The reference's multiprocessing launcher: a Ticket handed to one process per rank.

    python examples/mnist_multiprocess.py 2 --epochs 1
"""

import multiprocessing
import sys

import troupe
from mnist_cnn import parse_args, train_mnist_cnn


def train(ticket, local_rank, world_size, argv):
    train_mnist_cnn(parse_args(argv), ticket=ticket, local_rank=local_rank, world_size=world_size)


if __name__ == "__main__":
    # Make a ticket: only processes holding it can join the job.
    ticket = troupe.Ticket()
    world_size = int(sys.argv[1])
    ctx = multiprocessing.get_context("spawn")
    process = [
        ctx.Process(target=train, args=(ticket, local_rank, world_size, sys.argv[2:]))
        for local_rank in range(world_size)
    ]
    for p in process:
        p.start()
    # Like p.join() for each, but when one rank fails the others are stopped too.
    sys.exit(troupe.wait_all(process))
