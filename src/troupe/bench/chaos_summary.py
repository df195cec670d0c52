"""The figures of a chaos run, from the three JSON-lines files it leaves (no torch, no torchft).

A chaos run (troupe's elastic mode, or torchft's fault-tolerant DDP in `chaos_torchft`)
writes into one folder:

* ``events.jsonl``  one line per step per group:
  ``{"t": s since the job started, "group": g, "step": n, "committed": bool, "samples": 64}``;
* ``faults.jsonl``  ``{"t", "group", "kind"}`` with kind ``kill``, ``restart``, ``stop``,
  ``cont``, ``kill-server`` (group -1, with the server's ``rank``), ``crash`` (a group exited
  non-zero without being killed) or ``hang`` (a live group made no step for 60 s);
* ``final.jsonl``   ``{"group", "eval_acc", "params_sha256", "exit_code"}`` per group.

`summarize` turns them into throughput, recovery and stall times, crashes, hangs, progress
lost to a restart from scratch, final accuracy and whether the groups ended bit-identical; `markdown_table` lays several runs
side by side against a fault-free one.
"""

from __future__ import annotations

import gzip
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def read_jsonl(path: str | Path) -> tuple[list[dict[str, Any]], int]:
    """The records of a JSON-lines file and the number of lines that did not parse.

    A missing file is read from ``<path>.gz`` when that exists (kept results are compressed),
    else it is empty. A line that does not parse is counted, not raised: a process killed with
    SIGKILL may leave a torn last line, and the rest of the run still counts.
    """
    path = Path(path)
    zipped = path.with_name(path.name + ".gz")
    if path.exists():
        text = path.read_text()
    elif zipped.exists():
        text = gzip.decompress(zipped.read_bytes()).decode()
    else:
        return [], 0
    records, bad = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            bad += 1
    return records, bad


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default)."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def committed_times(events: Sequence[dict[str, Any]]) -> dict[int, list[float]]:
    """Each group's committed-step times, sorted."""
    times: dict[int, list[float]] = {}
    for e in events:
        if e["committed"]:
            times.setdefault(e["group"], []).append(e["t"])
    return {g: sorted(ts) for g, ts in sorted(times.items())}


def median_step_s(times: dict[int, list[float]]) -> float | None:
    """The median gap between two consecutive committed steps of one group, over all groups."""
    gaps = [b - a for ts in times.values() for a, b in zip(ts, ts[1:])]
    return statistics.median(gaps) if gaps else None


def recovery_s(times: dict[int, list[float]], group: int, t_kill: float) -> float | None:
    """Seconds from a kill until the killed group commits a step again (None: it never does)."""
    after = [t for t in times.get(group, []) if t > t_kill]
    return after[0] - t_kill if after else None


def stall_s(times: dict[int, list[float]], group: int, start: float, end: float,
            median_step: float | None) -> float | None:
    """How long the groups other than `group` were held up in [start, end].

    The longest gap between two consecutive committed steps of one surviving group that
    overlaps the window, less the median step time (never below 0). None when no
    survivor committed a step after `start`.
    """
    gaps = [b - a for g, ts in times.items() if g != group
            for a, b in zip(ts, ts[1:]) if b > start and a < end]
    if not gaps:
        return None
    return max(0.0, max(gaps) - (median_step or 0.0))


def progress_lost_steps(events: Sequence[dict[str, Any]]) -> int:
    """The most steps any one group went back: 0 when every restarted group healed from a peer.

    A group's committed step never decreases while some group keeps the state (a restarted
    group heals to the quorum's step); when every group restarted at once, training starts
    again from step 0 and each group goes back by the steps it had done.
    """
    lost: dict[int, int] = {}
    last: dict[int, int] = {}
    for e in sorted((e for e in events if e["committed"]), key=lambda e: e["t"]):
        g = e["group"]
        if g in last and e["step"] < last[g]:
            lost[g] = lost.get(g, 0) + last[g] - e["step"]
        last[g] = e["step"]
    return max(lost.values(), default=0)


