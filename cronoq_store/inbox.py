"""The inbox: apps enqueue task specs in their own transactions; the leader drains them.

An app calls `enqueue(conn, spec)` on its own `Connection` or ORM `Session`, inside its own
transaction: the row commits with the app's writes or not at all, and nothing here commits.
The leader reads the oldest rows (`SqlStore.read_inbox`), turns each into a task, and commits
`InboxTaken` for it in the same fenced batch as its `Submitted`, so an item becomes at most one
task and a fenced leader consumes nothing (see docs/guarantees.md).

Times in an enqueued spec (deadline, fixed start) are Unix nanoseconds, i.e. engine times under
`TimeBase(0)`: an app knows no engine's time base. The leader reads them under its own base.
"""

from __future__ import annotations

__all__ = ["enqueue", "enqueue_async", "enqueue_many", "enqueue_many_async"]

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any, Final

from sqlalchemy import (
    BigInteger,
    BindParameter,
    Connection,
    Delete,
    Insert,
    MetaData,
    Select,
    Table,
    bindparam,
    delete,
    func,
    insert,
    select,
    true,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Dialect, Engine
from sqlalchemy.orm import Session

from . import codec, dialects, execution
from .config import DEFAULT_MAX_PAYLOAD
from .errors import CorruptValue, InvalidValue, SchemaError
from .model import InboxItem, TaskSpec, TimeBase
from .repository.folding import check_payload
from .schema import check_schema_name, inbox, inbox_rejects

if TYPE_CHECKING:  # sync users never import the asyncio extension
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

log = logging.getLogger(__name__)

CHANNEL: Final = "cronoq_inbox"
"""The PostgreSQL NOTIFY channel an enqueue signals on commit. One for every schema: a wake-up
meant for another schema's store costs its listener one cheap check, nothing more."""
UNIX: Final = TimeBase(0)
"""The time base of enqueued specs: their times are Unix nanoseconds."""
SLOW_CHECK_S: Final = 1.0
"""While listening, PostgreSQL still checks this often (seconds): a notify that never came
(an enqueue by hand, in SQL) delays an item by at most this long."""


# Statements.


@cache
def insert_stmt() -> Insert:
    """One inbox row, stamped with the database's clock (the host's on SQLite)."""
    return insert(inbox).values(enqueued_unix_ns=dialects.db_now_ns())


def notify_call() -> Any:
    """PostgreSQL: wake listening leaders when (and only if) this transaction commits."""
    return func.pg_notify(CHANNEL, "")


@cache
def notify_stmt() -> Select[Any]:
    """`notify_call` as a statement of its own."""
    return select(notify_call())


_EMPTY: Final = {"deps": "[]", "resources": "{}", "tags": "[]", "labels": "{}"}
"""The JSON columns' empty values, which `insert_many_stmt` writes for a NULL."""


@cache
def insert_many_stmt(*, notify: bool, table: Table = inbox) -> Insert:
    """PostgreSQL: any number of inbox rows in one statement, each column bound as one array
    (`array_param`) and unnested in order; their ids come back, and to `notify` the
    notification is taken once, in the same round trip.

    The rows are inserted in their order (`ORDER BY` the ordinality), so the sequence numbers
    them in that order: the ids returned, sorted, are the rows' ids in order.
    """
    source = (
        func.unnest(*(array_param(name) for name in codec.SPEC_COLUMNS))
        .table_valued(*codec.SPEC_COLUMNS, with_ordinality="ordinal")
        .render_derived(name="spec")
    )
    values = (
        source.c[name] if name not in _EMPTY else func.coalesce(source.c[name], _EMPTY[name])
        for name in codec.SPEC_COLUMNS
    )
    rows = select(dialects.db_now_ns(), *values)
    if notify:
        # A CTE scanned once: one notification for the statement, not one per row.
        woken = select(notify_call().label("woken")).cte("cronoq_woken")
        rows = rows.select_from(source.join(woken, true()))
    else:
        rows = rows.select_from(source)
    rows = rows.order_by(source.c.ordinal)
    columns = ["enqueued_unix_ns", *codec.SPEC_COLUMNS]
    return insert(table).from_select(columns, rows).returning(table.c.id)


def array_param(name: str) -> BindParameter[Any]:
    """The array of column `name`'s values, one per row (`insert_many_stmt`)."""
    return bindparam(f"a_{name}", type_=ARRAY(inbox.c[name].type))


@cache
def _inbox_in(schema: str) -> Table:
    """The inbox table in `schema`, for statements compiled once to the driver's SQL."""
    return inbox.to_metadata(MetaData(), schema=schema)


_BINARY: dict[tuple[type[Dialect], str | None, bool], tuple[str, dict[str, Any]]] = {}


def _binary(dialect: Dialect, schema: str | None, *, notify: bool) -> tuple[str, dict[str, Any]]:
    """`insert_many_stmt` as psycopg's SQL with its arrays sent in binary (`%(a_...)b`), and
    its other parameters' values: psycopg dumps a text array element by element through an
    escaping regex, a binary one without (a third of the CPU of a 100-row enqueue_many)."""
    key = (type(dialect), schema, notify)
    hit = _BINARY.get(key)
    if hit is None:
        table = inbox if schema is None else _inbox_in(schema)
        compiled = insert_many_stmt(notify=notify, table=table).compile(dialect=dialect)
        sql = str(compiled)
        params = dict(compiled.construct_params({f"a_{n}": None for n in codec.SPEC_COLUMNS}))
        for name in codec.SPEC_COLUMNS:
            placeholder = f"%(a_{name})s"
            if sql.count(placeholder) != 1:
                raise RuntimeError(f"unexpected placeholder {placeholder} in {sql}")
            sql = sql.replace(placeholder, f"%(a_{name})b")
            del params[f"a_{name}"]
        hit = _BINARY.setdefault(key, (sql, params))
    return hit


@cache
def insert_notify_stmt() -> Insert:
    """PostgreSQL: one inbox row, its id and the notification in one round trip."""
    return insert_stmt().returning(inbox.c.id, notify_call())


@cache
def insert_into_stmt(table: Table) -> Insert:
    """`insert_stmt` on `table` (the inbox, or the inbox in a `schema=`)."""
    return insert(table).values(enqueued_unix_ns=dialects.db_now_ns())


@cache
def insert_one_stmt(table: Table, *, notify: bool) -> Insert:
    """One inbox row of `table` and its id (and, PostgreSQL, to `notify`, the notification),
    in one statement run on the driver's cursor (`execution.run_stmt`)."""
    stmt = insert_into_stmt(table)
    return stmt.returning(table.c.id, notify_call()) if notify else stmt.returning(table.c.id)


@cache
def last_rowid_stmt() -> Select[Any]:
    """SQLite: the rowid its connection inserted last."""
    return select(func.last_insert_rowid())


@cache
def oldest_stmt(*, after: bool, budget: bool = False) -> Select[Any]:
    """The oldest inbox rows (above `after`), in id order, at most `limit`; with `budget`,
    only as many as start within `budget` bytes of payload (the first always does): the
    sizes of the `limit` oldest are summed in id order first (`length` reads no payload on
    PostgreSQL, whose sizes are in the TOAST header), so a read holds at most the budget and
    one more payload, whatever `limit`."""
    columns = (inbox.c.id, inbox.c.enqueued_unix_ns, *(inbox.c[n] for n in codec.SPEC_COLUMNS))
    if not budget:
        stmt = select(*columns)
        if after:
            stmt = stmt.where(inbox.c.id > bindparam("after"))
        return stmt.order_by(inbox.c.id).limit(bindparam("limit"))
    size = func.coalesce(func.length(inbox.c.payload), 0)
    oldest = select(inbox.c.id, size.label("size"))
    if after:
        oldest = oldest.where(inbox.c.id > bindparam("after"))
    next_rows = oldest.order_by(inbox.c.id).limit(bindparam("limit")).subquery("cronoq_next")
    before = func.sum(next_rows.c.size).over(order_by=next_rows.c.id) - next_rows.c.size
    sized = select(next_rows.c.id, before.label("before")).subquery("cronoq_sized")
    return (
        select(*columns)
        .join_from(inbox, sized, sized.c.id == inbox.c.id)
        .where(sized.c.before < bindparam("budget", type_=BigInteger()))
        .order_by(inbox.c.id)
    )


@cache
def first_id_stmt() -> Select[Any]:
    """The oldest inbox id, if any: one primary-key probe, the cheap poll."""
    return select(inbox.c.id).order_by(inbox.c.id).limit(1)


@cache
def depth_stmt() -> Select[int, Any]:
    """How many items wait, and when the oldest was enqueued (operators' status)."""
    return select(func.count(), func.min(inbox.c.enqueued_unix_ns))


@cache
def rejects_count_stmt() -> Select[int]:
    """How many rows were set aside."""
    return select(func.count()).select_from(inbox_rejects)


def depth(conn: Connection) -> dict[str, Any]:
    """The inbox's depth, the age (seconds) of its oldest item and how many rows were set aside."""
    items, oldest = conn.execute(depth_stmt()).one()
    rejects = conn.execute(rejects_count_stmt()).scalar_one()
    age = None if oldest is None else round(max(0, time.time_ns() - oldest) / 1e9, 3)
    return {"items": items, "oldest_age_s": age, "set_aside": rejects}


@cache
def reject_delete_stmt() -> Delete:
    """Take one undecodable row out of the inbox (moving it aside)."""
    return delete(inbox).where(inbox.c.id == bindparam("b_id"))


@cache
def reject_insert_stmt() -> Insert:
    """Keep an undecodable row for inspection."""
    return insert(inbox_rejects)


@cache
def rejects_stmt() -> Select[Any]:
    """Rows set aside, oldest first."""
    return select(inbox_rejects).order_by(inbox_rejects.c.inbox_id).limit(bindparam("limit"))


# Enqueueing, in the caller's transaction.


MAX_PAYLOAD_SETTING: Final = (
    "enqueue's max_payload_bytes; the store's StoreConfig.max_payload_bytes"
)


def _rows(specs: Iterable[TaskSpec], max_payload: int | None) -> list[dict[str, Any]]:
    """The inbox rows of `specs`; refuses (`InvalidValue`) any that cannot be stored, or
    whose payload is longer than `max_payload`."""
    if max_payload is not None and (
        not isinstance(max_payload, int) or isinstance(max_payload, bool) or max_payload < 1
    ):
        raise InvalidValue("max_payload_bytes must be a positive int or None")
    rows = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, TaskSpec):
            raise InvalidValue(f"specs[{i}] must be a TaskSpec, not {type(spec).__name__}")
        check_payload(spec.payload, max_payload, MAX_PAYLOAD_SETTING)
        rows.append(codec.spec_columns(UNIX, spec))
    return rows


