"""`StoreConfig`: how a store behaves, checked when made; what both faces are configured by.

Re-exported by `cronoq_store.store`, where the reference documents it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Final

from .errors import InvalidValue
from .schema import check_schema_name

MAX_WAIT: Final = timedelta(milliseconds=2**31 - 1)
"""Longest lease, poll or timeout: what every dialect enforces (PostgreSQL's statement_timeout
and SQLite's busy_timeout are 32-bit milliseconds), about 24.8 days."""

DEFAULT_MAX_PAYLOAD: Final = 16 * 1024 * 1024
"""16 MiB: the largest value every dialect's payload column is proven to hold (tests of the
columns), and what MariaDB's default `max_allowed_packet` about carries; a payload describes
work, the data it works on belongs in the app's own storage."""
DEFAULT_INBOX_BATCH_BYTES: Final = 64 * 1024 * 1024
"""64 MiB of payloads per `read_inbox`: a thousand small items as before, four of the largest."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreConfig:
    """How a store behaves; durations are `timedelta`."""

    retention: timedelta = timedelta(hours=1)
    """How long finished tasks are returned by recovery (key deduplication)."""
    lease_ttl: timedelta = timedelta(seconds=10)
    """How long a lease lasts unrenewed; a standby takes over once it runs out."""
    lease_renew: timedelta = timedelta(seconds=2)
    """How often the leader renews its lease; well below `lease_ttl`."""
    lock_poll: timedelta = timedelta(milliseconds=500)
    """How often a standby checks whether the lease has run out."""
    busy_timeout: timedelta = timedelta(seconds=5)
    """How long a SQLite statement waits for another process's write."""
    commit_timeout: timedelta = timedelta(seconds=30)
    """Longest a commit may take; past it the commit rolls back with `StoreUnavailable`."""
    full_sync: bool = True
    """SQLite: fsync every commit (synchronous=FULL); off, a power loss may drop the last ones."""
    require_durable: bool = False
    """`open` refuses (`NotDurable`) a database whose settings let a crash lose an acknowledged
    commit (PostgreSQL `fsync`/`synchronous_commit` off, InnoDB not flushing each commit, a
    Galera node, SQLite without `full_sync`); off, `open` logs one WARNING naming them."""
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD
    """Largest `TaskSpec.payload` a commit or an enqueue accepts (`InvalidValue` past it); also
    the size, with `inbox_batch_bytes`, that bounds what one `read_inbox` holds in memory."""
    inbox_batch_bytes: int = DEFAULT_INBOX_BATCH_BYTES
    """`read_inbox` stops adding items once their payloads reach this many bytes (it always
    returns at least one): a drain holds at most this plus one payload, whatever `limit`."""
    pool_size: int = 4
    """Pool size of an engine the store creates (`open`); an engine handed in keeps its own."""
    schema: str | None = None
    """PostgreSQL schema (or MySQL database) holding the tables; None for the default. Any name
    up to 63 bytes without '.', '[', ']', control characters or outer whitespace."""
    migrate: bool = True
    """Whether `SqlStore.open` migrates the database to this build's schema."""
    inbox_poll: timedelta = timedelta(milliseconds=100)
    """How often `wait_inbox` checks the inbox on SQLite and MariaDB/MySQL, and on PostgreSQL
    with `transaction_pooler` or without `inbox_listen` (otherwise PostgreSQL's LISTEN/NOTIFY
    wakes it at once)."""
    inbox_listen: bool = True
    """PostgreSQL: `wait_inbox` listens for enqueues' notifications (waking within
    milliseconds); off, it polls every `inbox_poll`, for apps that enqueue with
    `notify=False` (whose commits then skip the lock a notifying commit holds through its WAL
    flush: docs/tuning.md, "Waking the leader")."""
    transaction_pooler: bool = False
    """PostgreSQL: the store reaches the server through a pooler in transaction mode
    (pgbouncer's `pool_mode = transaction`), where consecutive transactions run on different
    server connections. The engine `open` creates then makes no server-side prepared
    statements (psycopg's `prepare_threshold=None`), and `wait_inbox` polls every
    `inbox_poll` instead of LISTEN, which such a pooler cannot deliver. An engine handed in
    must be made so by its owner (docs/deploying.md, "Poolers")."""

    def __post_init__(self) -> None:
        for name in (
            "retention",
            "lease_ttl",
            "lease_renew",
            "lock_poll",
            "busy_timeout",
            "commit_timeout",
            "inbox_poll",
        ):
            value = getattr(self, name)
            if not isinstance(value, timedelta):
                raise InvalidValue(f"StoreConfig.{name} must be a timedelta")
            if name == "retention":
                continue  # any length: recovery's cutoff saturates
            if value <= timedelta(0):
                raise InvalidValue(f"StoreConfig.{name} must be positive")
            if value > MAX_WAIT:
                raise InvalidValue(f"StoreConfig.{name} must be at most {MAX_WAIT}")
        if self.retention < timedelta(0):
            raise InvalidValue("StoreConfig.retention must not be negative")
        if self.lease_renew * 2 > self.lease_ttl:
            raise InvalidValue(
                "StoreConfig.lease_renew must be at most half of lease_ttl, so that one failed "
                "renewal does not lose the lease"
            )
        if self.lock_poll >= self.lease_ttl:
            raise InvalidValue(
                "StoreConfig.lock_poll must be below lease_ttl: a standby that checks less often "
                "than a lease lasts leaves the scheduler leaderless for longer than the TTL"
            )
        if not isinstance(self.pool_size, int) or isinstance(self.pool_size, bool):
            raise InvalidValue("StoreConfig.pool_size must be an int")
        if self.pool_size < 1:
            raise InvalidValue("StoreConfig.pool_size must be at least 1")
        for name in ("max_payload_bytes", "inbox_batch_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidValue(f"StoreConfig.{name} must be an int")
            if value < 1:
                raise InvalidValue(f"StoreConfig.{name} must be at least 1")
        for flag in ("inbox_listen", "transaction_pooler", "require_durable", "full_sync"):
            if not isinstance(getattr(self, flag), bool):
                raise InvalidValue(f"StoreConfig.{flag} must be a bool")
        if self.schema is not None:
            check_schema_name(self.schema, "StoreConfig.schema")
