"""Turn measurements into ``docs/benchmarks.md``: tables, and each figure against its target."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from benchmarks import overhead
from benchmarks.common import DASH, TIMES, Summary, Target, ratio, table, us

AT_MOST_FLOOR = f"\N{LESS-THAN OR EQUAL TO} 1.3{TIMES}"
AT_MOST_ONCE = f"\N{LESS-THAN OR EQUAL TO} 1.0{TIMES}"


def targets_table(targets: Sequence[Target]) -> list[str]:
    return table(["measure", "target", "result", ""], [t.row() for t in targets])


# -- 1. per-task overhead ------------------------------------------------------------------

LABELS = {
    "plain": "plain `Task`",
    "session_mutex": "PgLockTask, session, no slot (mutex only)",
    "session_slot": "PgLockTask, session, slot (ledger)",
    "transaction_slot": "PgLockTask, transaction scope, slot",
    "once": "celery-once `QueueOnce`",
    "singleton": "celery-singleton `Singleton`",
    "floor_mutex": "floor: our mutex statements, bare",
    "floor_slot": "floor: our ledger statements, bare",
    "floor_transaction": "floor: our transaction-scope statements, bare",
    "floor_minimal": "floor: `pg_try_advisory_lock` + `pg_advisory_unlock`",
}


def overhead_section(result: overhead.Result) -> tuple[list[str], list[Target]]:
    rows = []
    for name in overhead.TIMED:
        trips = result.trips.get(name)
        rows.append(
            [
                LABELS[name],
                Summary.of(result.values("service", name)).text(us),
                Summary.of(result.values("publish", name)).text(us),
                Summary.of(result.values("drain", name)).text(us),
                Summary.of(result.values("total_extra", name)).text(us) if name != "plain" else "",
                Summary.of(result.values("cpu", name)).text(us),
                Summary.of(result.values("cpu_extra", name)).text(us) if name != "plain" else "",
                _waited(trips) if trips else "",
            ]
        )
    pairs, targets = _overhead_pairs(result)
    n = len(result.rounds)
    lines = [
        f"{n} rounds {TIMES} {result.per_batch} tasks per contender "
        f"({n * result.per_batch:,} each), contenders interleaved in an order rotated "
        f"every round; {result.load.text()}.",
        "",
        f"Per task; median over rounds of each round's median (min{DASH}max over rounds).",
        "*service*: `task_prerun` → `task_postrun` in the worker process. *publish*: the",
        "harness publishing. *drain*: batch wall time / tasks with 2 processes (broker and",
        "acks included). *extra*: service above plain, plus publish above the median publish",
        "of the contenders that do nothing at publish, in the same round. *CPU*: CPU time per",
        "task of the worker processes, their PostgreSQL sessions and the publishing thread",
        "(`/proc/*/schedstat`), much less sensitive to the other tenants' load than wall time.",
        "The Redis server's CPU is shown apart and left out of the total: other tenants share",
        "that server, so its CPU cannot be attributed to one contender.",
        "",
        *table(
            [
                "contender",
                "service",
                "publish",
                "drain",
                "extra",
                "CPU",
                "CPU extra",
                "waited round trips",
            ],
            rows,
        ),
        "",
        *_cpu_breakdown(result),
        "",
        f"Ratios per pair, computed within each round (median, min{DASH}max over rounds):",
        "",
        *table(["pair", "measure", "ratio", "target"], pairs),
        "",
        *_harness_floor(result),
        "",
        *_trip_breakdown(result),
        "",
        *NOTES,
    ]
    return lines, targets


def _overhead_pairs(result: overhead.Result) -> tuple[list[list[str]], list[Target]]:
    rows = []
    targets = []
    for ours, floor in overhead.FLOOR_OF.items():
        values = Summary.of(result.floor_ratio(ours))
        rows.append(
            [f"{ours} / {floor}", "extra service time vs plain", values.text(ratio), AT_MOST_FLOOR]
        )
        targets.append(
            Target(
                f"1. {ours}: extra time / floor",
                AT_MOST_FLOOR,
                values.text(ratio),
                values.median <= 1.3,
            )
        )
    for rival in ("once", "singleton"):
        for metric, label in (("total_extra", "extra time"), ("cpu_extra", "extra CPU")):
            per_round = [
                getattr(r, metric)("session_mutex") / getattr(r, metric)(rival)
                for r in result.rounds
            ]
            values = Summary.of(per_round)
            target = AT_MOST_ONCE if rival == "once" else ""
            rows.append([f"session_mutex / {rival}", label, values.text(ratio), target])
            if rival == "once":
                targets.append(
                    Target(
                        f"1. mutex-only vs celery-once ({label} per task)",
                        AT_MOST_ONCE,
                        values.text(ratio),
                        values.median <= 1.0,
                    )
                )
    for name in ("session_mutex", "session_slot", "transaction_slot", "once", "singleton"):
        values = Summary.of(result.pair(name, "plain", "drain"))
        rows.append([f"{name} / plain", "drain (throughput)", values.text(ratio), ""])
    return rows, targets


def _cpu_breakdown(result: overhead.Result) -> list[str]:
    rows = []
    for name in overhead.TIMED:
        parts = [
            statistics.median(r.batches[name].cpu[part] / r.batches[name].n for r in result.rounds)
            - statistics.median(
                r.batches["plain"].cpu[part] / r.batches["plain"].n for r in result.rounds
            )
            for part in overhead.CPU_PARTS
        ]
        rows.append([LABELS[name], *(us(v) for v in parts)])
    return [
        "Where the extra CPU goes (median per task above plain):",
        "",
        *table(["contender", *overhead.CPU_PARTS], rows),
    ]


def _harness_floor(result: overhead.Result) -> list[str]:
    rows = [
        [LABELS[name], Summary.of(values).text(us)] for name, values in result.harness_floor.items()
    ]
    return [
        "The floor statements run serially from one connection in the harness (no Celery, no",
        "concurrency; 3 repetitions):",
        "",
        *table(["floor", "per task"], rows),
    ]


NOTES = [
    "Reading these numbers:",
    "",
    "- *Against the floor.* Our extra time is close to that of our own statements issued",
    "  bare: the Python around them (claim, key hash, pool, heartbeat, signals) is a small",
    "  share; the round trips and the server work in them are the cost.",
    "- *Mutex only against celery-once.* celery-once sets its Redis key when the task is",
    "  *published* and deletes it after the run: one Redis round trip in the worker, one in",
    "  the publisher (measured here while the worker is idle). We take the advisory lock in",
    "  the worker, one waited PostgreSQL round trip, and free it with a statement sent",
    "  without waiting for its reply (read when the connection is next used; see",
    "  docs/guarantees.md). That one statement also takes a fencing token, arms the lease",
    "  (`idle_session_timeout`), labels the session (`application_name`) and writes the",
    "  holder row (`celery pglock status`, SKIPPED meta): the CPU breakdown shows the",
    "  difference in CPU is PostgreSQL backend time, which a Redis `SET`/`DEL` does not",
    "  spend. celery-once also promises less: its key expires (default 1 h) or is deleted",
    "  after a failure, and it does not dedupe a redelivered message or a duplicate sent",
    "  after the run.",
    "- *Round trips.* Session scope waits for the minimum: one round trip without a slot",
    "  (the release is not waited for), two with a slot (`acquire`: lock, token, lease,",
    "  holder and ledger claim in one statement; `release`: outcome and unlock in one,",
    "  waited, because the outcome must be in the ledger before the message is",
    "  acknowledged). Transaction scope makes four: psycopg sends `BEGIN` before the first",
    "  statement of a transaction and `COMMIT` as round trips of their own. Two would need",
    "  `BEGIN` folded into `acquire` and `COMMIT` into `release` (an autocommit connection",
    "  opening the transaction itself, in a pipeline), which changes what the task's",
    "  `self.pglock.connection` looks like to its body; not done.",
    "- *One connection per process.* psycopg_pool hands out idle connections first in,",
    "  first out; a process that had opened two alternated between two server processes,",
    "  15% slower per run. A process now reuses the connection it gave back last",
    "  (`celery_pglock/store/_pool.py`, which has since replaced psycopg_pool).",
]


def _trip_breakdown(result: overhead.Result) -> list[str]:
    rows = []
    for name, trips in result.trips.items():
        carried = "; ".join(f"{label} {TIMES}{count:.2f}" for label, count in trips.items())
        minimum = overhead.MINIMUM_TRIPS.get(name, 2)
        rows.append([name, f"{sum(trips.values()):.2f}", _waited(trips), str(minimum), carried])
    return [
        "Round trips per task, counted by a proxy that reads the protocol (untimed pass).",
        "*waited*: those the task waits for; a mutex-only release is sent and its reply read",
        "when the connection is next used (`SELECT pg_advisory_unlock_all(), set_config…`).",
        "",
        *table(["contender", "round trips", "waited", "minimum waited", "what each carried"], rows),
    ]


def _waited(trips: dict[str, float]) -> str:
    unwaited = sum(n for label, n in trips.items() if label.startswith(overhead.UNWAITED_LABEL))
    return f"{sum(trips.values()) - unwaited:.2f}"
