"""``python -m tests.apps.django_proj.setup_db``: migrate, then add a 1-s ``tick`` entry."""

from __future__ import annotations

import os

import django  # type: ignore[import-untyped]


def main() -> None:
    """Create django-celery-beat's tables and a PeriodicTask running testapp.tick every 1 s."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.apps.django_proj.settings")
    django.setup()
    from django.core.management import (  # type: ignore[import-untyped] # noqa: PLC0415
        call_command,  # imported after django.setup()
    )
    from django_celery_beat.models import (  # type: ignore[import-untyped] # noqa: PLC0415
        IntervalSchedule,
        PeriodicTask,
    )

    call_command("migrate", verbosity=0, interactive=False)
    every, _ = IntervalSchedule.objects.get_or_create(every=1, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.update_or_create(
        name="tick", defaults={"task": "testapp.tick", "interval": every, "enabled": True}
    )


if __name__ == "__main__":
    main()
