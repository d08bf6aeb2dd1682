"""Scratch (to be removed): D1 behind PgBouncer."""

from __future__ import annotations

import psycopg
import pytest

from celery_pglock.embedded import EmbeddedPostgres
from tests.chaos.test_regressions import DEADLINE, SLOT, holder_backend
from tests.faults.pgbouncer import PgBouncer
from tests.faults.workload import Workload
from tests.fixtures.procs import Procs, wait_until

pytestmark = pytest.mark.chaos


def test_scratch(private_pg: EmbeddedPostgres, procs: Procs, redis_url: str) -> None:
    """Scratch."""
    bouncer = PgBouncer(private_pg.dsn, procs.log_dir / "pgbouncer.log")
    try:
        w = Workload(name="txb", admin_dsn=private_pg.dsn, app_dsn=bouncer.dsn_for("tx"),
                     redis_url=redis_url, procs=procs)
        w.prepare()
        worker = w.worker("tx", concurrency=1)
        gate, key = w.gate(), w.key("tx")
        [sent] = w.send(key, slot=SLOT, task="faults.job_tx", gate=str(gate))
        wait_until(lambda: holder_backend(private_pg.dsn, sent.lock), timeout=DEADLINE,
                   message="held")
        private_pg.restart("fast")
        gate.touch()
        w.settle([sent])
        rows = [(r["slot"], r["state"]) for r in w.ledger() if r["lock_name"] == sent.lock]
        print("STATE", sent.result.state, repr(sent.result.result), rows)
        print("\n".join(l for l in worker.log_text().splitlines() if "could not record" in l or "Error" in l)[-3000:])
    finally:
        bouncer.stop()
