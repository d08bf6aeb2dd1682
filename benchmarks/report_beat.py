"""Report sections for beat: failover side by side with celery-redbeat, and the big tick."""

from __future__ import annotations

import statistics

from benchmarks import failover, tick
from benchmarks.common import Summary, ms, quantile, table
from benchmarks.report import Target


def spread(values: list[float], *, with_max: bool = False) -> str:
    """``median / p95`` (``/ max``) in milliseconds."""
    parts = [statistics.median(values), quantile(values, 0.95)]
    if with_max:
        parts.append(max(values))
    return " / ".join(ms(v) for v in parts)


# -- 2. failover ---------------------------------------------------------------------------


def failover_section(
    series: list[failover.Series], load_text: str
) -> tuple[list[str], list[Target]]:
    rows = []
    targets = []
    for s in series:
        if not s.trials:
            ttl = Summary.of(s.lock_ttl)
            rows.append(
                [
                    s.system,
                    s.config,
                    s.fault,
                    f"{len(s.lock_ttl)}",
                    s.note,
                    f"lock TTL at kill {ttl.text(lambda x: f'{x:,.0f} s')}",
                    "",
                    "",
                ]
            )
            continue
        detected = [t.detected for t in s.trials]
        gaps = [t.gap for t in s.trials]
        rows.append(
            [
                s.system,
                s.config,
                s.fault,
                str(len(s.trials)),
                spread(detected, with_max=True),
                spread(gaps),
                str(sum(t.missed for t in s.trials)),
                str(sum(t.duplicates for t in s.trials)),
            ]
        )
        if s.system == "celery-pglock":
            p95 = quantile(gaps, 0.95)
            if s.fault == "kill":
                targets.append(
                    Target("2. failover after SIGKILL, p95 gap", "< 1 s", ms(p95), p95 < 1.0)
                )
            else:
                lease = float(s.config.split("=")[1].split()[0])
                targets.append(
                    Target(
                        "2. failover after SIGSTOP, p95 gap",
                        f"≤ lease + 1 s = {lease + 1:g} s",
                        ms(p95),
                        p95 <= lease + 1,
                    )
                )
    lines = [
        f"3 replicas, one entry every 1 s; {load_text}.",
        "",
        "*detected*: fault → first send by another replica (median / p95 / max). *gap*: that",
        "send minus (the old leader's last send + 1 s), i.e. time the schedule went unserved",
        "beyond its period (median / p95). *periods missed*: periods with no send between the",
        "old leader's last send and the new one's first (celery-pglock's default",
        '`pglock_beat_catch_up = "none"` does not send them late, like stock beat).',
        "*duplicates*: sends by the frozen replica after it woke.",
        "",
        *table(
            [
                "system",
                "configuration",
                "fault",
                "trials",
                "detected",
                "gap",
                "periods missed",
                "duplicates",
            ],
            rows,
        ),
    ]
    return lines, targets


# -- 3. tick -------------------------------------------------------------------------------

SEND_SPAN_TARGET = 5.0  # seconds: 10,000 entries due at once all sent (issue 28)


def tick_section(result: tick.Result) -> tuple[list[str], list[Target]]:
    rows = []
    targets = []
    for entries in sorted({t.entries for t in result.ticks}):
        runs = [t for t in result.ticks if t.entries == entries]

        def med(part: str, runs: list[tick.Tick] = runs) -> float:
            return statistics.median(getattr(t, part) for t in runs)

        rows.append(
            [
                f"{entries:,}",
                str(len(runs)),
                ms(med("span")),
                ms(med("first_confirmed")),
                ms(med("claim")),
                f"{ms(med('confirm'))} ({med('confirms'):.0f})",
                f"{med('cpu_per_send') * 1e6:,.0f} µs",
            ]
        )
        if entries == 10_000:
            span = med("span")
            targets.append(
                Target(
                    "3. 10,000 entries due at once: all sent and confirmed",
                    f"< {SEND_SPAN_TARGET:g} s",
                    ms(span),
                    span < SEND_SPAN_TARGET,
                )
            )
    lines = [
        "Entries all due at the same instant, one `PgLockScheduler` in-process (leader",
        f"election on), Redis broker; medians; {result.load.text()}.",
        "*span*: tick start to the last confirmation; *first confirmed*: tick start to the",
        "first; *confirm*: time in confirmations (round trips); *CPU per send*: the beat",
        "process's CPU time over the tick per message sent.",
        "",
        *table(
            [
                "entries",
                "runs",
                "span",
                "first confirmed",
                "claim (1 round trip)",
                "confirm (round trips)",
                "CPU per send",
            ],
            rows,
        ),
    ]
    return lines, targets
