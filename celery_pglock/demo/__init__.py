"""``celery-pglock demo``: real beat and worker replicas, with and without the lock.

``main(argv)`` is what ``celery-pglock demo`` and ``python -m celery_pglock demo`` call.
"""

from __future__ import annotations

import sys

INSTALL_HINT = "pip install 'celery-pglock[demo]'"


def main(argv: list[str] | None = None) -> int:
    """Run the demo with command-line arguments ``argv`` (default: ``sys.argv[1:]``)."""
    try:
        from celery_pglock.demo._cli import main as run  # noqa: PLC0415
    except ImportError as exc:
        print(f"celery-pglock demo needs {exc.name or exc}: {INSTALL_HINT}", file=sys.stderr)
        return 2
    return run(argv)


__all__ = ["main"]
