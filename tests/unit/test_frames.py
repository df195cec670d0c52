"""Frames (a peer's messages sent in one go) without processes: the codec, and the server loop reading them."""

from __future__ import annotations

import pytest
import torch

from troupe.cluster.wire import sparse
from troupe.cluster.wire.frames import HEADER_BYTES, Frame, pack
from troupe.cluster.wire.messages import FRAME_MAGIC, HEADER_TAG, PAYLOAD_TAG, Header, MessageError, Op
from troupe.cluster.serving.server import Server
from troupe.cluster.serving.shard import ParamShard, plan_slices
from tests.unit.test_cluster_topk import Scripted

MIXED = [
    (Header(Op.LR, -1, 0, 3, 2), torch.tensor([0.5, 0.25], dtype=torch.float64)),
    (Header(Op.UPDATE, 0, 4, 3, 3), torch.tensor([1.0, -2.0, 3.0], dtype=torch.float16)),  # 6 bytes: misaligns
    (Header(Op.GET, 1, 0, 3, 0), None),
    (Header(Op.SPARSE_UPDATE, 2, 1, 3, 2), sparse.encode(torch.tensor([4, 1]), torch.tensor([0.5, -1.5]))),
    (Header(Op.UPDATE, 1, 2, 3, 5), torch.arange(5.0)),
    (Header(Op.SKIP, 3, 0, 3, 0), None),
]


def read(sent: list[tuple[torch.Tensor, int]], first_length: int) -> list[tuple[Header, torch.Tensor | None]]:
    """The messages a frame holds, read the way a receiver reads them (payloads as raw bytes)."""
    (opener, tag), (body, body_tag) = sent
    assert (tag, body_tag) == (HEADER_TAG, PAYLOAD_TAG)
    header = Header.decode(opener)
    assert header.frame == body.numel()
    frame, out = Frame(body), []
    header = header.with_length(first_length)
    while True:
        dtype = {Op.LR: torch.float64, Op.SPARSE_UPDATE: torch.uint8}.get(header.op, torch.float32)
        if header.op is Op.UPDATE and header.slice_id == 0:
            dtype = torch.float16
        size = sparse.payload_bytes(header.length, torch.float32) if header.op is Op.SPARSE_UPDATE else header.length
        out.append((header, frame.take(size, dtype) if header.length else None))
        if not frame.left:
            return out
        header = frame.next_header()


def test_a_frame_sends_exactly_the_bytes_of_its_messages_and_reads_back_the_same():
    sent = pack(MIXED)
    lone = sum(HEADER_BYTES + (0 if p is None else p.numel() * p.element_size()) for _, p in MIXED)
    assert len(sent) == 2 and sum(t.numel() * t.element_size() for t, _ in sent) == lone
    assert int(sent[0][0][0]) == FRAME_MAGIC
    back = read(sent, first_length=2)
    assert [h for h, _ in back] == [h for h, _ in MIXED]
    for (_, got), (_, want) in zip(back, MIXED):
        assert (got is None and want is None) or torch.equal(got, want)


def test_one_message_goes_alone():
    header, payload = MIXED[4]
    (h, h_tag), (p, p_tag) = pack([MIXED[4]])
    assert Header.decode(h) == header and (h_tag, p_tag) == (HEADER_TAG, PAYLOAD_TAG) and p is payload
    assert [Header.decode(t) for t, _ in pack([MIXED[2]])] == [MIXED[2][0]]
    assert pack([]) == []


def test_malformed_frames_are_message_errors():
    short = Header(Op.GET, 0, 0, 1, 0, frame=8).encode()
    with pytest.raises(MessageError, match="a frame of 8 bytes opened by GET: too short"):
        Header.decode(short)
    (_, _), (body, _) = pack([MIXED[2], MIXED[4]])
    truncated = Frame(body[:-4])
    truncated.next_header()
    with pytest.raises(MessageError, match="the frame ends 4 bytes before a payload of 5 torch.float32"):
        truncated.take(5, torch.float32)
    nested = Frame(torch.cat([Header(Op.GET, 0, 0, 1, 0, frame=96).encode().view(torch.uint8)]))
    with pytest.raises(MessageError, match="a frame opened inside a frame by GET"):
        nested.next_header()


# --- the server loop, fed frames by a scripted communicator --------------------------------------


SIZES = [10, 6]