def _arrays(rows: list[dict[str, Any]]) -> dict[str, list[Any] | None]:
    """The arrays `insert_many_stmt` unnests, one per column. A column NULL (or, for a JSON
    one, empty) in every row is sent as one NULL, which `unnest` pads to the rows' length:
    most specs leave most fields unset, and psycopg dumps an array element by element."""
    arrays: dict[str, list[Any] | None] = {}
    for name in codec.SPEC_COLUMNS:
        values = [row[name] for row in rows]
        unset = values.count(_EMPTY.get(name))
        arrays[f"a_{name}"] = None if unset == len(values) else values
    return arrays


def _options(schema: str | None) -> Mapping[str, Any]:
    if schema is None:
        return {}
    check_schema_name(schema)
    return {"schema_translate_map": {None: schema}}


def _write(
    conn: Connection, rows: list[dict[str, Any]], options: Mapping[str, Any], *, notify: bool
) -> list[int]:
    """Insert `rows` in order and return their ids; on PostgreSQL, to `notify`, notify on
    commit, in the same round trip as the ids."""
    if not rows:
        return []
    stmt = insert_stmt()
    dialect = conn.dialect
    postgresql = dialects.name(dialect) == "postgresql"
    if len(rows) > 1 and postgresql:
        arrays = _arrays(rows)
        if dialect.driver == "psycopg":
            sql, params = _binary(dialect, _schema(conn, options), notify=notify)
            result = conn.exec_driver_sql(sql, {**params, **arrays})
        else:
            result = conn.execute(
                insert_many_stmt(notify=notify), arrays, execution_options=options
            )
        ids = sorted(result.scalars())  # numbered in row order (`insert_many_stmt`)
    elif len(rows) > 1 and dialects.name(dialect) == "sqlite" and _one_transaction(conn):
        # One executemany, no RETURNING (which SQLAlchemy runs a row at a time here to keep
        # the order): this transaction holds SQLite's write lock from its first INSERT on, so
        # AUTOINCREMENT numbers the rows one after another, the last one `last_insert_rowid`.
        execution.run_many(conn, insert_into_stmt(_table(options)), rows)
        last = int(execution.run_stmt(conn, last_rowid_stmt()).rows[0][0])
        ids = list(range(last - len(rows) + 1, last + 1))
    elif len(rows) == 1 and dialects.says_lastrowid(dialect):
        # SQLAlchemy's execution is most of a small enqueue's CPU: the driver's cursor runs
        # the statement compiled once, unless something observes the connection's statements.
        ids = [execution.inserted_id(conn, insert_into_stmt(_table(options)), rows[0])]
    elif len(rows) == 1 and dialect.insert_returning:  # PostgreSQL: the notification with it
        stmt = insert_one_stmt(_table(options), notify=notify and postgresql)
        ran = execution.run_stmt(conn, stmt, rows[0])
        ids = [int(ran.rows[0][0])]
    elif postgresql and notify:
        [row] = rows
        ids = [int(conn.execute(insert_notify_stmt(), row, execution_options=options).one()[0])]
    elif len(rows) > 1 and (returned := _values_returning(conn, rows, options)) is not None:
        ids = sorted(returned)  # numbered in row order, as the rows go in
    elif len(rows) > 1 and dialect.insert_executemany_returning_sort_by_parameter_order:
        ids = list(
            conn.execute(
                stmt.returning(inbox.c.id, sort_by_parameter_order=True),
                rows,
                execution_options=options,
            ).scalars()
        )
    else:
        ids = []
        for row in rows:
            key: Any = conn.execute(stmt, row, execution_options=options).inserted_primary_key
            ids.append(int(key[0]))
    return ids