def _kill_figures(times: dict[int, list[float]], faults: Sequence[dict[str, Any]],
                  median_step: float | None) -> list[dict[str, Any]]:
    """Recovery and stall of every kill, in the order of the kills."""
    last = max((ts[-1] for ts in times.values() if ts), default=0.0)
    out = []
    for f in sorted((f for f in faults if f["kind"] == "kill"), key=lambda f: f["t"]):
        rec = recovery_s(times, f["group"], f["t"])
        end = f["t"] + rec if rec is not None else last
        out.append({"t": f["t"], "group": f["group"], "recovery_s": rec,
                    "stall_s": stall_s(times, f["group"], f["t"], end, median_step)})
    return out


def _server_kill_figures(times: dict[int, list[float]], faults: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per server killed (`--kill-server-at`): how long after it every group had committed again (its
    workers once they failed over), and which group took longest."""
    out = []
    for f in sorted((f for f in faults if f["kind"] == "kill-server"), key=lambda f: f["t"]):
        back = {g: recovery_s(times, g, f["t"]) for g in times}
        slowest = max(back, key=lambda g: float("inf") if back[g] is None else back[g], default=None)
        out.append({"t": f["t"], "rank": f.get("rank"), "all_back_s": None if None in back.values() else
                    max(back.values(), default=None), "slowest_group": slowest})
    return out


def _stop_figures(times: dict[int, list[float]], faults: Sequence[dict[str, Any]],
                  median_step: float | None) -> list[dict[str, Any]]:
    """Per SIGSTOP: how long after its SIGCONT the group commits again, and the survivors' stall."""
    last = max((ts[-1] for ts in times.values() if ts), default=0.0)
    ordered = sorted(faults, key=lambda f: f["t"])
    out = []
    for i, f in enumerate(ordered):
        if f["kind"] != "stop":
            continue
        cont = next((c["t"] for c in ordered[i + 1:] if c["kind"] == "cont" and c["group"] == f["group"]), None)
        rejoin = recovery_s(times, f["group"], cont) if cont is not None else None
        end = cont + rejoin if rejoin is not None else last
        out.append({"t": f["t"], "group": f["group"], "cont_t": cont, "rejoin_s": rejoin,
                    "stall_s": stall_s(times, f["group"], f["t"], end, median_step)})
    return out


def _final_figures(finals: Sequence[dict[str, Any]], asynchronous: bool = False) -> dict[str, Any]:
    """Mean accuracy over the groups that reported one, and whether all hashes agree (None for
    asynchronous workers: each holds the servers' values of its own last fetch)."""
    accs = [f["eval_acc"] for f in finals if f.get("eval_acc") is not None]
    hashes = [f.get("params_sha256") for f in finals]
    return {
        "groups_final": len(finals),
        "final_acc": statistics.fmean(accs) if accs else None,
        "bit_identical": None if asynchronous else bool(hashes) and None not in hashes and len(set(hashes)) == 1,
        "nonzero_exits": sum(1 for f in finals if f.get("exit_code") not in (0, None)),
    }


def summarize(out_dir: str | Path) -> dict[str, Any]:
    """The figures of the chaos run whose files are in `out_dir` (see the module docstring).

    samples_per_s is the committed samples of all groups over the span from the first to
    the last committed step; kept_of_own_pace divides it by what every group would commit
    at the run's median step time (1.0 for a run that never slowed down). recovery_s and stall_s are per kill (see `recovery_s`,
    `stall_s`); their p50/p99 leave out the kills a group never recovered from
    (counted in ``unrecovered``). For a SIGSTOP, stop_rejoin_s runs from its SIGCONT until
    the group commits again, and its stall window from the SIGSTOP to that commit.

        >>> summarize("runs/ddp-kill30")["recovery_p99"]   # doctest: +SKIP
    """
    out_dir = Path(out_dir)
    events, bad_events = read_jsonl(out_dir / "events.jsonl")
    faults, _ = read_jsonl(out_dir / "faults.jsonl")
    finals, _ = read_jsonl(out_dir / "final.jsonl")
    times = committed_times(events)
    all_t = sorted(t for ts in times.values() for t in ts)
    samples = sum(e["samples"] for e in events if e["committed"])
    span = all_t[-1] - all_t[0] if len(all_t) > 1 else 0.0
    median_step = median_step_s(times)
    kills = _kill_figures(times, faults, median_step)
    recoveries = [k["recovery_s"] for k in kills if k["recovery_s"] is not None]
    stalls = [k["stall_s"] for k in kills if k["stall_s"] is not None]
    kinds = [f["kind"] for f in faults]
    # What the groups would have committed stepping at their median pace the whole span:
    # a ratio within one run, so a host whose load changes between runs moves it less.
    per_step = samples / len(all_t) if all_t else 0
    pace = len(times) * per_step / median_step if median_step else None
    stops = _stop_figures(times, faults, median_step)
    rejoins = [x["rejoin_s"] for x in stops if x["rejoin_s"] is not None]
    stop_stalls = [x["stall_s"] for x in stops if x["stall_s"] is not None]
    return {
        "committed_samples": samples,
        "span_s": span,
        "samples_per_s": samples / span if span > 0 else 0.0,
        "median_step_s": median_step,
        "kept_of_own_pace": samples / span / pace if pace and span > 0 else None,
        "kills": len(kills),
        "stops": len(stops),
        "unrecovered": sum(1 for k in kills if k["recovery_s"] is None),
        "recovery_p50": percentile(recoveries, 50),
        "recovery_p99": percentile(recoveries, 99),
        "stall_p50": percentile(stalls, 50),
        "stall_p99": percentile(stalls, 99),
        "stop_rejoin_p50": percentile(rejoins, 50),
        "stop_rejoin_p99": percentile(rejoins, 99),
        "stop_stall_p50": percentile(stop_stalls, 50),
        "stop_stall_p99": percentile(stop_stalls, 99),
        "crashes": kinds.count("crash"),
        "hangs": kinds.count("hang"),
        "progress_lost_steps": progress_lost_steps(events),
        "bad_event_lines": bad_events,
        "per_kill": kills,
        "per_stop": stops,
        "per_server_kill": _server_kill_figures(times, faults),
        **_final_figures(finals, asynchronous=_asynchronous(out_dir)),
    }


def _asynchronous(out_dir: Path) -> bool:
    """A run of asynchronous workers (`troupe bench chaos --downpour` or `--hogwild`): they never hold the
    same values."""
    path = out_dir / "args.json"
    if not path.exists():
        return False
    args = json.loads(path.read_text())
    return bool(args.get("downpour") or args.get("hogwild"))


def _yes_no(v: bool | None) -> str:
    return "n/a (asynchronous)" if v is None else "yes" if v else "no"


def _fmt(v: float | None, digits: int = 2) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def markdown_table(runs: dict[str, dict[str, Any]], reference: str) -> str:
    """One row per run (name -> `summarize` result); throughput kept is relative to `reference`.

    "kept" divides the samples per second; "kept (pace)" divides each run's
    kept_of_own_pace, which cancels a host load that differs between the two runs.
    """
    if reference not in runs:
        raise ValueError(f"reference {reference!r} is not one of the runs {sorted(runs)}")
    ref = runs[reference]["samples_per_s"]
    head = ("| run | samples/s | kept | kept (pace) | kills | recovery p50 / p99 (s) | stall p50 / p99 (s) "
            "| crashed survivors | hangs | steps lost | final acc (%) | bit-identical |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, s in runs.items():
        kept = s["samples_per_s"] / ref if ref else None
        ref_pace, pace = runs[reference]["kept_of_own_pace"], s["kept_of_own_pace"]
        kept_pace = pace / ref_pace if pace is not None and ref_pace else None
        acc = None if s["final_acc"] is None else 100 * s["final_acc"]
        rows.append(
            f"| {name} | {s['samples_per_s']:.0f} | {_fmt(kept)} | {_fmt(kept_pace)} | {s['kills']} "
            f"| {_fmt(s['recovery_p50'], 1)} / {_fmt(s['recovery_p99'], 1)} "
            f"| {_fmt(s['stall_p50'], 1)} / {_fmt(s['stall_p99'], 1)} "
            f"| {s['crashes']} | {s['hangs']} | {s['progress_lost_steps']} | {_fmt(acc)} | {_yes_no(s['bit_identical'])} |")
    return "\n".join(rows)
