"""The elastic quorum's shared vocabulary: the Quorum record, the round Decision, the store's keys.

An elastic job (`troupe run --elastic`) keeps its membership in the launcher's TCP store, not
in a worker. The launcher's `Lighthouse` (runtime/lighthouse.py) watches which worker groups
are alive and proposes quorums; the workers (runtime/elastic.py) vote once per step and move
to a new quorum only at a step boundary, all together. Both sides read and write the keys
named here, and nothing else: no torch import, so `troupe run` stays light.

Keys (under the job's ``troupe/<token>/`` prefix):

* ``beat/<rank>``    a counter each worker's heartbeat thread adds to (runtime/liveness.py: the lighthouse evicts
                     a rank's group when its counter stands still for ``evict_after`` seconds: SIGSTOP, a hang);
* ``ready/<rank>``   a worker asks to be (re)admitted: a `Ready` record; then it appends ``"<rank> "`` to
                    ``asked`` (`ASKED`), the log the lighthouse reads instead of every rank's key;
* ``proposal``       the lighthouse's next quorum, not yet adopted; ``proposals`` (`PROPOSALS`) counts those
                     written (a quorum's leader reads the proposal only when the count moved);
* ``latest``         the newest adopted quorum (what a joining worker waits for);
* ``q<id>/r<k>/d``   round k of quorum id's decision (written once, by compare-and-set: by the
                     quorum's leader after an all-reduce of every member's vote, or by the lighthouse
                     when a member is lost and will never vote; runtime/vote.py);
* ``q<id>/r<k>/n``, ``/bad``   the votes and failed votes of a round voted through the store (a vote
                     collective failed): its last voter writes the decision;
* ``heal/<id>/<tag>/<place>``  the state the source group's process at `place` hands to the
                     joiners' processes at the same place, for quorum id;
* ``bye/<rank>``, ``byes``   a worker leaving (its exit hooks): "done" or "error", and a counter the
                     lighthouse watches, so it need not wait for the silence or the exit;
* ``closed``         the job is over (members finished): a worker still waiting to be admitted leaves;
* ``reports``, ``report/<n>``   on several nodes, what another node's launcher saw of its own ranks
                     ("lost R", "finished R", "restarted R"), numbered in the order said: the
                     lighthouse reads them as it hears of its own node's ranks (`Reporter`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

BATCH_MODES = {
    "shrink": "a step averages the gradients of the groups present: the global batch shrinks while one is missing",
    "constant": "the groups present also take the missing groups' batches (`Quorum.covered_by`): every step "
                "averages over the whole global batch, as a fault-free run does",
}
"""`troupe run --elastic-batch`: what a missing worker group does to the global batch."""
ASKED = "asked"
"""The log of ranks that asked to be admitted since the job started (``"<rank> "`` each, appended after the request)."""
ASKED_COUNT = "asked/n"
"""How many entries the workers have appended to `ASKED` (added to after each append: the lighthouse reads the log
only when it moved)."""
PROPOSALS = "proposals"
"""A counter the lighthouse adds to after each ``proposal`` it writes: a quorum's leader reads one counter a step and
the proposal only when it moved."""
POLL_READS_PER_S = 2000.0
"""What a quorum's members may cost the launcher's store together, in reads a second, asking while they wait (a step's
reduction, the vote) whether the step was decided without them: a member asks every 0.1 s up to 200 processes, then
every size / POLL_READS_PER_S seconds (`poll_interval`)."""
REJOIN_EXIT = 75
"""The exit code of a worker that was left out of the quorum and asks its launcher to start it again."""
ENV_VAR = "TROUPE_ELASTIC"
"""JSON `ElasticOptions`, set by `troupe run --elastic` for every worker."""
REJOIN_VAR = "TROUPE_REJOIN"
"""Set ("1") by `troupe run --elastic` for a parameter-server framework (`troupe.runtime.rejoin`)."""


@dataclass(frozen=True, kw_only=True)
class ElasticOptions:
    """What `troupe run --elastic` tells every worker (and its lighthouse) about the job."""

    groups: int
    """Worker groups in the job when all are present."""
    group_size: int = 1
    """Processes per worker group (`--nworker-groups`: group g is ranks [g*k, (g+1)*k)); 1: each
    process is a group of one."""
    min_groups: int = 2
    """A step needs at least this many groups present; with fewer the job waits for restarts."""
    timeout: float = 10.0
    """Seconds a collective may wait for a frozen peer before the step is given up (the eviction
    bound for a SIGSTOPped worker), and a new quorum's process group may take to form."""
    evict_after: float = 5.0
    """Seconds without a heartbeat after which the lighthouse drops a worker from the quorum."""
    heartbeat: float = 0.5
    """Seconds between a worker's heartbeats."""
    form_within: float = 60.0
    """At the start, seconds the lighthouse waits for every group before forming a quorum of at
    least `min_groups` (a restart later is admitted as soon as it is ready)."""
    batch: str = "shrink"
    """What a missing group does to the global batch (`BATCH_MODES`)."""
    max_groups: int | None = None
    """At most this many groups step together; the other ready groups wait, started and loaded, as
    standbys, and one joins (healing) in the same decision that drops a lost member. None: all."""

    def __post_init__(self) -> None:
        if self.batch not in BATCH_MODES:
            raise ValueError(f"elastic batch must be one of {sorted(BATCH_MODES)}, got {self.batch!r}")
        if self.group_size < 1:
            raise ValueError(f"elastic group_size must be >= 1, got {self.group_size}")
        if self.min_groups < 2:
            raise ValueError(f"min_groups must be >= 2 (a quorum of one has nobody to heal from), "
                             f"got {self.min_groups}")
        if self.min_groups > self.groups:
            raise ValueError(f"min_groups ({self.min_groups}) is larger than the job's {self.groups} worker groups")
        if self.max_groups is not None and not self.min_groups <= self.max_groups <= self.groups:
            raise ValueError(f"max_groups ({self.max_groups}) must be from min_groups ({self.min_groups}) to the "
                             f"job's {self.groups} worker groups")
        for name in ("timeout", "evict_after", "heartbeat", "form_within"):
            if getattr(self, name) <= 0:
                raise ValueError(f"elastic {name} must be > 0 seconds, got {getattr(self, name)}")
        if self.heartbeat * 2 > self.evict_after:
            raise ValueError(f"elastic evict_after ({self.evict_after}s) must be at least two heartbeats "
                             f"({self.heartbeat}s each)")

    @property
    def cap(self) -> int:
        """The most groups one step uses (`max_groups`, or all of them)."""
        return self.groups if self.max_groups is None else self.max_groups

    @property
    def processes(self) -> int:
        """Processes in the job when every group is present."""
        return self.groups * self.group_size

    def ranks(self, group: int) -> range:
        """The global ranks of worker group `group`."""
        return range(group * self.group_size, (group + 1) * self.group_size)

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, text: str) -> ElasticOptions:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class Quorum:
    """The worker groups that take steps together, and who hands state to whom when it formed."""

    id: int
    members: tuple[int, ...]
    """Worker groups, ascending (with one process per group, a group's number is its rank)."""
    joiners: tuple[int, ...] = ()
    """Members whose state is not the quorum's yet: they receive it from `source` before their first step."""
    source: int = -1
    """The member whose state every joiner copies, place by place (-1: no joiners)."""
    base: int = 0
    """The quorum this one replaces (0: formed by the lighthouse from ready workers, not from a running quorum)."""
    tokens: tuple[str, ...] = ()
    """Per member, the `Ready` tokens its processes were admitted with, joined by "|" in rank order: a
    restarted process joins only a quorum that admitted its own request, never one that names its rank
    for the process it replaced."""
    group_size: int = 1
    """Processes per group: group g is ranks [g*k, (g+1)*k)."""

    def group_of(self, rank: int) -> int:
        return rank // self.group_size

    @property
    def size(self) -> int:
        """Processes in the quorum's process group: every process of every member."""
        return len(self.members) * self.group_size

    def index(self, rank: int) -> int:
        """This rank's place in the quorum's process group (ordered by rank among the members' processes)."""
        return self.members.index(self.group_of(rank)) * self.group_size + rank % self.group_size

    def covered_by(self, group: int, groups: int) -> tuple[int, ...]:
        """The groups whose batches member `group` takes in a step of this quorum under a constant
        global batch: its own, then the missing groups dealt out in turn to the members (both in
        ascending order), so each of the job's `groups` batches is taken by exactly one member.

        >>> Quorum(1, (0, 2)).covered_by(0, 4), Quorum(1, (0, 2)).covered_by(2, 4)
        ((0, 1), (2, 3))
        """
        if group not in self.members:
            raise ValueError(f"worker group {group} is not a member of quorum {self.id} {list(self.members)}")
        missing = [g for g in range(groups) if g not in self.members]
        mine = self.members.index(group)
        return (group, *missing[mine :: len(self.members)])

    def encode(self) -> str:
        return json.dumps({"id": self.id, "members": self.members, "joiners": self.joiners, "source": self.source,
                           "base": self.base, "tokens": self.tokens, "group_size": self.group_size})

    @classmethod
    def decode(cls, text: str | bytes) -> Quorum:
        d = json.loads(text)
        return cls(d["id"], tuple(d["members"]), tuple(d["joiners"]), d["source"], d["base"],
                   tuple(d.get("tokens", ())), d.get("group_size", 1))

    def admits(self, rank: int, token: str) -> bool:
        """Does this quorum name `rank` for the request `token`?"""
        group = self.group_of(rank)
        return (group in self.members
                and self.tokens[self.members.index(group)].split("|")[rank % self.group_size] == token)


