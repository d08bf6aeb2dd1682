"""A small Celery project, as most start: an app module and a tasks module."""

from proj.celery import app

__all__ = ["app"]
