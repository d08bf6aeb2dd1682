"""``celery-pglock demo``: the problem and the cure, with real processes, in one command."""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import sys
import tempfile
import traceback
from pathlib import Path
from types import FrameType
from typing import Any

from celery_pglock._dsn import redact
from celery_pglock.demo import _render as render
from celery_pglock.demo import _server as server
from celery_pglock.demo._chaos import MIN_DURATION
from celery_pglock.demo._processes import ProcessFailed
from celery_pglock.demo._progress import Display
from celery_pglock.demo._report import full_report
from celery_pglock.demo._runner import Place, RunRecord, RunSpec, run

EXIT_DOUBLE = 1
EXIT_SETUP = 2
EXIT_CRASH = 3
EXIT_INTERRUPTED = 130


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="celery-pglock demo",
        description="Run real celery beat and worker replicas of a demo app and count how "
        "often each periodic slot runs, with celery-pglock and (--without-lock) without.",
    )
    p.add_argument("--beats", type=_positive_int, default=3, help="celery beat replicas (3)")
    p.add_argument("--workers", type=_positive_int, default=2, help="celery workers (2)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds to measure (30)")
    p.add_argument("--dsn", help="an existing PostgreSQL (default: start an embedded one)")
    p.add_argument("--schema", help="schema for the demo's tables (default: a temporary one)")
    p.add_argument(
        "--broker", help="broker URL, e.g. redis://127.0.0.1:6379/0 (default: PostgreSQL)"
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--without-lock", action="store_true", help="stock Celery, for comparison")
    mode.add_argument("--compare", action="store_true", help="stock Celery, then celery-pglock")
    p.add_argument(
        "--chaos", action="store_true", help="kill the leader beat and a worker, freeze a worker"
    )
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--seed", type=int, help="seed for the faults and redeliveries (random)")
    p.add_argument("--concurrency", type=_positive_int, default=4, help="pool size per worker (4)")
    p.add_argument(
        "--redeliver-every",
        type=float,
        default=3.0,
        metavar="SECONDS",
        help="simulate a broker redelivery this often (3; 0: never)",
    )
    p.add_argument("--keep-logs", action="store_true", help="keep the processes' log files")
    return p


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def specs(args: argparse.Namespace) -> list[RunSpec]:
    modes = [False, True] if args.compare else [not args.without_lock]
    return [
        RunSpec(
            locked=locked,
            beats=args.beats,
            workers=args.workers,
            duration=args.duration,
            concurrency=args.concurrency,
            chaos=args.chaos,
            redeliver_every=args.redeliver_every,
        )
        for locked in modes
    ]


def main(argv: list[str] | None = None) -> int:
    """Run the demo; 0 when no slot ran twice with the lock on, 1 if one did.

    2: it could not start (the message says why), 3: it failed, 130: interrupted.
    """
    args = parser().parse_args(argv)
    problem = _check(args)
    if problem:
        print(f"celery-pglock demo: {problem}", file=sys.stderr)
        return EXIT_SETUP
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    log_dir = Path(tempfile.mkdtemp(prefix="pglock-demo-"))
    previous = _handle_termination()
    try:
        return _run_all(args, seed, log_dir)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_all(args: argparse.Namespace, seed: int, log_dir: Path) -> int:
    status = EXIT_SETUP
    try:
        rng = random.Random(seed)  # noqa: S311 - picks faults to inject, not secrets
        records = _runs(args, rng, log_dir)
        report = full_report(records, seed)
        status = int(report["exit_status"])
        report["logs"] = str(log_dir) if args.keep_logs or status != 0 else None
        _print(report, as_json=args.json)
    except (server.DemoSetupError, ProcessFailed) as exc:
        print(f"celery-pglock demo: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        print("celery-pglock demo: interrupted; every process was stopped", file=sys.stderr)
        status = EXIT_INTERRUPTED
    except Exception:  # noqa: BLE001 - shown in full; exit 1 must keep meaning "ran twice"
        traceback.print_exc()
        print("celery-pglock demo: failed (above); every process was stopped", file=sys.stderr)
        status = EXIT_CRASH
    finally:
        _logs(log_dir, keep=args.keep_logs or status != 0)
    return status


def _runs(args: argparse.Namespace, rng: random.Random, log_dir: Path) -> list[RunRecord]:
    records = []
    with server.postgres(args.dsn) as dsn, server.demo_schema(dsn, args.schema) as schema:
        place = Place(dsn=dsn, schema=schema, broker=args.broker, log_dir=log_dir)
        for spec in specs(args):
            label = "celery-pglock" if spec.locked else "stock Celery"
            with Display(label) as display:
                records.append(run(place, spec, rng, display))
    return records


def _print(report: dict[str, Any], *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report, indent=2))
        return
    console = render.console()
    for run_report in report["runs"]:
        render.print_run(console, run_report)
    if len(report["runs"]) > 1:
        render.print_comparison(console, report["runs"])
    console.print(f"(seed {report['seed']}: --seed {report['seed']} replays the same choices)")


def _check(args: argparse.Namespace) -> str | None:
    if args.duration < 3:
        return "--duration must be at least 3 seconds"
    if args.chaos and args.duration < MIN_DURATION:
        return f"--chaos needs --duration {MIN_DURATION:g} or more (faults are spread over the run)"
    if args.broker is None and not _importable("sqlalchemy"):
        return "the PostgreSQL broker needs SQLAlchemy: pip install 'celery-pglock[demo]'"
    if args.dsn and "://" not in args.dsn and "=" not in args.dsn:
        return f"--dsn {redact(args.dsn)!r} is not a PostgreSQL URL or key=value string"
    return None


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def _handle_termination() -> Any:
    """SIGTERM and SIGHUP stop the demo like Ctrl-C: every process is stopped on the way out."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGHUP, interrupt)
    return signal.signal(signal.SIGTERM, interrupt)


def _logs(log_dir: Path, *, keep: bool) -> None:
    if keep:
        print(f"celery-pglock demo: process logs are in {log_dir}", file=sys.stderr)
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
