"""Per-step stats (JSON lines), a timeline (Chrome trace) and TensorBoard scalars of what each rank does in a step.

Enabled by `troupe run --stats FILE --timeline FILE --tensorboard DIR` (or ``TROUPE_STATS`` /
``TROUPE_TIMELINE`` / ``TROUPE_TENSORBOARD``); when none is set nothing here runs in the training loop.

A step, as seen by rank r::

    data + forward | backward (bucket reductions start as gradients arrive) | wait | optimizer
                         [--- bucket 1 comm ---]  [--- bucket 2 comm ---]

*exposed* communication is the wait after backward; *overlapped* is the rest of the
buckets' communication time, hidden behind backward.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from typing import Any

from troupe.observe.tensorboard import ScalarWriter


def _now_us() -> float:
    return time.perf_counter_ns() / 1000.0


class Recorder:
    """Collects one rank's step phases and collective spans; writes stats lines and trace events."""

    def __init__(self, rank: int, stats_path: str | None, timeline_path: str | None,
                 tensorboard_dir: str | None = None):
        self.rank = rank
        self.stats_path, self.timeline_path = stats_path, timeline_path
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()  # collective spans are recorded from backend threads
        self._marks: dict[str, float] = {}
        self._spans: list[tuple[float, float]] = []
        self._bytes_at_start = 0
        self._loss: Any = None
        # First, so a missing tensorboard package fails here (at start) and opens no stats file.
        self._board = ScalarWriter(tensorboard_dir, rank) if tensorboard_dir else None
        self._stats_file = open(stats_path, "a", buffering=1) if stats_path else None
        atexit.register(self.close)

    # --- called by DistOpt / the reducer / the Communicator ------------------------------------

    def mark(self, name: str) -> None:
        """Record when a phase boundary happened this step (backward, backward_end, reduced)."""
        self._marks[name] = _now_us()

    def note_loss(self, loss: Any) -> None:
        """The loss this step's backward starts from (read as a number only when the step ends)."""
        self._loss = loss.detach() if hasattr(loss, "detach") else loss

    def span(self, name: str, start_us: float, end_us: float, **args: Any) -> None:
        """A collective that ran from start to end (any thread)."""
        with self._lock:
            self._spans.append((start_us, end_us))
            if self.timeline_path and self.events is not None:  # None: closed (the rank left the job)
                self.events.append({"name": name, "ph": "X", "ts": start_us, "dur": end_us - start_us,
                                    "pid": self.rank, "tid": 1, "args": args})

    def end_step(self, step: int, bytes_sent: int, extra: dict[str, Any] | None = None) -> None:
        """Close step `step`: phases from the marks, communication from the spans."""
        end = _now_us()
        m = self._marks
        start = m.get("forward", m.get("backward", end))
        bwd, bwd_end = m.get("backward", start), m.get("backward_end", end)
        reduced = m.get("reduced", bwd_end)
        with self._lock:
            spans, self._spans = self._spans, []
        comm_total = sum(e - s for s, e in spans)
        exposed = max(reduced - bwd_end, 0.0)
        row = {
            "rank": self.rank, "step": step, "time_ms": (end - start) / 1e3,
            "forward_ms": (bwd - start) / 1e3, "backward_ms": (bwd_end - bwd) / 1e3,
            "comm_exposed_ms": exposed / 1e3, "comm_overlapped_ms": max(comm_total - exposed, 0.0) / 1e3,
            "optimizer_ms": (end - reduced) / 1e3, "bytes_sent": bytes_sent - self._bytes_at_start,
            **(extra or {}),
        }
        if self._loss is not None:
            row["loss"] = float(self._loss)
            self._loss = None
        self._bytes_at_start = bytes_sent
        if self._stats_file:
            self._stats_file.write(json.dumps(row) + "\n")
        if self._board:
            self._board.write(row)
        if self.timeline_path and self.events is not None:
            for name, a, b in (("forward", start, bwd), ("backward", bwd, bwd_end),
                               ("wait for reductions", bwd_end, reduced), ("optimizer step", reduced, end)):
                if b > a:
                    self.events.append({"name": name, "ph": "X", "ts": a, "dur": b - a, "pid": self.rank,
                                        "tid": 0, "args": {"step": step}})
        # The next step's forward (with its data loading) starts now; scripts call
        # self.forward(x) directly, as SINGA's do, so no module hook would see it.
        self._marks = {"forward": _now_us()}

    def log(self, step: int, values: dict[str, float]) -> None:
        """User scalars (`troupe.log`): TensorBoard tags as named, and a ``{"rank", "step", "log"}`` stats line."""
        if self._board:
            self._board.write_scalars(step, values)
        if self._stats_file:
            self._stats_file.write(json.dumps({"rank": self.rank, "step": step, "log": values}) + "\n")

    def close(self) -> None:
        """Flush and close the files (at `troupe.shutdown()` and at exit; the second call does nothing)."""
        if self._board:
            self._board.close()
            self._board = None
        if self._stats_file:
            self._stats_file.close()
            self._stats_file = None
        if self.timeline_path and self.events is not None:
            names = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}},
                     {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": 0, "args": {"name": "compute"}},
                     {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": 1,
                      "args": {"name": "communication"}}]
            path = _rank_path(self.timeline_path, self.rank)
            tmp = f"{path}.tmp"
            with open(tmp, "w") as f:
                json.dump({"traceEvents": names + self.events, "displayTimeUnit": "ms"}, f)
            os.replace(tmp, path)
            with self._lock:
                self.events = None  # type: ignore[assignment]


def _rank_path(path: str, rank: int) -> str:
    """Each rank writes its own timeline: FILE for rank 0, FILE with .rankR before the suffix otherwise."""
    if rank == 0:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext}"


def start(rank: int, stats: str | None = None, timeline: str | None = None, board: str | None = None) -> Recorder | None:
    """A Recorder when a stats file, a timeline or a TensorBoard directory is given
    (TROUPE_STATS, TROUPE_TIMELINE, TROUPE_TENSORBOARD: `troupe.init()` passes them and the
    World holds it), else None: nothing is recorded."""
    if stats or timeline or board:
        return Recorder(rank, stats, timeline, board)
    return None


def merge_timelines(path: str, world_size: int) -> None:
    """Fold every rank's timeline into `path` (one trace, one process row per rank)."""
    events = []
    for r in range(world_size):
        part = _rank_path(path, r)
        if os.path.exists(part):
            with open(part) as f:
                events += json.load(f)["traceEvents"]
            if r:
                os.remove(part)
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def summarize(path: str) -> str:
    """A per-rank table of mean step phases from a stats file (what `troupe run` prints at the end)."""
    rows: dict[int, list[dict[str, Any]]] = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if "log" in row:  # troupe.log's scalars, not a step
                continue
            rows.setdefault(row["rank"], []).append(row)
    keys = ["time_ms", "forward_ms", "backward_ms", "comm_exposed_ms", "comm_overlapped_ms", "optimizer_ms"]
    lines = ["rank  steps  " + "  ".join(k.removesuffix("_ms").rjust(15) for k in keys) + "   bytes/step"]
    for rank in sorted(rows):
        rs = rows[rank][1:] or rows[rank]  # the first step includes warm-up
        means = [sum(r[k] for r in rs) / len(rs) for k in keys]
        bytes_ = sum(r["bytes_sent"] for r in rs) / len(rs)
        lines.append(f"{rank:4d}  {len(rows[rank]):5d}  " + "  ".join(f"{v:12.2f} ms" for v in means)
                     + f"   {bytes_:10.0f}")
    return "\n".join(lines)
