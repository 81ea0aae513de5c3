"""The raw-driver baselines: the same tables and rows through the bare DB-API driver.

The raw side does what a careful hand-written store would do and no more: it encodes the same
JSON columns, executemany's plain statements (compiled once from Core, so both sides send the
same SQL shapes), and commits. It does not fence, fold, validate, or check idempotency.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import sqlite3
import time
from collections.abc import Iterator, Sequence
from typing import Any, Literal, cast

from sqlalchemy import (
    URL,
    Delete,
    Index,
    MetaData,
    Table,
    bindparam,
    delete,
    false,
    insert,
    null,
    select,
    true,
    update,
)
from sqlalchemy.engine.interfaces import Dialect
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import ClauseElement

from .. import codec, dialects
from ..model import (
    ById,
    StatusChanged,
    Submitted,
    TaskStatus,
    TimeBase,
)
from ..schema import MYSQL_TABLE_ARGS, NAMING_CONVENTION, task_deps, tasks

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), sort_keys=True).encode


# The raw driver: the same tables, the same rows, plain executemany.


def raw_tables(dialect: Dialect) -> tuple[Table, Table]:
    """`bench_raw_tasks` and `bench_raw_task_deps`: copies of the store's tables."""
    meta = MetaData(naming_convention=NAMING_CONVENTION)
    args = dict(MYSQL_TABLE_ARGS)
    if dialects.name(dialect) == "mysql":
        args["mysql_collate"] = dialects.mysql_collation(dialect)

    def copy(table: Table, name: str) -> Table:
        # Indexes anew, so the naming convention names them after the copy.
        out = Table(name, meta, *(c._copy() for c in table.columns), **args)
        for index in table.indexes:
            Index(None, *(out.c[c.name] for c in index.columns), unique=index.unique)
        return out

    return copy(tasks, "bench_raw_tasks"), copy(task_deps, "bench_raw_task_deps")


