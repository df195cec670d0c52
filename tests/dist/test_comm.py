"""The Communicator's collectives and byte counters, on a real 3-rank Gloo world."""

from __future__ import annotations

import torch

from tests.dist.world import run_world


def _collectives(rank, world_size):
    import troupe

    c = troupe.init().comm
    n = world_size
    out = {}
    t = torch.full((4,), float(rank + 1))
    c.all_reduce(t, "sum")
    out["sum"] = t.tolist()
    t = torch.full((4,), float(rank + 1))
    c.all_reduce(t, "mean")
    out["mean"] = t.tolist()
    t = torch.tensor([float(rank)])
    h = c.all_reduce(t, "max", async_op=True)
    h.wait()
    out["max"] = t.item()

    a, b = torch.full((2, 3), float(rank)), torch.full((5,), 10.0 * rank)
    c.fused_all_reduce([a, b], "sum")
    out["fused"] = (a.tolist(), b.tolist())

    t = torch.full((3,), float(rank))
    c.broadcast(t, src=1)
    out["broadcast"] = t.tolist()

    out["all_gather"] = [g.tolist() for g in c.all_gather(torch.tensor([rank, 2 * rank]))]
    sizes = [0, 2, 5]
    out["varsize"] = [g.tolist() for g in c.all_gather_varsize(torch.arange(sizes[rank], dtype=torch.float32) + rank)]
    gathered = c.gather(torch.tensor([rank * 3]), dst=0)
    out["gather"] = None if gathered is None else [g.item() for g in gathered]
    recv = torch.empty(2)
    chunks = [torch.tensor([float(r), float(r) + 0.5]) for r in range(n)] if rank == 0 else None
    out["scatter"] = c.scatter(recv, chunks, src=0).tolist()
    out["objects"] = c.all_gather_object({"rank": rank})
    c.barrier()

    # the ring reduce-scatter, on a group of its own (its thread), against a sum: chunk `rank` is the
    # sum, both asynchronously and not; (n-1)/n of the buffer counted on the wire
    ring = c.new_group(range(n))
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(n * 1000, generator=g), torch.randn(n * 7, generator=g)
    want_x, want_y = x.clone(), y.clone()
    c.all_reduce(want_x, "sum")
    c.all_reduce(want_y, "sum")
    pending = ring.ring_reduce_scatter(x, async_op=True)
    ring.ring_reduce_scatter(y)
    pending.wait()
    out["ring"] = [torch.allclose(got.view(n, -1)[rank], want.view(n, -1)[rank], rtol=1e-5, atol=1e-5)
                   for got, want in ((x, want_x), (y, want_y))]
    out["ring_wire"] = ring.traffic["reduce_scatter"].wire_bytes
    try:
        ring.ring_reduce_scatter(torch.zeros(n * 2 + 1))
    except ValueError as e:
        out["ring_uneven"] = str(e)

    # counters: a ring all-reduce sends 2(n-1)/n of the payload; then they reset
    c.reset_counters()
    c.all_reduce(torch.zeros(300), "sum")
    out["traffic"] = (c.traffic["all_reduce"].calls, c.traffic["all_reduce"].payload_bytes, c.bytes_sent())
    return out


def test_every_collective_against_its_definition():
    results = run_world(_collectives, 3)
    n = 3
    for rank, r in enumerate(results):
        assert r["sum"] == [6.0] * 4 and r["mean"] == [2.0] * 4 and r["max"] == 2.0
        assert r["fused"] == ([[3.0] * 3] * 2, [30.0] * 5)
        assert r["broadcast"] == [1.0] * 3
        assert r["all_gather"] == [[q, 2 * q] for q in range(n)]
        assert r["varsize"] == [[], [1.0, 2.0], [2.0, 3.0, 4.0, 5.0, 6.0]]
        assert r["gather"] == ([0, 3, 6] if rank == 0 else None)
        assert r["scatter"] == [float(rank), rank + 0.5]
        assert r["objects"] == [{"rank": q} for q in range(n)]
        assert r["ring"] == [True, True]
        assert r["ring_wire"] == int((n - 1) / n * n * 1000 * 4) + int((n - 1) / n * n * 7 * 4)
        assert r["ring_uneven"] == "ring_reduce_scatter: 7 elements do not cut into 3 equal chunks"
        calls, payload, wire = r["traffic"]
        assert calls == 1 and payload == 300 * 4 and wire == int(2 * (n - 1) / n * 300 * 4)
