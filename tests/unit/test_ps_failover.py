"""A worker's failover to another server group (`troupe run --elastic`, Downpour over 2 server groups), without
processes: a real `PSClient` and two real `Server` loops (threads) over an in-memory transport whose ranks can die."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from tests.unit.test_serversync import Comm, Net, post
from troupe.cluster.configuration.config import ClusterConfig
from troupe.cluster.configuration.roles import roles
from troupe.cluster.serving.server import Server, TakeOver
from troupe.cluster.serving.shard import ParamShard, plan_slices
from troupe.cluster.wire.messages import Op
from troupe.cluster.workers.ps_client import PSClient

CLUSTER = ClusterConfig(nworker_groups=2, nserver_groups=2, server_worker_separate=True)
"""Workers 0 and 1 (groups of one), servers 2 (server group 0, worker 0's) and 3 (server group 1, worker 1's)."""
LR = 0.1


class DyingNet(Net):
    """`Net`, where a rank can die: its own receives and everyone's receives from it and sends to it fail."""

    def __init__(self):
        super().__init__()
        self.dead: set[int] = set()

    def comm(self, rank: int) -> Comm:
        return DyingComm(self, rank)

    def kill(self, rank: int) -> None:
        with self.cv:
            self.dead.add(rank)
            self.boxes[rank].clear()
            self.cv.notify_all()


class DyingComm(Comm):
    world_size, recorder, watchdog = 1, None, None  # what the worker's bucket packing asks of its own group

    def send(self, tensor, dst, tag=0):
        if dst in self.net.dead:
            raise RuntimeError(f"Connection closed by peer (rank {dst})")
        super().send(tensor, dst, tag)

    def recv(self, tensor, src=None, tag=0):
        box = self.net.boxes[self.rank]
        with self.net.cv:
            def ready():
                gone = self.rank in self.net.dead or src in self.net.dead
                return gone or any(t == tag and src in (None, s) for s, t, _ in box)

            self.net.cv.wait_for(ready, timeout=30)
            if self.rank in self.net.dead or src in self.net.dead:
                raise RuntimeError(f"Connection reset by peer (rank {src})")
        return super().recv(tensor, src, tag)


def model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def server(net: DyingNet, rank: int, group: int) -> tuple[Server, ParamShard]:
    template = torch.optim.SGD([torch.zeros(1)], lr=LR)
    numels = [p.numel() for p in model().parameters()]
    shard = ParamShard(plan_slices(numels, 1), template, [0, 0], {group: {group}})
    take_over = TakeOver({0: 0, 1: 1}, mean=True)
    return Server(net.comm(rank), shard, workers=[0, 1], putters={0}, take_over=take_over), shard


def step(client: PSClient, net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    F.cross_entropy(net(x), y).backward()
    client.step()
    for p in net.parameters():
        p.grad = None


@pytest.mark.parametrize("fetch", ["wait", "background"])
def test_a_worker_whose_server_dies_fails_over_to_the_next_server_group(fetch):
    net = DyingNet()
    cluster = dataclasses.replace(CLUSTER, fetch=fetch)
    (s2, shard2), (s3, shard3) = server(net, 2, 0), server(net, 3, 1)
    threads = [threading.Thread(target=serve, args=(s,), daemon=True) for s in (s2, s3)]
    for t in threads:
        t.start()
    worker = model()
    for rank in (2, 3):  # worker 0 (group 0) Puts the initial values to both server groups
        for s in plan_slices([p.numel() for p in worker.parameters()], 1):
            post(net, 0, rank, Op.PUT, s.id, list(worker.parameters())[s.param].detach().reshape(-1)[s.start:s.stop])
    opt = torch.optim.SGD(worker.parameters(), lr=LR)
    everyone = roles(cluster)
    client = PSClient(cluster, everyone[1], everyone, net.comm(1), list(worker.parameters()), 1 << 20, opt,
                      alone=net.comm(1), fail_over=True)
    client.start()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=gen), torch.randint(0, 3, (8,), generator=gen)
    for _ in range(3):
        step(client, worker, x, y)
    assert client.server_of == {0: 3, 1: 3} and shard3.updates > 0 and shard2.updates == 0

    time.sleep(0.2)  # (background fetch: the last step's replies are in)
    net.kill(3)
    for _ in range(2 if fetch == "background" else 1):  # the step whose replies die with the server
        step(client, worker, x, y)
    assert client.gone == {3} and client.server_of == {0: 2, 1: 2}
    assert client.failovers == [{"step": 4 if fetch == "wait" else 5, "gone": [3], "to": [2]}]
    # The worker holds server 2's values now, and server 2 serves its group: each of 2 groups counts 1/2
    assert 1 in shard2.group_of and s2.took_over == [1]
    assert shard2.optimizer.param_groups[0]["lr"] == pytest.approx(LR / 2)
    if fetch == "wait":
        for p, s in zip(worker.parameters(), sorted(shard2.values)):
            torch.testing.assert_close(p.detach().reshape(-1), shard2.values[s])
    before = shard2.updates
    for _ in range(4):
        step(client, worker, x, y)
    client.close()
    with net.cv:
        post(net, 0, 2, Op.STOP, -1)  # worker 0, which only Put
        net.cv.notify_all()
    threads[0].join(10)
    assert not threads[0].is_alive()  # both workers said Stop to server 2
    assert shard2.updates == before + 4 * 2  # every later step's update of both slices reached server 2


def serve(s: Server) -> None:
    try:
        s.serve()
    except RuntimeError:  # the transport says this server died
        pass
