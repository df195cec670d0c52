"""Separate server groups' synchronisation without processes: the master-copy arithmetic, and two real
`Server` loops (threads) talking through an in-memory transport."""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import pytest
import torch

from troupe.cluster.wire.messages import HEADER_TAG, PAYLOAD_TAG, Header, MessageError, Op
from troupe.cluster.serving.server import Server
from troupe.cluster.serving.mastercopies import MasterCopies
from troupe.cluster.serving.serversync import ServerSync
from troupe.cluster.serving.shard import ParamShard, plan_slices

NUMELS = [6, 5]
W0 = torch.arange(11.0)


def make_shard(group: int, workers: set[int], lr: float = 1.0) -> ParamShard:
    shard = ParamShard(plan_slices(NUMELS, 1), torch.optim.SGD([torch.zeros(1)], lr=lr), [0, 0], {group: workers})
    for s in shard.slices.values():
        shard.put(s.id, W0[sum(NUMELS[: s.param]) + s.start : sum(NUMELS[: s.param]) + s.stop])
    return shard


def flat(shard: ParamShard) -> torch.Tensor:
    return torch.cat([shard.values[k] for k in sorted(shard.values)])


def change(shard: ParamShard, delta: torch.Tensor) -> None:
    """What the server's workers' updates did (the shard's values moved by `delta`)."""
    offset = 0
    for k in sorted(shard.values):
        n = shard.values[k].numel()
        shard.values[k].add_(delta[offset : offset + n])
        offset += n


def part(copies: MasterCopies, k: int, t: torch.Tensor) -> torch.Tensor:
    """Part k of a flat vector laid out as the shard's slices (param 0: elements 0-5, param 1: 6-10)."""
    return torch.cat([t[s.param * 6 + lo : s.param * 6 + hi] for s, lo, hi in copies.parts[k]])


@pytest.mark.parametrize("merge", ["mean", "sum"])
def test_fold_and_adopt_keep_the_updates_applied_meanwhile(merge):
    a, b = MasterCopies(make_shard(0, {0}), 0, 2, merge), MasterCopies(make_shard(1, {1}), 1, 2, merge)
    a.start(), b.start()
    assert a.sizes == b.sizes and sum(a.sizes) == sum(NUMELS)
    scale = 0.5 if merge == "mean" else 1.0
    da, db, later = torch.linspace(0, 1, 11), torch.linspace(5, 3, 11), torch.full((11,), 100.0)
    change(a.shard, da)
    change(b.shard, db)
    delta = a.request(1)  # a's change of part 1 since its last sync, to b (the master of part 1)
    torch.testing.assert_close(delta, part(a, 1, da))
    change(a.shard, later)  # a's workers go on while the Merge travels
    b.fold_own()  # b's own change goes into its master copy first, adopted at once
    torch.testing.assert_close(b.gather(1), part(b, 1, W0) + scale * part(b, 1, db))
    version, value = b.fold(delta, seen=0)
    assert version == 2 and b.merges == [1]  # one merge (b's own) since a last adopted
    torch.testing.assert_close(value, part(a, 1, W0) + scale * part(a, 1, da + db))
    sent = part(a, 1, W0 + da)
    a.adopt(1, value)
    # a keeps what it applied after the Merge left: cur = master + (cur - sent); last_sync = master
    torch.testing.assert_close(a.gather(1), value + part(a, 1, later))
    torch.testing.assert_close(a.gather(1, a.shard.last_sync), value)
    assert a.drift == pytest.approx(float((value - sent).abs().max()))
    # part 0 is a's own: its master copy takes a's whole change (scaled), adopted at once
    a.fold_own()
    torch.testing.assert_close(a.gather(0), part(a, 0, W0) + scale * part(a, 0, da + later))
    torch.testing.assert_close(a.gather(0, a.shard.last_sync), a.gather(0))
    # the next Merge of part 1 carries only what came after the adoption
    torch.testing.assert_close(a.request(1), part(a, 1, later))
    with pytest.raises(RuntimeError, match="already in flight"):
        a.request(1)
    a.forget(1)  # its master died: the values stay as they are
    torch.testing.assert_close(a.gather(1), value + part(a, 1, later))


