"""``python -m tests.apps.django_dash.setup_db PASSWORD``: migrate, then three users: ``sam``
(staff, reads), ``olga`` (staff with ``celery_pglock.steer``, acts), ``nina`` (no staff)."""

from __future__ import annotations

import os
import sys


def main(password: str) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.apps.django_dash.settings")
    import django  # noqa: PLC0415
    from django.core.management import call_command  # noqa: PLC0415

    django.setup()
    call_command("migrate", interactive=False, verbosity=0)
    from django.contrib.auth.models import Permission, User  # noqa: PLC0415

    steer = Permission.objects.get(codename="steer", content_type__app_label="celery_pglock")
    for name, staff in (("sam", True), ("olga", True), ("nina", False)):
        user = User.objects.create_user(name, password=password, is_staff=staff)
        if name == "olga":
            user.user_permissions.add(steer)


if __name__ == "__main__":
    main(sys.argv[1])
