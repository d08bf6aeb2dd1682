"""Beat's statements on the ledger (``sql/beat_queries.sql``): claim the due slots, confirm
the ones sent, find claims never confirmed, and close the rows dead attempts left running.

Each replica claims before it sends and sends only what it claimed, so a slot goes out
once however many replicas tick. Statements run through the scheduler's ``run_query``: on
the leader's own connection in leader mode, so that a replica whose session was ended
(frozen past its lease, partitioned) cannot claim, and so cannot send.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, NamedTuple

from celery_pglock import _slots as slots
from celery_pglock._keys import lock_key
from celery_pglock._ledger import RunQuery, sweep_orphans
from celery_pglock.beat._planner import Due
from celery_pglock.beat._settings import BeatSettings
from celery_pglock.errors import DatabaseError
from celery_pglock.store.statements import Row

logger = logging.getLogger("celery_pglock.beat")


class Claimed(NamedTuple):
    send: set[tuple[str, str]]  # (entry, slot) this replica claimed and sends
    paused: set[tuple[str, str]]  # claimed for a paused entry: recorded, never sent


RESEND_HORIZON = 86400.0  # seconds: older unconfirmed claims are not re-sent
RESEND_LIMIT = 1000  # unconfirmed claims taken over per statement
DEADLOCK_DETECTED = "40P01"  # SQLSTATE
# The fence of a leader on rows (``_row_leader``), which fills it in: none elsewhere.
NO_FENCE = {"leader_key": None, "term": None}


class BeatClaims:
    """The ledger as one beat replica sees it."""

    def __init__(self, settings: BeatSettings, run_query: RunQuery) -> None:
        self.settings = settings
        self._run_query = run_query

    def last_slots_sent(self) -> dict[str, str]:
        """The last slot sent of each entry of this namespace, by any replica."""
        rows = self._run_query("beat_state", {"namespace": self.settings.namespace})
        return {row["entry"]: row["last_slot"] for row in rows if row["last_slot"]}

    def claim(self, due: list[Due]) -> Claimed:
        """Claim ``due`` in one round trip: the (entry, slot) pairs this replica may send,
        and those it claimed for a paused entry (recorded, not to be sent)."""
        # One order for every replica: the schedule's order is a set's (per process hash
        # seed), and two replicas inserting the same claims in opposite orders deadlock.
        due = sorted(due, key=_claim_order)
        rows = self._claim_rows(
            {
                "namespace": self.settings.namespace,
                "replica": self.settings.replica,
                "entries": [d.entry.name for d in due],
                "slots": [d.slot for d in due],
                "lock_names": [d.lock_name for d in due],
                "keys": [lock_key(d.lock_name) for d in due],
                "tasks": [d.entry.task for d in due],
                # A stored entry may be disabled: its slots are then recorded paused.
                "stored": [bool(getattr(d.entry, "stored", False)) for d in due],
                **NO_FENCE,
            },
        )
        return Claimed(
            send={(row["entry"], row["slot"]) for row in rows if not row["paused"]},
            paused={(row["entry"], row["slot"]) for row in rows if row["paused"]},
        )

    def _claim_rows(self, params: dict[str, Any]) -> list[Row]:
        """``beat_claim``, made once more when PostgreSQL chose it as a deadlock's victim
        (active-active: another replica's claim of the same slots). It was rolled back
        whole, so the second one takes what the other left: a deadlock is no outage. The
        statement inserts in (entry, slot) order, which makes one unlikely."""
        try:
            return self._run_query("beat_claim", params)
        except DatabaseError as exc:
            if exc.sqlstate != DEADLOCK_DETECTED:
                raise
            logger.info(
                "beat claim deadlocked with another replica's; claiming again",
                extra={"action": "pglock_beat_claim_deadlock"},
            )
        return self._run_query("beat_claim", params)

    def confirm(self, sent: Iterable[Due]) -> None:
        """Record these claims as sent (a claim never confirmed is re-sent)."""
        sent = sorted(sent, key=_claim_order)  # rows updated in the claims' order
        if not sent:
            return
        run_at = {slot: slots.parse_slot(slot) for slot in {d.slot for d in sent}}  # a few
        self._run_query(
            "beat_confirm",
            {
                "namespace": self.settings.namespace,
                "entries": [d.entry.name for d in sent],
                "slots": [d.slot for d in sent],
                "run_ats": [run_at[d.slot] for d in sent],
            },
        )

    def unconfirmed(self, *, at_once: bool = False) -> list[tuple[str, str]]:
        """(entry, slot) claims whose sender died or stopped between claim and
        confirmation, taken over by this replica (at most ``RESEND_LIMIT``): those older
        than ``pglock_beat_resend_after``, or, ``at_once`` (a new leader: whoever claimed
        them no longer leads), all of them."""
        rows = self._run_query(
            "beat_unsent",
            {
                "namespace": self.settings.namespace,
                "replica": self.settings.replica,
                "after": 0.0 if at_once else self.settings.resend_after,
                "horizon": RESEND_HORIZON,
                "limit": RESEND_LIMIT,
                **NO_FENCE,
            },
        )
        return [(row["entry"], row["slot"]) for row in rows]

    def sweep_orphans(self) -> None:
        """Record failed the ledger rows a dead attempt left running (they are final then)."""
        sweep_orphans(self._run_query)


def _claim_order(item: Due) -> tuple[str, str]:
    return (item.entry.name, item.slot)
