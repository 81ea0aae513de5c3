"""The error tree of cronoq-store.

Callers catch `StoreError` for everything the store raises, `StoreUnavailable` for what is worth
retrying, and `Fenced` to step down. Database errors are translated in one place
(`cronoq_store.dialects.translate`), so no driver exception escapes the store.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .verdict import Durability, LostCommits

__all__ = [
    "BuildTooOld",
    "CorruptValue",
    "DatabaseBehind",
    "Fenced",
    "InvalidValue",
    "LeaderRowMissing",
    "NotDurable",
    "SchemaError",
    "StoreError",
    "StoreUnavailable",
]


class StoreError(Exception):
    """Base of every error the store raises."""


class StoreUnavailable(StoreError):
    """The database could not be reached, was busy, or refuses writes (a standby, a server in
    read-only mode: not the primary now); the operation may be retried as is.

    Commits are idempotent, so retrying a commit that did land in fact is harmless.
    """


class Fenced(StoreError):
    """Another instance took leadership: this one must not write again until it leads anew."""


class DatabaseBehind(Fenced):
    """The database holds less than this leader made durable: commits it acknowledged are gone.

    An asynchronous failover that promoted a replica behind the primary (or a restored backup)
    does this. The leader steps down instead of writing on, and records the gap in the lease
    row, which the next `recover` reports (`Recovered.lost`). See docs/guarantees.md.
    """

    def __init__(self, message: str, *, lost: LostCommits) -> None:
        super().__init__(message)
        self.lost = lost
        """What the leader found missing (its `noticed_unix_ns` on this host's clock)."""


class SchemaError(StoreError):
    """The database schema is not one this build can work with (newer, unknown, or missing)."""


class LeaderRowMissing(Fenced, SchemaError):
    """The lease row (`cronoq_leader`, id = 1) is gone, so no instance can lead or commit.

    A `Fenced` (a leader that meets it steps down) and a `SchemaError` (nothing to retry):
    `cronoq-store upgrade`, or `SqlStore.open` with migration on, restores the row.
    """

    def __init__(self, message: str | None = None) -> None:
        super().__init__(
            message
            or "the leader row (table cronoq_leader, id = 1) is missing, so no instance can "
            "lead or commit: run `cronoq-store upgrade` (or SqlStore.open with migrate on) to "
            "restore it with an id high-water mark above every id still stored"
        )


class BuildTooOld(Fenced, SchemaError):
    """A migration made this database's schema one this build may no longer write: its
    `cronoq_writers.oldest_writer` is newer than this build (`cronoq_store.builds`).

    A `Fenced` (a leader that meets it at a commit or renewal steps down, having written
    nothing) and a `SchemaError` (nothing to retry: deploy the newer build). The message names
    both versions.
    """

    def __init__(self, message: str, *, floor: int) -> None:
        super().__init__(message)
        self.floor = floor
        """The oldest build that may write the database, encoded (`builds.decode` reads it)."""


class InvalidValue(StoreError, ValueError):
    """A value handed to the store cannot be stored as it is (out of range, too long, bad type).

    Raised before anything is written, so a batch with one bad value leaves the database as it
    was. The message names the field.
    """


class CorruptValue(StoreError, ValueError):
    """A stored value cannot be decoded; recovery quarantines the row that holds it."""


class NotDurable(StoreError):
    """The server can lose a commit it acknowledged, on a crash, and the store was told to
    refuse such a server (`StoreConfig(require_durable=True)`). Nothing was written; the
    message names the settings, `durability` holds what was read."""

    def __init__(self, message: str, *, durability: Durability) -> None:
        super().__init__(message)
        self.durability = durability
        """The settings read and the ones that make the server unsafe."""
