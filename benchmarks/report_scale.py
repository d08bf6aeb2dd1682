"""Report sections for ledger scale, contention, and connections and memory."""

from __future__ import annotations

import math
import statistics

from benchmarks import contention, ledger_scale, resources
from benchmarks.common import TIMES, ms, quantile, ratio, table
from benchmarks.report import Target

# -- 4. ledger -----------------------------------------------------------------------------


def ledger_section(result: ledger_scale.Result) -> tuple[list[str], list[Target]]:
    rows = []
    targets = []
    for kind in ledger_scale.KINDS:
        empty = result.latencies[(result.sizes[0], kind)]
        for size in result.sizes:
            values = result.latencies[(size, kind)]
            r_med = statistics.median(values) / statistics.median(empty)
            r_p99 = quantile(values, 0.99) / quantile(empty, 0.99)
            rows.append(
                [
                    kind,
                    f"{size:,}",
                    f"{result.table_bytes[size] / 1e6:,.0f} MB",
                    f"{result.fill_seconds[size]:,.0f} s",
                    str(len(values)),
                    ms(statistics.median(values)),
                    ms(quantile(values, 0.99)),
                    ms(max(values)),
                    ratio(r_med),
                    ratio(r_p99),
                ]
            )
            if size:
                targets.append(
                    Target(
                        f"4. claim latency ({kind}), {size:,} rows / empty (median)",
                        f"\N{LESS-THAN OR EQUAL TO} 1.2{TIMES}",
                        ratio(r_med),
                        r_med <= 1.2,
                    )
                )
    before, during = result.before_prune, result.during_prune
    prune_rows = (
        [
            [
                "before the prune",
                str(len(before)),
                ms(statistics.median(before)),
                ms(quantile(before, 0.99)),
                ms(max(before)),
            ],
            [
                "during the prune",
                str(len(during)),
                ms(statistics.median(during)),
                ms(quantile(during, 0.99)),
                ms(max(during)),
            ],
        ]
        if before and during
        else []
    )
    worst = max(during) if during else math.nan
    targets.append(
        Target(
            "4. claims during a prune of the ledger",
            "not blocked",
            f"max claim {ms(worst)} while deleting {result.pruned_rows:,} rows "
            f"in {result.prune_seconds:.1f} s",
            bool(during) and worst < 1.0,
        )
    )
    lines = [
        "A claim = `acquire` + `release` of a new slot through our code (session scope, "
        "lease armed), "
        f"interleaved across the schemas; {result.load.text()}.",
        "",
        *table(
            [
                "claim",
                "ledger rows",
                "table + indexes",
                "fill",
                "claims",
                "median",
                "p99",
                "max",
                "median / empty",
                "p99 / empty",
            ],
            rows,
        ),
        "",
        "Before the CASE in `acquire` (coalescing look-up), a ledger with statistics made",
        "PostgreSQL plan `acquire` afresh on every claim: 1.19-1.20x at 1 M and 10 M rows for a",
        "caller's slot, 1.34x at 1 M for a beat slot. It now keeps its generic plan.",
        "",
        f"`retention.prune` (batches of 1,000, `SKIP LOCKED`) deleting {result.pruned_rows:,} "
        f"rows in {result.prune_seconds:.1f} s from another process, while this process keeps "
        "claiming on the same table:",
        "",
        *table(["claims", "n", "median", "p99", "max"], prune_rows),
    ]
    return lines, targets


# -- 5. contention -------------------------------------------------------------------------


def contention_section(result: contention.Result) -> tuple[list[str], list[Target]]:
    rows = []
    for number, t in enumerate(result.trials, 1):
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(t.reasons.items()))
        rows.append(
            [
                str(number),
                str(t.runs),
                str(t.skips),
                f"{t.ledger_attempts} / {t.ledger_state}",
                f"{t.logged_skips} ({reasons})",
                ms(quantile(t.decisions, 0.99)),
            ]
        )
    decisions = result.decisions
    exact = all(
        t.runs == 1 and t.ledger_attempts == 1 and t.ledger_state == "succeeded"
        for t in result.trials
    )
    p99 = quantile(decisions, 0.99)
    targets = [
        Target(
            "5. 64 deliveries of one slot, 4 processes",
            "exactly 1 run",
            f"{sum(t.runs for t in result.trials)} runs in {len(result.trials)} trials",
            exact,
        ),
        Target(
            "5. time to the SKIPPED decision, p99",
            "(reported)",
            f"{ms(p99)} (median {ms(statistics.median(decisions))})",
            None if not decisions else True,
        ),
    ]
    lines = [
        "`celery worker -c 4`, 64 messages with one slot per trial, body 50 ms; "
        f"{result.load.text()}.",
        "Decision time: `task_prerun` → `task_skipped` signal (after SKIPPED is stored in Redis).",
        "",
        f"All {len(decisions)} skip decisions: median {ms(statistics.median(decisions))}, "
        f"p99 {ms(p99)}, max {ms(max(decisions))}.",
        "",
        *table(
            [
                "trial",
                "bodies run",
                "skips",
                "ledger attempts / state",
                "skips logged (reasons)",
                "p99 decision",
            ],
            rows,
        ),
    ]
    return lines, targets


# -- 6. resources --------------------------------------------------------------------------


def resources_section(result: resources.Result) -> tuple[list[str], list[Target]]:
    expected_worker = result.concurrency
    expected_beat = result.beat_replicas
    rss_rows = [
        [
            str(pid),
            f"{result.rss_start.get(pid, 0) / 1024:.1f} MiB",
            f"{result.rss_end.get(pid, 0) / 1024:.1f} MiB",
            f"{(result.rss_end.get(pid, 0) - result.rss_start.get(pid, 0)):+,} KiB",
        ]
        for pid in result.rss_start
    ]
    growth = max((result.rss_end.get(p, 0) - v for p, v in result.rss_start.items()), default=0)
    ok = result.peak_worker <= expected_worker and result.peak_beat <= expected_beat
    targets = [
        Target(
            "6. peak PostgreSQL connections (worker c=2 + 2 beat replicas)",
            f"{expected_worker} + {expected_beat}",
            f"{result.peak_worker} + {result.peak_beat}",
            ok,
        ),
        Target(
            "6. connections left after stop", "0", str(result.after_stop), result.after_stop == 0
        ),
        Target(
            f"6. worker RSS over {result.tasks:,} tasks",
            "flat",
            f"max growth {growth:+,} KiB per process",
            growth < 2048,
        ),
    ]
    lines = [
        f"`celery worker -c 2` running {result.tasks:,} `session_slot` tasks, and "
        f"{result.beat_replicas} `celery beat` replicas (`PgLockScheduler`) beside it; sampled "
        f"every 50 ms; {result.load.text()}.",
        "",
        *table(
            ["connections", "expected", "peak", "idle after the run", "after stop"],
            [
                [
                    "worker (pool of each process)",
                    str(expected_worker),
                    str(result.peak_worker),
                    str(result.idle_after),
                    "",
                ],
                [
                    "beat replicas (leader + standby)",
                    str(expected_beat),
                    str(result.peak_beat),
                    "",
                    "",
                ],
                ["all of them", "", "", "", str(result.after_stop)],
            ],
        ),
        "",
        *table(
            ["worker process", "RSS after warm-up", f"RSS after {result.tasks:,} tasks", "growth"],
            rss_rows,
        ),
    ]
    return lines, targets
