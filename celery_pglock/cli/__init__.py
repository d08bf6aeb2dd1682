"""Command lines: ``celery -A proj pglock …`` (``command``), ``celery-pglock`` (``console``)."""
