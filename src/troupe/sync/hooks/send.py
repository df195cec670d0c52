"""The parameter-server client's hook: each sealed bucket leaves for the servers, nothing is reduced here."""

from __future__ import annotations

from dataclasses import dataclass

from troupe.runtime.comm import Handle
from troupe.sync.bucket import Bucket


@dataclass(frozen=True)
class SendBuckets:
    """Hands each sealed bucket to `send` (a parameter-server client's Update messages); nothing
    comes back into the bucket."""

    send: object
    prescale: None = None
    mean_over_active: bool = False
    carries_digest: bool = False
    coalesce: bool = False

    def __call__(self, bucket: Bucket) -> Handle:
        return self.send(bucket)  # type: ignore[operator]
