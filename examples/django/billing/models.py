"""What the periodic tasks write."""

from __future__ import annotations

from django.db import models


class Rollup(models.Model):
    """One nightly rollup per beat slot; ``token`` is the fencing token of the run that wrote it."""

    slot = models.CharField(max_length=40, unique=True)
    token = models.BigIntegerField()
    created = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"rollup {self.slot} (token {self.token})"
