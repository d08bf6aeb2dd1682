"""A tick's sends shared among sender processes forked from beat (``pglock_beat_senders``).

One process publishes about 4,000 messages a second on two cores, most of it Celery's own
publish (docs/benchmarks.md, section 15): 10,000 entries due at once take it 2.4 to 2.8 s.
With ``pglock_beat_senders = N`` the leader claims a large tick's slots as ever, then forks
N senders, each with every N-th claim. A sender publishes its share through a broker
connection of its own, in kombu's batches; once a batch is on the broker it reports it to
the leader and waits for its confirmation before the next one goes out, so at most one
batch per sender is on the broker unconfirmed. The leader alone talks to PostgreSQL: it
confirms each reported batch (one round trip) and fences the senders. Leadership lost, it
kills them; stopped (SIGTERM), it lets them finish for up to ``STOP_FINISH_WITHIN`` s, then
kills them; killed, they die with it (``PR_SET_PDEATHSIG`` on Linux; elsewhere at their
next report, whose pipe has no reader then). A sender that dies leaves its unreported
claims to the leader, which sends them itself: a batch on the broker but not reported
is sent twice, and the workers skip the copies.

A sender is a fork: it shares the leader's memory as it was, never uses the leader's
connections (PostgreSQL's, the broker's) and leaves by ``os._exit``, so nothing of theirs
is closed, flushed or written from it. Celery's ``before_task_publish`` and
``after_task_publish`` handlers run in the senders.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import selectors
import signal
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from celery_pglock.beat._planner import Due
from celery_pglock.beat._sending import (
    CONFIRM_BATCH,
    STOP_FINISH_WITHIN,
    Confirmations,
    HeldStops,
    batched,
)

logger = logging.getLogger("celery_pglock.beat")

SHARED_FROM = 2 * CONFIRM_BATCH  # claims in a tick before senders are forked for it
LOOK_EVERY = 0.1  # seconds between two looks at leadership and stops while senders send
# Seconds a sender may go without reporting a batch before the leader kills it and sends
# its share itself: a batch takes milliseconds; kombu's retries on a broker that does not
# answer take seconds; a sender stuck for good would hold the tick for ever.
SILENT_FOR = 30.0
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a child gets when its parent thread dies


@dataclass(frozen=True)
class Sending:
    """What a sender and the leader need of the scheduler."""

    publish: Callable[[Due, Any], bool]  # in a sender: one claim's message, through a producer
    new_producer: Callable[[], Any]  # in a sender: a producer on a connection of its own
    still_leading: Callable[[float], bool]  # in the leader: asked at least every third lease
    lease: float


@dataclass
class _Sender:
    """The leader's view of one sender: its share and what it reported."""

    pid: int
    share: list[Due]
    reports: int  # the pipe the sender writes its batches to (read end)
    acks: int  # the pipe the leader confirms them on (write end)
    reported: set[int] = field(default_factory=set)
    pending: bytes = b""
    heard: float = field(default_factory=time.monotonic)  # its last report, or its start

    def batches(self, chunk: bytes) -> list[list[Due]]:
        """The batches whole in what was read so far (a line of indices each)."""
        *lines, self.pending = (self.pending + chunk).split(b"\n")
        found = []
        for line in lines:
            indices = [int(i) for i in line.split(b",") if i]
            self.reported.update(indices)
            found.append([self.share[i] for i in indices])
        return found

    def unreported(self) -> list[Due]:
        return [item for i, item in enumerate(self.share) if i not in self.reported]


def send_shared(
    claimed: list[Due],
    senders: int,
    sending: Sending,
    confirmations: Confirmations,
    stops: HeldStops,
) -> list[Due]:
    """Send ``claimed`` by ``senders`` forked processes, confirming each batch they
    report; the claims left for the caller to send (a sender died, or could not be
    forked). Nothing once stopping or no longer leading: the next leader sends the rest."""
    forked: list[_Sender] = []
    left: list[Due] = []
    try:
        for index in range(senders):
            share = claimed[index::senders]
            siblings = [fd for other in forked for fd in (other.reports, other.acks)]
            sender = _fork(share, sending, siblings)
            if sender is None:
                left.extend(share)
            else:
                forked.append(sender)
        left.extend(_collect(forked, sending, confirmations, stops))
    finally:
        for sender in forked:
            _end(sender)
    confirmations.flush()  # what waits (paused claims) when no batch was reported
    return left


def _collect(
    forked: list[_Sender], sending: Sending, confirmations: Confirmations, stops: HeldStops
) -> list[Due]:
    """Confirm the senders' batches as they report them, till all have exited; what those
    that died left unreported."""
    live = {sender.reports: sender for sender in forked}
    with selectors.DefaultSelector() as pipes:
        for fd in live:
            pipes.register(fd, selectors.EVENT_READ)
        return _confirm_reports(live, pipes, sending, confirmations, stops)


