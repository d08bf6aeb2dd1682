"""Tools for test suites, the demo and the benchmarks; never imported by the package core.

``celery_pglock.testing.embedded``: a throwaway PostgreSQL server on a loopback port.
"""
