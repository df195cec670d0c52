"""Top-K updates to separate servers (wire_topk) without processes: config, codec, payloads, the server loop."""

from __future__ import annotations

import pytest
import torch

from troupe.cluster.wire import sparse
from troupe.cluster.configuration.config import ClusterConfig
from troupe.cluster.configuration.sources import parse_cluster_text, resolve
from troupe.cluster.wire.messages import HEADER_TAG, PAYLOAD_TAG, Header, MessageError, Op, check
from troupe.cluster.serving.server import Server
from troupe.cluster.serving.shard import ParamShard, plan_slices
from troupe.compress import ErrorFeedback
from troupe.compress.topk import topk_count

# --- configuration ------------------------------------------------------------------------------


def test_wire_topk_from_every_source():
    assert ClusterConfig().wire_topk is None
    cfg = ClusterConfig(nworkers_per_group=2, server_worker_separate=True, wire_topk=0.01, wire_dtype="fp16")
    assert ClusterConfig.from_json(cfg.to_json()) == cfg
    block = "cluster {\n  nworkers_per_group: 2\n  server_worker_separate: true\n  wire_topk: 0.01\n}"
    assert parse_cluster_text(block).wire_topk == 0.01
    assert parse_cluster_text("server_worker_separate = true\nwire_topk = 0.05").wire_topk == 0.05
    # a flag that does not change the shape keeps the preset rescalable to -n
    assert resolve("sandblaster", nprocs=4, wire_topk=0.01) == ClusterConfig(
        nworkers_per_group=2, nservers_per_group=2, server_worker_separate=True, wire_topk=0.01)


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"wire_topk": 0.01}, r"^wire_topk 0.01 needs separate servers \(server_worker_separate: true\)"),
        ({"nworker_groups": 2, "nworkers_per_procs": 2, "share_memory": True, "wire_topk": 0.1},
         r"^wire_topk 0.1 needs separate servers"),
        ({"server_worker_separate": True, "wire_topk": 0}, r"must be in \(0, 1\) or unset \(dense\), got 0$"),
        ({"server_worker_separate": True, "wire_topk": 1.0}, r"got 1.0$"),
        ({"server_worker_separate": True, "wire_topk": True}, r"got True$"),
        ({"server_worker_separate": True, "wire_topk": "0.1"}, r"got '0.1'$"),
    ],
)
def test_wire_topk_refused_where_it_cannot_apply(fields, message):
    with pytest.raises(ValueError, match=message) as e:
        ClusterConfig(**fields)
    assert "\n" not in str(e.value)


def test_wire_topk_in_a_job_file_must_be_a_number():
    with pytest.raises(ValueError, match=r"line 1: cluster field wire_topk: expected a fraction in \(0, 1\), got 'all'"):
        parse_cluster_text("cluster { server_worker_separate: true wire_topk: all }")


# --- the codec and the payload -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [None, torch.float16, torch.bfloat16])
def test_error_feedback_sent_plus_residual_is_update_plus_old_residual(dtype):
    residuals: dict[str, torch.Tensor] = {}
    codec = ErrorFeedback(sparse.WireTopK(0.1, dtype), residuals)
    g = torch.Generator().manual_seed(0)
    for step in range(5):
        update = torch.randn(97, generator=g)
        old = residuals.get("slice3", torch.zeros(97)).clone()
        (index, values), ctx = codec.compress(update, "slice3")
        sent = codec.decompress([index, values], ctx)
        assert index.dtype == torch.int32 and index.numel() == topk_count(0.1, 97) == 10
        assert values.dtype == (dtype or torch.float32)
        # exact: a kept element's residual is what rounding it lost, a dropped one's is the whole element
        assert torch.equal(sent + residuals["slice3"], update + old), step
        # the pairs are the largest of (update + old residual)
        corrected = (update + old).abs()
        assert corrected[index.long()].min() >= corrected.topk(10).values.min()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_payload_round_trip(dtype):
    index = torch.tensor([7, 0, 3], dtype=torch.int32)
    values = torch.tensor([1.5, -2.0, 0.25], dtype=dtype)
    raw = sparse.encode(index, values)
    assert raw.dtype == torch.uint8 and raw.numel() == sparse.payload_bytes(3, dtype) == 3 * (4 + dtype.itemsize)
    got_index, got_values = sparse.decode(raw, 3, dtype, numel=8)
    assert torch.equal(got_index, index) and torch.equal(got_values, values)
    dense = sparse.densify(got_index, got_values, 8, torch.float32)
    assert dense.tolist() == [-2.0, 0, 0, 0.25, 0, 0, 0, 1.5]


