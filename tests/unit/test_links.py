"""The parameter-server links (`troupe.cluster.wire.links`) between a server and workers in one process:
both sides are threads here, each link a real Gloo group of two made through one store."""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from troupe.cluster.wire.links import Links, knock_key, reason
from troupe.cluster.wire.messages import HEADER_TAG, PAYLOAD_TAG, Header, Op, empty_header


def header(op: Op, sender: int, length: int = 0) -> torch.Tensor:
    return Header(op, 0, 0, sender, length).encode()


def test_a_server_takes_each_workers_link_then_a_restarted_ones_in_order():
    store = dist.HashStore()
    server = Links(store, 0, timeout=30.0)
    events: list[tuple] = []
    server.on_link = lambda peer: events.append(("link", peer))
    server.on_lost = lambda peer, why: events.append(("lost", peer, why))
    server.listen([1, 2], empty_header)
    workers = {1: Links(store, 1, timeout=30.0), 2: Links(store, 2, timeout=30.0)}
    for rank, w in workers.items():
        w.dial(0, incarnation=0)
        assert store.get(knock_key(0, rank)) == b"0"
    # A message from each: its header through the receive from any worker, its payload from that worker.
    # (A Gloo send completes once its receive is posted: they leave as isends, waited for at the end.)
    sends = [workers[2].isend(header(Op.UPDATE, 2, 3), 0, HEADER_TAG),
             workers[2].isend(torch.full((3,), 2.0), 0, PAYLOAD_TAG),
             workers[1].isend(header(Op.UPDATE, 1, 3), 0, HEADER_TAG),
             workers[1].isend(torch.full((3,), 1.0), 0, PAYLOAD_TAG)]
    got = {}
    for _ in range(2):
        raw = empty_header()
        src = server.recv(raw, None, HEADER_TAG)
        payload = torch.empty(3)
        server.recv(payload, src, PAYLOAD_TAG)
        assert Header.decode(raw).sender == src
        got[src] = payload[0].item()
    for h in sends:
        h.wait()
    assert got == {1: 1.0, 2: 2.0}
    assert sorted(events) == [("link", 1), ("link", 2)]
    # The server answers on the same link.
    reply = empty_header()
    pending = workers[1].irecv(reply, 0, HEADER_TAG)
    server.send(header(Op.ACK, 0), 1, HEADER_TAG)
    pending.wait()
    assert Header.decode(reply).op is Op.ACK

    # Worker 2 "restarts": its next life dials with incarnation 1. The server first loses the old link,
    # then takes the new one, before it hands over the new life's first message.
    events.clear()
    again = Links(store, 2, timeout=30.0)
    again.dial(0, incarnation=1)
    sent = again.isend(header(Op.GET, 2), 0, HEADER_TAG)
    raw = empty_header()
    assert server.recv(raw, None, HEADER_TAG) == 2 and Header.decode(raw).op is Op.GET
    sent.wait()
    assert [e[:2] for e in events] == [("lost", 2), ("link", 2)]
    assert "started again (incarnation 1)" in events[0][2]
    assert server.connected(2) and server.connected(1)
    reply = empty_header()
    pending = again.irecv(reply, 0, HEADER_TAG)
    server.send(header(Op.ACK, 0), 2, HEADER_TAG)
    pending.wait()
    assert Header.decode(reply).op is Op.ACK
    server.close()


def test_a_lost_peer_is_refused_by_name_and_gloos_error_reads_in_a_few_words():
    links = Links(dist.HashStore(), 0, timeout=5.0)
    try:
        links.send(torch.zeros(1), 3)
    except RuntimeError as e:
        assert "rank 0 has no link to rank 3 (it died, or never dialled)" in str(e)
    else:
        raise AssertionError("a send without a link must raise")
    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:8111. This is typically caused by a remote worker crashing.")
    assert reason(gloo) == "Connection closed by peer [127.0.0.1]:8111"


def test_dialling_blocks_until_the_server_has_made_its_side():
    store = dist.HashStore()
    worker = Links(store, 1, timeout=30.0)
    done = threading.Event()
    t = threading.Thread(target=lambda: (worker.dial(0, 0), done.set()), daemon=True)
    t.start()
    assert not done.wait(0.3)  # nobody listens yet
    server = Links(store, 0, timeout=30.0)
    server.listen([1], empty_header)
    assert done.wait(20)
    server.close()
