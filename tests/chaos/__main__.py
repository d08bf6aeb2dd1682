"""``python -m tests.chaos``: run one chaos campaign; exit 1 on any violation.

Options: ``--seed N`` (default: a random one, printed), ``--seconds S`` of faults (120),
``--quiet Q`` seconds without faults before the checks (15), ``--active-active`` (every
beat replica sends, ``pglock_beat_leader = False``), ``--workdir DIR`` (logs and
``report.json``; default a new directory under the system's temporary directory). The
same seed replays the same fault schedule.
"""

from __future__ import annotations

import argparse
import secrets
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import NoReturn

from tests.chaos.campaign import Campaign, Options


def _interrupt(signum: int, frame: FrameType | None) -> NoReturn:
    # SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C, so every process gets stopped.
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    parser.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    parser.add_argument("--seconds", type=float, default=120.0, help="length of the fault phase")
    parser.add_argument("--quiet", type=float, default=15.0, help="quiet period before checks")
    parser.add_argument("--active-active", action="store_true", help="pglock_beat_leader=False")
    parser.add_argument(
        "--pooled", action="store_true", help="every process through PgBouncer (locks on rows)"
    )
    parser.add_argument("--workdir", type=Path, default=None, help="logs and report.json")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else secrets.randbelow(1_000_000)
    signal.signal(signal.SIGTERM, _interrupt)
    options = Options(
        seed=seed,
        seconds=args.seconds,
        quiet=args.quiet,
        active_active=args.active_active,
        pooled=args.pooled,
        workdir=args.workdir,
        out=lambda line: print(line, flush=True),
    )
    outcome = Campaign(options).run()
    return 1 if outcome.violations else 0


if __name__ == "__main__":
    sys.exit(main())