def server(script, sender=0, framed=True):
    """Serve `script` (lists of messages from `sender`, each list one frame or one message after the other),
    after the initial Puts and before a Stop; returns the shard, the stats and what was sent."""
    puts = [(Header(Op.PUT, k, 0, sender, n), torch.arange(float(n)) + k) for k, n in enumerate(SIZES)]
    steps = [puts, *script, [(Header(Op.STOP, -1, 0, sender, 0), None)]]
    wire = []
    for messages in steps:
        groups = [messages] if framed else [[m] for m in messages]
        wire += [(sender, tag, t) for g in groups for t, tag in pack(g)]
    shard = ParamShard(plan_slices(SIZES, 1), torch.optim.SGD([torch.zeros(1)], lr=1.0, momentum=0.5), [0, 0],
                       {0: {sender}})
    comm = Scripted(wire)
    stats = Server(comm, shard, workers=[sender], putters={sender}).serve()
    assert not comm.script
    return shard, stats, comm.sent


def replies(sent) -> list[tuple[Header, torch.Tensor | None]]:
    """What the server said, frame by frame, as (header, payload) messages."""
    out, queue = [], [(tag, t) for _, tag, t in sent]
    while queue:
        tag, raw = queue.pop(0)
        header = Header.decode(raw)
        if not header.frame:
            out.append((header, queue.pop(0)[1] if header.length else None))
            continue
        frame = Frame(queue.pop(0)[1])
        header = header.with_length(SIZES[header.slice_id] if header.op is Op.REPLY else 0)
        while True:
            out.append((header, frame.take(header.length, torch.float32).clone() if header.length else None))
            if not frame.left:
                break
            header = frame.next_header()
    return out


STEPS = [
    [(Header(Op.GET, 0, 0, 0, 0), None), (Header(Op.GET, 1, 0, 0, 0), None)],
    [(Header(Op.LR, -1, 0, 0, 1), torch.tensor([0.5], dtype=torch.float64)),
     (Header(Op.UPDATE, 0, 0, 0, 10), torch.ones(10)), (Header(Op.UPDATE, 1, 0, 0, 6), torch.full((6,), 2.0))],
    [(Header(Op.UPDATE, 0, 1, 0, 10), torch.ones(10)), (Header(Op.PUSH, 1, 1, 0, 6), -torch.ones(6))],
]


def test_a_frame_is_served_as_its_messages_one_by_one_and_answered_in_one_frame():
    framed, stats, sent = server(STEPS)
    lone, lone_stats, lone_sent = server(STEPS, framed=False)
    for k in range(len(SIZES)):
        assert torch.equal(framed.values[k], lone.values[k]) and framed.version[k] == lone.version[k] == 2
    assert stats.updates == lone_stats.updates == 4 and stats.rejected == 0
    # SGD at lr 0.5 with momentum 0.5: slice 0 moved by 0.5 then 0.75, slice 1 by 1.0 then 0.5 - 0.5
    assert torch.equal(framed.values[0], torch.arange(10.0) - 1.25)
    assert torch.equal(framed.values[1], torch.arange(6.0) + 1 - 1.0)
    # each frame of the worker is answered by one frame: 3 frames of 2 messages
    assert [tag for _, tag, _ in sent] == [HEADER_TAG, PAYLOAD_TAG] * 3
    assert [tag for _, tag, _ in lone_sent] == [HEADER_TAG, PAYLOAD_TAG] * 5 + [HEADER_TAG]  # the Push's Ack
    said, said_alone = replies(sent), replies(lone_sent)
    assert [h for h, _ in said] == [h for h, _ in said_alone]
    assert [h.op for h, _ in said] == [Op.REPLY] * 5 + [Op.ACK]
    for (_, a), (_, b) in zip(said, said_alone):
        assert (a is None and b is None) or torch.equal(a, b)
    # a reply carries the values when it was made: the first Update's reply holds slice 0 after one step
    assert torch.equal(said[4][1], torch.arange(10.0) - 1.25)


