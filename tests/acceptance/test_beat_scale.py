"""Beat at scale (issue 28): 2,000 entries due at once, the leader SIGKILLed or SIGTERMed
in the middle of the tick that sends them.

Two real ``celery beat`` replicas (leader election on) and two ``celery worker``
processes (niced) share a generated schedule of 2,000 entries due on the same 10-s boundary. Once
the leader's tick is seen half done (some of the slot's claims confirmed, not all), the
leader gets the signal. Then every claim of that slot must be confirmed (on the broker)
within ``pglock_beat_lease`` + 2 s of the signal, plus 0.5 ms for each claim (the new
leader's sending of what was left), by the stopped leader before it exited or by the new
leader at once; and every entry's slot runs exactly once in the workers (a
message sent twice is skipped by the ledger: how many were is printed, for
docs/benchmarks.md).

And a stop right after a batch reached the broker (issue 34): 1,000 entries, no worker,
the leader SIGTERMed the moment the queue first grows; every claim of the slot must be on
the broker exactly once (a stopped leader leaves no double send), counted on the queue.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
import redis
from psycopg import sql

from celery_pglock.beat._sending import CONFIRM_BATCH
from tests.acceptance.beat_support import APP, prepared_schema
from tests.apps.harness import app_env
from tests.fixtures.procs import Proc, Procs, children_of, wait_until

# Run alone (serial): 2,000 entries due at once and a worker running them all. Its one bound
# is a guarantee, not a speed: after a leader kill or stop every claimed slot is on the broker
# within pglock_beat_lease + 2 s (docs/guarantees.md, Beat). How fast a whole tick is sent is
# measured in benchmarks/tick.py (docs/benchmarks.md §3).
pytestmark = [pytest.mark.acceptance, pytest.mark.serial]

# PGLOCK_BEAT_SCALE_ENTRIES=10000 for the figures at the scale (docs/benchmarks.md).
ENTRIES = int(os.environ.get("PGLOCK_BEAT_SCALE_ENTRIES", "2000"))
EVERY = 10.0  # seconds between two slots of every entry
LEASE = 5.0  # pglock_beat_lease
MARGIN = 2.0  # seconds on top of the lease: the documented bound, never tuned down
# ... plus the new leader's sending of what the cut-short tick left: the documented
# allowance, 0.5 ms a claim (docs/operations.md; 10,000 entries: 5 s more).
SEND_ALLOWANCE = 0.0005
CELERY = [sys.executable, "-m", "celery", "-A"]
START_TIMEOUT = 90.0  # processes start, a leader is elected, a slot falls due
RUN_TIMEOUT = 120.0 * max(1, ENTRIES // 2000)  # the workers run them (and the slot after)


@dataclass
class Lab:
    dsn: str
    schema: str
    env: dict[str, str]
    procs: Procs
    beats: list[Proc]

    def query(self, text: str, table: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            query = sql.SQL(text).format(sql.Identifier(self.schema, table))
            return conn.execute(query, params).fetchall()

    def claims(self, slot: str | None = None) -> list[tuple[str, int, int, str]]:
        """Per slot (newest first, or ``slot`` only): claims, confirmed ones, a claimer."""
        return [
            (row[0], int(row[1]), int(row[2]), str(row[3]))
            for row in self.query(
                "SELECT slot, count(*), count(sent_at), min(sent_by) FROM {} "
                "WHERE namespace = %(ns)s AND (%(slot)s::text IS NULL OR slot = %(slot)s) "
                "GROUP BY slot ORDER BY slot DESC",
                "pglock_beat_sends",
                {"ns": self.env["TEST_NAMESPACE"], "slot": slot},
            )
        ]

    def executions(self, slot: str) -> Counter[str]:
        """Lock name -> how many times the slot ran under it."""
        rows = self.query(
            "SELECT lock_name FROM {} WHERE slot = %(slot)s", "executions", {"slot": slot}
        )
        return Counter(row[0] for row in rows)

    def skipped(self, slot: str) -> int:
        """Messages of the slot the workers skipped (a duplicate: a double send)."""
        [(count,)] = self.query(
            "SELECT count(*) FROM {} WHERE slot = %(slot)s", "pglock_skips", {"slot": slot}
        )
        return int(count)

    def outcomes(self, slot: str) -> str:
        """What became of the slot's messages, for a failure's message."""
        runs = self.query(
            "SELECT state, count(*) FROM {} WHERE slot = %(slot)s GROUP BY state",
            "pglock_runs",
            {"slot": slot},
        )
        skips = self.query(
            "SELECT reason, count(*) FROM {} WHERE slot = %(slot)s GROUP BY reason",
            "pglock_skips",
            {"slot": slot},
        )
        ran = sum(self.executions(slot).values())
        return f"executions {ran}, ledger rows by state {runs}, skips by reason {skips}"

    def check_alive(self, *, killed: Proc | None = None) -> None:
        for proc in self.procs.started:
            if proc is not killed and proc.returncode is not None:
                raise AssertionError(f"{proc!r} exited:\n{proc.log_tail()}")


def entries_env(
    pg_dsn: str, schema: str, redis_url: str, entries: int, every: float = EVERY
) -> dict[str, str]:
    """The test app's environment with ``entries`` interval entries, all due at once."""
    return app_env(
        pg_dsn=pg_dsn,
        schema=schema,
        broker_url=redis_url,
        TEST_BEAT_ENTRIES=entries,
        TEST_BEAT_ENTRIES_EVERY=every,
        TEST_BEAT_LEASE=LEASE,
    )


