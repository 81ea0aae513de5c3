"""The raw-driver baselines: the store's work done by hand on the bare DB-API driver.

The raw side writes to its own database (its own SQLite file, its own server database), whose
schema the store's migrations created, so both sides have the same tables and indexes but share
no file, WAL, checkpoint or buffer pool. It runs the very Core statements the store runs,
compiled once to the driver's own SQL: the same INSERTs, the same transition UPDATE (the live
key released or kept, the message carried over), the same prune DELETE with its dependency
checks by id and by key and, on PostgreSQL, the VACUUM after it. It does what a careful
hand-written store would do and no more: it encodes the same JSON, binds plain tuples,
executemany's, and commits. It does not fence, fold, validate, or check idempotency.

Submissions have more than one raw baseline: `json` encodes rows with the standard library
inside the timed loop (what a hand-written store does), `pre-encoded` binds rows built before
the clock starts (the driver's ceiling, SQLite), and `copy` streams them with COPY (psycopg).
"""

from __future__ import annotations

import contextlib
import gc
import json
import sqlite3
import time
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, Final, Literal, cast

from sqlalchemy import URL, Table
from sqlalchemy.engine.interfaces import Dialect
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import ClauseElement

from .. import codec, dialects, execution
from ..model import ById, StatusChanged, Submitted, TaskStatus, TimeBase
from ..repository import commit, prune, recovery
from ..schema import task_deps, tasks

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), sort_keys=True).encode

Baseline = Literal["json", "pre-encoded", "executemany", "copy"]
"""How the raw side submits: see the module's doc."""

_UPDATE_ORDER: Final = (
    "b_terminal",
    "b_status",
    "b_terminal",
    "b_attempt",
    "b_at",
    "b_terminal",
    "b_at",
    "b_message",
    "b_id",
)
_UPDATE_OUTPUT_ORDER: Final = (*_UPDATE_ORDER[:-1], "b_output", "b_id")


def raw_tables(dialect: Dialect) -> tuple[Table, Table]:
    """The tables the raw side writes: the store's own, in the raw side's own database.

    The same `Table` objects on every dialect (`dialect` is kept for callers of the older form).
    """
    del dialect
    return tasks, task_deps


class RawDatabase:
    """What the raw side does its own way on one database: how it connects, begins, commits
    and ends a read, and its baselines. One subclass per database, registered by the store's
    class of that database (`dialects.DefaultImpl`, Alembic's way): a new database is a new
    subclass here, never a branch in `RawDriver`."""

    impl: ClassVar[type[dialects.DefaultImpl]] = dialects.DefaultImpl
    """The store's class of the database this one speaks to."""
    paramstyle: ClassVar[str] = "format"
    """The driver's own positional style, as a hand-written caller binds rows."""
    baselines: ClassVar[tuple[Baseline, ...]] = ("executemany",)
    """The raw submission baselines; the first is the main one."""

    _registry: ClassVar[dict[type[dialects.DefaultImpl], type[RawDatabase]]] = {}

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        RawDatabase._registry[cls.impl] = cls

    @staticmethod
    def of(impl: type[dialects.DefaultImpl]) -> type[RawDatabase]:
        """The raw class of the database whose store class is `impl`."""
        return RawDatabase._registry.get(impl, RawDatabase)

    def connect(self, url: URL, *, full_sync: bool) -> Any:
        """A bare DB-API connection to `url`, not in autocommit."""
        raise NotImplementedError(f"no raw driver for {self.impl.name}")

    def begin(self, conn: Any) -> None:
        """Begin a write transaction (the driver begins one on its own by default)."""

    def commit(self, conn: Any) -> None:
        """Commit the transaction."""
        conn.commit()

    def end_read(self, conn: Any) -> None:
        """End the transaction a read began (the driver's own, by default)."""
        conn.commit()