def test_malformed_payloads_are_message_errors():
    values = torch.ones(3)
    with pytest.raises(MessageError, match="index out of range: \\[0, 8\\] for a slice of 8 elements"):
        sparse.decode(sparse.encode(torch.tensor([0, 8, 2]), values), 3, torch.float32, 8)
    with pytest.raises(MessageError, match="index out of range: \\[-1, 2\\]"):
        sparse.decode(sparse.encode(torch.tensor([-1, 1, 2]), values), 3, torch.float32, 8)
    with pytest.raises(MessageError, match="1 repeated index"):
        sparse.decode(sparse.encode(torch.tensor([4, 1, 4]), values), 3, torch.float32, 8)
    with pytest.raises(MessageError, match="a payload of 2 pairs with torch.float32 values has 16 bytes, got 24"):
        sparse.decode(sparse.encode(torch.tensor([4, 1, 5]), values), 2, torch.float32, 8)
    with pytest.raises(ValueError, match="3 indices but 2 values"):
        sparse.encode(torch.tensor([0, 1, 2]), torch.ones(2))


def test_sparse_headers_are_checked_against_the_top_k():
    h = Header(Op.SPARSE_UPDATE, 2, 5, 1, 4)
    assert Header.decode(h.encode()) == h
    with pytest.raises(MessageError, match="SPARSE_PUSH message with payload length 0"):
        Header.decode(Header(Op.SPARSE_PUSH, 2, 5, 1, 0).encode())
    check(h, src=1, expected_length=4, allowed={Op.SPARSE_UPDATE})
    with pytest.raises(MessageError, match="carries 4 pairs, its top-K is 3$"):
        check(h, src=1, expected_length=3, allowed={Op.SPARSE_UPDATE})


# --- the server loop, with a scripted communicator -----------------------------------------------


class Scripted:
    """A Communicator stand-in: receives come from a script of (src, tag, tensor), sends are kept."""

    rank = 9

    def __init__(self, script):
        self.script, self.sent = list(script), []

    def recv(self, tensor, src=None, tag=0):
        sender, t, value = self.script.pop(0)
        assert t == tag and src in (None, sender), (t, tag, src, sender)
        # Gloo needs sender and receiver to agree on the size: so must the server
        assert value.dtype == tensor.dtype and value.shape == tensor.shape, (value, tensor)
        tensor.copy_(value)
        return sender

    def send(self, tensor, dst, tag=0):
        self.sent.append((dst, tag, tensor.clone()))


def header(op, length, slice_id=0, version=0, sender=0):
    return (sender, HEADER_TAG, Header(op, slice_id, version, sender, length).encode())


def payload(tensor, sender=0):
    return (sender, PAYLOAD_TAG, tensor)


def sparse_update(index, values):
    return [header(Op.SPARSE_UPDATE, len(index)), payload(sparse.encode(torch.tensor(index), torch.tensor(values)))]


def serve(script, topk):
    shard = ParamShard(plan_slices([10], 1), torch.optim.SGD([torch.zeros(10)], lr=1.0), [0], {0: {0}})
    comm = Scripted([header(Op.PUT, 10), payload(torch.arange(10.0)), *script, header(Op.STOP, 0)])
    stats = Server(comm, shard, workers=[0], putters={0}, wire_topk=topk).serve()
    assert not comm.script
    return shard, stats, comm.sent


def test_server_applies_pairs_as_the_dense_update_and_rejects_malformed_ones():
    k = topk_count(0.3, 10)
    good = sparse_update([1, 7, 4], [1.0, -2.0, 0.5])
    script = [
        *sparse_update([1, 10, 4], [1.0, 1.0, 1.0]),  # index out of range
        *sparse_update([1, 1, 4], [1.0, 1.0, 1.0]),  # an index twice
        header(Op.SPARSE_UPDATE, k + 1), payload(sparse.encode(torch.arange(4), torch.ones(4))),  # not the top-K's k
        header(Op.UPDATE, 10), payload(torch.ones(10)),  # dense, where the cluster sends top-K
        *good,
        header(Op.SPARSE_PUSH, k, version=1), payload(sparse.encode(torch.tensor([0, 9, 2]), torch.ones(3))),
    ]
    shard, stats, sent = serve(script, 0.3)
    assert stats.rejected == 4 and stats.updates == 2
    expected = torch.arange(10.0)
    expected[[1, 7, 4]] -= torch.tensor([1.0, -2.0, 0.5])  # SGD at lr 1 with the scattered update
    (_, _, reply), (_, _, value), (_, _, ack) = sent  # the worker gets the fresh slice back, as for an Update
    assert Header.decode(reply).op is Op.REPLY and torch.equal(value, expected)
    assert Header.decode(ack) == Header(Op.ACK, 0, 2, 9, 0)  # a Push is acknowledged without values
    expected[[0, 9, 2]] -= 1
    assert torch.equal(shard.values[0], expected) and shard.version[0] == 2


def test_a_dense_server_rejects_pairs_and_keeps_its_footing():
    shard, stats, _ = serve([*sparse_update([1, 7, 4], [1.0, -2.0, 0.5]), header(Op.UPDATE, 10),
                             payload(torch.ones(10))], None)
    assert stats.rejected == 1 and stats.updates == 1
    assert torch.equal(shard.values[0], torch.arange(10.0) - 1)
