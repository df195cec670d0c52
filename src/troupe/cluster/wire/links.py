"""Channels between a separate server and its workers that a restarted worker can open again.

Under `troupe run --elastic --framework downpour` a parameter-server job's messages do not travel
in the job's process group: a restarted worker cannot enter a group made without it. Each
(server, worker) pair has a Gloo group of its own, two ranks, made through the job's store when
the worker *dials*: it writes a token under ``ps/knock/<server>/<worker>`` (its incarnation and the
server's, "3.1"; "3" for a server's first life) and both sides make the pair under a prefix of that
token. A worker that restarts dials again and gets a fresh pair; the server takes it at its next
receive (`Links.on_link`) and drops the old one. A server that restarts (Distributed Hogwild's
groups are each other's servers) listens for tokens that name its own incarnation only, so an older
life's knock is never taken, and the pair of two lives is never the pair of two others.

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

LINK_FORM_SECONDS = 30.0
"""How long a server waits for a dialling worker's side of their link (it may die while dialling)."""


def reason(error: BaseException) -> str:
    """A failed link's error in a few words: Gloo's first sentence without its source location."""
    line = str(error).splitlines()[0] if str(error) else type(error).__name__
    line = re.sub(r"^\[[^\]]*\]\s*", "", line)
    return line.split(". ")[0][:160]


def knock_key(server: int, worker: int) -> str:
    return f"ps/knock/{server}/{worker}"


def token(dialer: int, server: int, attempt: int = 0) -> str:
    """A pair's name: the incarnations of the worker that dials and of the server it dials ("3.1"; "3" for a
    server's first life, which is every separate server's only one), and which attempt of that dialler at
    that server it is ("3.1.2": the third; a pair that failed to form leaves its keys in the store)."""
    name = f"{dialer}.{server}" if server or attempt else str(dialer)
    return f"{name}.{attempt}" if attempt else name


def _order(name: str) -> tuple[int, int, int]:
    """(the dialler's life, the server's life, the attempt) named by a token."""
    parts = [int(p) for p in name.split(".")] + [0, 0]
    return parts[0], parts[1], parts[2]


def _pair(store: dist.Store, server: int, worker: int, name: str, me: int, timeout: float, form: float
          ) -> dist.ProcessGroup:
    """The Gloo group of two (server 0, worker 1) of these lives of `server` and `worker` (`name`, a token):
    it forms within `form` seconds or fails (the other end died meanwhile), then a message waits `timeout`."""
    prefixed = dist.PrefixStore(f"ps/pair/{server}/{worker}/{name}/", store)
    # Gloo waits for the other end with the group's own timeout, which is also every message's (it has no
    # other for its point-to-point messages): wait for the other end's word first, with `form`.
    prefixed.set(f"here/{me}", "1")
    prefixed.wait([f"here/{1 - me}"], datetime.timedelta(seconds=form))
    return dist.ProcessGroupGloo(prefixed, me, 2, datetime.timedelta(seconds=timeout))


@dataclass
class _Link:
    peer: int
    token: str
    group: dist.ProcessGroup
    other: int
    """The peer's rank in the pair (1 on the server, 0 on the worker)."""
    lost: bool = False
    retired: bool = False
    """Its peer said it is done: its reader posts no further receive (one left pending when the process
    ends can abort it inside Gloo)."""
    next_header: threading.Event = field(default_factory=threading.Event)
    """Set by the loop when it has read the rest of this link's last message."""


