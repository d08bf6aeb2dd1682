"""Short chaos campaigns, one per way of electing beat's leader: two with fixed seeds
(active-active; on rows, behind PgBouncer), and the advisory leader's with seed 4242, or
with a seed of your choice.

Each campaign starts its own PostgreSQL, Redis and PgBouncer on loopback ports, injects
the faults its seed draws for ``SECONDS`` seconds, goes quiet, drains and checks every
invariant (see ``tests/chaos/invariants.py``). ``PGLOCK_CHAOS_SEED=N`` (or ``random``)
runs the advisory leader's campaign with that seed, printed in the test id and the output
(CI draws one):

    PGLOCK_CHAOS_SEED=random make test-chaos

They are left out of ``make test`` (three minutes on 2 cores); CI runs them after it.

A campaign whose only violations are evidence of a known, reported library defect (see
``invariants.KNOWN_DEFECTS`` and ``test_regressions.py``) is an expected failure, so the
known defect is shown and any other violation still fails.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

import pytest

from celery_pglock.testing.embedded import EmbeddedPostgresError
from tests.chaos import invariants
from tests.chaos.campaign import Campaign, Options
from tests.fixtures.redis_server import RedisUnavailable
from tests.fixtures.services import required_services, unavailable

pytestmark = [pytest.mark.chaos, pytest.mark.campaign]

SECONDS = 30.0  # of faults per campaign: three of them take about three minutes on 2 cores
QUIET = 12.0  # seconds: beyond the beat leader's 10-s sweep of abandoned rows
# One campaign per way of electing: active-active; the leader on rows, every process
# through PgBouncer's transaction pooling (seed 2612 found D11 and D12); the leader on an
# advisory lock is the chosen seed's (CI draws one every run), so .ci/run stays within its
# 20 minutes (the leader seed 4242 ran here until issue 35).
FIXED = [
    pytest.param(1717, True, False, id="active-active-seed-1717"),
    pytest.param(2612, False, True, id="pooled-seed-2612"),
]


def chosen() -> list[object]:
    raw = os.environ.get("PGLOCK_CHAOS_SEED", "").strip()
    if not raw:  # the leader on an advisory lock, fixed, when none is chosen
        return [pytest.param(4242, False, False, id="leader-seed-4242")]
    seed = secrets.randbelow(1_000_000) if raw == "random" else int(raw)
    return [pytest.param(seed, False, False, id=f"chosen-seed-{seed}")]


def run_campaign(seed: int, active_active: bool, pooled: bool, workdir: Path) -> None:
    if shutil.which("pgbouncer") is None and "pgbouncer" in required_services():
        pytest.fail("pgbouncer is not installed but PGLOCK_TEST_REQUIRE lists it", pytrace=False)
    lines: list[str] = []
    options = Options(
        seed=seed,
        seconds=SECONDS,
        quiet=QUIET,
        active_active=active_active,
        pooled=pooled,
        workdir=workdir,
        out=lines.append,
    )
    try:
        outcome = Campaign(options).run()
    except RedisUnavailable as exc:
        unavailable("redis", str(exc))
    except EmbeddedPostgresError as exc:
        unavailable("postgres", f"embedded server unavailable: {exc}")
    print("\n".join(lines))
    report = "\n".join(lines)
    assert [] == [str(v) for v in outcome.unknown_violations], report
    if outcome.violations:
        names = sorted({d.name for v in outcome.violations if (d := invariants.known_defect(v))})
        pytest.xfail(f"seed {seed}: only known defects {names} showed: {outcome.last_line}")


@pytest.mark.parametrize(("seed", "active_active", "pooled"), FIXED + chosen())
def test_a_campaign_keeps_every_promise(
    seed: int, active_active: bool, pooled: bool, tmp_path: Path
) -> None:
    """A short campaign with this seed (faults mixed at random) ends with 0 violations."""
    run_campaign(seed, active_active, pooled, tmp_path)