def _values_returning(
    conn: Connection, rows: list[dict[str, Any]], options: Mapping[str, Any]
) -> list[Any] | None:
    """MariaDB: the ids of `rows`, inserted by one INSERT ... VALUES of every row, RETURNING
    (`execution.insert_returning`), or None where that is not to be had."""
    if not conn.dialect.insert_returning:
        return None
    table = _table(options)
    return execution.insert_returning(conn, insert_into_stmt(table), table.c.id, rows)


def _table(options: Mapping[str, Any]) -> Table:
    """The inbox, or for a `schema=` argument the inbox in that schema."""
    return inbox if not options else _inbox_in(options["schema_translate_map"][None])


def _one_transaction(conn: Connection) -> bool:
    """SQLite: whether an executemany now runs in one transaction (one begun, or one the
    driver begins before a write), not a transaction per row (the driver's autocommit)."""
    driver: Any = conn.connection.driver_connection
    if driver.in_transaction:
        return True
    legacy = getattr(driver, "autocommit", -1) == -1  # sqlite3.LEGACY_TRANSACTION_CONTROL
    return legacy and driver.isolation_level is not None


def _write_or_explain(
    conn: Connection, rows: list[dict[str, Any]], options: Mapping[str, Any], *, notify: bool
) -> list[int]:
    """`_write`, its driver errors translated: where the inbox table is not, a `SchemaError`
    naming the schema searched and `schema=` (an app's usual slip is to leave it out)."""
    try:
        return _write(conn, rows, options, notify=notify)
    except sa_exc.DBAPIError as exc:
        if not dialects.missing_table(exc):
            raise dialects.translate(exc) from exc
        dialects.hide_parameters(exc)
        given = (options.get("schema_translate_map") or {}).get(None)
        raise SchemaError(
            f"no table {inbox.name} in {_searched(conn, given)}: pass enqueue(..., schema=) "
            f"the schema of the store's tables (its StoreConfig.schema), or create them there "
            f"(`cronoq-store upgrade`)"
        ) from exc
    except sa_exc.SQLAlchemyError as exc:
        raise dialects.translate(exc) from exc


