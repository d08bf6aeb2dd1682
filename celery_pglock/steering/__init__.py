"""Steering: what the operator's faces share, written once.

``celery pglock`` (``cli/``), the web dashboard (``web/``) and the Django mount
(``contrib/django``) read the same things and act through the same functions: every
operator action, one function each (``actions``, public), who acts and how a face
connects (``_operator``), the app's beat entries as its scheduler loads them, stored ones
included (``_apps``), and the reads a page or a command shows (``_reads``, ``_history``:
the status, one slot's story, an entry's history, the audit trail). The writes are
``celery_pglock._controls``'; nothing here knows click or HTML.
"""
