"""Per-step stats as TensorBoard scalars: one run directory per rank (DIR/rank0, DIR/rank1, ...).

Enabled by `troupe run --tensorboard DIR` (or ``TROUPE_TENSORBOARD=DIR``); then
`trace.Recorder` hands every step's stats row to a `ScalarWriter`, and `troupe.log`'s
scalars under the tags the user names. Needs the optional
`tensorboard` package, imported only when a writer is made so `import troupe` stays light.

    tensorboard --logdir DIR
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

INSTALL_HINT = "pip install tensorboard (or pip install 'torch-troupe[test]')"

TAGS = {
    "time_ms": "time/step_ms",
    "forward_ms": "time/forward_ms",
    "backward_ms": "time/backward_ms",
    "optimizer_ms": "time/optimizer_ms",
    "comm_exposed_ms": "comm/exposed_ms",
    "comm_overlapped_ms": "comm/overlapped_ms",
    "bytes_sent": "comm/bytes_sent",
    "ratio": "comm/compression_ratio",
    "residual_norm": "comm/residual_norm",
    "staleness": "ps/staleness",
    "loss": "train/loss",
}
"""Stats-row keys and their scalar tags; other numeric keys go to ``stats/<key>``."""

SKIPPED = {"rank", "step"}
"""Row keys that are not scalars of their own (the run directory and the x axis)."""


def require() -> None:
    """Raise ImportError, with the install command, when the tensorboard package is missing."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ImportError(f"TensorBoard scalars (--tensorboard / TROUPE_TENSORBOARD) need the tensorboard "
                          f"package, which is not installed: {INSTALL_HINT}")


def rank_dir(logdir: str, rank: int) -> str:
    """Where rank `rank` writes its event files."""
    return os.path.join(logdir, f"rank{rank}")


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The tags and values one stats row becomes (strings such as ``option`` are left out)."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if key in SKIPPED or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out[TAGS.get(key, f"stats/{key}")] = float(value)
    if "time_ms" in row and "comm_exposed_ms" in row:
        # Everything but waiting for communication: what a faster network cannot take away.
        out["time/compute_ms"] = float(row["time_ms"] - row["comm_exposed_ms"])
    return out


class ScalarWriter:
    """Writes stats rows of one rank as scalars under ``logdir/rank<R>``, x axis = step."""

    def __init__(self, logdir: str, rank: int, flush_secs: int = 10):
        require()
        from torch.utils.tensorboard import SummaryWriter

        self.path = rank_dir(logdir, rank)
        self._writer: SummaryWriter | None = SummaryWriter(self.path, flush_secs=flush_secs)

    def write(self, row: dict[str, Any]) -> None:
        if self._writer is None:
            return
        step = int(row["step"])
        for tag, value in scalars(row).items():
            self._writer.add_scalar(tag, value, step)

    def write_scalars(self, step: int, values: dict[str, float]) -> None:
        """Scalars under the tags given (`troupe.log`'s), x axis = `step`."""
        if self._writer is None:
            return
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
