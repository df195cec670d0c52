"""Parameter-server messages: a fixed int64 header, then (when length > 0) a float payload.

A header is ``[MAGIC, op, slice_id, version, sender, length]``. The receiver checks
every field before it touches a payload; a malformed or unexpected message is
rejected with a logged error and never applied. Several messages to one peer travel as
one frame (`troupe.cluster.wire.frames`): the first one's header, marked by `FRAME_MAGIC`,
carries the frame's size in bytes where a lone header carries its payload's length.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import IntEnum

import torch
from torch import Tensor

log = logging.getLogger(__name__)

MAGIC = 0x7450_5331  # "tPS1"
FRAME_MAGIC = 0x7450_5346  # "tPSF": this header opens a frame (`troupe.cluster.wire.frames`)
HEADER_LEN = 6
HEADER_TAG = 0x7450
"""Point-to-point tag of headers: a receive for any header can never match a payload."""
PAYLOAD_TAG = 0x7451


class Op(IntEnum):
    """What a message asks for (SINGA's Get/Put/Update, plus the reply and control messages)."""

    GET = 1
    """Worker -> server: send me the slice's current value."""
    PUT = 2
    """Worker -> server: here is the slice's initial value."""
    UPDATE = 3
    """Worker -> server: here is my gradient for the slice (based on `version`)."""
    REPLY = 4
    """Server -> worker: the slice's value at `version`."""
    STOP = 5
    """Worker -> server: I have finished training."""
    PUSH = 7
    """Worker -> server: an Update whose answer need not carry values (the worker fetches every n steps)."""
    ACK = 8
    """Server -> worker: your update of the slice is applied; it is now at `version` (no values)."""
    LR = 9
    """Worker -> server: the learning rate of each param group changed (float64 payload; a scheduler ran)."""
    SYNC = 10
    """Group -> master copy (Distributed Hogwild): my change since I last synced (`slice_id`: my worker group)."""
    SKIP = 11
    """Worker -> server: I take part in this step of the slice without a gradient (mine was not finite,
    nan_policy): the group's update of the slice is skipped. Answered with an Ack."""
    SPARSE_UPDATE = 12
    """Worker -> server: an Update as `length` (index, value) pairs, the top-K of the slice's update
    (`ClusterConfig.wire_topk`; the payload's layout is `troupe.cluster.wire.sparse`'s)."""
    SPARSE_PUSH = 13
    """Worker -> server: a Push as (index, value) pairs."""
    MERGE = 14
    """Server -> the master copy of a part, held by a server of another server group
    (`troupe.cluster.serving.serversync`): my change of the part since I last synced (`slice_id`: my server
    group; `version`: the master copy's version I last adopted)."""
    MERGED = 15
    """Master copy -> server: the part's value after folding in your Merge (`version`: the master copy's)."""
    FINISHED = 16
    """Server -> the servers of the other server groups: every worker of my groups has stopped and my
    last Merge has left (`slice_id`: my server group)."""
    FINAL = 17
    """Master copy -> server: the part's value once every server group has finished (no more merges)."""
    EVICTED = 18
    """Server -> worker (`troupe run --elastic`): your group went on without you (you were frozen); what you
    read next from me is this. The worker exits, and its launcher restarts it to rejoin."""
    SNAPSHOT = 19
    """Group -> group (Distributed Hogwild under `troupe run --elastic`): I started again; send me your
    replica and the last value you adopted of my part of the master copy."""
    STATE = 20
    """Group -> a group that started again: my replica (`length` bytes, `troupe.cluster.serving.groupsync`)
    and, `version`, the version of your part's master copy I last adopted."""
    NO_STATE = 21
    """A group starting again -> another group: I have no state yet (to a Snapshot: none to give; to a
    Sync: your change was not folded in, keep it for your next Sync)."""


WITH_PAYLOAD = {Op.PUT, Op.UPDATE, Op.PUSH, Op.REPLY, Op.LR, Op.SYNC, Op.SPARSE_UPDATE, Op.SPARSE_PUSH,
                Op.MERGE, Op.MERGED, Op.FINAL, Op.STATE}
"""Ops whose header is followed by a payload of `length` elements (pairs, for the sparse ones)."""
SPARSE = {Op.SPARSE_UPDATE: Op.UPDATE, Op.SPARSE_PUSH: Op.PUSH}
"""The sparse ops, and the dense op each stands for once its pairs are scattered into a slice."""


class MessageError(ValueError):
    """A message that fails validation."""


@dataclass(frozen=True)
class Header:
    """One message's header."""

    op: Op
    slice_id: int
    version: int
    sender: int
    length: int
    frame: int = 0
    """Bytes of the frame this header opens (0: a lone message). The frame's body is this message's
    payload, then each further message's header and payload; this message's `length` is not sent:
    the receiver knows it from the op and the slice (`with_length`)."""

    def encode(self) -> Tensor:
        magic, last = (FRAME_MAGIC, self.frame) if self.frame else (MAGIC, self.length)
        return torch.tensor([magic, int(self.op), self.slice_id, self.version, self.sender, last], dtype=torch.int64)

    def with_length(self, length: int) -> Header:
        """The first message of a frame, with the payload length its receiver expects."""
        return Header(self.op, self.slice_id, self.version, self.sender, length)

    @classmethod
    def decode(cls, raw: Tensor) -> Header:
        """Parse a received header; raises `MessageError` naming what is wrong."""
        if raw.dtype != torch.int64 or raw.numel() != HEADER_LEN:
            raise MessageError(f"header must be {HEADER_LEN} int64 values, got {raw.numel()} {raw.dtype}")
        magic, op, slice_id, version, sender, length = (int(v) for v in raw.tolist())
        if magic not in (MAGIC, FRAME_MAGIC):
            raise MessageError(f"bad magic {magic:#x} (expected {MAGIC:#x}): not a troupe message")
        try:
            op = Op(op)
        except ValueError:
            raise MessageError(f"unknown op {op}") from None
        if slice_id < -1 or version < 0 or sender < 0 or length < 0:
            raise MessageError(f"negative field in {op.name} header: slice {slice_id}, version {version}, "
                               f"sender {sender}, length {length}")
        if magic == FRAME_MAGIC:
            if length < HEADER_LEN * 8:
                raise MessageError(f"a frame of {length} bytes opened by {op.name}: too short for a second message")
            return cls(op, slice_id, version, sender, 0, frame=length)
        if (length > 0) != (op in WITH_PAYLOAD):
            raise MessageError(f"{op.name} message with payload length {length}")
        return cls(op, slice_id, version, sender, length)


def empty_header() -> Tensor:
    """A buffer to receive a header into."""
    return torch.zeros(HEADER_LEN, dtype=torch.int64)


def check(header: Header, *, src: int, expected_length: int | None, allowed: set[Op]) -> None:
    """Raise `MessageError` unless `header` is one of `allowed`, really from `src`, with the slice's length
    (for a sparse op `expected_length` is its number of pairs)."""
    if header.op not in allowed:
        raise MessageError(f"unexpected {header.op.name} from rank {src}")
    if header.sender != src:
        raise MessageError(f"{header.op.name} claims sender {header.sender} but came from rank {src}")
    if header.op in WITH_PAYLOAD:
        if expected_length is None:
            raise MessageError(f"{header.op.name} from rank {src} for unknown slice {header.slice_id}")
        if header.length != expected_length:
            unit, has = ("pairs", "its top-K is") if header.op in SPARSE else ("elements", "the slice has")
            raise MessageError(
                f"{header.op.name} from rank {src} for slice {header.slice_id} carries {header.length} "
                f"{unit}, {has} {expected_length}"
            )