def test_a_frames_updates_step_together_yet_every_reply_says_what_one_by_one_would():
    # The frame's updates wait for one fused step; a Get or a learning rate between them steps them first.
    mixed = [[(Header(Op.UPDATE, 0, 0, 0, 10), torch.ones(10)), (Header(Op.GET, 0, 0, 0, 0), None),
              (Header(Op.LR, -1, 0, 0, 1), torch.tensor([0.5], dtype=torch.float64)),
              (Header(Op.UPDATE, 1, 0, 0, 6), torch.full((6,), 2.0))],
             [(Header(Op.UPDATE, 1, 1, 0, 6), torch.ones(6)), (Header(Op.UPDATE, 0, 1, 0, 10), torch.ones(10))]]
    framed, _, sent = server(mixed)
    lone, _, lone_sent = server(mixed, framed=False)
    assert all(torch.equal(framed.values[k], lone.values[k]) for k in range(len(SIZES)))
    said, said_alone = replies(sent), replies(lone_sent)
    assert [h for h, _ in said] == [h for h, _ in said_alone] and len(said) == 5
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(said, said_alone))
    assert torch.equal(said[1][1], torch.arange(10.0) - 1)  # the Get saw the Update before it


def test_a_bad_message_in_a_frame_is_rejected_and_the_rest_applied():
    forged = (Header(Op.UPDATE, 1, 0, 5, 6), torch.full((6,), 1e6))  # claims another sender
    unknown = (Header(Op.GET, 7, 0, 0, 0), None)
    shard, stats, sent = server([[forged, (Header(Op.UPDATE, 0, 0, 0, 10), torch.ones(10)), unknown]])
    assert stats.rejected == 2 and stats.updates == 1
    assert torch.equal(shard.values[0], torch.arange(10.0) - 1) and torch.equal(shard.values[1], torch.arange(6.0) + 1)
    assert [h.op for h, _ in replies(sent)] == [Op.REPLY]  # the good Update is answered alone


def test_a_frame_opened_for_a_slice_not_held_is_dropped_whole_and_the_server_keeps_its_footing():
    bad_first = [(Header(Op.UPDATE, 7, 0, 0, 3), torch.ones(3)), (Header(Op.UPDATE, 0, 0, 0, 10), torch.ones(10))]
    good = [(Header(Op.UPDATE, 0, 0, 0, 10), torch.ones(10)), (Header(Op.UPDATE, 1, 0, 0, 6), torch.ones(6))]
    shard, stats, _ = server([bad_first, good])
    assert stats.rejected == 1 and stats.updates == 2
    assert torch.equal(shard.values[0], torch.arange(10.0) - 1)


def test_bytes_holding_wider_types_come_out_aligned():
    (_, _), (body, _) = pack([MIXED[1], MIXED[3]])  # 6 bytes of fp16, then the sparse message
    frame = Frame(body)
    frame.take(3, torch.float16)
    header = frame.next_header()
    raw = frame.take(sparse.payload_bytes(header.length, torch.float32), torch.uint8, align=8)
    assert raw.storage_offset() % 8 == 0
    index, values = sparse.decode(raw, 2, torch.float32, 10)
    assert index.tolist() == [4, 1] and values.tolist() == [0.5, -1.5]


def test_the_inbox_keeps_the_rest_of_a_frame_for_the_next_ask():
    from troupe.cluster.wire.frames import Inbox

    said = [(Header(Op.REPLY, 0, 3, 9, 10), torch.arange(10.0)), (Header(Op.ACK, 1, 2, 9, 0), None),
            (Header(Op.REPLY, 1, 3, 9, 6), torch.ones(6))]
    lone = (Header(Op.REPLY, 0, 4, 9, 10), torch.zeros(10))
    comm = Scripted([(9, tag, t) for tag_t in (pack(said), pack([lone])) for t, tag in tag_t])
    inbox = Inbox(comm, limit=1000, first_length=lambda h, src: SIZES[h.slice_id] if h.op is Op.REPLY else 0)

    def ask(n):
        out = []
        for header, frame in inbox.messages(9, n):
            if not header.length:
                out.append((header, None))
            elif frame is None:
                value = torch.empty(header.length)
                comm.recv(value, 9, PAYLOAD_TAG)
                out.append((header, value))
            else:
                out.append((header, frame.take(header.length, torch.float32).clone()))
        return out

    first, second = ask(2), ask(2)  # the frame's third reply is the next step's, then a lone one
    assert [h for h, _ in first + second] == [h for h, _ in said + [lone]]
    assert torch.equal(first[0][1], torch.arange(10.0)) and torch.equal(second[0][1], torch.ones(6))
    assert torch.equal(second[1][1], torch.zeros(10)) and not comm.script
    too_small = Inbox(Scripted([(9, tag, t) for t, tag in pack(said)]), 100, lambda h, src: 10)
    with pytest.raises(MessageError, match="a frame of 160 bytes from rank 9; at most 100"):
        next(too_small.messages(9, 1))