def _searched(conn: Connection, given: str | None) -> str:
    """Where a statement without a schema looked: the schema given, or the connection's own."""
    kind = {"postgresql": "PostgreSQL schema", "mysql": "MySQL database"}.get(
        dialects.name(conn.dialect)
    )
    if kind is None:
        return "this SQLite database"
    if given is not None:
        return f"{kind} {given!r} (schema=)"
    return f"{kind} {conn.dialect.default_schema_name!r} (the connection's default; no schema=)"


def _schema(conn: Connection, options: Mapping[str, Any]) -> str | None:
    """The schema a statement without one is translated to by `options` or by `conn`."""
    translate = options.get("schema_translate_map") or conn.get_execution_options().get(
        "schema_translate_map"
    )
    schema: str | None = (translate or {}).get(None)
    return schema


def _connection(conn: Connection | Session) -> Connection:
    if isinstance(conn, Session):
        return conn.connection()  # joins (or begins) the session's transaction
    if isinstance(conn, Connection):
        return conn
    raise InvalidValue(f"enqueue needs a Connection or Session, not {type(conn).__name__}")


def enqueue(
    conn: Connection | Session,
    spec: TaskSpec,
    *,
    schema: str | None = None,
    notify: bool = True,
    max_payload_bytes: int | None = DEFAULT_MAX_PAYLOAD,
) -> int:
    """Write `spec` into the inbox in the caller's transaction.

    Never commits: the item exists once the caller's transaction commits, and a rollback leaves
    no trace.

    PostgreSQL: the transaction also notifies a listening leader when it commits, unless not
    `notify`. A notifying commit holds a database-wide lock through its WAL flush, so where
    commits are slow such commits run one at a time (docs/tuning.md, "Waking the leader").
    Without it the leader finds the item by its probe: every `StoreConfig.inbox_poll` when it
    polls (`inbox_listen=False`, or `transaction_pooler=True`, behind which no notification
    arrives anyway); within `SLOW_CHECK_S` if it listens.

    Args:
        conn: The app's `Connection`, or its ORM `Session` (its transaction is joined).
        spec: The task to create once a leader drains the inbox.
        schema: The PostgreSQL schema (MySQL database) of the store's tables, if any: the
            store's `StoreConfig.schema`.
        notify: PostgreSQL: wake a listening leader when the transaction commits (above).
        max_payload_bytes: The longest payload accepted (`InvalidValue` past it): the
            store's `StoreConfig.max_payload_bytes` (16 MiB by default), whose leader sets
            aside an item longer than its own; None accepts any.

    Returns:
        The item's inbox id.

    Raises:
        InvalidValue: A spec that cannot be stored (a payload over `max_payload_bytes`
            among them), a bad `schema`, or `conn` of another type (before anything is
            written).
        SchemaError: No cronoq inbox table where the statement looked: the message names
            the schema searched (usually a store in a schema and no `schema=`).
        StoreUnavailable: The database could not be reached (the caller's transaction
            is then the caller's to roll back).
        StoreError: Anything else the database refused; never a driver exception.
    """
    return enqueue_many(
        conn, [spec], schema=schema, notify=notify, max_payload_bytes=max_payload_bytes
    )[0]