def test_bad_merge_setting_is_refused():
    with pytest.raises(ValueError, match="group_merge"):
        MasterCopies(make_shard(0, {0}), 0, 2, "median")


# --- two Server loops over an in-memory transport ------------------------------------------------


class _Done:
    def wait(self) -> None:
        pass


class Net:
    """Mailboxes of every rank; a receive takes the first message that matches (source, tag)."""

    def __init__(self):
        self.boxes: dict[int, list[tuple[int, int, torch.Tensor]]] = defaultdict(list)
        self.cv = threading.Condition()
        self.dead: set[int] = set()

    def kill(self, rank: int) -> None:
        """`rank`'s process dies: what it sends is lost, its receives fail, and so do the others' receives from
        it once nothing it sent before is left (a reset connection)."""
        with self.cv:
            self.dead.add(rank)
            self.cv.notify_all()

    def comm(self, rank: int) -> Comm:
        return Comm(self, rank)


class Comm:
    def __init__(self, net: Net, rank: int):
        self.net, self.rank = net, rank

    def send(self, tensor, dst, tag=0):
        with self.net.cv:
            if not {self.rank, dst} & self.net.dead:
                self.net.boxes[dst].append((self.rank, tag, tensor.detach().clone()))
            self.net.cv.notify_all()

    def isend(self, tensor, dst, tag=0):
        self.send(tensor, dst, tag)
        return _Done()

    def recv(self, tensor, src=None, tag=0):
        box = self.net.boxes[self.rank]
        with self.net.cv:
            def first():
                return next((i for i, (s, t, _) in enumerate(box) if t == tag and src in (None, s)), None)

            def reset():
                return self.rank in self.net.dead or (src in self.net.dead and first() is None)

            self.net.cv.wait_for(lambda: first() is not None or reset(), timeout=30)
            if reset():
                raise RuntimeError(f"rank {self.rank}: connection reset (rank {src} died)")
            i = first()
            assert i is not None, f"rank {self.rank}: nothing to receive from {src} on tag {tag}"
            s, _, value = box.pop(i)
        tensor.copy_(value)
        return s


SERVERS = {0: 10, 1: 11}  # server group -> rank of its one server
WORKERS = {0: 0, 1: 1}  # worker group (one per server group) -> rank


def post(net: Net, src: int, dst: int, op: Op, slice_id: int, payload: torch.Tensor | None = None, version=0):
    length = 0 if payload is None else payload.numel()
    net.boxes[dst].append((src, HEADER_TAG, Header(op, slice_id, version, src, length).encode()))
    if payload is not None:
        net.boxes[dst].append((src, PAYLOAD_TAG, payload.clone()))