class Links:
    """One process's links to its peers (a worker's to its servers, or a server's to its workers)."""

    def __init__(self, store: dist.Store, rank: int, timeout: float, connect: Callable[[], dist.Store] | None = None,
                 form: float = LINK_FORM_SECONDS):
        self.store, self.rank, self.timeout, self.form = store, rank, timeout, form
        """`form`: how long a link may take to form (both ends alive, it takes milliseconds)."""
        self._accepting: threading.Thread | None = None
        self._forming: set[threading.Thread] = set()
        """Threads forming a link now (a process must not end inside one: `close` waits for them)."""
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

    def dial(self, server: int, incarnation: int, server_incarnation: int = 0) -> None:
        """Open this worker's link to `server` (blocks until the server has made its side)."""
        name = token(incarnation, server_incarnation)
        self._knock(server, name)
        group = _pair(self.store, server, self.rank, name, 1, self.timeout, self.form)
        self._links[server] = _Link(server, name, group, 0)

    def dial_later(self, server: int, incarnation: int, server_incarnation: int, attempt: int = 0,
                   on_ready: Callable[[int], None] = lambda server: None,
                   on_failed: Callable[[int, int], None] = lambda server, life: None) -> None:
        """Open this worker's link to `server` in a thread (the server may be dead or starting again);
        once it forms, it replaces any link to an older life of either end and `on_ready(server)` runs;
        if it does not form within `form` seconds, `on_failed(server, server_incarnation)` runs (a next
        `attempt` at the same life is dialled under a name of its own)."""
        name = token(incarnation, server_incarnation, attempt)

        def make() -> None:
            try:
                store = self._connect()
                self._knock(server, name, store)
                group = _pair(store, server, self.rank, name, 1, self.timeout, self.form)
            except (RuntimeError, ConnectionError, OSError) as e:  # it died meanwhile, or is slow: dialled again
                log.info("troupe rank %d: the link to rank %d (%s) did not form: %s", self.rank, server, name,
                         reason(e))
                on_failed(server, server_incarnation)
                return
            current = self._links.get(server)
            if current is not None and _order(current.token) > _order(name):
                return  # a later dial formed first
            self._links[server] = _Link(server, name, group, 0)
            on_ready(server)

        self._start_forming(make, f"troupe-dial-{server}")

    def _start_forming(self, target: Callable[[], None], name: str) -> None:
        """Run `target` (it forms a link) in a thread that `close` waits for."""
        def run() -> None:
            try:
                target()
            finally:
                self._forming.discard(threading.current_thread())

        thread = threading.Thread(target=run, name=name, daemon=True)
        self._forming.add(thread)
        thread.start()

    def _knock(self, server: int, name: str, store: dist.Store | None = None) -> None:
        store = store or self.store
        store.set(knock_key(server, self.rank), name)
        store.add(f"ps/knocks/{server}", 1)

    # --- a server's side ------------------------------------------------------------------

    def listen(self, workers: Iterable[int], header: Callable[[], Tensor], incarnation: int = 0) -> None:
        """Take the links `workers` dial (again, after a restart) to this life (`incarnation`) of this
        process, in a thread; `header()` makes the tensor a message's header is received into."""
        self._header = header
        self._accepting = threading.Thread(target=self._accept, args=(sorted(workers), incarnation),
                                           name="troupe-ps-links", daemon=True)
        self._accepting.start()

    def _accept(self, workers: list[int], incarnation: int) -> None:
        store, seen, tokens = self._connect(), -1, {}
        while not self._stop.is_set():
            try:
                knocks = store.add(f"ps/knocks/{self.rank}", 0)
                if knocks != seen:
                    seen = knocks
                    for w in workers:
                        key = knock_key(self.rank, w)
                        if store.check([key]):
                            name = store.get(key).decode()
                            if tokens.get(w) != name and _order(name)[1] == incarnation:  # not on an older life's door
                                tokens[w] = name
                                self._start_forming(lambda w=w, name=name: self._make(w, name), f"troupe-ps-link-{w}")
            except (RuntimeError, ConnectionError, OSError) as e:  # the launcher's store is gone: the job is over
                log.debug("troupe server %d: stopped taking links: %s", self.rank, e)
                return
            time.sleep(POLL_SECONDS)

    def _make(self, worker: int, name: str) -> None:
        try:
            group = _pair(self._connect(), self.rank, worker, name, 0, self.timeout, self.form)
        except (RuntimeError, ConnectionError, OSError) as e:  # it died while dialling; its next life dials again
            log.warning("troupe server %d: worker %d's link (incarnations %s) did not form: %s", self.rank, worker,
                        name, reason(e))
            return
        link = _Link(worker, name, group, 1)
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
            if link.retired:
                return

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
                if current is not None and _order(link.token) < _order(current.token):
                    continue  # an older life's link that formed late (it died meanwhile): never used
                if current is not None and not current.lost:
                    current.lost = True  # an older incarnation, its loss not seen yet: it is gone
                    self.on_lost(link.peer, f"it started again (incarnation {_order(link.token)[0]})")
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

    def retire(self, peer: int) -> None:
        """`peer` sent its last message on its link (the loop is reading it now): read nothing more there."""
        link = self._links.get(peer)
        if link is not None:
            link.retired = True

    def connected(self, peer: int) -> bool:
        link = self._links.get(peer)
        return link is not None and not link.lost

    def _link(self, peer: int) -> _Link:
        link = self._links.get(peer)
        if link is None or link.lost:
            raise RuntimeError(f"rank {self.rank} has no link to rank {peer} (it died, or never dialled)")
        return link

    def close(self, wait: bool = False) -> None:
        """Stop taking links; `wait`: until the thread taking them has stopped and every link forming now has
        formed or failed, at most `form` seconds (a thread inside a store call or Gloo's making of a group
        when the interpreter ends aborts the process)."""
        self._stop.set()
        for link in list(self._links.values()):
            link.next_header.set()
        deadline = time.monotonic() + self.form
        threads = ([self._accepting] if self._accepting is not None else []) + list(self._forming)
        for thread in threads if wait else ():
            thread.join(max(deadline - time.monotonic(), 0.0))

