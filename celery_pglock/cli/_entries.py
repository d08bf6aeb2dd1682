"""What the operator commands share: who acts, a slot given on the command line. The
entries, sending a slot and waiting for its outcome: ``steering``."""

from __future__ import annotations

import click

from celery_pglock._messages import checked_slot
from celery_pglock.errors import ConfigurationError

BY_HELP = "Who acts, for the audit trail [default: user@host]."


def checked(slot: str) -> str:
    """A slot given on the command line, or a usage error naming what is wrong with it."""
    try:
        return checked_slot("--slot", slot)
    except ConfigurationError as exc:
        raise click.BadParameter(str(exc), param_hint="--slot") from None
