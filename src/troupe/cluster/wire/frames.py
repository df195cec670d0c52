"""Frames: the messages a peer sends another in one go (a worker's step to one server, a server's replies).

Every point-to-point message costs a wakeup of the receiving process and of Gloo's threads,
which on shared cores is worth more than the bytes: a worker's step to one server is one
message per slice (a slice per parameter), so a step of many small messages pays many wakeups
(docs/clusters.md, "Frames"; its cost: docs/clusters_performance.md). A frame sends them as two
transport messages whatever their number: the first message's header, marked as opening a
frame and carrying the frame's size in bytes, then one body holding the first message's
payload followed by each further message's header and payload. The receiver knows the first
message's payload length from its op and slice, so a frame sends exactly the bytes its
messages would have sent one by one.

Messages keep their meaning inside a frame: the receiver checks and applies them in order,
as if they had arrived one after the other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from troupe.cluster.wire.messages import HEADER_LEN, HEADER_TAG, PAYLOAD_TAG, Header, MessageError, empty_header

HEADER_BYTES = HEADER_LEN * 8


def as_bytes(t: Tensor) -> Tensor:
    """A tensor's memory as uint8 (a view when contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def pack(messages: Sequence[tuple[Header, Tensor | None]]) -> list[tuple[Tensor, int]]:
    """What to send, with its tag, for `messages` to one peer: a lone message as its header and payload,
    several as a frame (the first header, marked, then one body)."""
    if not messages:
        return []
    first, payload = messages[0]
    if len(messages) == 1:
        return [(first.encode(), HEADER_TAG)] + ([] if payload is None else [(payload, PAYLOAD_TAG)])
    parts = [] if payload is None else [as_bytes(payload)]
    for header, payload in messages[1:]:
        parts.append(as_bytes(header.encode()))
        if payload is not None:
            parts.append(as_bytes(payload))
    body = torch.cat(parts)
    opener = Header(first.op, first.slice_id, first.version, first.sender, 0, frame=body.numel())
    return [(opener.encode(), HEADER_TAG), (body, PAYLOAD_TAG)]


class Frame:
    """A received frame's body, read front to back: a payload, then a header and its payload, and so on."""

    def __init__(self, body: Tensor):
        self.body = body
        self.at = 0

    @classmethod
    def receive(cls, comm, header: Header, src: int, limit: int) -> Frame:
        """Receive the body of the frame `header` opens (at most `limit` bytes)."""
        if header.frame > limit:
            raise MessageError(f"a frame of {header.frame} bytes from rank {src}; at most {limit} fit what it may hold")
        body = torch.empty(header.frame, dtype=torch.uint8)
        comm.recv(body, src, tag=PAYLOAD_TAG)
        return cls(body)

    @property
    def left(self) -> int:
        """Bytes not read yet."""
        return self.body.numel() - self.at

    def take(self, count: int, dtype: torch.dtype, align: int | None = None) -> Tensor:
        """The next `count` elements of `dtype`: a view of the body where its offset is a multiple of
        `align` bytes (the dtype's size unless given: bytes that hold wider types ask for more), else a copy."""
        nbytes = count * dtype.itemsize
        if nbytes > self.left:
            raise MessageError(f"the frame ends {nbytes - self.left} bytes before a payload of {count} {dtype}")
        raw = self.body[self.at : self.at + nbytes]
        self.at += nbytes
        if raw.storage_offset() % (align or dtype.itemsize):
            raw = raw.clone()
        return raw.view(dtype)

    def skip(self, nbytes: int) -> None:
        self.take(nbytes, torch.uint8)

    def next_header(self) -> Header:
        """The next message's header; a frame inside a frame is malformed."""
        header = Header.decode(self.take(HEADER_LEN, torch.int64))
        if header.frame:
            raise MessageError(f"a frame opened inside a frame by {header.op.name}")
        return header


class Inbox:
    """Messages from peers, lone or in frames, as many as are owed; the rest of a frame waits for the next ask
    (a frame may hold replies of a later step too: replies the staleness bound held, let go together)."""

    def __init__(self, comm, limit: int, first_length: Callable[[Header, int], int]):
        self.comm = comm
        self.limit = limit
        """The largest frame accepted, in bytes."""
        self.first_length = first_length
        """The payload length of a frame's first message, from its header and sender."""
        self._rest: dict[int, Frame] = {}

    def messages(self, src: int, count: int) -> Iterator[tuple[Header, Frame | None]]:
        """The next `count` messages of `src`: (header, the frame holding its payload, or None: its payload
        is the next receive from `src`). Each payload must be taken before the next message is asked for."""
        for _ in range(count):
            frame = self._rest.pop(src, None)
            if frame is not None:
                header = frame.next_header()
            else:
                raw = empty_header()
                self.comm.recv(raw, src, tag=HEADER_TAG)
                header = Header.decode(raw)
                if header.frame:
                    frame = Frame.receive(self.comm, header, src, self.limit)
                    header = header.with_length(self.first_length(header, src))
            yield header, frame
            if frame is not None and frame.left:
                self._rest[src] = frame
