"""Channels between a separate server and its workers that a restarted worker can open again.

Under `troupe run --elastic --framework downpour` a parameter-server job's messages do not travel
in the job's process group: a restarted worker cannot enter a group made without it. Each
(server, worker) pair has a Gloo group of its own, two ranks, made through the job's store when
the worker *dials*: it writes its incarnation under ``ps/knock/<server>/<worker>`` and both sides
make the pair under a prefix of that incarnation. A worker that restarts dials again and gets a
fresh pair; the server takes it at its next receive (`Links.on_link`) and drops the old one.

`Links` is the part of `troupe.runtime.comm.Communicator` the messages use: ``send``, ``isend``
and ``recv`` with a tag, ``recv`` from any worker on the server. A server receives "from any
worker" through one reader thread per link: it waits for its worker's next header and hands it
to the server's loop, then waits for the loop to have read the rest of that message (its
payload or frame, through ``recv`` from that worker) before it asks for the next header: one
receive at a time per link. A link whose receive or send fails is lost (`Links.on_lost`); events
reach the loop in order with the messages, in the loop's thread.
"""

from __future__ import annotations

import datetime
import logging
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch.distributed as dist
from torch import Tensor

from troupe.cluster.wire.messages import HEADER_TAG
from troupe.runtime.comm import Handle

log = logging.getLogger(__name__)

POLL_SECONDS = 0.02
"""How often a server looks for workers dialling it."""


def reason(error: BaseException) -> str:
    """A failed link's error in a few words: Gloo's first sentence without its source location."""
    line = str(error).splitlines()[0] if str(error) else type(error).__name__
    line = re.sub(r"^\[[^\]]*\]\s*", "", line)
    return line.split(". ")[0][:160]


def knock_key(server: int, worker: int) -> str:
    return f"ps/knock/{server}/{worker}"


def _pair(store: dist.Store, server: int, worker: int, token: str, me: int, timeout: float) -> dist.ProcessGroup:
    """The Gloo group of two (server 0, worker 1) of this incarnation of `worker`."""
    prefixed = dist.PrefixStore(f"ps/pair/{server}/{worker}/{token}/", store)
    return dist.ProcessGroupGloo(prefixed, me, 2, datetime.timedelta(seconds=timeout))


@dataclass
class _Link:
    peer: int
    token: str
    group: dist.ProcessGroup
    other: int
    """The peer's rank in the pair (1 on the server, 0 on the worker)."""
    lost: bool = False
    next_header: threading.Event = field(default_factory=threading.Event)
    """Set by the loop when it has read the rest of this link's last message."""


