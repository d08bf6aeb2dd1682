# Celery's in-process fixtures (celery_app, celery_worker, celery_config). pytest-celery 1.x
# also exports them, but names its Docker-based worker celery_worker too: registering
# Celery's plugin here, in the project's conftest, makes its in-process one the fixture.
pytest_plugins = ("celery.contrib.pytest",)
