"""A user's project for the retrofit tests: a stock Celery project written into a folder,
changed only as documented, run in real ``celery worker`` and ``celery beat`` processes,
with a separate process that plays the web server and sends. The README's lines are read
out of README.md and executed as they stand."""

from __future__ import annotations

import json
import re
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from tests.apps.harness import WORKER_READY_TIMEOUT, redis_result_backend
from tests.fixtures.procs import Proc, Procs

README = Path(__file__).resolve().parents[2] / "README.md"
DEADLINE = 30.0  # seconds; generous, the machine runs other suites meanwhile
SLOT = "2026-12-01T06:00:00Z"

# How the test's projects configure broker, queue and schema (``{name}``: the package).
TEST_CONF = """
app.conf.update(
    broker_url=os.environ["TEST_BROKER_URL"],
    result_backend=os.environ["TEST_RESULT_BACKEND"],
    task_default_queue=os.environ["TEST_QUEUE"],
    broker_connection_retry_on_startup=True,
    pglock_schema=os.environ["TEST_SCHEMA"],
    pglock_namespace=os.environ["TEST_SCHEMA"],
    imports=["{name}.tasks"],
)
"""
# The project as it was before the retrofit.
APP_MODULE = (
    """
import os

from celery import Celery

app = Celery("{name}")
"""
    + TEST_CONF
)
TASKS_MODULE = """
import os
import time

import psycopg
from celery import shared_task
from celery.signals import after_task_publish
from psycopg import sql


def note(task, marker):
    # What ran, as a user's task would write it: plain psycopg, no celery-pglock.
    lease = getattr(task, "pglock", None)
    with psycopg.connect(os.environ["PGLOCK_DSN"], autocommit=True) as conn:
        conn.execute(
            sql.SQL("INSERT INTO {} (task_id, slot, marker, classes) VALUES (%s, %s, %s, %s)")
            .format(sql.Identifier(os.environ["TEST_SCHEMA"], "ran")),
            (task.request.id, lease.slot if lease else None, marker,
             [cls.__name__ for cls in type(task).__mro__]),
        )


def notes(task_id, prefix):
    with psycopg.connect(os.environ["PGLOCK_DSN"], autocommit=True) as conn:
        return conn.execute(
            sql.SQL("SELECT count(*) FROM {} WHERE task_id = %s AND marker LIKE %s")
            .format(sql.Identifier(os.environ["TEST_SCHEMA"], "ran")),
            (task_id, prefix + "%"),
        ).fetchone()[0]


@shared_task(bind=True)
def record(self, marker=None):
    note(self, marker)
    return marker


@shared_task(bind=True)
def send_welcome_email(self, user_id):
    # A plain task of the project, one second of work per user.
    time.sleep(1)
    note(self, f"user-{user_id}")
    return user_id


@shared_task(bind=True)
def long_first_attempt(self, marker=None):
    # Its first attempt runs until its worker process is killed; a redelivery finishes.
    note(self, f"start {os.getpid()}")
    if notes(self.request.id, "start ") == 1:
        time.sleep(120)
    note(self, marker)
    return marker


@shared_task(bind=True, max_retries=3)
def retry_once(self, marker=None):
    # self.retry() from a locked task: the retry must be published and run.
    record.run(f"try{self.request.retries}")
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    return marker


@after_task_publish.connect
def note_retry_published(sender=None, headers=None, **_):
    # A retry published while its attempt still holds the lock is skipped as "locked" by
    # the worker process that takes it: say whether this process held a lock then.
    if sender != retry_once.name or not (headers or {}).get("retries"):
        return
    with psycopg.connect(os.environ["PGLOCK_DSN"], autocommit=True) as conn:
        held = conn.execute(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
            " WHERE l.locktype = 'advisory' AND l.granted AND a.application_name LIKE %s",
            (f"pglock {os.getpid()} %",),  # held by this process: the retrying attempt
        ).fetchone()[0]
    record.run(f"retry published, lock held: {bool(held)}")
"""
RAN_SQL = """
CREATE TABLE {} (
    task_id text, slot text, marker text, classes text[],
    at timestamptz NOT NULL DEFAULT clock_timestamp()
)"""
# The web server: imports the project (and so the README's import, if it has it) and
# sends one slot several times with ``pglock_slot=``; prints the (result, state) pairs.
SENDER = """
import json, sys
{imports}
from {name}.celery import app
from {name} import tasks

slot, count, task = sys.argv[1], int(sys.argv[2]), getattr(tasks, sys.argv[3])
results = [task.apply_async((f"m{{n}}",), pglock_slot=slot) for n in range(count)]
print(json.dumps([[r.get(timeout=30), r.state] for r in results]))
"""


def readme_retrofit() -> str:
    """The Python block of README.md's "Retrofit an existing project" section, as written."""
    text = README.read_text()
    section = text[text.index("## Retrofit an existing project") :]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, "README's retrofit section has no python block"
    return match.group(1)


