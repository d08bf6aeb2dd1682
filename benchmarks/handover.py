"""Lock handover: how soon a waiter gets the lock after its holder lets go or dies.

A holder process takes ``advisory_lock(name)``; a waiter in this process calls
``advisory_lock(name, wait=True)`` and queues in the server's lock queue. Then the holder
either leaves its ``with`` block (*released*: the time is the holder's, taken just before
it lets go; ``CLOCK_MONOTONIC`` is one clock for every process of the machine) or is
SIGKILLed (*killed*: the time is taken just before the signal). Measured: that moment to
the waiter's grant. Both cases alternate within one run, so their ratio says what a death
costs beside a clean release on the same machine at the same load.

``tests/integration/test_standalone.py`` asserts the behaviour (the waiter is queued in
the server, the kill frees it); this module measures the speed, which a test must not.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from benchmarks import common
from celery_pglock import advisory_lock, lock_key
from celery_pglock._keys import split_key
from celery_pglock.store._database import close_all

CASES = ("released", "killed")
TRIALS = 20

# argv: dsn schema name go. Holds the lock until ``go`` exists, then lets go.
HOLDER = """
import sys, time
from pathlib import Path
from celery_pglock import advisory_lock
dsn, schema, name, go = sys.argv[1:5]
with advisory_lock(name, dsn=dsn, schema=schema) as lock:
    assert lock.acquired, lock.skip
    print("HELD", flush=True)
    while not Path(go).exists():
        time.sleep(0.001)
    print("RELEASING", time.monotonic(), flush=True)
"""

WAITERS = (
    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
    "AND objsubid = 1 AND classid = %s::bigint::oid AND objid = %s::bigint::oid"
)


@dataclass
class Result:
    seconds: dict[str, list[float]]  # case -> let go (or killed) to granted, per trial
    load: common.LoadWindow


def read_line(proc: subprocess.Popen[str], prefix: str) -> str:
    """The holder's next line starting with ``prefix`` (its other lines are skipped)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(prefix):
            return line
    raise RuntimeError(f"the holder ended before saying {prefix!r}")


def trial(dsn: str, schema: str, case: str, workdir: Path) -> float:
    """One handover of a fresh lock name: seconds from the holder's end to the grant."""
    name, go = f"{schema}:handover-{uuid.uuid4().hex[:8]}", workdir / uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": str(common.ROOT)}
    args = [sys.executable, "-c", HOLDER, dsn, schema, name, str(go)]
    holder = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env)
    try:
        read_line(holder, "HELD")
        granted: list[float] = []

        def wait() -> None:
            with advisory_lock(name, dsn=dsn, schema=schema, wait=True, timeout=30) as lock:
                granted.append(time.monotonic())
                assert lock.acquired, lock.skip

        waiter = threading.Thread(target=wait)
        waiter.start()
        with psycopg.connect(dsn, autocommit=True) as conn:
            common.wait_for(lambda: queued(conn, name), 20, "the waiter in the lock queue")
        if case == "killed":
            let_go = time.monotonic()
            holder.send_signal(signal.SIGKILL)
        else:
            go.touch()
            let_go = float(read_line(holder, "RELEASING").split()[1])
        waiter.join()
        return granted[0] - let_go
    finally:
        holder.kill()
        holder.wait()


def queued(conn: psycopg.Connection[Any], name: str) -> bool:
    row = conn.execute(WAITERS, split_key(lock_key(name))).fetchone()
    return bool(row and row[0])


def run(dsn: str, trials: int = TRIALS) -> Result:
    load = common.LoadWindow()
    seconds: dict[str, list[float]] = {case: [] for case in CASES}
    with common.private_schema(dsn, "handover") as schema, tempfile.TemporaryDirectory() as tmp:
        for i in range(trials):
            for case in common.rotate_list(CASES, i):
                seconds[case].append(trial(dsn, schema, case, Path(tmp)))
        close_all()
    load.close()
    return Result(seconds, load)


def section(result: Result) -> tuple[list[str], list[Any]]:
    rows = []
    released = common.Summary.of(result.seconds["released"]).median
    for case in CASES:
        summary = common.Summary.of(result.seconds[case])
        rows.append(
            [
                case,
                str(len(result.seconds[case])),
                common.ms(summary.median),
                common.ms(common.quantile(result.seconds[case], 0.95)),
                common.ms(max(result.seconds[case])),
                common.ratio(summary.median / released),
            ]
        )
    header = ["holder", "trials", "median", "p95", "max", "median vs released"]
    lines = [
        f"A waiter queued in `advisory_lock(wait=True)`; the holder process leaves its block "
        f"or is SIGKILLed; time to the waiter's grant. The cases alternate; {result.load.text()}.",
        "",
        *common.table(header, rows),
    ]
    return lines, []


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.handover")
    parser.add_argument("--trials", type=int, default=TRIALS)
    args = parser.parse_args(argv)
    with common.postgres() as dsn:
        lines, _ = section(run(dsn, args.trials))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