def enqueue_many(
    conn: Connection | Session,
    specs: Iterable[TaskSpec],
    *,
    schema: str | None = None,
    notify: bool = True,
    max_payload_bytes: int | None = DEFAULT_MAX_PAYLOAD,
) -> list[int]:
    """`enqueue` for several specs at once (all or none).

    Args:
        conn: The app's `Connection`, or its ORM `Session`.
        specs: The tasks, in order.
        schema: The schema of the store's tables, as for `enqueue`.
        notify: As for `enqueue`.
        max_payload_bytes: As for `enqueue`.

    Returns:
        Their inbox ids, in order.

    Raises:
        InvalidValue: A spec that cannot be stored (a payload over `max_payload_bytes`
            among them), a bad `schema`, or `conn` of another type (before anything is
            written).
        SchemaError: No cronoq inbox table where the statement looked: the message names
            the schema searched (usually a store in a schema and no `schema=`).
        StoreUnavailable: The database could not be reached (the caller's transaction
            is then the caller's to roll back).
        StoreError: Anything else the database refused; never a driver exception.
    """
    rows = _rows(specs, max_payload_bytes)
    options = _options(schema)
    return _write_or_explain(_connection(conn), rows, options, notify=_notify(notify))


def _notify(notify: object) -> bool:
    if not isinstance(notify, bool):
        raise InvalidValue(f"notify must be a bool, not {type(notify).__name__}")
    return notify


