"""One checkpoint save at a time in a background thread, over a Gloo group of its own.

`troupe.checkpoint.save(..., async_save=True)` copies the state (the staging copy), hands
the writing to `Background.submit` and returns; training goes on. The thread runs the same
collective save as a blocking one, but over a second process group: Gloo matches the
collectives of one group by their order on each rank, so a save's gathers issued from this
thread on the training group would interleave with the training's all-reduces differently
on different ranks. (This is what ``torch.distributed.checkpoint.async_save`` does too:
stage, then ``save`` in a thread; it leaves the second group to the caller.)

The next save or load waits for the save in flight (`wait`), and a save that failed raises
there, once, as a CheckpointError: a failure is never lost. When the process leaves the job
the save in flight is finished first (a World shutdown hook); a failure found then can only
be logged.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable

import torch.distributed as dist

from troupe.runtime.comm import Communicator
from troupe.runtime.launch import DEFAULT_TIMEOUT
from troupe.runtime.world import World

log = logging.getLogger(__name__)


class SaveFailed(RuntimeError):
    """The asynchronous save of a checkpoint failed (raised at the next checkpoint call)."""


class Background:
    """The save in flight of one World: at most one, finished before the next begins."""

    def __init__(self, world: World):
        self.world = world
        self._groups: dict[tuple[int, ...], Communicator] = {}
        self._thread: threading.Thread | None = None
        self.what = ""
        """The save in flight (or the last one)."""
        self._error: BaseException | None = None
        world.on_shutdown(self._finish_at_exit)

    def comm(self, comm: Communicator) -> Communicator:
        """A Gloo communicator over the ranks of `comm` for the background thread (made once per set of ranks).

        Only the members make it (``use_local_synchronization``): under a parameter-server
        cluster the servers never save.
        """
        ranks = tuple(range(comm.world_size)) if comm.group is None else tuple(dist.get_process_group_ranks(comm.group))
        if ranks not in self._groups:
            timeout = datetime.timedelta(seconds=self.world.settings.timeout or DEFAULT_TIMEOUT)
            group = dist.new_group(list(ranks), backend="gloo", timeout=timeout, use_local_synchronization=True)
            # No watchdog: it tracks what the training thread is blocked on.
            self._groups[ranks] = Communicator(group)
        return self._groups[ranks]

    def submit(self, what: str, write: Callable[[], None]) -> None:
        """Run `write()` in the background (after the previous save, which must have been waited for)."""
        assert self._thread is None, "wait() for the save in flight first"
        self.what, self._error = what, None

        def run() -> None:
            try:
                write()
            except BaseException as e:  # kept for the next checkpoint call: never lost
                self._error = e

        # Not a daemon: the interpreter waits for a save in flight before it exits.
        self._thread = threading.Thread(target=run, name=f"troupe-checkpoint {what}")
        self._thread.start()

    @property
    def busy(self) -> bool:
        """Whether a save is still writing."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> str | None:
        """Block until the save in flight is written; raise SaveFailed if it failed. Returns what it saved."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise SaveFailed(f"the asynchronous save of {self.what} failed: {type(error).__name__}: {error}") \
                from error
        return self.what

    def _finish_at_exit(self) -> None:
        try:
            self.wait()
        except SaveFailed as e:  # nobody is left to raise it to
            log.error("%s", e)
