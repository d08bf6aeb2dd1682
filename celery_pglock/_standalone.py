"""The lock outside Celery: ``advisory_lock`` (a context manager) and ``@run_once``.

A cron script, a Django management command or any program run by several hosts takes
the same lock, ledger row and fencing token a ``PgLockTask`` would: the lock key comes
from ``celery_pglock._keys``, the claim and the release are ``locks.acquire``/``release``,
a skip is the ledger's ``Skip`` (reason ``locked`` or ``done``, and who holds the lock or
ran the slot). So a task and a script that use one lock name exclude each other.

``wait=True`` waits in the server's lock queue (``pg_advisory_lock`` on the connection
that will hold the lock) rather than polling: the lock passes on the moment its holder
ends, waiters get it first come first served, and a wait costs no queries and leaves no
skip rows behind. ``timeout`` bounds the wait with ``lock_timeout``; when it runs out, one
last try reports the holder as any skip does. On rows (behind a transaction pooler,
``pglock_lock_backend``) there is no session to queue in: the wait looks every
``WAIT_POLL`` seconds instead.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Concatenate, Literal, ParamSpec, TypedDict, TypeVar, overload

from celery_pglock._config import Settings, resolve_dsn
from celery_pglock._keys import check_lock_name, check_slot, lock_key
from celery_pglock._locks import acquire, lease_ms
from celery_pglock._protocol import Claim, Lease, Skip
from celery_pglock._runs import settle_failure, settle_success
from celery_pglock._values import SCOPES, LockBackend, Scope
from celery_pglock._values import lock_backend as valid_backend
from celery_pglock.errors import (
    ConfigurationError,
    DatabaseError,
    LockLost,
    PgLockError,
    SessionGone,
    WaitEnded,
)
from celery_pglock.schema import Tables
from celery_pglock.store._database import Database, database
from celery_pglock.store._driver import Connection
from celery_pglock.store._lock_sessions import LockSession

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11

logger = logging.getLogger("celery_pglock")

WAIT_POLL = 0.25  # seconds between the looks of a wait on rows (``_acquire_polling``)

P = ParamSpec("P")
R = TypeVar("R")
Dsn = str | Callable[[], str] | None
NameOption = str | Callable[..., str]
SlotOption = str | Callable[..., str] | None


class LockSettings(TypedDict, total=False):
    """The options of ``advisory_lock`` and ``run_once``; defaults and checks: ``LockOptions``."""

    dsn: Dsn
    scope: Scope
    lease: float | None
    wait: bool
    timeout: float | None
    schema: str
    table_prefix: str
    lock_backend: LockBackend


@dataclass(frozen=True)
class LockOptions:
    """How to lock, validated once (``advisory_lock`` and ``run_once`` share it)."""

    dsn: Dsn = None
    scope: Scope = "session"
    lease: float | None = 30.0
    wait: bool = False
    timeout: float | None = None
    schema: str = "public"
    table_prefix: str = "pglock_"
    lock_backend: LockBackend = "auto"

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ConfigurationError(
                f"scope must be 'session' or 'transaction', not {self.scope!r}"
            )
        if self.lease is not None and self.lease < 0:
            raise ConfigurationError(f"lease must be seconds >= 0 (0: no lease), not {self.lease}")
        if self.timeout is not None and (self.timeout < 0 or not self.wait):
            raise ConfigurationError(
                f"timeout={self.timeout} needs wait=True (--wait) and seconds >= 0"
            )
        Tables(self.schema, self.table_prefix)  # raises on an unusable schema or prefix
        valid_backend(self.lock_backend)  # raises naming the choices

    @property
    def lease_seconds(self) -> float | None:
        """The lease, or None when turned off (``0`` or ``None``)."""
        return float(self.lease) if self.lease else None

    def settings(self) -> Settings:
        """Where the tables live; the DSN is resolved now (argument, PGLOCK_DSN, DATABASE_URL)."""
        dsn = resolve_dsn({"pglock_dsn": self.dsn})
        return Settings(
            dsn=dsn,
            schema=self.schema,
            table_prefix=self.table_prefix,
            lock_backend=self.lock_backend,
        )


@dataclass
class LockHandle:
    """What ``advisory_lock`` yields: the lock if ``acquired``, else ``skip`` says why not."""

    name: str
    slot: str | None
    tables: Tables
    skip: Skip | None = None
    granted: Lease | None = field(default=None, repr=False)

    @property
    def acquired(self) -> bool:
        return self.granted is not None

    @property
    def token(self) -> int | None:
        """The fencing token of this attempt (None when not acquired)."""
        return self.granted.token if self.granted else None

    @property
    def lost(self) -> bool:
        """True once we know the server took the lock away (lease expired, session ended)."""
        return self.granted.lost if self.granted else False

    @property
    def reason(self) -> str | None:
        """Why the lock was not acquired: ``locked`` or ``done`` (None when acquired)."""
        return self.skip.reason if self.skip else None

    @property
    def holder(self) -> dict[str, Any] | None:
        """Who holds the lock (``locked``) or ran the slot (``done``), when not acquired."""
        return self.skip.holder if self.skip else None

    @property
    def connection(self) -> Connection:
        """The lock's connection; in transaction scope, inside the lock's transaction."""
        if self.granted is None:
            raise PgLockError(f"lock {self.name!r} was not acquired ({self.reason}): no connection")
        return self.granted.connection

    def check(self) -> None:
        """Raise ``LockLost`` unless the lock is held right now (asks the server)."""
        if self.granted is None:
            raise LockLost(f"lock {self.name!r} was never acquired ({self.reason})")
        self.granted.check()


@contextmanager
def advisory_lock(
    name: str, *, slot: str | None = None, **options: Unpack[LockSettings]
) -> Iterator[LockHandle]:
    """Hold lock ``name`` for the ``with`` block, or learn why not (``.acquired``, ``.skip``).

    Same lock key, ledger and fencing tokens as a ``PgLockTask`` whose lock name is
    ``name``. With a ``slot``, a slot that already succeeded is skipped (reason ``done``);
    the block's outcome is recorded (``succeeded``, or ``failed`` when it raises). In
    ``transaction`` scope, ``.connection`` is in the lock's transaction: committed when
    the block ends normally, rolled back when it raises.

    Options (``LockSettings``): ``dsn`` (default: ``PGLOCK_DSN``, else ``DATABASE_URL``),
    ``scope`` ("session"), ``lease`` (30.0 s; 0 or None: none), ``wait`` (False),
    ``timeout`` (None: with ``wait``, wait for good), ``schema`` ("public"),
    ``table_prefix`` ("pglock_"), ``lock_backend`` ("auto": on rows behind a transaction
    pooler, else advisory locks).
    """
    with hold(LockOptions(**options), name, slot) as handle:
        yield handle


@contextmanager
def hold(
    options: LockOptions, name: str, slot: str | None, *, task_name: str | None = None
) -> Iterator[LockHandle]:
    """``advisory_lock`` with validated options; ``task_name`` goes to the ledger."""
    claim = make_claim(name, slot, task_name)
    db = database(options.settings())
    outcome = _acquire(db, claim, options)
    handle = LockHandle(name, claim.slot, db.tables)
    if isinstance(outcome, Skip):
        handle.skip = outcome
        log_skip(outcome)
        yield handle
        return
    handle.granted = outcome
    try:
        yield handle
    except BaseException as exc:
        if not _clean_exit(exc):
            settle_failure(db, outcome, exc)
            raise
        settle_success(db, outcome)
        raise
    settle_success(db, outcome)


def make_claim(name: str, slot: str | None, task_name: str | None) -> Claim:
    """The ledger claim of this process, or a ``ConfigurationError`` naming the bad input."""
    try:
        check_lock_name(name)
        checked_slot = None if slot is None else check_slot(slot)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"cannot lock {name!r}: {exc}") from None
    return Claim(name, lock_key(name), checked_slot, None, task_name, pid=os.getpid())


def _acquire(db: Database, claim: Claim, options: LockOptions) -> Lease | Skip:
    lease = options.lease_seconds
    if not options.wait or options.timeout == 0:  # one try, whose skip names the holder
        return acquire(db, claim, options.scope, lease)
    deadline = None if options.timeout is None else time.monotonic() + options.timeout
    if options.scope == "session" and db.on_rows:
        return _acquire_polling(db, claim, options, deadline)
    waited = wait_for_lock(db, claim.key, options)
    if waited is None:  # the wait ran out: one try, whose skip names the holder
        return acquire(db, claim, options.scope, lease)
    outcome = acquire(db, claim, options.scope, lease, waited=waited)
    if isinstance(outcome, Skip) and outcome.reason == "locked":
        # Held on rows by a process behind a transaction pooler: the server's lock queue
        # let us through, so wait as a waiter on rows does.
        return _acquire_polling(db, claim, options, deadline)
    return outcome


def _acquire_polling(
    db: Database, claim: Claim, options: LockOptions, deadline: float | None
) -> Lease | Skip:
    """``wait=True`` on rows (behind a transaction pooler), or for a holder on rows: no
    server lock queue to wait in, so look every ``WAIT_POLL`` seconds whether the lock is
    free, then try it (a try that loses the race to another waiter is a skip row, and the
    wait goes on) until ``deadline`` (``time.monotonic``; None: for good)."""
    while True:
        free = _free_by(db, claim, deadline)
        outcome = acquire(db, claim, options.scope, options.lease_seconds)
        if not free or isinstance(outcome, Lease) or outcome.reason != "locked":
            return outcome


def _free_by(db: Database, claim: Claim, deadline: float | None) -> bool:
    """Wait until no one holds ``claim``'s lock; False when ``deadline`` came first."""
    while True:
        with db.statements() as statements:
            row = statements.row("lock_free", {"keys": list(claim.keys or (claim.key,))})
        if row is not None and row["free"]:
            return True
        if deadline is not None and time.monotonic() + WAIT_POLL > deadline:
            return False
        time.sleep(WAIT_POLL)