async def enqueue_async(
    conn: AsyncConnection | AsyncSession,
    spec: TaskSpec,
    *,
    schema: str | None = None,
    notify: bool = True,
    max_payload_bytes: int | None = DEFAULT_MAX_PAYLOAD,
) -> int:
    """`enqueue` on an asyncio `AsyncConnection` or `AsyncSession`.

    Args:
        conn: The app's `AsyncConnection` or `AsyncSession`.
        spec: The task to create once a leader drains the inbox.
        schema: The schema of the store's tables, as for `enqueue`.
        notify: As for `enqueue`.
        max_payload_bytes: As for `enqueue`.

    Returns:
        The item's inbox id.

    Raises:
        InvalidValue: A spec that cannot be stored (a payload over `max_payload_bytes`
            among them), a bad `schema`, or `conn` of another type (before anything is
            written).
        SchemaError: No cronoq inbox table where the statement looked: the message names
            the schema searched (usually a store in a schema and no `schema=`).
        StoreUnavailable: The database could not be reached (the caller's transaction
            is then the caller's to roll back).
        StoreError: Anything else the database refused; never a driver exception.
    """
    ids = await enqueue_many_async(
        conn, [spec], schema=schema, notify=notify, max_payload_bytes=max_payload_bytes
    )
    return ids[0]


async def enqueue_many_async(
    conn: AsyncConnection | AsyncSession,
    specs: Iterable[TaskSpec],
    *,
    schema: str | None = None,
    notify: bool = True,
    max_payload_bytes: int | None = DEFAULT_MAX_PAYLOAD,
) -> list[int]:
    """`enqueue_many` on an asyncio `AsyncConnection` or `AsyncSession`.

    Args:
        conn: The app's `AsyncConnection` or `AsyncSession`.
        specs: The tasks, in order.
        schema: The schema of the store's tables, as for `enqueue`.
        notify: As for `enqueue`.
        max_payload_bytes: As for `enqueue`.

    Returns:
        Their inbox ids, in order.

    Raises:
        InvalidValue: A spec that cannot be stored (a payload over `max_payload_bytes`
            among them), a bad `schema`, or `conn` of another type (before anything is
            written).
        SchemaError: No cronoq inbox table where the statement looked: the message names
            the schema searched (usually a store in a schema and no `schema=`).
        StoreUnavailable: The database could not be reached (the caller's transaction
            is then the caller's to roll back).
        StoreError: Anything else the database refused; never a driver exception.
    """
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

    rows = _rows(specs, max_payload_bytes)
    options = _options(schema)
    notify = _notify(notify)
    if isinstance(conn, AsyncSession):
        conn = await conn.connection()
    if not isinstance(conn, AsyncConnection):
        raise InvalidValue(
            f"enqueue_many_async needs an AsyncConnection or AsyncSession, "
            f"not {type(conn).__name__}"
        )
    return await conn.run_sync(lambda c: _write_or_explain(c, rows, options, notify=notify))


# The leader's side.


@dataclass(frozen=True, slots=True)
class Read:
    """One read of the inbox: the items, and the undecodable rows found (to move aside)."""

    items: list[InboxItem]
    bad: list[dict[str, Any]]
    """Undecodable rows, each with a "reason"."""
    last_id: int | None
    """The highest id looked at (items and bad rows alike)."""


def read(
    conn: Connection,
    *,
    base: TimeBase,
    limit: int,
    after: int | None,
    stored: codec.StoredSpecs | None = None,
    budget: int | None = None,
    max_payload: int | None = None,
) -> Read:
    """The oldest `limit` rows above `after` (as many as start within `budget` bytes of
    payload, when given: `oldest_stmt`), decoded under `base` (times shift from Unix); each
    spec's columns remembered in `stored`, for the commit that drains it. A row whose payload
    is longer than `max_payload` is bad (set aside, as an undecodable one): a commit would
    refuse its task, and every drain after it."""
    items: list[InboxItem] = []
    bad: list[dict[str, Any]] = []
    last: int | None = None
    params: dict[str, Any] = {"limit": limit}
    if after is not None:
        params["after"] = after
    if budget is not None:
        params["budget"] = budget
    stmt = oldest_stmt(after=after is not None, budget=budget is not None)
    rows = execution.run_stmt(conn, stmt, params).rows
    spec_dict, item = codec.spec_dict, codec.inbox_item
    # Plain tuples from the driver (SQLAlchemy's rows and psycopg's fetchone per row cost as
    # much as decoding the spec), the spec's columns made a dict once.
    with execution.collection_paused():  # what is decoded is kept: no garbage to find
        for inbox_id, enqueued, *values in rows:
            last = inbox_id
            columns = spec_dict(values)
            try:
                spec = codec.spec_from_values(base, *values)
                if max_payload is not None and len(spec.payload) > max_payload:
                    raise CorruptValue(
                        f"payload of {len(spec.payload)} bytes, over this store's "
                        f"StoreConfig.max_payload_bytes ({max_payload})"
                    )
            except CorruptValue as exc:
                row = {"id": inbox_id, "enqueued_unix_ns": enqueued, **columns, "reason": str(exc)}
                bad.append(row)
                continue
            if stored is not None:
                stored.add(spec, columns)
            items.append(item(inbox_id=inbox_id, spec=spec, enqueued_unix_ns=enqueued))
    return Read(items=items, bad=bad, last_id=last)