class RawDriver:
    """A bare DB-API connection running statements compiled once from Core."""

    def __init__(self, url: URL, dialect: Dialect, *, full_sync: bool) -> None:
        self.which = dialects.name(dialect)
        # The driver's own positional style, as a hand-written caller would bind rows.
        dialect_class: Any = type(dialect)
        self._compile_dialect: Dialect = dialect_class(
            paramstyle="qmark" if self.which == "sqlite" else "format"
        )
        self.conn: Any
        if self.which == "sqlite":
            self.conn = sqlite3.connect(url.database or "", isolation_level=None)
            for pragma in (
                "PRAGMA busy_timeout = 5000",
                "PRAGMA journal_mode = WAL",
                f"PRAGMA synchronous = {'FULL' if full_sync else 'NORMAL'}",
            ):
                self.conn.execute(pragma)
        elif self.which == "postgresql":
            psycopg: Any = importlib.import_module("psycopg")
            kw = {
                "host": url.host,
                "port": url.port,
                "user": url.username,
                "password": url.password,
                "dbname": url.database,
            }
            self.conn = psycopg.connect(**{k: v for k, v in kw.items() if v is not None})
        else:
            pymysql: Any = importlib.import_module("pymysql")
            self.conn = pymysql.connect(
                host=url.host or "localhost",
                port=url.port or 3306,
                user=url.username or "root",
                password=url.password or "",
                database=url.database,
                charset="utf8mb4",
                autocommit=False,
            )
        self.tasks, self.deps = raw_tables(dialect)
        self.insert_tasks, columns = self.sql(insert(self.tasks))
        if columns != tuple(c.name for c in self.tasks.columns):
            raise RuntimeError(f"unexpected insert column order {columns}")
        self.insert_deps, _ = self.sql(insert(self.deps))
        t = self.tasks
        self.running, _ = self.sql(
            update(t)
            .where(t.c.id == bindparam("b_id"))
            .values(
                status=bindparam("b_status"),
                terminal=bindparam("b_terminal"),
                attempt=bindparam("b_attempt"),
                updated_unix_ns=bindparam("b_at"),
            )
        )
        self.finished, _ = self.sql(
            update(t)
            .where(t.c.id == bindparam("b_id"))
            .values(
                status=bindparam("b_status"),
                terminal=bindparam("b_terminal"),
                attempt=bindparam("b_attempt"),
                updated_unix_ns=bindparam("b_at"),
                live_key=null(),
                output=bindparam("b_output"),
            )
        )
        self.live, _ = self.sql(
            select(
                t.c.id,
                t.c.seq,
                t.c.arrival_unix_ns,
                t.c.attempt,
                *(t.c[name] for name in codec.SPEC_COLUMNS),
            )
            .where(t.c.terminal == false())
            .order_by(t.c.id)
        )
        self._prunable = (
            select(t.c.id)
            .where(t.c.terminal == true(), t.c.updated_unix_ns < bindparam("cutoff"))
            .order_by(t.c.updated_unix_ns)
            .limit(bindparam("limit"))
            .compile(dialect=self._compile_dialect)
        )
        self.prunable = str(self._prunable)
        self._prunable_keys = tuple(self._prunable.positiontup or ())
        self._in_lists: dict[tuple[str, int], str] = {}

    def sql(self, stmt: ClauseElement) -> tuple[str, tuple[str, ...]]:
        """The driver SQL of a Core statement and the order of its parameters."""
        compiled = cast(SQLCompiler, stmt.compile(dialect=self._compile_dialect))
        return str(compiled), tuple(compiled.positiontup or ())

    def delete_in(self, table: Literal["tasks", "deps"], count: int) -> str:
        """DELETE ... WHERE id IN (count placeholders), compiled once per count."""
        sql = self._in_lists.get((table, count))
        if sql is None:
            stmt: Delete
            if table == "tasks":
                column = self.tasks.c.id
                stmt = delete(self.tasks)
            else:
                column = self.deps.c.task_id
                stmt = delete(self.deps)
            stmt = stmt.where(column.in_([bindparam(f"i{n}") for n in range(count)]))
            sql = self.sql(stmt)[0]
            self._in_lists[(table, count)] = sql
        return sql

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Any]:
        """A cursor in a transaction (BEGIN IMMEDIATE on SQLite, as the store does)."""
        if self.which == "sqlite":
            self.conn.execute("BEGIN IMMEDIATE")
        cursor = self.conn.cursor()
        try:
            yield cursor
        except BaseException:
            self.conn.rollback()
            raise
        finally:
            cursor.close()
        if self.which == "sqlite":
            self.conn.execute("COMMIT")
        else:
            self.conn.commit()

    def close(self) -> None:
        self.conn.close()

    # What the raw side does for each figure.

    def submit(self, base: TimeBase, batch: Sequence[Submitted]) -> None:
        """Encode and insert new tasks and their dependency rows, in one transaction."""
        now = time.time_ns()
        rows: list[tuple[Any, ...]] = []
        dep_rows: list[tuple[Any, ...]] = []
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
                    TaskStatus.QUEUED.value,
                    False,
                    0,
                    now,
                    None,
                    None,
                )
            )
        with self.transaction() as cur:
            cur.executemany(self.insert_tasks, rows)
            if dep_rows:
                cur.executemany(self.insert_deps, dep_rows)

    def transition(
        self, base: TimeBase, batch: Sequence[StatusChanged], outputs: dict[int, bytes | None]
    ) -> None:
        """Status updates (with outputs; finished tasks lose their dependency rows)."""
        with self.transaction() as cur:
            if outputs:
                cur.executemany(
                    self.finished,
                    [
                        (m.status.value, True, m.attempt, base.unix_ns + m.at, outputs[m.id], m.id)
                        for m in batch
                    ],
                )
                cur.execute(self.delete_in("deps", len(batch)), [m.id for m in batch])
            else:
                cur.executemany(
                    self.running,
                    [(m.status.value, False, m.attempt, base.unix_ns + m.at, m.id) for m in batch],
                )

    def recover(self) -> list[tuple[Any, ...]]:
        """Fetch the live tasks in id order, decoding their JSON columns."""
        cur = self.conn.cursor()
        cur.execute(self.live)
        loads = json.loads
        out = []
        while chunk := cur.fetchmany(1000):
            for r in chunk:
                out.append(
                    (
                        *r[:8],
                        bytes(r[8]),
                        *r[9:15],
                        None if r[15] is None else loads(r[15]),
                        loads(r[16]),
                        loads(r[17]),
                        loads(r[18]),
                        loads(r[19]),
                        r[20],
                    )
                )
        cur.close()
        if self.which != "sqlite":
            self.conn.commit()
        return out

    def _prunable_params(self, cutoff: int, limit: int) -> list[Any]:
        params = self._prunable.construct_params({"cutoff": cutoff, "limit": limit})
        return [params[k] for k in self._prunable_keys]

    def prune(self, cutoff: int, limit: int) -> int:
        """Delete finished tasks updated before `cutoff`, `limit` per transaction."""
        total = 0
        while True:
            with self.transaction() as cur:
                cur.execute(self.prunable, self._prunable_params(cutoff, limit))
                ids = [r[0] for r in cur.fetchall()]
                if ids:
                    cur.execute(self.delete_in("tasks", len(ids)), ids)
            total += len(ids)
            if len(ids) < limit:
                return total