@pytest.fixture
def lab(pg_dsn: str, redis_url: str, procs: Procs) -> Iterator[Lab]:
    with prepared_schema(pg_dsn, "scale") as schema:
        env = entries_env(pg_dsn, schema, redis_url, ENTRIES)
        for n in range(2):
            # Niced: on a 2-core machine the workers running the slot's 2,000 tasks would
            # otherwise take most of the CPU the bound is about (beat's sends).
            procs.start(
                [
                    "nice",
                    "-n",
                    "10",
                    *CELERY,
                    APP,
                    "worker",
                    "--pool=solo",
                    "--loglevel=WARNING",
                    f"--hostname=scale{n}-{schema}@%h",
                    "--without-mingle",
                    "--without-gossip",
                    "--without-heartbeat",
                ],
                env=env,
                name=f"worker{n}",
            )
        beats = [
            procs.celery(APP, "beat", "--loglevel=INFO", env=env, name=f"beat{n}") for n in range(2)
        ]
        yield Lab(pg_dsn, schema, env, procs, beats)
        procs.stop_all()


def mid_tick(lab: Lab) -> tuple[str, Proc]:
    """Wait for a tick seen half done: its slot, and the leader sending it."""
    seen_whole: set[str] = set()

    def half_done() -> tuple[str, Proc] | None:
        lab.check_alive()
        for slot, claims, confirmed, sent_by in lab.claims()[:1]:
            if 0 < confirmed < claims:
                pid = int(sent_by.rsplit(":", 1)[1])
                return slot, next(proc for proc in lab.beats if proc.pid == pid)
            seen_whole.add(slot)
        return None

    found = wait_until(half_done, timeout=START_TIMEOUT, interval=0.01, message="a tick half done")
    assert found is not None, seen_whole
    return found


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_every_claim_of_a_tick_cut_short_is_sent_within_the_lease_and_runs_once(
    lab: Lab, fault: signal.Signals
) -> None:
    slot, leader = mid_tick(lab)
    os.kill(leader.pid, fault)
    cut = time.monotonic()

    def all_sent() -> bool:
        [(_, claims, confirmed, _)] = lab.claims(slot)
        return claims == confirmed == ENTRIES

    wait_until(
        all_sent,
        timeout=LEASE + MARGIN + ENTRIES * SEND_ALLOWANCE,
        interval=0.05,
        message="every claim of the slot sent",
    )
    sent_after = time.monotonic() - cut

    def all_ran() -> bool:
        lab.check_alive(killed=leader)
        return len(lab.executions(slot)) == ENTRIES

    try:
        wait_until(all_ran, timeout=RUN_TIMEOUT, interval=0.5, message=f"{ENTRIES} entries run")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; {lab.outcomes(slot)}") from None
    ran = lab.executions(slot)
    twice = {name: n for name, n in ran.items() if n > 1}
    assert not twice, twice
    if fault == signal.SIGTERM:
        assert 0 == leader.wait(LEASE), leader.log_tail()  # a clean stop
    print(
        f"\n{fault.name}: slot {slot}: all {ENTRIES} claims on the broker {sent_after:.2f} s "
        f"after the signal; doubles skipped by the workers so far: {lab.skipped(slot)}"
    )


# Four batches of sending.CONFIRM_BATCH; PGLOCK_BEAT_STOP_ENTRIES=10000 at the scale.
STOP_ENTRIES = int(os.environ.get("PGLOCK_BEAT_STOP_ENTRIES", "1000"))
# Seconds between two slots there: no worker runs them, so the next slot comes sooner.
STOP_EVERY = max(4.0, STOP_ENTRIES / 1000)


@dataclass
class Queue:
    """The lab's broker queue (a Redis list), read without a consumer."""

    client: redis.Redis
    name: str

    def length(self) -> int:
        return int(self.client.llen(self.name))

    def slot_sends(self, slot: str) -> Counter[str]:
        """Entry -> how many of its messages for ``slot`` are on the queue."""
        found: Counter[str] = Counter()
        for raw in self.client.lrange(self.name, 0, -1):
            headers = json.loads(raw)["headers"]
            if headers.get("pglock_slot") == slot:
                found[headers["pglock_entry"]] += 1
        return found

    def first_slot(self) -> str:
        """The slot of the oldest message (kombu pushes left, pops right)."""
        oldest = self.client.lindex(self.name, -1)
        assert oldest is not None
        return str(json.loads(oldest)["headers"]["pglock_slot"])