def _fields_json(row: Mapping[str, Any]) -> str:
    skip = {"id", "payload", "reason"}

    def plain(value: object) -> object:
        return bytes(value).hex() if isinstance(value, bytes | memoryview) else repr(value)

    return json.dumps({k: v for k, v in row.items() if k not in skip}, default=plain)


def set_aside(conn: Connection, *, bad: Sequence[Mapping[str, Any]], now_unix_ns: int) -> int:
    """Move undecodable rows to `cronoq_inbox_rejects`; returns how many this call moved."""
    moved = 0
    for row in bad:
        # Deleting first claims the row: of two readers at once, only one moves it.
        if conn.execute(reject_delete_stmt(), {"b_id": row["id"]}).rowcount != 1:
            continue
        payload = row.get("payload")
        conn.execute(
            reject_insert_stmt(),
            {
                "inbox_id": row["id"],
                "enqueued_unix_ns": row.get("enqueued_unix_ns"),
                "rejected_unix_ns": now_unix_ns,
                "reason": codec.clean(row["reason"]),
                "payload": None if payload is None else bytes(payload),
                "fields": codec.clean(_fields_json(row)),
            },
        )
        log.error(
            "inbox row %s set aside as undecodable: %s",
            row["id"],
            row["reason"],
            extra={"inbox_id": row["id"], "set_aside": 1},
        )
        moved += 1
    return moved


def has_items(conn: Connection) -> bool:
    """Whether the inbox holds an item (one index probe)."""
    return conn.execute(first_id_stmt()).first() is not None


def check_after(after: object) -> int | None:
    if after is not None and (not isinstance(after, int) or isinstance(after, bool)):
        raise InvalidValue(f"after must be an int, not {type(after).__name__}")
    return after


def check_limit(limit: object) -> int:
    if not isinstance(limit, int) or isinstance(limit, bool):
        raise InvalidValue(f"limit must be an int, not {type(limit).__name__}")
    if limit < 1:
        raise InvalidValue("limit must be at least 1")
    return min(limit, 2**31 - 1)


# Waiting for an enqueue: LISTEN on PostgreSQL, a poll elsewhere.


def can_listen(dialect: Dialect, *, pooled: bool = False) -> bool:
    """Whether an engine of `dialect` can LISTEN: PostgreSQL through psycopg 3 (whose notifies
    wait), unless `pooled` by a transaction pooler (`StoreConfig.transaction_pooler`), which
    delivers no notification: a LISTEN holds for the server connection it ran on, which the
    pooler hands to other clients right after."""
    return dialect.name == "postgresql" and dialect.driver == "psycopg" and not pooled


UNHEARD_DRAIN_S: Final = 0.05
"""How long a listener that found an item no notification announced still waits for a late
one before it says that notifications do not reach it."""
UNHEARD_WARNING: Final = (
    "an inbox item arrived but no notification reached this store's LISTEN connection (it was "
    "found by the check every %.0f s): behind a pooler in transaction mode (pgbouncer's "
    "pool_mode = transaction) LISTEN cannot work; set StoreConfig(transaction_pooler=True), "
    "so that wait_inbox polls every inbox_poll instead. (Items enqueued with notify=False "
    "also cause this: then set StoreConfig(inbox_listen=False); or rows inserted in SQL "
    "without pg_notify.)"
)
"""Logged once per store (a WARNING) whose listener misses a notification."""


def _listen_sql(engine: Engine | AsyncEngine) -> str:
    return f"LISTEN {engine.dialect.identifier_preparer.quote(CHANNEL)}"


