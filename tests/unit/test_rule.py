"""Only a duplicate is skipped: what each kind of message locks, by how its task was locked
(``celery_pglock._policy``; no database: the claims a message would make)."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_pglock import ConfigurationError, PgLockTask
from celery_pglock._config import TaskOptions
from celery_pglock._keys import lock_key, slot_key
from celery_pglock._policy import claim, describe, locks, overlap
from celery_pglock._protocol import Claim

SLOT = "2026-12-01T06:00:00Z"


def make_app(**conf: Any) -> Celery:
    app = Celery("proj", set_as_current=False, **conf.pop("constructor", {}))
    app.conf.update(broker_url="memory://", **conf)
    return app


def task_options(app: Celery, **attributes: Any) -> TaskOptions:
    """The options of a task ``proj.job`` declared on ``app`` with ``attributes``."""

    @app.task(name="proj.job", shared=False, **attributes)
    def job(*args: Any, **kwargs: Any) -> None:
        """A task."""

    app.finalize()
    task: Any = app.tasks["proj.job"]
    options: TaskOptions = task.pglock_options()
    return options


def message(
    options: TaskOptions, *, slot: str | None = None, entry: str | None = None
) -> Claim | None:
    """The claim a message of ``proj.job`` makes, or None when it takes no lock."""
    if not locks(options, slot, entry):
        return None
    return claim("proj.job", options, ((), {}), slot=slot, entry=entry, task_id="id-1")


RETROFITS = {
    "pglock_all_tasks": lambda: make_app(pglock_all_tasks=True),
    "task_cls": lambda: make_app(constructor={"task_cls": "celery_pglock:PgLockTask"}),
}


@pytest.mark.parametrize("retrofit", sorted(RETROFITS))
def test_the_retrofit_locks_nothing_for_an_ad_hoc_message_without_a_slot(retrofit: str) -> None:
    """Eight calls for eight users are distinct work: under an app-wide retrofit they take
    no lock at all, so none can skip another."""
    options = task_options(RETROFITS[retrofit]())

    assert (True, None) == (options.retrofit, message(options))
    assert "duplicates only (beat: one at a time per entry)" == describe(options)


@pytest.mark.parametrize("retrofit", sorted(RETROFITS))
def test_the_retrofit_locks_an_ad_hoc_slot_alone(retrofit: str) -> None:
    """A slot sent by hand is locked by itself: its copies exclude each other (and the
    ledger dedupes them), other slots of the task run beside it."""
    options = task_options(RETROFITS[retrofit]())

    one, other = message(options, slot="q2-1"), message(options, slot="q2-2")

    assert one is not None
    assert other is not None
    assert ("proj:proj.job", "proj:proj.job") == (one.lock_name, other.lock_name)
    assert slot_key("proj:proj.job", "q2-1") == one.key
    assert one.key != other.key
    assert (True, 0, False) == (one.per_slot, one.params()["concurrency"], one.buffer)


def test_the_retrofit_guards_a_beat_entry_under_the_entry_s_own_lock_name() -> None:
    """Beat's slots of one entry run one at a time, each once; two entries of one task
    (other arguments, same schedule) are distinct work under distinct lock names."""
    options = task_options(make_app(pglock_all_tasks=True))

    daily = message(options, slot=SLOT, entry="report-daily")
    weekly = message(options, slot=SLOT, entry="report-weekly")

    assert daily is not None
    assert weekly is not None
    assert "proj:proj.job@report-daily" == daily.lock_name
    assert (lock_key(daily.lock_name), False) == (daily.key, daily.per_slot)
    assert daily.lock_name != weekly.lock_name
    assert ("skip", "allow") == (overlap(options, "report-daily"), overlap(options, None))


@pytest.mark.parametrize(
    "asked",
    [
        {"pglock_key": "reports"},
        {"pglock_concurrency": 2},
        {"pglock_overlap": "skip"},
        {"pglock_overlap": "buffer_one"},
    ],
)
def test_a_task_that_asks_for_a_lock_keeps_it_under_the_retrofit(asked: dict[str, Any]) -> None:
    """Declared on the task, pglock_key, pglock_concurrency or pglock_overlap guard every
    message of it, ad-hoc ones included, under one lock name."""
    options = task_options(make_app(pglock_all_tasks=True), **asked)

    adhoc, beat = message(options), message(options, slot=SLOT, entry="tick")

    assert adhoc is not None
    assert beat is not None
    assert not options.retrofit
    assert adhoc.lock_name == beat.lock_name
    assert (adhoc.key, False) == (lock_key(adhoc.lock_name), adhoc.per_slot)


def test_app_wide_overlap_setting_restores_one_at_a_time_for_every_message() -> None:
    """``app.conf.pglock_overlap = "skip"``: the 0.1 behaviour, asked for explicitly."""
    options = task_options(make_app(pglock_all_tasks=True, pglock_overlap="skip"))

    adhoc = message(options)

    assert adhoc is not None
    assert ("proj:proj.job", "one at a time") == (adhoc.lock_name, describe(options))


def test_a_task_with_its_own_base_is_one_at_a_time() -> None:
    """``base=PgLockTask`` asks for overlap protection on the task name: every message."""
    options = task_options(make_app(), base=PgLockTask)

    adhoc = message(options)
    beat = message(options, slot=SLOT, entry="tick")

    assert not options.retrofit
    assert adhoc is not None
    assert beat is not None
    assert ("proj:proj.job", "proj:proj.job") == (adhoc.lock_name, beat.lock_name)
    assert "one at a time" == describe(options)


def test_a_task_with_its_own_base_in_a_task_cls_app_keeps_what_it_asked() -> None:
    """In an app retrofitted by ``task_cls``, a task declared ``base=PgLockTask`` asked."""
    app = make_app(constructor={"task_cls": "celery_pglock:PgLockTask"})

    assert not task_options(app, base=PgLockTask).retrofit


def test_allow_takes_no_lock_without_a_slot_and_the_slot_alone_with_one() -> None:
    """``pglock_overlap = "allow"`` on a task of its own: only duplicates are skipped."""
    options = task_options(make_app(), base=PgLockTask, pglock_overlap="allow")

    slotted = message(options, slot="a")

    assert message(options) is None
    assert slotted is not None
    assert slotted.per_slot
    assert "duplicates only" == describe(options)


def test_allow_with_a_concurrency_limit_is_refused() -> None:
    """A limit of runs at once means nothing without overlap protection: say so."""
    with pytest.raises(ConfigurationError, match="pglock_concurrency = 3 limits"):
        task_options(make_app(), base=PgLockTask, pglock_overlap="allow", pglock_concurrency=3)


def test_scheduled_only_leaves_a_guarded_task_s_slot_less_messages_unlocked() -> None:
    """``pglock_scheduled_only``: a task's own lock, for slotted messages only."""
    options = task_options(make_app(), base=PgLockTask, pglock_scheduled_only=True)

    assert message(options) is None
    assert message(options, slot=SLOT) is not None