def wait_for_lock(db: Database, key: int, options: LockOptions) -> LockSession | None:
    """A session of ``db`` that holds lock ``key``, or None when the wait ran out."""
    xact = options.scope == "transaction"
    armed = options.lease_seconds is not None and (xact or db.lease_supported)
    params = {
        "key": key,
        "xact": xact,
        "timeout_ms": _milliseconds(options.timeout),
        # As locks.acquire arms it: a lease that also covers the moment after the grant.
        "lease_ms": lease_ms(options.lease_seconds) if armed else None,
    }
    for attempt in range(2):
        session = db.lock_sessions.take()
        try:
            session.use_scope(options.scope)
            session.row("wait_lock", params)
        except WaitEnded:  # lock_timeout ran out, or a DBA's statement_timeout cut it short
            _give_back(db, session)
            return None
        except SessionGone:
            _give_back(db, session)
            # A pooled connection that died while idle: one more try on a fresh one.
            if attempt == 1 or not session.closed:
                raise
        except BaseException:
            _give_back(db, session)
            raise
        else:
            return session
    raise AssertionError("unreachable")  # pragma: no cover


def _milliseconds(seconds: float | None) -> str:
    return "0" if not seconds else str(max(1, round(seconds * 1000)))


def _give_back(db: Database, session: LockSession) -> None:
    """Return a session whose wait failed; the pool's reset frees what it took."""
    if not session.closed and session.in_transaction():
        # else the pool warns about an open transaction
        with contextlib.suppress(DatabaseError):
            session.rollback()
    db.lock_sessions.give_back(session, clean=False)