class SQLiteRaw(RawDatabase):
    """sqlite3 in autocommit, with the store's pragmas; BEGIN IMMEDIATE as the store does."""

    impl: ClassVar[type[dialects.DefaultImpl]] = dialects.SQLiteImpl
    paramstyle: ClassVar[str] = "qmark"
    baselines: ClassVar[tuple[Baseline, ...]] = ("json", "pre-encoded")

    def connect(self, url: URL, *, full_sync: bool) -> Any:
        conn = sqlite3.connect(url.database or "", isolation_level=None)
        for pragma in (
            "PRAGMA busy_timeout = 5000",
            "PRAGMA journal_mode = WAL",
            f"PRAGMA synchronous = {'FULL' if full_sync else 'NORMAL'}",
            "PRAGMA foreign_keys = OFF",
        ):
            conn.execute(pragma)
        return conn

    def begin(self, conn: Any) -> None:
        conn.execute("BEGIN IMMEDIATE")

    def commit(self, conn: Any) -> None:
        conn.execute("COMMIT")

    def end_read(self, conn: Any) -> None:
        """Nothing: autocommit, a read begins no transaction."""


class PostgresqlRaw(RawDatabase):
    """psycopg 3; COPY as a second baseline."""

    impl: ClassVar[type[dialects.DefaultImpl]] = dialects.PostgresqlImpl
    baselines: ClassVar[tuple[Baseline, ...]] = ("executemany", "copy")

    def connect(self, url: URL, *, full_sync: bool) -> Any:
        import psycopg  # the bench's extra: imported only where it runs

        kw: dict[str, Any] = {
            "host": url.host,
            "port": url.port,
            "user": url.username,
            "password": url.password,
            "dbname": url.database,
        }
        return psycopg.connect(**{k: v for k, v in kw.items() if v is not None})


class MySQLRaw(RawDatabase):
    """PyMySQL (MariaDB, MySQL)."""

    impl: ClassVar[type[dialects.DefaultImpl]] = dialects.MySQLImpl

    def connect(self, url: URL, *, full_sync: bool) -> Any:
        import pymysql  # type: ignore[import-untyped]  # the bench's extra, where it runs

        return pymysql.connect(
            host=url.host or "localhost",
            port=url.port or 3306,
            user=url.username or "root",
            password=url.password or "",
            database=url.database,
            charset="utf8mb4",
            autocommit=False,
        )


def baselines(dialect_name: str) -> tuple[Baseline, ...]:
    """The raw submission baselines of a dialect; the first is the main one."""
    return RawDatabase.of(dialects.class_of(dialect_name)).baselines