class Project:
    """A user's project written into ``root``; its processes run from there."""

    def __init__(self, root: Path, name: str, env: dict[str, str], procs: Procs) -> None:
        self.root, self.name, self.env, self.procs = root, name, env, procs
        package = root / name
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "tasks.py").write_text(TASKS_MODULE)
        self.env["PYTHONPATH"] = str(root)

    def write(self, module: str, text: str) -> None:
        (self.root / self.name / f"{module}.py").write_text(textwrap.dedent(text))

    def worker(self, *args: str) -> Proc:
        node = f"{self.name}-{len(self.procs.started)}"
        proc = self.procs.celery(
            f"{self.name}.celery",
            "worker",
            *("-n", f"{node}@%h", "-Q", self.env["TEST_QUEUE"], "-l", "info"),
            *("--without-gossip", "--without-mingle", "--without-heartbeat", *args),
            env=self.env,
            name=node,
        )
        proc.wait_for_log(f"{node}@", timeout=WORKER_READY_TIMEOUT)
        proc.wait_for_log(" ready.", timeout=WORKER_READY_TIMEOUT)
        return proc

    def beat(self) -> Proc:
        return self.procs.celery(
            f"{self.name}.celery", "beat", "-l", "info", env=self.env, name="beat"
        )

    def send(
        self, slot: str, count: int, *, imports: str = "", task: str = "record"
    ) -> list[tuple[Any, str]]:
        """Send ``slot`` ``count`` times from a fresh process; the (result, state) pairs.
        ``imports``: what the sender imports first (docs/retrofitting.md: a process that
        only sends imports celery_pglock when the app module does not)."""
        sender = self.root / "sender.py"
        sender.write_text(SENDER.format(name=self.name, imports=imports))
        proc = self.procs.python(sender, slot, str(count), task, env=self.env, name="sender")
        assert 0 == proc.wait(timeout=DEADLINE), proc.log_tail()
        return [tuple(pair) for pair in json.loads(proc.log_text().strip().splitlines()[-1])]

    def call(self, body: str, *, imports: str = "import celery_pglock") -> Any:
        """Run ``body`` in a fresh sender process (``app``, ``tasks`` and ``json`` imported);
        what its last line printed, as JSON."""
        return self.call_async(body, imports=imports).result(DEADLINE * 2)

    def call_async(self, body: str, *, imports: str = "import celery_pglock") -> Pending:
        """``call``, not waited for: its ``result`` later."""
        sender = self.root / f"call-{len(self.procs.started)}.py"
        head = f"import json\n{imports}\nfrom {self.name}.celery import app\n"
        sender.write_text(head + f"from {self.name} import tasks\n" + textwrap.dedent(body))
        return Pending(self.procs.python(sender, env=self.env, name="sender"))

    def cli(self, *args: str) -> tuple[int, str]:
        """``celery -A proj.celery pglock *args`` as an operator types it: status, output."""
        argv = ("-A", f"{self.name}.celery", "pglock", *args)
        proc = self.procs.start([sys.executable, "-m", "celery", *argv], env=self.env, name="cli")
        code = proc.wait(timeout=DEADLINE * 2)
        return code, proc.log_text()

    def ran(self) -> list[dict[str, Any]]:
        query = sql.SQL("SELECT * FROM {} ORDER BY at").format(
            sql.Identifier(self.env["TEST_SCHEMA"], "ran")
        )
        with (
            psycopg.connect(self.env["PGLOCK_DSN"], autocommit=True) as conn,
            conn.cursor(row_factory=psycopg.rows.dict_row) as cur,
        ):
            return cur.execute(query).fetchall()


class Pending:
    """A sender process running (``Project.call_async``)."""

    def __init__(self, proc: Proc) -> None:
        self.proc = proc

    def result(self, timeout: float) -> Any:
        """What its last line printed, as JSON, once it exited (0)."""
        assert 0 == self.proc.wait(timeout=timeout), self.proc.log_tail()
        return json.loads(self.proc.log_text().strip().splitlines()[-1])


@pytest.fixture
def project(
    tmp_path: Path, procs: Procs, pg_dsn: str, pglock_schema: str, redis_url: str
) -> Project:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL(RAN_SQL).format(sql.Identifier(pglock_schema, "ran")))
    env = {
        "PGLOCK_DSN": pg_dsn,  # as the README says: the DSN from the environment
        "TEST_SCHEMA": pglock_schema,
        "TEST_BROKER_URL": redis_url,
        "TEST_RESULT_BACKEND": redis_result_backend(redis_url),
        "TEST_QUEUE": f"q-{pglock_schema}",
    }
    return Project(tmp_path / "project", "proj", env, procs)


def readme_project(project: Project, extra: str = "") -> None:
    """The project with README's retrofit block appended to its app module, as written."""
    project.write("celery", APP_MODULE.format(name="proj") + readme_retrofit() + extra)


def users(project: Project) -> Counter[str]:
    """How often each ``send_welcome_email`` user's e-mail went out."""
    return Counter(row["marker"] for row in project.ran() if row["marker"].startswith("user-"))


ONE_SLOT_TIMES = """
results = [tasks.send_welcome_email.apply_async((7,), pglock_slot="q2-7") for _ in range({times})]
print(json.dumps([[r.get(timeout=60), r.state] for r in results]))
"""


def one_slot_runs_once(project: Project, times: int) -> None:
    """The same slot sent ``times`` at once is one piece of work: one run, every other
    message ``SKIPPED`` (``done`` or ``locked``)."""
    results = project.call(ONE_SLOT_TIMES.format(times=times))

    assert Counter({"SUCCESS": 1, "SKIPPED": times - 1}) == Counter(state for _, state in results)
    assert {"done", "locked"} >= {meta["reason"] for meta, state in results if state == "SKIPPED"}
    assert Counter({"user-7": 1}) == users(project)


def skipped(results: list[tuple[Any, str]]) -> list[str]:
    return sorted(meta["reason"] for meta, state in results if state == "SKIPPED")


DJANGO_SETTINGS = """
SECRET_KEY = "test-only"
INSTALLED_APPS = []
USE_TZ = True
CELERY_PGLOCK_ALL_TASKS = True
"""
DJANGO_CELERY = """
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")

app = Celery("proj")
app.config_from_object("django.conf:settings", namespace="CELERY")
""" + TEST_CONF.format(name="proj")


def has_django_task() -> bool:
    try:
        import celery.contrib.django.task  # noqa: F401, PLC0415 - Celery >= 5.4 only
    except ImportError:
        return False
    return True
