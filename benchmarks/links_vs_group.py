"""What the elastic parameter-server links cost against the job's process group, step by step.

    python benchmarks/links_vs_group.py [--reps 21] [--trips 40]

Two processes, a "server" and a "worker", hold both channels at once: the job's Gloo group (what
Downpour's messages use without --elastic: the server receives from any rank) and a link
(`troupe.cluster.wire.links`, what they use under `troupe run --elastic`: a pair group, the server's
receive from any worker through a reader thread). One round trip is a parameter server's step: the
worker sends a header and a payload, the server receives them and replies with a header and a
payload of the same size. Each repetition times `--trips` round trips on each channel, the two in
alternating order; the table gives the median per round trip and the ratio links / group.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from troupe.cluster.wire.links import Links
from troupe.cluster.wire.messages import HEADER_TAG, PAYLOAD_TAG, empty_header
from troupe.runtime.ticket import free_port

SIZES = {"4 KiB": 1024, "1.7 MB (the MNIST CNN)": 431_080}


class Group:
    """The job's group as the server loop uses it: receive a header from any rank."""

    def __init__(self):
        self.rank = dist.get_rank()

    def send(self, t, dst, tag):
        dist.send(t, dst, tag=tag)

    def recv(self, t, src=None, tag=0):
        return dist.recv(t, src, tag=tag)


def trips(channel, server: bool, peer: int, numel: int, count: int) -> float:
    header, payload = empty_header(), torch.ones(numel)
    start = time.perf_counter()
    for _ in range(count):
        if server:
            src = channel.recv(header, None, HEADER_TAG)
            channel.recv(payload, src, PAYLOAD_TAG)
            channel.send(header, src, HEADER_TAG)
            channel.send(payload, src, PAYLOAD_TAG)
        else:
            channel.send(header, peer, HEADER_TAG)
            channel.send(payload, peer, PAYLOAD_TAG)
            channel.recv(header, peer, HEADER_TAG)
            channel.recv(payload, peer, PAYLOAD_TAG)
    return (time.perf_counter() - start) / count


def main(rank: int, port: int, reps: int, count: int) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, None, rank == 0, datetime.timedelta(seconds=60),
                          wait_for_workers=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg/", store), rank=rank, world_size=2)
    server, peer = rank == 0, 1 - rank
    links = Links(store, rank, 3600.0)
    if server:
        links.listen([1], empty_header)
    else:
        links.dial(0, 0)
    channels = {"group": Group(), "links": links}
    results: dict[str, dict[str, list[float]]] = {size: {"group": [], "links": []} for size in SIZES}
    for size, numel in SIZES.items():
        trips(channels["group"], server, peer, numel, 5)  # warm both up
        trips(channels["links"], server, peer, numel, 5)
        for rep in range(reps):
            order = ("group", "links") if rep % 2 == 0 else ("links", "group")
            for name in order:
                dist.barrier()
                results[size][name].append(trips(channels[name], server, peer, numel, count))
    if server:
        print(f"{reps} repetitions of {count} round trips each, alternating order; median per round trip")
        print("| payload | group (us) | links (us) | links / group |")
        print("| --- | --- | --- | --- |")
        for size in SIZES:
            g, lk = (statistics.median(results[size][n]) * 1e6 for n in ("group", "links"))
            print(f"| {size} | {g:.0f} | {lk:.0f} | {lk / g:.2f} |")
        sys.stdout.flush()
    dist.barrier()
    links.close()
    os._exit(0)  # the reader thread still waits on its link


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=21)
    p.add_argument("--trips", type=int, default=40)
    a = p.parse_args()
    port = free_port("127.0.0.1")
    mp.start_processes(main, args=(port, a.reps, a.trips), nprocs=2, start_method="spawn")
