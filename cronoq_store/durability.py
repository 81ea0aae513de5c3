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
from dataclasses import dataclass
from typing import Any, Final

JEPSEN_GALERA: Final = (
    "Jepsen's analysis of MariaDB Galera Cluster 12.1.2 (2026-03) found committed "
    "transactions lost: under the recommended settings when nodes crash in quick succession "
    "(no flush before acknowledgement), and occasionally with process crashes and network "
    "partitions even with innodb_flush_log_at_trx_commit=1"
)
"""Why a Galera node is never called safe (https://jepsen.io/analyses)."""

ACKNOWLEDGED: Final = {
    "postgresql": (
        "the server has flushed the commit's WAL to this server's disk (fsync on, "
        "synchronous_commit not off); a failover to a standby keeps it only with synchronous "
        "replication (see 'server')"
    ),
    "mysql": (
        "InnoDB has written and flushed its redo log for the commit "
        "(innodb_flush_log_at_trx_commit=1), and, with a binary log, the binary log too "
        "(sync_binlog=1)"
    ),
    "sqlite": (
        "SQLite has fsynced the write-ahead log (journal_mode=wal, synchronous=FULL or EXTRA: "
        "StoreConfig.full_sync, the default)"
    ),
}
"""What an acknowledged commit means on each backend when `safe`."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Unsafe:
    """One setting that lets a crash take back an acknowledged commit."""

    setting: str
    """Its name, as the server spells it."""
    value: str
    """Its value, as read."""
    why: str
    """What it risks, in a sentence."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Durability:
    """Whether an acknowledged commit survives a crash of the server (or of its machine)."""

    dialect: str
    """sqlite, postgresql or mysql (MariaDB too)."""
    settings: Mapping[str, str | None]
    """Every setting read, by name (None: not known from here)."""
    unsafe: tuple[Unsafe, ...]
    """The settings that make it unsafe; empty when safe."""
    acknowledged: str
    """What "acknowledged" means on this backend."""

    @property
    def safe(self) -> bool:
        """No setting read lets a crash lose an acknowledged commit."""
        return not self.unsafe

    def summary(self) -> str:
        """The unsafe settings in a line.

        Returns:
            "synchronous_commit=off (why); ...", empty when safe.
        """
        return "; ".join(f"{u.setting}={u.value} ({u.why})" for u in self.unsafe)

    def as_dict(self) -> dict[str, Any]:
        """This as JSON-ready data.

        Returns:
            The `durability` object of `status --json`: safe, settings, unsafe (setting,
            value, why), acknowledged.
        """
        return {
            "safe": self.safe,
            "settings": dict(self.settings),
            "unsafe": [{"setting": u.setting, "value": u.value, "why": u.why} for u in self.unsafe],
            "acknowledged": self.acknowledged,
        }


def _on(value: str | None) -> bool | None:
    if value is None:
        return None
    return value.strip().lower() in ("on", "1", "true", "yes")


def classify(dialect: str, settings: Mapping[str, str | None]) -> Durability:
    """The durability `settings` give; no I/O.

    A setting that is missing or None is not known from here (a SQLite reader cannot see the
    `synchronous` of the leader's connections) and makes nothing unsafe.

    Args:
        dialect: "postgresql", "mysql" (MariaDB too) or "sqlite".
        settings: The server's settings by name, as `dialects.durability_settings` reads
            them (values as the server prints them: "on", "2", "wal", ...).

    Returns:
        The settings, whether they are safe, and the ones that are not, with why.
    """
    unsafe: list[Unsafe] = []

    def flag(name: str, why: str) -> None:
        unsafe.append(Unsafe(setting=name, value=str(settings.get(name)), why=why))

    def norm(name: str) -> str | None:
        value = settings.get(name)
        return None if value is None else str(value).strip().lower()

    if dialect == "postgresql":
        if _on(settings.get("fsync")) is False:
            flag(
                "fsync",
                "nothing is flushed to disk: a crash of the machine loses commits "
                "and can corrupt the whole cluster",
            )
        if norm("synchronous_commit") == "off":
            flag(
                "synchronous_commit",
                "a commit is acknowledged before its WAL is flushed: "
                "a crash loses up to 3 x wal_writer_delay of acknowledged commits",
            )
        if _on(settings.get("full_page_writes")) is False:
            flag(
                "full_page_writes",
                "a page torn by a power loss cannot be repaired from the "
                "WAL: committed rows can be lost or the database corrupted",
            )
    elif dialect == "mysql":
        flush = norm("innodb_flush_log_at_trx_commit")
        if flush is not None and flush != "1":
            flag(
                "innodb_flush_log_at_trx_commit",
                "the redo log is not flushed at each "
                "commit: a crash (of the machine with 2, of the server with 0) loses up to a "
                "second of acknowledged commits",
            )
        if norm("innodb_doublewrite") in ("off", "0"):
            flag(
                "innodb_doublewrite",
                "a page torn by a power loss cannot be repaired: "
                "committed rows can be lost or the tablespace corrupted",
            )
        sync_binlog = norm("sync_binlog")
        if _on(settings.get("log_bin")) and sync_binlog is not None and sync_binlog != "1":
            flag(
                "sync_binlog",
                "the binary log is not flushed at each commit: after a crash "
                "of the machine, replicas and point-in-time recovery miss acknowledged "
                "commits",
            )
        if _on(settings.get("wsrep_on")):
            flag("wsrep_on", f"a Galera node: {JEPSEN_GALERA}")
    elif dialect == "sqlite":
        journal = norm("journal_mode")
        sync = norm("synchronous")
        sync = {"0": "off", "1": "normal", "2": "full", "3": "extra"}.get(sync or "", sync)
        if journal in ("memory", "off"):
            flag("journal_mode", "no journal on disk: a crash mid-commit can corrupt the database")
        if sync == "off":
            flag(
                "synchronous",
                "SQLite never fsyncs: a power loss or OS crash loses "
                "acknowledged commits and can corrupt the database",
            )
        elif sync == "normal":
            flag(
                "synchronous",
                "SQLite does not fsync each commit (StoreConfig.full_sync "
                "off): a power loss or OS crash loses the last acknowledged commits",
            )
    shown = {name: (None if v is None else str(v)) for name, v in settings.items()}
    return Durability(
        dialect=dialect,
        settings=shown,
        unsafe=tuple(unsafe),
        acknowledged=ACKNOWLEDGED.get(dialect, "unknown for this dialect"),
    )
