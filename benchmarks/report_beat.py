"""Report sections for beat: failover side by side with celery-redbeat, and the big tick."""

from __future__ import annotations

import math
import statistics

from benchmarks import failover, tick
from benchmarks.common import Summary, ms, quantile, ratio, table
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


def tick_section(result: tick.Result) -> tuple[list[str], list[Target]]:
    def med(kind: list[dict[str, float]], part: str) -> float:
        values = [r[part] for r in kind if part in r]
        return statistics.median(values) if values else math.nan

    p = result.pglock
    rows = [
        [
            f"PgLockScheduler, one tick ({len(p)} runs)",
            ms(med(p, "total")),
            ms(med(p, "due")),
            ms(med(p, "claim")),
            ms(med(p, "publish")),
            ms(med(p, "confirm")),
        ],
        [
            f"stock Scheduler, {result.entries:,} ticks ({len(result.stock)} run)",
            ms(med(result.stock, "total")),
            "",
            "",
            "",
            "",
        ],
    ]
    guard = med(p, "claim") + med(p, "confirm")
    sends = med(p, "publish")
    target = Target(
        "3. 10,000-entry tick: claim + confirm vs publish",
        "claims < sends",
        f"{ms(guard)} vs {ms(sends)} ({ratio(guard / sends)})",
        guard < sends,
    )
    lines = [
        f"{result.entries:,} entries due at the same instant, Redis broker; {result.load.text()}.",
        "",
        *table(
            [
                "scheduler",
                "total",
                "due",
                "claim (1 round trip)",
                "publish",
                "confirm (1 round trip)",
            ],
            rows,
        ),
    ]
    return lines, [target]
