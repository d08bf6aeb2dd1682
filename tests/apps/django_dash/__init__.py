"""A Django project with the dashboard mounted at ``/pglock/`` (Django's auth, the admin's
login page), served by waitress in the dashboard's Django tests."""
