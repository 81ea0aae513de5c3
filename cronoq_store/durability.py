"""What the server does with an acknowledged commit: read once at `open`, live in `status`.

A commit the store acknowledged is one the scheduler builds on (a task it reported submitted,
an inbox item it consumed). Whether a crash can take it back is the server's configuration,
not the store's: PostgreSQL's `fsync`, `synchronous_commit` and `full_page_writes`; InnoDB's
`innodb_flush_log_at_trx_commit`, its doublewrite buffer, the binary log's `sync_binlog` and
Galera's replication; SQLite's `synchronous` and journal mode (set from
`StoreConfig.full_sync`). `classify` turns the settings read into a `Durability`, with no I/O
(so it is tested on any settings); `dialects.durability_settings` reads them, in one round
trip, never on a commit's path. docs/guarantees.md says per backend what "acknowledged" means.
"""

from __future__ import annotations

__all__ = ["Durability", "Unsafe", "classify"]

from collections.abc import Mapping
from typing import Final

from .dialects import MySQLImpl, PostgresqlImpl, SQLiteImpl, class_of
from .dialects.mysql import JEPSEN_GALERA as JEPSEN_GALERA
from .verdict import Durability as Durability
from .verdict import Unsafe as Unsafe

ACKNOWLEDGED: Final = {
    impl.name: impl.acknowledged for impl in (SQLiteImpl, PostgresqlImpl, MySQLImpl)
}
"""What an acknowledged commit means on each backend when `safe` (each class's
`acknowledged`)."""


def classify(dialect: str, settings: Mapping[str, str | None]) -> Durability:
    """The durability `settings` give; no I/O. What is unsafe on each database is its
    class's `unsafe_durability` (`dialects.class_of`).

    A setting that is missing or None is not known from here (a SQLite reader cannot see the
    `synchronous` of the leader's connections) and makes nothing unsafe.

    Args:
        dialect: "postgresql", "mysql" (MariaDB too) or "sqlite".
        settings: The server's settings by name, as `dialects.durability_settings` reads
            them (values as the server prints them: "on", "2", "wal", ...).

    Returns:
        The settings, whether they are safe, and the ones that are not, with why.
    """
    impl = class_of(dialect)
    unsafe = tuple(
        Unsafe(setting=name, value=str(settings.get(name)), why=why)
        for name, why in impl.unsafe_durability(settings)
    )
    shown = {name: (None if v is None else str(v)) for name, v in settings.items()}
    return Durability(
        dialect=dialect,
        settings=shown,
        unsafe=unsafe,
        acknowledged=impl.acknowledged,
    )