def run_servers(merge: str, steps: int, grads: dict[int, torch.Tensor], sync_freq: int = 2, extra=None):
    """Two server groups of one server, one worker group each. Worker 0 Puts W0 to both servers; each
    worker then sends `steps` Updates with a constant gradient (SGD at lr 1: every update adds -grad,
    so the result does not depend on the order), and Stop to both servers."""
    net, channel = Net(), Net()  # the workers' messages, and the servers' own channel
    shards, servers = {}, {}
    slices = plan_slices(NUMELS, 1)
    for g, rank in SERVERS.items():
        shards[g] = ParamShard(slices, torch.optim.SGD([torch.zeros(1)], lr=1.0), [0, 0], {g: {WORKERS[g]}})
        copies = MasterCopies(shards[g], g, 2, merge)
        sync = ServerSync(channel.comm(rank), copies, {k: r for k, r in SERVERS.items() if k != g}, sync_freq,
                          {WORKERS[g]})
        servers[g] = Server(net.comm(rank), shards[g], workers=list(WORKERS.values()), putters={0}, sync=sync)
    for rank in SERVERS.values():
        for s in slices:
            post(net, 0, rank, Op.PUT, s.id, W0[s.param * 6 + s.start : s.param * 6 + s.stop])
    for src, dst, op, slice_id, payload in (extra or {}).get("forged", []):  # first: nothing is in flight
        post(channel, src, dst, op, slice_id, payload)
    for g, worker in WORKERS.items():
        for step in range(steps):
            for s in slices:
                post(net, worker, SERVERS[g], Op.UPDATE, s.id, grads[g][s.param * 6 + s.start : s.param * 6 + s.stop])
    for worker in WORKERS.values():
        for rank in SERVERS.values():
            post(net, worker, rank, Op.STOP, -1)
    stats = {}
    threads = [threading.Thread(target=lambda g=g: stats.__setitem__(g, servers[g].serve()), daemon=True)
               for g in SERVERS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(not t.is_alive() for t in threads) and set(stats) == set(SERVERS), "a server loop did not end"
    return shards, stats, servers


@pytest.mark.parametrize("merge", ["mean", "sum"])
def test_two_server_groups_end_equal_with_every_groups_change(merge):
    steps = 9
    grads = {0: torch.linspace(-1, 1, 11), 1: torch.linspace(2, 0.5, 11) ** 2}
    shards, stats, servers = run_servers(merge, steps, grads)
    scale = 0.5 if merge == "mean" else 1.0
    expected = W0 - scale * steps * (grads[0] + grads[1])
    alone = {g: W0 - steps * grads[g] for g in grads}  # what each would hold without syncing
    for g in SERVERS:
        torch.testing.assert_close(flat(shards[g]), expected, atol=1e-5, rtol=0)
        last_sync = torch.cat([shards[g].last_sync[k] for k in sorted(shards[g].values)])
        torch.testing.assert_close(last_sync, flat(shards[g]))
        assert (flat(shards[g]) - alone[g]).abs().max() > 1.0
        assert stats[g].rejected == 0 and stats[g].updates == steps * 2
        assert servers[g].sync.syncs >= 2 and "syncs with server groups" in str(stats[g])
    assert torch.equal(flat(shards[0]), flat(shards[1]))  # the Finals make them identical


def test_a_server_rejects_forged_peer_messages_and_keeps_its_footing():
    # part 0 (held by rank 10) has 3 + 2 elements, part 1 (rank 11) 3 + 3
    forged = [
        (11, 10, Op.MERGED, 1, torch.full((6,), 1e6)),  # an answer to no Merge in flight
        (11, 10, Op.FINAL, 1, torch.full((6,), 1e6)),  # a Final before either finished
        (11, 10, Op.MERGE, 1, torch.full((6,), 1e6)),  # names the part the sender's own group masters
        (11, 10, Op.MERGE, 0, torch.full((4,), 1e6)),  # wrong length for the part held here
        (11, 10, Op.MERGED, 1, torch.full((2,), 1e6)),  # wrong length (drained: the next message lines up)
    ]
    steps = 5
    grads = {0: torch.ones(11), 1: -torch.ones(11)}
    shards, stats, servers = run_servers("mean", steps, grads, extra={"forged": forged})
    assert servers[0].sync.rejected == 5 and servers[1].sync.rejected == 0 and stats[0].rejected == 0
    torch.testing.assert_close(flat(shards[0]), W0, atol=1e-5, rtol=0)  # mean of +1 and -1 steps: unchanged
    assert torch.equal(flat(shards[0]), flat(shards[1]))


def test_a_dead_neighbour_is_forgotten():
    net = Net()
    shard = make_shard(0, {0})
    sync = ServerSync(net.comm(10), MasterCopies(shard, 0, 2), {1: 11}, 2, {0})
    with sync.lock:
        sync.progress(live=set())  # every worker of the group stopped: last Merge and Finished leave
        assert sync.finishing and not sync.done() and sync.watching() == [11]
        sync.alive = lambda rank: rank != 11
        sync.wait_done()  # notices that rank 11 is gone
        assert sync.done() and sync.watching() == [] and "peers gone: [11]" in sync.stats()
        with pytest.raises(MessageError, match="forgotten"):
            sync.handle(11, Header(Op.FINISHED, 1, 0, 11, 0))


def test_a_dead_server_group_s_part_gets_a_new_master_and_the_survivors_end_equal_on_every_part():
    # Three server groups of one server (ranks 10, 11, 12), a worker each (worker 2's gradients are zero). Rank 12
    # dies after some syncs: its part 2 moves to server group 0 (the next live one after 2), which takes it over
    # from the value it last adopted; rank 11 Merges part 2 there from then on, and the Finals make ranks 10 and
    # 11 equal on all three parts. Parts 0 and 1 lose nothing (their masters live): they end where the mean of
    # every group's change puts them; part 2 loses at most what only the dead master held.
    servers3, workers3, sync_freq, steps = {0: 10, 1: 11, 2: 12}, {0: 0, 1: 1, 2: 2}, 2, 12
    grads = {0: torch.linspace(-1, 1, 11), 1: torch.linspace(2, 0.5, 11) ** 2, 2: torch.zeros(11)}
    net, channel = Net(), Net()
    slices = plan_slices(NUMELS, 1)
    shards, servers, stats = {}, {}, {}
    for g, rank in servers3.items():
        shards[g] = ParamShard(slices, torch.optim.SGD([torch.zeros(1)], lr=1.0), [0, 0], {g: {workers3[g]}})
        sync = ServerSync(channel.comm(rank), MasterCopies(shards[g], g, 3), {k: r for k, r in servers3.items()
                                                                             if k != g}, sync_freq, {workers3[g]})
        servers[g] = Server(net.comm(rank), shards[g], workers=list(workers3.values()), putters={0}, sync=sync,
                            alive=lambda r: r not in channel.dead)

    def updates(g: int, n: int) -> None:
        for _ in range(n):
            for s in slices:
                post(net, workers3[g], servers3[g], Op.UPDATE, s.id, grads[g][s.param * 6 + s.start : s.param * 6 + s.stop])

    for rank in servers3.values():
        for s in slices:
            post(net, 0, rank, Op.PUT, s.id, W0[s.param * 6 + s.start : s.param * 6 + s.stop])
    for g in servers3:
        updates(g, steps // 2)

    def serve(g: int) -> None:
        try:
            stats[g] = servers[g].serve()
        except RuntimeError:  # rank 12, killed
            pass

    threads = {g: threading.Thread(target=serve, args=(g,), daemon=True) for g in servers3}
    for t in threads.values():
        t.start()
    deadline = time.monotonic() + 30
    while not (servers[2].sync.copies.version >= 3 and min(servers[g].sync.syncs for g in (0, 1)) >= 2):
        assert time.monotonic() < deadline, "the three server groups never synced"
        time.sleep(0.01)
    net.kill(12)
    channel.kill(12)
    for g in (0, 1):
        updates(g, steps - steps // 2)
    for worker in workers3.values():
        for g in (0, 1):
            post(net, worker, servers3[g], Op.STOP, -1)
    with net.cv:  # (post() does not wake the servers' loops, which are running now)
        net.cv.notify_all()
    for g in (0, 1):
        threads[g].join(60)
        assert not threads[g].is_alive() and g in stats, "a surviving server loop did not end"
    with servers[2]._lock:  # rank 12's process is gone, and its worker-watching thread with it (left running,
        servers[2].live.clear()  # it may wake during the interpreter's exit, which then aborts)
    for t in [t for t in threading.enumerate() if t.name == "troupe-ps-watch"]:
        t.join(5)
    syncs = {g: servers[g].sync for g in (0, 1)}
    assert syncs[0].master_of == syncs[1].master_of == {0: 0, 1: 1, 2: 0}
    assert syncs[0].taken_over == [2] and syncs[1].taken_over == [] and "parts taken over: [2]" in str(stats[0])
    assert all(stats[g].rejected == 0 and syncs[g].rejected == 0 for g in (0, 1))
    assert torch.equal(flat(shards[0]), flat(shards[1]))  # every part, the dead one's too: one master each
    expected = W0 - steps * (grads[0] + grads[1]) / 3
    copies = syncs[0].copies
    for k in (0, 1):
        torch.testing.assert_close(part(copies, k, flat(shards[0])), part(copies, k, expected), atol=1e-5, rtol=0)
    # Part 2: what group 1 folded into the dead master after group 0 last adopted it is lost (a third of each
    # update under "mean"): at most group 1's updates before the death (group 0 may have run ahead of it), and
    # whole updates; everything after the death counts.
    lost = (part(copies, 2, flat(shards[0])) - part(copies, 2, expected)) / (part(copies, 2, grads[1]) / 3)
    assert torch.allclose(lost, lost[0].round().expand_as(lost), atol=1e-4) and 0 <= lost[0].round() <= steps // 2, lost
