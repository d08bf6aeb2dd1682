"""Where the library talks to PostgreSQL: connections and what their errors mean.

- ``database``: one process's pool for a set of settings, fork safety, reuse;
- ``pool``: the connections of a process, capped, handed over in order, closed when idle;
- ``connections``: one connection: connect, label, check, close;
- ``failover``: the successes a process recalls, checked after a promotion;
- ``migrations``: the schema's migrations, applied under a lock;
- ``failures``: a driver error becomes the library's (session gone, outage,
  misconfiguration, read-only, wait ended, statement failed), decided once;
- ``unwaited``: a statement sent without waiting for its reply;
- ``statements``: statements by name with dict rows back (the operator's side);
- ``lock_sessions``: the server session a run's lock lives on, its statements by name;
- ``memory``, ``memory_locks``, ``memory_waiting``, ``memory_sessions``: the in-memory
  twins of the above, for unit tests (the contract tests run on both).
"""