class RawDriver:
    """A bare DB-API connection running the store's statements compiled once from Core."""

    def __init__(self, url: URL, dialect: Dialect, *, full_sync: bool) -> None:
        self.database = RawDatabase.of(type(dialects.dialect_of(dialect)))()
        """What this database does its own way."""
        dialect_class: Any = type(dialect)
        self.compile_dialect: Dialect = dialect_class(paramstyle=self.database.paramstyle)
        self.conn: Any = self.database.connect(url, full_sync=full_sync)
        self.tasks, self.deps = tasks, task_deps
        self.insert_tasks, columns = self.sql(commit.insert_tasks_stmt())
        if columns != tuple(c.name for c in tasks.columns):
            raise RuntimeError(f"unexpected insert column order {columns}")
        self.insert_deps, columns = self.sql(commit.insert_deps_stmt())
        if columns != ("task_id", "ordinal", "target_id", "target_key"):
            raise RuntimeError(f"unexpected dependency column order {columns}")
        prep = dialect.identifier_preparer
        names = ", ".join(prep.quote(c.name) for c in tasks.columns)
        self.copy_tasks = f"COPY {prep.format_table(tasks)} ({names}) FROM STDIN"
        names = ", ".join(prep.quote(c.name) for c in task_deps.columns)
        self.copy_deps = f"COPY {prep.format_table(task_deps)} ({names}) FROM STDIN"
        self.running, order = self.sql(commit.status_update_stmt())
        if order != _UPDATE_ORDER:
            raise RuntimeError(f"unexpected update parameter order {order}")
        self.finished, order = self.sql(commit.status_output_stmt())
        if order != _UPDATE_OUTPUT_ORDER:
            raise RuntimeError(f"unexpected update parameter order {order}")
        self.live, _ = self.sql(recovery.live_tasks_stmt())
        # Where the spec's columns start in a live-task row (after id, seq, status and the rest).
        self._spec_at = len(recovery.live_tasks_stmt().selected_columns) - len(codec.SPEC_COLUMNS)
        self._prune = prune.prune_stmt(join=dialects.delete_joins(dialect)).compile(
            dialect=self.compile_dialect
        )
        self.prune_sql = str(self._prune)
        self._prune_keys = tuple(self._prune.positiontup or ())
        # The store's VACUUM after a prune, compiled for the server's version (`dialect` is live).
        self.vacuum_sql = (
            str(dialects.Vacuum(tasks, task_deps).compile(dialect=dialect))
            if dialects.vacuums(dialect)
            else None
        )
        self._in_lists: dict[int, str] = {}

    def sql(self, stmt: ClauseElement) -> tuple[str, tuple[str, ...]]:
        """The driver SQL of a Core statement and the order of its parameters."""
        compiled = cast(SQLCompiler, stmt.compile(dialect=self.compile_dialect))
        return str(compiled), tuple(compiled.positiontup or ())

    def delete_deps_in(self, count: int) -> str:
        """The store's dependency-row DELETE with `count` ids, compiled once per count."""
        sql = self._in_lists.get(count)
        if sql is None:
            compiled = commit.delete_deps_stmt().compile(dialect=self.compile_dialect)
            state = compiled.construct_expanded_state({"ids": list(range(count))})
            sql = self._in_lists[count] = state.statement
        return sql

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Any]:
        """A cursor in a transaction (BEGIN IMMEDIATE on SQLite, as the store does)."""
        self.database.begin(self.conn)
        cursor = self.conn.cursor()
        try:
            yield cursor
        except BaseException:
            self.conn.rollback()
            raise
        finally:
            cursor.close()
        self.database.commit(self.conn)

    def close(self) -> None:
        self.conn.close()

    # What the raw side does for each figure.

    def encode(
        self, base: TimeBase, batch: Sequence[Submitted]
    ) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
        """Task rows and dependency rows of new tasks, JSON columns encoded by `json`."""
        now = time.time_ns()
        rows: list[tuple[Any, ...]] = []
        dep_rows: list[tuple[Any, ...]] = []
        queued = TaskStatus.QUEUED.value
        for m in batch:
            s = m.spec
            deps = "[]"
            if s.deps:
                items: list[dict[str, Any]] = []
                for ordinal, d in enumerate(s.deps):
                    if isinstance(d.target, ById):
                        items.append({"id": d.target.id, "on": d.on})
                        dep_rows.append((m.id, ordinal, d.target.id, None))
                    else:
                        items.append({"key": d.target.key, "on": d.on})
                        dep_rows.append((m.id, ordinal, None, d.target.key))
                deps = _dumps(items)
            rows.append(
                (
                    m.id,
                    m.seq,
                    base.unix_ns + m.arrival,
                    s.pool,
                    s.kind,
                    int(s.priority),
                    s.key,
                    s.key,
                    s.payload,
                    None,
                    None,
                    None,
                    None,
                    None,
                    None,
                    None,
                    deps,
                    _dumps(s.resources) if s.resources else "{}",
                    _dumps(sorted(s.tags)) if s.tags else "[]",
                    _dumps(s.labels) if s.labels else "{}",
                    s.tenant,
                    queued,
                    False,
                    0,
                    now,
                    None,  # finished_unix_ns
                    None,
                    None,
                )
            )
        return rows, dep_rows

    def insert(
        self, rows: list[tuple[Any, ...]], dep_rows: list[tuple[Any, ...]], *, copy: bool = False
    ) -> None:
        """Insert encoded rows in one transaction: executemany, or COPY (psycopg)."""
        with self.transaction() as cur:
            if copy:
                with cur.copy(self.copy_tasks) as c:
                    for row in rows:
                        c.write_row(row)
                if dep_rows:
                    with cur.copy(self.copy_deps) as c:
                        for row in dep_rows:
                            c.write_row(row)
                return
            cur.executemany(self.insert_tasks, rows)
            if dep_rows:
                cur.executemany(self.insert_deps, dep_rows)

    def submit(self, base: TimeBase, batch: Sequence[Submitted], *, copy: bool = False) -> None:
        """Encode and insert new tasks and their dependency rows, in one transaction."""
        rows, dep_rows = self.encode(base, batch)
        self.insert(rows, dep_rows, copy=copy)

    def transition(
        self, base: TimeBase, batch: Sequence[StatusChanged], outputs: dict[int, bytes | None]
    ) -> None:
        """The store's transition UPDATE; a finished task's output rides along and its
        dependency rows go."""
        at = base.unix_ns
        with self.transaction() as cur:
            if outputs:
                cur.executemany(
                    self.finished,
                    [
                        (
                            True,
                            m.status.value,
                            True,
                            m.attempt,
                            at + m.at,
                            True,
                            at + m.at,
                            m.message,
                            outputs[m.id],
                            m.id,
                        )
                        for m in batch
                    ],
                )
                ids = [m.id for m in batch]
                for start in range(0, len(ids), execution.IN_CHUNK):
                    chunk = ids[start : start + execution.IN_CHUNK]
                    cur.execute(self.delete_deps_in(len(chunk)), chunk)
            else:
                cur.executemany(
                    self.running,
                    [
                        (
                            False,
                            m.status.value,
                            False,
                            m.attempt,
                            at + m.at,
                            False,
                            at + m.at,
                            m.message,
                            m.id,
                        )
                        for m in batch
                    ],
                )

    def recover(self) -> list[tuple[Any, ...]]:
        """Fetch the live tasks in id order, decoding their JSON columns.

        Collection is off meanwhile, as in the store's recovery: the decoded objects are all
        kept, so a collection pass finds no garbage, only cost.
        """
        cur = self.conn.cursor()
        cur.execute(self.live)
        loads = json.loads
        out = []
        # The payload, retry, deps, resources, tags, labels and tenant (SPEC_COLUMNS' order).
        s = self._spec_at
        pay, retry, deps, res, tags, labels, tenant = (
            s + 4,
            s + 11,
            s + 12,
            s + 13,
            s + 14,
            s + 15,
            s + 16,
        )
        enabled = gc.isenabled()
        gc.disable()
        try:
            while chunk := cur.fetchmany(1000):
                for r in chunk:
                    out.append(
                        (
                            *r[:pay],
                            bytes(r[pay]),
                            *r[pay + 1 : retry],
                            None if r[retry] is None else loads(r[retry]),
                            loads(r[deps]),
                            loads(r[res]),
                            loads(r[tags]),
                            loads(r[labels]),
                            r[tenant],
                        )
                    )
        finally:
            if enabled:
                gc.enable()
        cur.close()
        self.database.end_read(self.conn)
        return out

    def prune(self, cutoff: int, limit: int) -> int:
        """The store's prune DELETE (dependency checks by id and by key), `limit` rows per
        transaction, until a batch comes back short; then, where the store vacuums after a
        prune (PostgreSQL), the same VACUUM."""
        params = self._prune.construct_params({"cutoff": cutoff, "limit": limit})
        args = [params[k] for k in self._prune_keys]
        total = 0
        while True:
            with self.transaction() as cur:
                cur.execute(self.prune_sql, args)
                count: int = cur.rowcount
            total += count
            if count < limit:
                break
        if total and self.vacuum_sql is not None:
            self.conn.autocommit = True
            try:
                self.conn.execute(self.vacuum_sql)
            finally:
                self.conn.autocommit = False
        return total
