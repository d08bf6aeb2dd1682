"""``python -m celery_pglock …``: the console script (``celery-pglock``), or just the demo."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def _console() -> Callable[[list[str]], Any] | None:
    """The ``celery-pglock`` console script's ``main``, when the CLI package is installed."""
    try:
        module = importlib.import_module("celery_pglock.cli.console")
    except ModuleNotFoundError as exc:
        if exc.name not in ("celery_pglock.cli", "celery_pglock.cli.console"):
            raise
        return None
    main: Callable[[list[str]], Any] = module.main
    return main


def run(argv: list[str]) -> int:
    """Hand ``argv`` to ``celery-pglock``'s CLI; without it, only ``demo`` is understood."""
    console = _console()
    if console is not None:
        result = console(argv)  # click exits by itself (SystemExit) when it is done
        return result if isinstance(result, int) else 0
    if argv[:1] == ["demo"]:
        from celery_pglock.demo import main  # noqa: PLC0415 - only when asked for

        return main(argv[1:])
    print("usage: python -m celery_pglock demo [options]  (see: demo --help)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