@pytest.fixture(params=[1, 2], ids=["one-process", "two-senders"])
def unconsumed(
    pg_dsn: str, redis_url: str, procs: Procs, request: pytest.FixtureRequest
) -> Iterator[tuple[Lab, Queue]]:
    """Two beat replicas and 1,000 entries due at once; no worker: the queue keeps all.
    Each beat sends alone, or by two forked senders (``pglock_beat_senders = 2``)."""
    client = redis.Redis.from_url(redis_url)
    with prepared_schema(pg_dsn, "stop") as schema:
        env = entries_env(pg_dsn, schema, redis_url, STOP_ENTRIES, STOP_EVERY)
        env["TEST_BEAT_SENDERS"] = str(request.param)
        beats = [
            procs.celery(APP, "beat", "--loglevel=INFO", env=env, name=f"beat{n}") for n in range(2)
        ]
        try:
            yield Lab(pg_dsn, schema, env, procs, beats), Queue(client, env["TEST_QUEUE"])
        finally:
            procs.stop_all()
            client.delete(env["TEST_QUEUE"])
            client.close()


def test_a_leader_stopped_right_after_a_batch_reached_the_broker_sends_each_claim_once(
    unconsumed: tuple[Lab, Queue],
) -> None:
    """SIGTERM the moment the first batch of a tick lands on the queue: every claim of
    the slot is on the broker within the lease + 2 s (plus 0.5 ms a claim), each exactly once."""
    lab, queue = unconsumed

    def elected() -> Proc | None:
        lab.check_alive()
        return next((p for p in lab.beats if "is now the leader" in p.log_text()), None)

    leader = wait_until(elected, timeout=START_TIMEOUT, interval=0.1, message="a leader")
    assert leader is not None
    [standby] = [proc for proc in lab.beats if proc is not leader]
    assert 0 == queue.length()
    # A tight poll: the window (the batch's replies read, its claims confirmed) is a few ms.
    wait_until(queue.length, timeout=START_TIMEOUT, interval=0.0005, message="a first batch")
    os.kill(leader.pid, signal.SIGTERM)
    cut = time.monotonic()
    slot = queue.first_slot()

    def all_on_broker() -> bool:
        return len(queue.slot_sends(slot)) == STOP_ENTRIES

    bound = LEASE + MARGIN + STOP_ENTRIES * SEND_ALLOWANCE
    wait_until(all_on_broker, timeout=bound, interval=0.05, message="every claim sent")
    sent_after = time.monotonic() - cut
    assert 0 == leader.wait(LEASE), leader.log_tail()  # a clean stop

    def taken_over() -> bool:  # the standby re-sent what was left, then claimed on
        lab.check_alive(killed=leader)
        newest = lab.claims()[0]
        return newest[0] > slot and newest[3].endswith(f":{standby.pid}")

    wait_until(taken_over, timeout=STOP_EVERY + LEASE + MARGIN, message="the standby leading")
    sends = queue.slot_sends(slot)
    doubles = sum(n - 1 for n in sends.values())
    print(
        f"\nSIGTERM after a batch: slot {slot}: all {STOP_ENTRIES} claims on the broker "
        f"{sent_after:.2f} s after the signal; doubles on the queue: {doubles}"
    )
    assert (STOP_ENTRIES, 0) == (len(sends), doubles), {e: n for e, n in sends.items() if n > 1}
    [(_, claims, confirmed, _)] = lab.claims(slot)
    assert STOP_ENTRIES == claims == confirmed


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie no one reaped yet does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("unconsumed", [2], ids=["two-senders"], indirect=True)
def test_a_leader_killed_while_its_senders_send_takes_them_with_it(
    unconsumed: tuple[Lab, Queue],
) -> None:
    """SIGKILL the leader while its two senders are sending: they die with it (none goes
    on sending for a leader that is gone), and the standby, leading, sends every claim of
    the slot; what the senders had on the broker unconfirmed, at most a batch each, is
    there twice (the workers skip those copies)."""
    lab, queue = unconsumed

    def sharing() -> tuple[Proc, set[int]] | None:
        lab.check_alive()
        for beat in lab.beats:
            senders = children_of(beat.pid) if queue.length() else set()
            if senders:
                return beat, senders
        return None

    found = wait_until(sharing, timeout=START_TIMEOUT, interval=0.0005, message="senders")
    assert found is not None
    leader, senders = found
    os.kill(leader.pid, signal.SIGKILL)
    slot = queue.first_slot()
    wait_until(
        lambda: not any(alive(pid) for pid in senders), timeout=LEASE, message="senders gone"
    )

    def all_on_broker() -> bool:
        lab.check_alive(killed=leader)
        return len(queue.slot_sends(slot)) == STOP_ENTRIES

    bound = LEASE + MARGIN + STOP_ENTRIES * SEND_ALLOWANCE
    wait_until(all_on_broker, timeout=bound, interval=0.05, message="every claim sent")
    sends = queue.slot_sends(slot)
    doubles = sum(n - 1 for n in sends.values())
    print(f"\nSIGKILL of a leader sharing its tick: slot {slot}: doubles on the queue: {doubles}")
    assert doubles <= 2 * CONFIRM_BATCH, doubles
    wait_until(lambda: lab.claims(slot)[0][2] == STOP_ENTRIES, timeout=bound, message="confirmed")
