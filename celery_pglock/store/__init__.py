"""Where the library talks to PostgreSQL: connections and what their errors mean.

Public: ``statements`` (statements by name with dict rows back, ``OnConnection``). The
rest is private (a leading underscore):

- ``_database``: one process's pool for a set of settings, fork safety, reuse;
- ``_pool``: the connections of a process, capped, handed over in order, closed when idle;
- ``_connections``: one connection: connect, label, check, close;
- ``_failover``: the successes a process recalls, checked after a promotion;
- ``_migrations``: the schema's migrations, applied under a lock;
- ``_failures``: a driver error becomes the library's (session gone, outage,
  misconfiguration, read-only, wait ended, statement failed), decided once;
- ``_unwaited``: a statement sent without waiting for its reply;
- ``_lock_sessions``: the server session a run's lock lives on, its statements by name;
- ``_shared_sessions``: the one a threads/gevent process's runs share;
- ``_leader_session``: a beat replica's own, for its leader election;
- ``_memory``, ``_memory_locks``, ``_memory_waiting``, ``_memory_ops``,
  ``_memory_sessions``: the in-memory twins of the above, for unit tests (the contract
  tests run on both).
"""
