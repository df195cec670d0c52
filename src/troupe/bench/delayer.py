"""Delay packets in user space through an NFQUEUE, for kernels without tc's netem.

    ip netns exec HOST python -m troupe.bench.delayer --queue 7 --ms 200 --jitter-ms 50

with an iptables rule in the same namespace that sends packets to queue 7
(``-j NFQUEUE --queue-num 7 --queue-bypass``, so packets pass unharmed if this process is
gone). Each packet's verdict (accept) is given `ms` (+ normal jitter, at least 0) after it
arrived, so the packets of a flow arrive that much later, possibly reordered, as with netem.
Speaks the nfnetlink_queue protocol directly (no libnetfilter_queue binding): only the
packet metadata is copied to user space, never the payload.
"""

from __future__ import annotations

import argparse
import heapq
import random
import select
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS = 1, 2
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NLM_F_REQUEST = 1
NF_ACCEPT = 1


def _attr(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def _message(kind: int, queue: int, attrs: bytes, family: int = socket.AF_UNSPEC) -> bytes:
    body = struct.pack("=BBH", family, 0, socket.htons(queue)) + attrs
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, NLM_F_REQUEST, 0, 0) + body


def _packet_ids(data: bytes):
    """The packet ids in a datagram of netlink messages from the queue."""
    offset = 0
    while offset + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, offset)
        if length < 16:
            return
        if kind & 0xFF == NFQNL_MSG_PACKET:
            pos, end = offset + 20, offset + length  # after nlmsghdr (16) and nfgenmsg (4)
            while pos + 4 <= end:
                alen, atype = struct.unpack_from("=HH", data, pos)
                if alen < 4:
                    break
                if atype & 0x7FFF == NFQA_PACKET_HDR:
                    yield struct.unpack_from("!I", data, pos + 4)[0]
                pos += (alen + 3) & ~3
        offset += (length + 3) & ~3


def open_queue(queue: int) -> socket.socket:
    """A netlink socket bound to NFQUEUE `queue`, copying packet metadata only."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.bind((0, 0))
    sock.send(_message(NFQNL_MSG_CONFIG, queue, _attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND,
                                                                                      socket.AF_INET))))
    sock.send(_message(NFQNL_MSG_CONFIG, queue, _attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))))
    return sock


def run(queue: int, ms: float, jitter_ms: float, seconds: float | None = None) -> int:
    """Delay every packet of `queue` until stopped (or for `seconds`); returns how many passed."""
    sock = open_queue(queue)
    due: list[tuple[float, int]] = []
    passed, end = 0, None if seconds is None else time.monotonic() + seconds
    while end is None or time.monotonic() < end:
        wait = max(due[0][0] - time.monotonic(), 0.0) if due else 0.5
        ready, _, _ = select.select([sock], [], [], wait)
        if ready:
            arrived = time.monotonic()
            for pid in _packet_ids(sock.recv(65536)):
                delay = max(random.gauss(ms, jitter_ms) if jitter_ms else ms, 0.0) / 1000
                heapq.heappush(due, (arrived + delay, pid))
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, pid = heapq.heappop(due)
            sock.send(_message(NFQNL_MSG_VERDICT, queue, _attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, pid)),
                               socket.AF_INET))
            passed += 1
    return passed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--queue", type=int, default=7)
    p.add_argument("--ms", type=float, required=True)
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--seconds", type=float, default=None)
    args = p.parse_args(argv)
    print("delayer ready", flush=True)
    print(f"delayer: {run(args.queue, args.ms, args.jitter_ms, args.seconds)} packets passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