class Links:
    """One process's links to its peers (a worker's to its servers, or a server's to its workers)."""

    def __init__(self, store: dist.Store, rank: int, timeout: float, connect: Callable[[], dist.Store] | None = None):
        self.store, self.rank, self.timeout = store, rank, timeout
        """`timeout`: how long one message may wait (the job's parameter-server timeout: a worker computes
        between two messages as long as it likes); a dead peer fails a receive at once anyway."""
        self._connect = connect or (lambda: store)
        self._links: dict[int, _Link] = {}
        self._inbox: queue.Queue = queue.Queue()
        self._held: _Link | None = None
        """The link whose last header the loop took: its reader waits until the loop asks for the next one."""
        self._stop = threading.Event()
        self.on_link: Callable[[int], None] = lambda peer: None
        """A worker's new link is in use (the server takes it back, or in for the first time)."""
        self.on_lost: Callable[[int, str], None] = lambda peer, why: None
        """A worker's link failed (its process died, or it closed)."""

    # --- a worker's side ------------------------------------------------------------------

    def dial(self, server: int, incarnation: int) -> None:
        """Open this worker's link to `server` (blocks until the server has made its side)."""
        token = str(incarnation)
        self.store.set(knock_key(server, self.rank), token)
        self.store.add(f"ps/knocks/{server}", 1)
        self._links[server] = _Link(server, token, _pair(self.store, server, self.rank, token, 1, self.timeout), 0)

    # --- a server's side ------------------------------------------------------------------

    def listen(self, workers: Iterable[int], header: Callable[[], Tensor]) -> None:
        """Take the links `workers` dial (again, after a restart), in a thread; `header()` makes the
        tensor a message's header is received into."""
        self._header = header
        threading.Thread(target=self._accept, args=(sorted(workers),), name="troupe-ps-links",
                         daemon=True).start()

    def _accept(self, workers: list[int]) -> None:
        store, seen, tokens = self._connect(), -1, {}
        while not self._stop.is_set():
            try:
                knocks = store.add(f"ps/knocks/{self.rank}", 0)
                if knocks != seen:
                    seen = knocks
                    for w in workers:
                        key = knock_key(self.rank, w)
                        if store.check([key]):
                            token = store.get(key).decode()
                            if tokens.get(w) != token:
                                tokens[w] = token
                                threading.Thread(target=self._make, args=(w, token), daemon=True,
                                                 name=f"troupe-ps-link-{w}").start()
            except (RuntimeError, ConnectionError, OSError) as e:  # the launcher's store is gone: the job is over
                log.debug("troupe server %d: stopped taking links: %s", self.rank, e)
                return
            time.sleep(POLL_SECONDS)

    def _make(self, worker: int, token: str) -> None:
        try:
            group = _pair(self._connect(), self.rank, worker, token, 0, self.timeout)
        except (RuntimeError, ConnectionError, OSError) as e:  # it died while dialling; its next life dials again
            log.warning("troupe server %d: worker %d's link (incarnation %s) did not form: %s", self.rank, worker,
                        token, reason(e))
            return
        link = _Link(worker, token, group, 1)
        self._inbox.put(("link", link))

    def _read(self, link: _Link) -> None:
        """Receive `link`'s headers one at a time, each after the loop has read the message before."""
        while not self._stop.is_set():
            raw = self._header()
            try:
                link.group.recv([raw], link.other, HEADER_TAG).wait()
            except RuntimeError as e:
                self._inbox.put(("lost", link, reason(e)))
                return
            link.next_header.clear()
            self._inbox.put(("message", link, raw))
            link.next_header.wait()

    # --- messages -------------------------------------------------------------------------

    def send(self, tensor: Tensor, dst: int, tag: int = 0) -> None:
        self.isend(tensor, dst, tag).wait()

    def isend(self, tensor: Tensor, dst: int, tag: int = 0) -> Handle:
        link = self._link(dst)
        return Handle(link.group.send([tensor.contiguous()], link.other, tag), label=f"a message to rank {dst}")

    def irecv(self, tensor: Tensor, src: int, tag: int = 0) -> Handle:
        link = self._link(src)
        return Handle(link.group.recv([tensor], link.other, tag), label=f"a message from rank {src}")

    def recv(self, tensor: Tensor, src: int | None = None, tag: int = 0) -> int:
        """Receive into `tensor` from `src`; from any worker when None (a server's next header)."""
        if src is None:
            return self._next(tensor)
        link = self._link(src)
        link.group.recv([tensor], link.other, tag).wait()
        return src

    def _next(self, into: Tensor) -> int:
        """The next header from any worker, after handing the loop every link and loss that came first."""
        held, self._held = self._held, None
        if held is not None:
            held.next_header.set()  # the loop is done with its message: its reader may take the next
        while True:
            what, link, *more = self._inbox.get()
            current = self._links.get(link.peer)
            if what == "link":
                if current is not None and int(link.token) < int(current.token):
                    continue  # an older life's link that formed late (it died meanwhile): never used
                if current is not None and not current.lost:
                    current.lost = True  # an older incarnation, its loss not seen yet: it is gone
                    self.on_lost(link.peer, f"it started again (incarnation {link.token})")
                self._links[link.peer] = link
                self.on_link(link.peer)
                threading.Thread(target=self._read, args=(link,), daemon=True,
                                 name=f"troupe-ps-read-{link.peer}").start()
            elif link is not current or link.lost:
                continue  # a superseded link's last words
            elif what == "lost":
                self.lose(link.peer, more[0])
            else:
                into.copy_(more[0])
                self._held = link
                return link.peer

    def lose(self, peer: int, why: str, *, tell: bool = True) -> None:
        """`peer`'s link failed (a receive or a send): forget it and tell the loop (`on_lost`; not when
        the loop found out itself, `tell=False`)."""
        link = self._links.get(peer)
        if link is not None and not link.lost:
            link.lost = True
            link.next_header.set()
            if tell:
                self.on_lost(peer, why)

    def connected(self, peer: int) -> bool:
        link = self._links.get(peer)
        return link is not None and not link.lost

    def _link(self, peer: int) -> _Link:
        link = self._links.get(peer)
        if link is None or link.lost:
            raise RuntimeError(f"rank {self.rank} has no link to rank {peer} (it died, or never dialled)")
        return link

    def close(self) -> None:
        self._stop.set()
        for link in self._links.values():
            link.next_header.set()

