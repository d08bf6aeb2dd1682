"""Optional integrations with other frameworks (``django``)."""
