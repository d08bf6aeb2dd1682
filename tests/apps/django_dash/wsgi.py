"""``python -m waitress tests.apps.django_dash.wsgi:application``."""

from __future__ import annotations

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.apps.django_dash.settings")
application = get_wsgi_application()
