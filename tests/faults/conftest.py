"""Fixtures of the fault tier: one workload run per module, shared by its tests.

A run injects several faults into one set of processes (starting processes costs more
than most faults), then stops them and checks the promises once; each test of the module
asserts one behaviour of that run. Recovery times measured by the runs are printed at the
end of the session (``tests/fixtures/measurements.py``).
"""

from __future__ import annotations

from collections.abc import Generator, Iterator

import pytest

from celery_pglock.testing.embedded import EmbeddedPostgres
from tests.fixtures.pg import started_embedded
from tests.fixtures.procs import Procs


@pytest.fixture(scope="module")
def run_procs(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Procs]:
    """Processes of this module's run; all stopped after its last test."""
    module = request.module.__name__.rsplit(".", 1)[-1]
    log_dir = tmp_path_factory.mktemp(module)
    manager = Procs(log_dir, cwd=request.config.rootpath)
    try:
        yield manager
    finally:
        manager.stop_all()


@pytest.fixture(scope="module")
def run_pg() -> Iterator[EmbeddedPostgres]:
    """A PostgreSQL server of this module's own, for runs that stop or reconfigure it."""
    with started_embedded() as server:
        yield server


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Attach the logs of the module's run to a failed test's report."""
    report = yield
    if report.failed:
        for name, value in getattr(item, "funcargs", {}).items():
            procs = value if isinstance(value, Procs) else getattr(value, "procs", None)
            if name != "procs" and isinstance(procs, Procs) and procs.started:
                report.sections.append((f"logs of {name}", procs.log_report()))
    return report