def test_message_slot_dedupes_redeliveries_and_keeps_parallelism_under_the_retrofit() -> None:
    """``pglock_slot = "message"``: the task id is the slot, locked alone."""
    options = task_options(make_app(pglock_all_tasks=True, pglock_slot="message"))

    redelivery = message(options, slot="id-1")

    assert redelivery is not None
    assert (True, slot_key("proj:proj.job", "id-1")) == (redelivery.per_slot, redelivery.key)


def test_a_slot_sent_by_hand_is_neither_superseded_nor_late() -> None:
    """An operator's trigger, backfill or rerun (``pglock_manual``) asked for that slot."""
    options = task_options(make_app(pglock_all_tasks=True, pglock_max_lateness=60))
    call = ((), {})

    beat = claim("proj.job", options, call, slot=SLOT, entry="tick", task_id="b")
    manual = claim("proj.job", options, call, slot=SLOT, entry="tick", task_id="m", manual=True)

    assert (True, 60.0) == (beat.coalesce, beat.max_lateness)
    assert (False, None) == (manual.coalesce, manual.max_lateness)
    assert beat.lock_name == manual.lock_name


@pytest.mark.parametrize(
    ("asked", "words"),
    [
        ({"pglock_concurrency": 3}, "3 at a time"),
        ({"pglock_overlap": "buffer_one"}, "one at a time, the newest slot waits"),
    ],
)
def test_describe_says_how_many_run_at_once(asked: dict[str, Any], words: str) -> None:
    """What the worker's start-up line and ``status`` say of a task."""
    assert words == describe(task_options(make_app(), base=PgLockTask, **asked))
