"""The invariant checker: what really happened, judged against the promises.

Pure functions over rows the campaign collected (no database, no processes), so each rule
can be tested on made-up histories (``tests/unit/test_chaos_invariants.py``):

- (a) no (lock, slot) succeeded twice: ``tests.faults.workload``'s checker, reused;
- (b) ``fences``: per resource, the accepted fenced writes, in commit order, carry
  non-decreasing tokens (one execution may write twice with its token; a smaller token
  after a larger one is a stale write that got through);
- (c) ``overlaps``: two executions of one lock overlap when the later token was granted
  before a fenced write of the earlier one. The earlier one must then have learned that
  its lock was lost (its ``check()`` before the write said so) and its write must have
  been refused: "fenced out". A violation is a ``check()`` that said "held" after the later
  token had been granted (the library told a superseded holder it still held the lock),
  or a write accepted after the later holder wrote (caught by (b)). Not violations, only
  counted: a check made before the later grant (it could not know yet; its write was
  refused), an overlap during which the earlier one wrote nothing (killed, or its write
  could not reach PostgreSQL), and a write accepted before the later holder's first write
  (fencing refuses a token only once a larger one wrote);
- (d) ``quiet``: after the quiet period, every advisory lock is held by a live running
  task (or the live beat leader), every ``running`` ledger row has a live holder, every
  library session belongs to a live process, at most ``pool size`` per process;
- (e) ``sends``: each slot was published by one beat replica, once, unless beat's
  documented resend (``beat_sends.sends`` > 1) sent it again; workers saw no more
  messages (task ids) of a slot than were sent;
- (f) in ``liveness``: per entry, the longest stretch without a successful run, the time
  it could not run deducted, stays within the documented bound (``slot_success`` here
  only counts, for the figures, how many slots succeeded);
- (g) every message ended in a final state (``SUCCESS``, ``FAILURE`` with its error,
  ``SKIPPED`` with its reason) and every ledger row is final: the reused checker again.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from tests.faults.workload import session_pid

BEAT_LEADER_SESSION = " beat leader "


@dataclass(frozen=True)
class Violation:
    """One broken promise: its invariant letter and the evidence."""

    invariant: str
    text: str

    def __str__(self) -> str:
        return f"({self.invariant}) {self.text}"


@dataclass(frozen=True)
class KnownDefect:
    """A library defect the campaign found, reported, and pinned by a targeted test."""

    name: str
    summary: str
    test: str

    def matches(self, violation: Violation) -> bool:
        return KNOWN_MATCHERS[self.name](violation)


# Defects found and not yet fixed, whose evidence a campaign reports without failing.
# D1 and D2 (tests/chaos/test_regressions.py) are fixed: their symptoms would be a
# regression, which their targeted tests catch as well.
KNOWN_DEFECTS: tuple[KnownDefect, ...] = ()  # none open: D1-D4 are fixed
KNOWN_MATCHERS = {
    # The `tx` entry's slot left `scheduled`: its run (on the worker behind PgBouncer) lost
    # its lock connection and nothing recorded the attempt (D1 and D3 are fixed).
    "D4": lambda v: v.invariant == "g" and ":chaos.tx " in v.text and "left scheduled" in v.text,
}


def known_defect(violation: Violation) -> KnownDefect | None:
    """The known defect ``violation`` is evidence of, if any."""
    return next((defect for defect in KNOWN_DEFECTS if defect.matches(violation)), None)


@dataclass
class Overlaps:
    """What ``overlaps`` found, violations apart."""

    fenced_out: int = 0  # overlapping writes refused, the earlier one knowing it was lost
    silent: int = 0  # overlaps during which the earlier execution wrote nothing
    before_first_write: int = 0  # earlier write accepted before the later holder wrote


# -- (b) fencing ----------------------------------------------------------------------------


def fences(writes: Iterable[dict[str, Any]]) -> list[Violation]:
    """Accepted fenced writes (``id`` is commit order per resource) never go back in token."""
    found: list[Violation] = []
    highest: dict[str, dict[str, Any]] = {}
    for write in sorted(writes, key=lambda w: w["id"]):
        top = highest.get(write["resource"])
        if top is not None and write["token"] < top["token"]:
            found.append(
                Violation(
                    "b",
                    f"{write['resource']}: {write['kind']} write of token {write['token']} "
                    f"(task {write['task_id']}) accepted after token {top['token']} "
                    f"(task {top['task_id']}) wrote",
                )
            )
        elif top is None or write["token"] > top["token"]:
            highest[write["resource"]] = write
    return found


# -- (c) overlapping executions ---------------------------------------------------------------


def overlaps(
    executions: Iterable[dict[str, Any]], writes: Iterable[dict[str, Any]]
) -> tuple[list[Violation], Overlaps]:
    """Overlapping executions of one lock and what the earlier one did meanwhile."""
    accepted = {(w["token"], w["kind"]) for w in writes}
    by_lock: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in executions:
        if row["token"] is not None and row["acquired_at"] is not None:
            by_lock[row["lock_name"]].append(row)
    found: list[Violation] = []
    seen = Overlaps()
    for rows in by_lock.values():
        rows.sort(key=lambda r: r["token"])
        for position, earlier in enumerate(rows):
            later = rows[position + 1 :]
            if not later:
                continue
            _judge_writes(earlier, later, accepted, found, seen)
    return found, seen


def _judge_writes(
    earlier: dict[str, Any],
    later: list[dict[str, Any]],
    accepted: set[tuple[int, str]],
    found: list[Violation],
    seen: Overlaps,
) -> None:
    wrote_during_overlap = False
    for kind in ("start", "end"):
        written_at = earlier[f"{kind}_write_at"]
        result = earlier[f"{kind}_result"]
        if (earlier["token"], kind) in accepted:
            result = "accepted"
        if written_at is None or result not in ("accepted", "refused"):
            continue
        rivals = [r for r in later if r["acquired_at"] < written_at]
        if not rivals:
            continue
        wrote_during_overlap = True
        rival = min(rivals, key=lambda r: r["acquired_at"])
        checked_at, lost = earlier[f"{kind}_check_at"], earlier[f"{kind}_lost"]
        told_held_late = not lost and checked_at is not None and checked_at > rival["acquired_at"]
        if told_held_late:
            found.append(
                Violation(
                    "c",
                    f"{earlier['lock_name']}: token {earlier['token']} (pid {earlier['pid']}, "
                    f"slot {earlier['slot']}) was told its lock was held at "
                    f"{_clock(checked_at)}, but token {rival['token']} (pid {rival['pid']}, "
                    f"slot {rival['slot']}) had held it since {_clock(rival['acquired_at'])}; "
                    f"its {kind} write was {result}",
                )
            )
        elif result == "refused":
            seen.fenced_out += 1
        else:
            seen.before_first_write += 1
    if not wrote_during_overlap and any(r["acquired_at"] < _end(earlier) for r in later):
        seen.silent += 1


def _end(row: dict[str, Any]) -> float:
    return float(row["ended_at"]) if row["ended_at"] is not None else float("inf")


def _clock(epoch: float) -> str:
    return datetime.fromtimestamp(epoch).strftime("%H:%M:%S.%f")[:-3]


# -- (d) after the quiet period ---------------------------------------------------------------


@dataclass
class QuietState:
    """The server and the processes once the quiet period is over."""

    locks: list[dict[str, Any]]  # granted advisory locks: key, backend, application_name
    sessions: list[dict[str, Any]]  # library sessions: backend, application_name, usename
    running: list[dict[str, Any]]  # ledger rows `running`, with `held` (backend holds the key)
    open_executions: list[dict[str, Any]]  # executions without ended_at: lock_name, pid
    alive: set[int]  # live processes of the campaign (beats, workers, live workers' pools)
    beat_pids: set[int]
    names: dict[int, str]  # lock key -> lock name
    leader_lock: str
    pool_size: int
    pooler_user: str | None = None  # sessions PgBouncer opened (counted apart)
    counts: dict[int, int] = field(default_factory=dict)  # library sessions per pid


def quiet(state: QuietState) -> list[Violation]:
    """Invariant (d) on one snapshot; also fills ``state.counts``."""
    return [*_quiet_locks(state), *_quiet_rows(state), *_quiet_sessions(state)]


def _quiet_locks(state: QuietState) -> list[Violation]:
    found = []
    running = {row["lock_name"] for row in state.open_executions if row["pid"] in state.alive}
    for lock in state.locks:
        name = state.names.get(lock["key"])
        session = lock["application_name"] or ""
        if name == state.leader_lock:
            if BEAT_LEADER_SESSION not in session or session_pid(session) not in state.alive:
                found.append(Violation("d", f"beat leader lock held by {_backend(lock)}"))
        elif name is None:
            found.append(Violation("d", f"advisory lock {lock['key']}: {_backend(lock)}"))
        elif name not in running:
            found.append(Violation("d", f"{name} held by {_backend(lock)}, no live task runs it"))
    return found


def _quiet_rows(state: QuietState) -> list[Violation]:
    return [
        Violation(
            "d",
            f"{row['lock_name']} {row['slot']} left running (token {row['token']}, "
            f"pid {row['pid']}, backend {row['backend_pid']}, lock held: {row['held']})",
        )
        for row in state.running
        if not row["held"] or row["pid"] not in state.alive
    ]


def _quiet_sessions(state: QuietState) -> list[Violation]:
    found = []
    state.counts = {}
    for session in state.sessions:
        if state.pooler_user is not None and session["usename"] == state.pooler_user:
            continue
        pid = session_pid(session["application_name"])
        if pid is None:
            continue
        state.counts[pid] = state.counts.get(pid, 0) + 1
        if pid not in state.alive:
            found.append(
                Violation("d", f"session of dead or orphaned process {pid}: {_backend(session)}")
            )
    for pid, count in sorted(state.counts.items()):
        limit = state.pool_size + (1 if pid in state.beat_pids else 0)
        if count > limit:
            found.append(Violation("d", f"process {pid} has {count} library sessions (> {limit})"))
    return found


def _backend(row: dict[str, Any]) -> str:
    return f"backend {row['backend']} {row['application_name']!r}"


# -- (e) one sender per slot --------------------------------------------------------------------


def sends(
    published: Iterable[dict[str, Any]],
    beat_sends: Iterable[dict[str, Any]],
    seen: Iterable[dict[str, Any]],
    beat_pids: set[int],
) -> list[Violation]:
    """Each slot published by one replica, once (resends aside); no more task ids seen."""
    claims = {(row["entry"], row["slot"]): row for row in beat_sends}
    by_lock = {(row["lock_name"], row["slot"]): row for row in beat_sends}
    found: list[Violation] = []
    ids: dict[tuple[str, str], set[str]] = defaultdict(set)
    senders: dict[tuple[str, str], set[int]] = defaultdict(set)
    for record in published:
        if record.get("waited"):  # a waiting slot sent again (buffer_one): same task id
            continue
        if record["pid"] in beat_pids and record["slot"] is not None:
            key = (record["entry"], record["slot"])
            ids[key].add(record["task_id"])
            senders[key].add(record["pid"])
    reported: set[tuple[str, str]] = set()
    for key in sorted(ids):
        claim = claims.get(key)
        if claim is None:
            found.append(
                Violation("e", f"{key[0]} {key[1]} sent without a claim by {senders[key]}")
            )
            continue
        if len(ids[key]) > claim["sends"] or len(senders[key]) > claim["sends"]:
            reported.add((claim["lock_name"], key[1]))
            found.append(
                Violation(
                    "e",
                    f"{key[0]} {key[1]} sent {len(ids[key])} times by pids "
                    f"{sorted(senders[key])} (task ids {sorted(ids[key])}); "
                    f"claimed by {claim['sent_by']}, sends {claim['sends']}",
                )
            )
    messages: dict[tuple[str, str], set[str]] = defaultdict(set)
    for row in seen:
        if row.get("task_id") and row.get("slot") is not None:
            messages[(row["lock_name"], row["slot"])].add(row["task_id"])
    for (entry, slot), task_ids in ids.items():
        claim = claims.get((entry, slot))
        if claim is not None:
            messages[(claim["lock_name"], slot)] |= task_ids
    for key, task_ids in sorted(messages.items()):
        claim = by_lock.get(key)
        if claim is not None and key not in reported and len(task_ids) > claim["sends"]:
            found.append(
                Violation(
                    "e",
                    f"{key[0]} {key[1]}: {len(task_ids)} messages ({sorted(task_ids)}) "
                    f"for {claim['sends']} send(s)",
                )
            )
    return found


# -- figures --------------------------------------------------------------------------------


def slot_success(
    beat_sends: Iterable[dict[str, Any]], ledger: Iterable[dict[str, Any]], entries: set[str]
) -> tuple[int, int]:
    """(succeeded, sent) among the slots of ``entries`` that beat sent."""
    states = {(row["lock_name"], row["slot"]): row["state"] for row in ledger}
    sent = [(row["lock_name"], row["slot"]) for row in beat_sends if row["entry"] in entries]
    return sum(states.get(key) == "succeeded" for key in sent), len(sent)


def failover_gaps(losses: Iterable[float], elections: Iterable[float]) -> list[float]:
    """Seconds from each loss of the leader's session to the next election after it."""
    ordered = sorted(elections)
    gaps = []
    for lost in sorted(losses):
        following = [at for at in ordered if at > lost]
        if following:
            gaps.append(following[0] - lost)
    return gaps


def largest_hole(slots: Iterable[str]) -> float:
    """Seconds between the two furthest-apart consecutive slots (beat's ISO form)."""
    times = sorted(
        datetime.fromisoformat(slot.replace("Z", "+00:00")).timestamp() for slot in slots
    )
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)
