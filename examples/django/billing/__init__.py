"""A Django app with periodic tasks."""