def _clean_exit(exc: BaseException) -> bool:
    """``sys.exit()`` / ``sys.exit(0)`` inside the block is a success, not a failure."""
    return isinstance(exc, SystemExit) and exc.code in (None, 0)


def log_skip(skip: Skip) -> None:
    """The INFO line of a skip, with a stable ``action`` key and the holder."""
    logger.info(
        "%s",
        describe_skip(skip),
        extra={
            "action": "pglock_run_skipped",
            "reason": skip.reason,
            "lock": skip.lock_name,
            "slot": skip.slot,
            "holder": skip.holder,
            "token": skip.token,
        },
    )


def describe_skip(skip: Skip) -> str:
    """One line: what was skipped, why, and who holds the lock or ran the slot."""
    what = f"lock {skip.lock_name!r}" + (f" slot {skip.slot!r}" if skip.slot else "")
    return f"skipped {what}: {skip.reason}, {_describe_holder(skip)}"


def _describe_holder(skip: Skip) -> str:
    holder = skip.holder
    if not holder:
        return "holder unknown (it finished a moment ago)"
    who = f"pid {holder.get('pid')} on {holder.get('host')}"
    if holder.get("task_id"):
        who += f" (task {holder['task_id']})"
    if skip.reason == "done":
        finished = holder.get("finished")
        return f"succeeded by {who}" + (f" at {finished}" if finished else "")
    since = holder.get("since")
    return f"held by {who}" + (f" since {since}" if since else "")


@overload
def run_once(
    name: NameOption,
    slot: SlotOption = None,
    *,
    bind: Literal[False] = False,
    **options: Unpack[LockSettings],
) -> Callable[[Callable[P, R]], Callable[P, R | None]]: ...


@overload
def run_once(
    name: NameOption,
    slot: SlotOption = None,
    *,
    bind: Literal[True],
    **options: Unpack[LockSettings],
) -> Callable[[Callable[Concatenate[LockHandle, P], R]], Callable[P, R | None]]: ...


def run_once(
    name: NameOption,
    slot: SlotOption = None,
    *,
    bind: bool = False,
    **options: Unpack[LockSettings],
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Run the function under lock ``name``; skip it (return None, log why) when it is
    held elsewhere or when ``slot`` already succeeded.

    ``name`` and ``slot`` are strings or callables of the function's arguments.
    ``bind=True`` passes the ``LockHandle`` first (its ``token``, ``connection``).
    Other options are ``advisory_lock``'s, checked when the function is decorated.
    """
    checked = LockOptions(**options)

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        task_name = f"{function.__module__}.{function.__qualname__}"

        @functools.wraps(function)
        def once(*args: Any, **kwargs: Any) -> Any:
            lock_name = _option_value(name, "name", args, kwargs)
            slot_value = None if slot is None else _option_value(slot, "slot", args, kwargs)
            with hold(checked, lock_name, slot_value, task_name=task_name) as handle:
                if not handle.acquired:
                    return None
                return function(handle, *args, **kwargs) if bind else function(*args, **kwargs)

        return once

    return decorate


def _option_value(option: str | Callable[..., Any], what: str, args: Any, kwargs: Any) -> Any:
    if not callable(option):
        return option
    try:
        return option(*args, **kwargs)
    except Exception as exc:
        raise ConfigurationError(
            f"the run_once {what} function raised {type(exc).__name__}: {exc}; it receives the "
            "function's positional and keyword arguments (accept **kwargs for the ones it "
            "ignores)"
        ) from exc


__all__ = [
    "LockHandle",
    "LockOptions",
    "LockSettings",
    "advisory_lock",
    "describe_skip",
    "hold",
    "run_once",
]