@dataclass(frozen=True)
class Decision:
    """How round k of a quorum ended: apply the step or not, and which quorum the next step uses."""

    commit: bool
    next: Quorum | None
    """None: fewer than min_groups are left; every member waits to be admitted to a new quorum."""
    by: str = "vote"
    """"vote" (the last voter) or "lighthouse" (a member was lost)."""

    def encode(self) -> str:
        return json.dumps({"commit": self.commit, "next": None if self.next is None else self.next.encode(),
                           "by": self.by})

    @classmethod
    def decode(cls, text: str | bytes) -> Decision:
        d = json.loads(text)
        return cls(d["commit"], None if d["next"] is None else Quorum.decode(d["next"]), d["by"])


@dataclass(frozen=True)
class Ready:
    """A worker asking to be admitted: a fresh process (step -1) or one that lost its quorum."""

    token: str
    """Unique per request (incarnation and attempt): the lighthouse admits each request once."""
    step: int
    """The optimizer steps this worker's state has taken (-1: no state yet)."""
    extra: dict = field(default_factory=dict)

    def encode(self) -> str:
        return json.dumps({"token": self.token, "step": self.step, "extra": self.extra})

    @classmethod
    def decode(cls, text: str | bytes) -> Ready:
        d = json.loads(text)
        return cls(d["token"], d["step"], d.get("extra", {}))


def poll_interval(size: int) -> float:
    """Seconds between a waiting member's reads of the store in a quorum of `size` processes (`POLL_READS_PER_S`)."""
    return max(0.1, size / POLL_READS_PER_S)


def round_key(quorum_id: int, k: int, what: str) -> str:
    return f"q{quorum_id}/r{k}/{what}"


def refusal_key(rank: int) -> str:
    """Where a rank of `troupe run --elastic` says why it refuses the job: its launcher stops the job rather
    than restart a rank that would be refused again."""
    return f"refused/{rank}"


def read_refusal(store, rank: int) -> str | None:  # noqa: ANN001  (a torch.distributed Store)
    """Why `rank` refused the job (`refusal_key`), or None."""
    key = refusal_key(rank)
    return store.get(key).decode() if store.check([key]) else None