def _confirm_reports(
    live: dict[int, _Sender],
    pipes: selectors.BaseSelector,
    sending: Sending,
    confirmations: Confirmations,
    stops: HeldStops,
) -> list[Due]:
    left: list[Due] = []
    checked_at = time.monotonic()
    finish_by = float("inf")
    while live:
        now = time.monotonic()
        if stops.caught is not None and finish_by == float("inf"):
            finish_by = now + STOP_FINISH_WITHIN
            logger.info(
                "beat stopping: its senders finish the tick first (a second stop: at once)",
                extra={"action": "pglock_beat_stopping"},
            )
        if now > finish_by:
            return []  # stopping: the rest is the next leader's, at once
        if not sending.still_leading(checked_at):
            logger.warning(
                "senders stopped: leadership lost", extra={"action": "pglock_beat_not_sent"}
            )
            return []
        if now - checked_at >= sending.lease / 3:
            checked_at = now
        for fd, sender in list(live.items()):
            if now - sender.heard > SILENT_FOR:
                pipes.unregister(fd)
                del live[fd]
                left.extend(_silenced(sender, now - sender.heard))
        for key, _ in pipes.select(LOOK_EVERY):
            sender = live[key.fd]
            chunk = os.read(key.fd, 1 << 16)
            if not chunk:
                pipes.unregister(key.fd)
                del live[key.fd]
                left.extend(_exited(sender))
                continue
            sender.heard = time.monotonic()
            for batch in sender.batches(chunk):
                confirmations.recorded(batch)  # on the broker: confirmed now
                confirmations.flush()
                with contextlib.suppress(BrokenPipeError):  # died since: its EOF is next
                    os.write(sender.acks, b"+")
    return left


def _exited(sender: _Sender) -> list[Due]:
    """A sender closed its pipe: what it left unsent, if it did not finish (exit 0: its
    unreported claims failed on the broker, said by it, and are sent again later)."""
    pid, sender.pid = sender.pid, 0
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if status == 0:
        return []
    unsent = sender.unreported()
    logger.warning(
        "beat sender %d ended (status %d) with %d message(s) unreported: sending them here",
        pid,
        status,
        len(unsent),
        extra={"action": "pglock_beat_sender_died"},
    )
    return unsent


def _silenced(sender: _Sender, silent: float) -> list[Due]:
    """A sender that reported nothing for ``silent`` s: killed; its unreported claims."""
    _end(sender)
    unsent = sender.unreported()
    logger.warning(
        "a beat sender sent nothing for %.0f s: killed; its %d unreported message(s) are sent here",
        silent,
        len(unsent),
        extra={"action": "pglock_beat_sender_died"},
    )
    return unsent


def _end(sender: _Sender) -> None:
    """Kill the sender if it still runs, reap it, close its pipes (once)."""
    if sender.pid:
        with contextlib.suppress(ProcessLookupError):
            os.kill(sender.pid, signal.SIGKILL)
        os.waitpid(sender.pid, 0)
        sender.pid = 0
    for fd in (sender.reports, sender.acks):
        if fd >= 0:
            os.close(fd)
    sender.reports = sender.acks = -1


def _fork(share: list[Due], sending: Sending, siblings: list[int]) -> _Sender | None:
    """A sender for ``share``; None if the system would not fork one (said).
    ``siblings``: the leader's ends of the pipes of the senders forked before, closed in
    this one, so that each sender's pipes end with the leader (a sibling holding them
    open would keep a sender of a dead leader waiting)."""
    leader = os.getpid()
    reports_r, reports_w = os.pipe()
    acks_r, acks_w = os.pipe()
    try:
        pid = os.fork()
    except OSError as exc:
        for fd in (reports_r, reports_w, acks_r, acks_w):
            os.close(fd)
        logger.warning(
            "could not fork a beat sender (%s): its %d message(s) are sent by the leader",
            exc,
            len(share),
            extra={"action": "pglock_beat_sender_died"},
        )
        return None
    if pid == 0:
        for fd in (reports_r, acks_w, *siblings):
            os.close(fd)
        _sender_main(share, sending, leader, reports_w, acks_r)
    os.close(reports_w)
    os.close(acks_r)
    return _Sender(pid, share, reports_r, acks_w)


def _sender_main(
    share: list[Due], sending: Sending, leader: int, reports: int, acks: int
) -> NoReturn:
    """A sender's whole life: publish ``share``, report each batch, wait for its
    confirmation, leave by ``os._exit`` (status 0: every batch reported or said failed)."""
    status = 1
    try:
        _detach(leader)
        producer = sending.new_producer()
        confirmations = Confirmations(_Reports(share, reports, acks))
        with batched(producer, confirmations):
            for item in share:
                if sending.publish(item, producer):
                    confirmations.sent(item)
        confirmations.flush()
        status = 0
        with contextlib.suppress(Exception):  # its own connection: closed as a client should
            producer.connection.close()
    except BaseException:
        logger.exception("beat sender %d failed", os.getpid())
    finally:
        os._exit(status)


def _detach(leader: int) -> None:
    """Stops are the leader's to take (Ctrl-C reaches the whole process group); the
    sender dies with the leader."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != leader:  # died before the line above
        os._exit(1)


class _Reports:
    """A sender's confirmations: each batch reported to the leader (the indices of its
    claims in the share, a line), then its confirmation awaited."""

    def __init__(self, share: list[Due], reports: int, acks: int) -> None:
        self._index = {id(item): i for i, item in enumerate(share)}
        self._reports = reports
        self._acks = acks

    def confirm(self, sent: Iterable[Due]) -> None:
        line = (",".join(str(self._index[id(item)]) for item in sent) + "\n").encode()
        while line:
            line = line[os.write(self._reports, line) :]
        if not os.read(self._acks, 1):
            raise ConnectionError("the beat leader is gone")
