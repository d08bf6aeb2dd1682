"""Faults injected during a run: ``--chaos`` and the simulated broker redeliveries.

``--chaos`` (times are fractions of ``--duration``):

- at 25 %: SIGKILL the beat that is sending (the leader), restart a replacement 2 s later;
- at 45 %: SIGKILL a worker and its pool (a container dying), start a replacement;
- at 60 %: SIGSTOP the worker running the long task for longer than the lease, then SIGCONT.

Redeliveries: brokers deliver some messages twice (Redis after ``visibility_timeout``,
any broker with ``acks_late`` after a worker is lost). Every few seconds one recently
completed message is published again, with the headers beat gave it.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

from celery import Celery

from celery_pglock._messages import ENTRY_HEADER, SLOT_HEADER
from celery_pglock.demo import _schedule as schedule
from celery_pglock.demo._facts import Reader
from celery_pglock.demo._processes import Fleet, Process

LONG_TASK = max(schedule.TASKS, key=lambda task: task.runs_for)
FREEZE_FOR = schedule.LEASE + 2.0
BEAT_RESTART_AFTER = 2.0
FIND_HOLDER_FOR = 4.0  # seconds to wait for the long task to be running before freezing
MIN_DURATION = 15.0


@dataclass
class Event:
    """One fault, as the report shows it."""

    kind: str
    at: float
    process: str
    pids: list[int]
    detail: dict[str, Any] = field(default_factory=dict)

    def as_dict(self, start: float) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "at_s": round(self.at - start, 2),
            "process": self.process,
            "pid": self.pids[0] if self.pids else None,
            **self.detail,
        }


class Chaos:
    """Runs the ``--chaos`` plan, one step per tick of the demo's loop."""

    def __init__(self, fleet: Fleet, reader: Reader, rng: random.Random, *, locked: bool) -> None:
        self.fleet = fleet
        self.reader = reader
        self.rng = rng
        self.locked = locked
        self.events: list[Event] = []
        self._plan: list[tuple[float, str]] = []
        self._thaw: tuple[float, Process] | None = None

    def schedule(self, start: float, duration: float) -> None:
        self._plan = [
            (start + 0.25 * duration, "kill_leader"),
            (start + 0.45 * duration, "kill_worker"),
            (start + 0.60 * duration, "freeze_worker"),
        ]

    def step(self, now: float) -> str | None:
        """Do what is due; return a line describing it, for the progress display."""
        if self._thaw is not None and now >= self._thaw[0]:
            return self._do_thaw(now)
        if not self._plan or now < self._plan[0][0]:
            return None
        due_at, action = self._plan[0]
        message: str | None = getattr(self, f"_{action}")(now, due_at)
        return message

    def _done(self) -> None:
        self._plan.pop(0)

    def _kill_leader(self, now: float, _: float) -> str:
        self._done()
        beat = self._leader()
        if beat is None:
            return "chaos: no live beat to kill"
        pids = beat.family()
        beat.kill()
        self.events.append(Event("leader_killed", now, beat.name, pids))
        self._plan.insert(0, (now + BEAT_RESTART_AFTER, "restart_beat"))
        role = "the leader, sending the slots" if self.locked else "one of the beats"
        return f"chaos: SIGKILL {beat.name} (pid {beat.pid}), {role}"

    def _restart_beat(self, now: float, _: float) -> str:
        self._done()
        beat = self.fleet.start_beat(stock=not self.locked)
        self.events.append(Event("beat_started", now, beat.name, [beat.pid]))
        return f"chaos: started {beat.name} (pid {beat.pid}) to replace the killed beat"

    def _kill_worker(self, now: float, _: float) -> str:
        self._done()
        workers = self.fleet.live("worker")
        if not workers:
            return "chaos: no live worker to kill"
        victim = self.rng.choice(workers)
        pids = victim.family()
        victim.kill()
        interrupted = self.reader.running_in(pids)
        replacement = self.fleet.start_worker()
        detail = {"interrupted_tasks": interrupted, "replacement": replacement.name}
        self.events.append(Event("worker_killed", now, victim.name, pids, detail))
        killed = f"{victim.name} (pid {victim.pid}) and its pool"
        return f"chaos: SIGKILL {killed}; started {replacement.name}"

    def _freeze_worker(self, now: float, due_at: float) -> str | None:
        victim = self._holder_of_long_task()
        if victim is None and now < due_at + FIND_HOLDER_FOR:
            return None  # wait for the long task to be running somewhere
        self._done()
        victim = victim or self._random_worker()
        if victim is None:
            return "chaos: no live worker to freeze"
        pids = victim.family()
        victim.freeze()
        holding = self.reader.running_in(pids)
        detail = {"frozen_for_s": FREEZE_FOR, "holding": holding}
        self.events.append(Event("worker_frozen", now, victim.name, pids, detail))
        self._thaw = (now + FREEZE_FOR, victim)
        what = f" while it runs {', '.join(holding)}" if holding else ""
        return f"chaos: SIGSTOP {victim.name} (pid {victim.pid}){what} for {FREEZE_FOR:.0f} s"

    def _do_thaw(self, now: float) -> str:
        assert self._thaw is not None
        victim = self._thaw[1]
        self._thaw = None
        victim.thaw()
        self.events.append(Event("worker_thawed", now, victim.name, [victim.pid]))
        return f"chaos: SIGCONT {victim.name} (pid {victim.pid})"

    def _leader(self) -> Process | None:
        beats = self.fleet.live("beat")
        sender = self.reader.last_sender() if self.locked else None
        return next((b for b in beats if b.pid == sender), beats[0] if beats else None)

    def _holder_of_long_task(self) -> Process | None:
        for pid in self.reader.running(LONG_TASK.name):
            owner = self.fleet.owner_of(pid)
            if owner is not None and owner.role == "worker":
                return owner
        return None

    def _random_worker(self) -> Process | None:
        workers = self.fleet.live("worker")
        return self.rng.choice(workers) if workers else None


class Redeliverer:
    """Publishes a recently completed message again, every ``every`` seconds."""

    def __init__(
        self, client: Celery, reader: Reader, rng: random.Random, every: float, *, after: float
    ) -> None:
        self.client = client
        self.reader = reader
        self.rng = rng
        self.every = every
        self.after = after  # only slots due after this (the run's window) are redelivered
        self.sent: list[tuple[str, str]] = []
        self._next = time.time() + every

    def step(self, now: float, queue: str) -> str | None:
        if self.every <= 0 or now < self._next:
            return None
        self._next = now + self.every
        recent = [
            (task, slot)
            for task, slot in self.reader.recent_completed(now - 2 * self.every)
            if schedule.slot_time(slot) > self.after
        ]
        if not recent:
            return None
        task, slot = self.rng.choice(recent)
        self.client.send_task(task, queue=queue, headers=redelivery_headers(task, slot))
        self.sent.append((task, slot))
        return None


def redelivery_headers(task: str, slot: str) -> dict[str, Any]:
    """What the original message carried: the slot (beat's header), the send time."""
    spec = schedule.TASKS_BY_NAME[task]
    return {
        SLOT_HEADER: slot,
        ENTRY_HEADER: spec.short,
        schedule.SENT_AT_HEADER: schedule.slot_time(slot) + 0.001,
        schedule.REDELIVERED_HEADER: True,
    }