class Listener:
    """A dedicated PostgreSQL connection (outside the pool) listening on `CHANNEL`.

    `wait` returns True when a notification arrived within `timeout` seconds. Notifications
    that arrive between waits queue on the connection, so none is lost between a check and
    the next wait. A broken connection is dropped and made anew on the next wait.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._conn: Any = None
        self._closed = False
        self.lock = threading.Lock()
        self.warned = False
        """Whether it said that notifications do not reach it (`unheard`)."""

    def unheard(self) -> None:
        """An item arrived that no notification announced while this listened: unless its
        notification is just late, say once why (a transaction pooler, most likely)."""
        if self.warned or self.wait(UNHEARD_DRAIN_S):
            return
        self.warned = True
        log.warning(UNHEARD_WARNING, SLOW_CHECK_S)

    def listening(self) -> bool:
        """Start listening if not yet; False if the connection cannot be made (or closed)."""
        if self._conn is not None or self._closed:
            return self._conn is not None
        conn: Any = None
        try:
            raw = self._engine.raw_connection()
            conn = raw.driver_connection
            raw.detach()  # ours for good: the pool makes another in its place
            conn.rollback()
            conn.autocommit = True
            conn.execute(_listen_sql(self._engine))
        except Exception as exc:
            log.warning("cannot listen for inbox notifications: %s", dialects.redact(str(exc)))
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
            return False
        self._conn = conn
        return True

    def wait(self, timeout: float) -> bool:
        try:
            for _ in self._conn.notifies(timeout=max(0.0, timeout), stop_after=1):
                return True
            return False
        except Exception as exc:
            log.warning("inbox listener lost: %s", dialects.redact(str(exc)))
            self.close(final=False)
            return True  # the caller checks the inbox, then listens anew

    def close(self, *, final: bool = True) -> None:
        """Close the connection; for good unless not `final` (a broken one is made anew)."""
        self._closed = self._closed or final
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # already broken
                conn.close()


def wait(
    check: Callable[[], bool],
    timeout: float,
    *,
    poll: float,
    listener: Listener | None,
) -> bool:
    """Whether the inbox holds an item within `timeout` seconds (at once if it does now).

    With a `listener` (PostgreSQL) this waits on its notifications, checking again on each and
    every `SLOW_CHECK_S`; otherwise it checks every `poll` seconds.
    """
    deadline = time.monotonic() + max(0.0, timeout)
    locked = listener is not None and listener.lock.acquire(blocking=False)
    # Whether the last wait ended by a notification. An item found after one that timed out
    # came without its notification, which the listener ought to have heard: it then says
    # (once) that notifications do not reach it (`Listener.unheard`).
    heard = True
    try:
        while True:
            # Listening (anew, if the connection was lost) before each check: a commit that
            # lands after the check notifies a connection that already listens.
            listening = locked and listener is not None and listener.listening()
            if check():
                if listening and not heard and listener is not None:
                    listener.unheard()
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if listening and listener is not None:
                heard = listener.wait(min(left, SLOW_CHECK_S))
            else:
                time.sleep(min(left, poll))
    finally:
        if locked and listener is not None:
            listener.lock.release()


class AsyncListener:
    """`Listener` on an asyncio loop, with the async driver's connection (psycopg's)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._conn: Any = None
        self._closed = False
        self.warned = False

    async def unheard(self) -> None:
        """`Listener.unheard`."""
        if self.warned or await self.wait(UNHEARD_DRAIN_S):
            return
        self.warned = True
        log.warning(UNHEARD_WARNING, SLOW_CHECK_S)

    async def listening(self) -> bool:
        if self._conn is not None or self._closed:
            return self._conn is not None
        conn: Any = None
        try:
            raw = await self._engine.raw_connection()
            conn = raw.driver_connection
            raw.detach()
            await conn.rollback()
            await conn.set_autocommit(True)
            await conn.execute(_listen_sql(self._engine))
        except Exception as exc:
            log.warning("cannot listen for inbox notifications: %s", dialects.redact(str(exc)))
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()
            return False
        self._conn = conn
        return True

    async def wait(self, timeout: float) -> bool:
        try:
            async for _ in self._conn.notifies(timeout=max(0.0, timeout), stop_after=1):
                return True
            return False
        except Exception as exc:
            log.warning("inbox listener lost: %s", dialects.redact(str(exc)))
            await self.close(final=False)
            return True

    async def close(self, *, final: bool = True) -> None:
        self._closed = self._closed or final
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()
