"""The app's side: enqueue in the caller's own transaction, which this never commits."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, TypedDict, Unpack

from sqlalchemy import (
    Connection,
    Engine,
    Insert,
    Table,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import Session

from .. import codec, compat, dialects, execution
from ..config import DEFAULT_MAX_PAYLOAD
from ..errors import InvalidValue, SchemaError
from ..model import TaskSpec
from ..repository.folding import check_payload
from ..schema import check_schema_name, inbox
from .statements import (
    EMPTY,
    UNIX,
    inbox_in,
    insert_into_stmt,
    insert_many_stmt,
    insert_notify_stmt,
    insert_one_stmt,
    insert_stmt,
    last_rowid_stmt,
)

if TYPE_CHECKING:  # sync users never import the asyncio extension
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

log = logging.getLogger("cronoq_store.inbox")  # the package's, as before its split


_BINARY: dict[tuple[type[Dialect], str | None, bool], tuple[str, dict[str, Any]]] = {}


def _binary(dialect: Dialect, schema: str | None, *, notify: bool) -> tuple[str, dict[str, Any]]:
    """`insert_many_stmt` as psycopg's SQL with its arrays sent in binary (`%(a_...)b`), and
    its other parameters' values: psycopg dumps a text array element by element through an
    escaping regex, a binary one without (a third of the CPU of a 100-row enqueue_many)."""
    key = (type(dialect), schema, notify)
    hit = _BINARY.get(key)
    if hit is None:
        table = inbox if schema is None else inbox_in(schema)
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


MAX_PAYLOAD_SETTING: Final = (
    "enqueue's max_payload_bytes; the store's StoreConfig.max_payload_bytes"
)


Row = tuple[Any, ...]
"""An inbox row: the values of `codec.SPEC_COLUMNS`, in that order (`codec.spec_values`)."""


def _rows(specs: Iterable[TaskSpec], max_payload: int | None) -> list[Row]:
    """The inbox rows of `specs`; refuses (`InvalidValue`) any that cannot be stored, or
    whose payload is longer than `max_payload`. Tuples, not dicts: PostgreSQL's statement
    takes them as columns (`_arrays`), and only the paths that bind by name make dicts."""
    if max_payload is not None and (
        not isinstance(max_payload, int) or isinstance(max_payload, bool) or max_payload < 1
    ):
        raise InvalidValue("max_payload_bytes must be a positive int or None")
    limit = -1 if max_payload is None else max_payload
    values = codec.spec_values
    rows = []
    with execution.collection_paused():  # every row is kept until written
        for i, spec in enumerate(specs):
            if type(spec) is not TaskSpec and not isinstance(spec, TaskSpec):
                raise InvalidValue(f"specs[{i}] must be a TaskSpec, not {type(spec).__name__}")
            if limit >= 0 and len(spec.payload) > limit:
                check_payload(spec.payload, max_payload, MAX_PAYLOAD_SETTING)  # its message
            rows.append(values(UNIX, spec))
    return rows


def arrays(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Any] | None]:
    """`_arrays` of rows given as mappings of `codec.SPEC_COLUMNS` (`codec.spec_columns`)."""
    names = codec.SPEC_COLUMNS
    return _arrays([tuple(row[name] for name in names) for row in rows])


def _arrays(rows: Sequence[Row]) -> dict[str, list[Any] | None]:
    """The arrays `insert_many_stmt` unnests, one per column. A column NULL (or, for a JSON
    one, empty) in every row is sent as one NULL, which `unnest` pads to the rows' length:
    most specs leave most fields unset, and psycopg dumps an array element by element."""
    arrays: dict[str, list[Any] | None] = {}
    count = len(rows)
    for name, values in zip(codec.SPEC_COLUMNS, zip(*rows, strict=True), strict=True):  # in C
        unset = values.count(EMPTY.get(name))
        arrays[f"a_{name}"] = None if unset == count else list(values)
    return arrays


def _options(schema: str | None) -> Mapping[str, Any]:
    if schema is None:
        return {}
    check_schema_name(schema)
    return {"schema_translate_map": {None: schema}}


def _write(
    conn: Connection, values: list[Row], options: Mapping[str, Any], *, notify: bool
) -> list[int]:
    """Insert the rows of `values` in order and return their ids; where the database
    `notifies` (PostgreSQL), to `notify`, notify on commit, in the same round trip as the
    ids. What the database does best is its class's to say (`dialects.dialect_of`)."""
    if not values:
        return []
    stmt = insert_stmt()
    dialect = conn.dialect
    impl = dialects.dialect_of(dialect)
    notifies = impl.notifies
    if len(values) > 1 and notifies:  # PostgreSQL: one INSERT of unnested arrays
        columns = _arrays(values)
        if impl.binary_arrays:
            sql, params = _binary(dialect, _schema(conn, options), notify=notify)
            # On the driver's cursor (`execution.run`): SQLAlchemy's result fetched the ids
            # a row at a time, a sixth of a 1000-row enqueue's CPU.
            got = [row[0] for row in _run_arrays(conn, sql, {**params, **columns})]
        else:
            result = conn.execute(
                insert_many_stmt(notify=notify), columns, execution_options=options
            )
            got = list(result.scalars())
        return sorted(got)  # numbered in row order (`insert_many_stmt`)
    rows = [codec.spec_dict(row) for row in values]  # bound by name from here on
    if len(rows) > 1 and impl.numbers_in_order(conn.connection.driver_connection):
        # SQLite: one executemany, no RETURNING (which SQLAlchemy runs a row at a time here
        # to keep the order): its rows are numbered one after another, the last one
        # `last_insert_rowid`.
        execution.run_many(conn, insert_into_stmt(_table(options)), rows)
        last = int(execution.run_stmt(conn, last_rowid_stmt()).rows[0][0])
        ids = list(range(last - len(rows) + 1, last + 1))
    elif len(rows) == 1 and dialects.says_lastrowid(dialect):
        # SQLAlchemy's execution is most of a small enqueue's CPU: the driver's cursor runs
        # the statement compiled once, unless something observes the connection's statements.
        ids = [execution.inserted_id(conn, insert_into_stmt(_table(options)), rows[0])]
    elif len(rows) == 1 and dialect.insert_returning:  # PostgreSQL: the notification with it
        stmt = insert_one_stmt(_table(options), notify=notify and notifies)
        ids = [int(_run_opening(conn, stmt, rows[0])[0][0])]
    elif notifies and notify:
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


_BEGIN: Final = ("BEGIN", None, False)


def _run_opening(conn: Connection, stmt: Insert, params: Mapping[str, Any]) -> Sequence[Any]:
    """The rows of `stmt` run once with `params`: on the cursor (`execution.run_stmt`), or in
    a flight (`_flight`)."""
    begin = _flies(conn)
    if begin is None:
        return execution.run_stmt(conn, stmt, params).rows
    sql, getter = execution.driver_sql(conn, stmt, tuple(params))
    return _flight(conn, sql, params if getter is None else getter(params), begin=begin)


def _run_arrays(conn: Connection, sql: str, params: Mapping[str, Any]) -> Sequence[Any]:
    """The rows of `insert_many_stmt`'s driver SQL (`_binary`): on the cursor
    (`execution.run`), or in a flight (`_flight`). Where nothing observes the connection,
    its arrays go as its dialect builds them (`built_arrays`), not dumped element by element."""
    if execution.pipelines(conn):  # sync psycopg's cursor or libpq connection
        impl = dialects.dialect_of(conn.dialect)
        params = impl.built_arrays(conn.connection.dbapi_connection, sql, params)
    begin = _flies(conn)
    if begin is None:
        return execution.run(conn, sql, params).rows
    return _flight(conn, sql, params, begin=begin)


def _flies(conn: Connection) -> bool | None:
    """Whether an enqueue's statement goes in a `wire` flight on sync psycopg
    (`execution.pipelines`: nothing observes it), and with a BEGIN: True where it opens the
    app's transaction (`_opens`), False on a connection in autocommit (`_standalone`'s, or
    an app's: the statement is its own transaction); None: on the cursor, in a transaction
    already open or begun as psycopg begins it."""
    if not execution.pipelines(conn):
        return None
    if conn.connection.dbapi_connection.autocommit:  # type: ignore[union-attr]
        return False
    return True if _opens(conn) else None


def _flight(conn: Connection, sql: str, values: Any, *, begin: bool) -> Sequence[Any]:
    """The rows of driver SQL `sql` sent in one flight (`wire`), after a BEGIN where it opens
    the app's transaction: psycopg's own BEGIN is a round trip of its own, so an enqueue that
    opens the transaction costs the app no round trip of its own."""
    from .. import wire  # psycopg's: only a pipelined connection comes here

    driver: Any = conn.connection.dbapi_connection
    if driver.prepare_threshold is not None:
        # Prepared once, as psycopg would from its fifth use: planned anew each time, a
        # one-row enqueue cost the server more than the round trip saved. An app behind a
        # transaction pooler turns psycopg's off (`prepare_threshold=None`): then so is this.
        wire.prepare_on(driver)
    statements = [_BEGIN, (sql, values, False)] if begin else [(sql, values, False)]
    try:
        try:
            try:
                answers = wire.run(driver, statements)
            except wire.Failed as failed:
                if begin or getattr(failed.error, "sqlstate", None) != _NO_SUCH_STATEMENT:
                    raise
                # Alone, it ran nowhere: the server had lost what `wire` prepared on this
                # connection (an app's DEALLOCATE, psycopg's after a rollback), which `wire`
                # now prepares anew. (With a BEGIN, `wire.run` itself sends it again.)
                answers = wire.run(driver, statements)
        except wire.Failed as failed:
            raise failed.error from None
    except conn.dialect.loaded_dbapi.Error as exc:
        raise compat.driver_error(conn, exc, sql) from exc
    return answers[-1][1]


_NO_SUCH_STATEMENT: Final = "26000"
"""PostgreSQL's invalid_sql_statement_name: a prepared statement the server does not have."""


def _opens(conn: Connection) -> bool:
    """Whether a statement now opens `conn`'s transaction on sync psycopg, whose BEGIN can
    then leave with it (`_flight`; `execution.pipelines`: nothing observes it)."""
    if not execution.pipelines(conn):
        return False
    driver: Any = conn.connection.dbapi_connection
    if driver.info.transaction_status != _IDLE or driver.autocommit:
        return False
    # psycopg's own BEGIN would carry the app's isolation level, read-only or deferrable
    # setting: those transactions begin as psycopg begins them.
    return driver.isolation_level is None and driver.read_only is None and not driver.deferrable


_IDLE: Final = 0
"""libpq's PQTRANS_IDLE: no transaction open on the server yet."""


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
    return inbox if not options else inbox_in(options["schema_translate_map"][None])


def _write_or_explain(
    conn: Connection, rows: list[Row], options: Mapping[str, Any], *, notify: bool
) -> list[int]:
    """`_write`, its driver errors translated: where the inbox table is not, a `SchemaError`
    naming the schema searched and `schema=` (an app's usual slip is to leave it out).

    The collector is paused meanwhile (`execution.collection_paused`): the arrays and the
    dumped parameters are kept until sent, and in an app's large heap a full collection
    that a 1000-row enqueue_many set off cost 47 ms, more than the call itself."""
    try:
        with execution.collection_paused():
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
    kind = dialects.dialect_of(conn).schema_word
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
    raise InvalidValue(f"enqueue needs a Connection, Session or Engine, not {type(conn).__name__}")


def _standalone(
    conn: Connection, rows: list[Row], options: Mapping[str, Any], *, notify: bool
) -> list[int]:
    """`_write_or_explain` in a transaction of its own on `conn`, fresh from an engine,
    committed before it returns. On PostgreSQL every enqueue is one statement (its
    notification in it), atomic by itself: run in autocommit (on sync psycopg in a flight of
    its own, `_flies`), it is one round trip where the app's BEGIN, INSERT and COMMIT are
    three (psycopg) and a peer's job one. Elsewhere the statement and a COMMIT."""
    if dialects.dialect_of(conn).notifies:
        conn.execution_options(isolation_level="AUTOCOMMIT")  # reset when conn goes back
        return _write_or_explain(conn, rows, options, notify=notify)
    with conn.begin():
        return _write_or_explain(conn, rows, options, notify=notify)


class EnqueueOptions(TypedDict, total=False):
    """The keyword arguments of `enqueue`, `enqueue_many` and their asyncio twins: each
    optional, its default in brackets."""

    schema: str | None
    """The PostgreSQL schema (MySQL database) of the store's tables, if any: the store's
    `StoreConfig.schema` [None]."""
    notify: bool
    """PostgreSQL: wake a listening leader when the transaction commits [True]."""
    max_payload_bytes: int | None
    """The longest payload accepted (`InvalidValue` past it): the store's
    `StoreConfig.max_payload_bytes` [16 MiB]; None accepts any."""


def _prepared(
    specs: Iterable[TaskSpec],
    *,
    schema: str | None = None,
    notify: object = True,
    max_payload_bytes: int | None = DEFAULT_MAX_PAYLOAD,
) -> tuple[list[Row], Mapping[str, Any], bool]:
    """The rows of `specs`, the execution options for `schema`, and `notify`, each checked
    (`InvalidValue`) before anything is written; an unknown option is a `TypeError`, as a
    keyword argument no signature names."""
    if not isinstance(notify, bool):
        raise InvalidValue(f"notify must be a bool, not {type(notify).__name__}")
    return _rows(specs, max_payload_bytes), _options(schema), notify


def enqueue(
    conn: Connection | Session | Engine, spec: TaskSpec, **options: Unpack[EnqueueOptions]
) -> int:
    """Write `spec` into the inbox in the caller's transaction.

    Never commits: the item exists once the caller's transaction commits, and a rollback leaves
    no trace. Given an `Engine` instead (no transaction of the app's to join), it writes the
    item in a transaction of its own, committed before it returns: on PostgreSQL one
    autocommit statement, one round trip.

    PostgreSQL: the transaction also notifies a listening leader when it commits, unless
    `notify=False`. A notifying commit holds a database-wide lock through its WAL flush, so
    where commits are slow such commits run one at a time (docs/tuning.md, "Waking the
    leader"). Without it the leader finds the item by its probe: every
    `StoreConfig.inbox_poll` when it polls (`inbox_listen=False`, or `transaction_pooler=True`,
    behind which no notification arrives anyway); within `SLOW_CHECK_S` if it listens.

    Args:
        conn: The app's `Connection`, or its ORM `Session` (its transaction is joined), or
            an `Engine` (a connection of its own, committed).
        spec: The task to create once a leader drains the inbox.
        options: `schema` (the store's `StoreConfig.schema`), `notify` (PostgreSQL: wake
            a listening leader on commit, above) and `max_payload_bytes` (the store's
            `StoreConfig.max_payload_bytes`, whose leader sets aside an item longer than its
            own; None accepts any): `EnqueueOptions`.

    Returns:
        The item's inbox id.

    Raises:
        InvalidValue: A spec that cannot be stored (a payload over `max_payload_bytes`
            among them), a bad `schema`, or `conn` of another type (before anything is
            written).
        SchemaError: No cronoq inbox table where the statement looked: the message names
            the schema searched (usually a store in a schema and no `schema=`).
        StoreUnavailable: The database could not be reached (the caller's transaction
            is then the caller's to roll back; an `Engine`'s is rolled back).
        StoreError: Anything else the database refused; never a driver exception.
    """
    return enqueue_many(conn, [spec], **options)[0]


def enqueue_many(
    conn: Connection | Session | Engine,
    specs: Iterable[TaskSpec],
    **options: Unpack[EnqueueOptions],
) -> list[int]:
    """`enqueue` for several specs at once (all or none), in the caller's transaction (or,
    given an `Engine`, in one of its own, committed: on PostgreSQL one round trip).

    Args:
        conn: The app's `Connection`, or its ORM `Session`, or an `Engine`.
        specs: The tasks, in order.
        options: As for `enqueue` (one notification for them all; `max_payload_bytes`
            for each spec).

    Returns:
        Their inbox ids, in order.

    Raises:
        InvalidValue: As for `enqueue`: nothing is written when any spec is refused.
        SchemaError: As for `enqueue`.
        StoreUnavailable: As for `enqueue`.
        StoreError: As for `enqueue`; never a driver exception.
    """
    rows, settings, notify = _prepared(specs, **options)
    if isinstance(conn, Engine):
        with conn.connect() as own:
            return _standalone(own, rows, settings, notify=notify)
    return _write_or_explain(_connection(conn), rows, settings, notify=notify)


async def enqueue_async(
    conn: AsyncConnection | AsyncSession | AsyncEngine,
    spec: TaskSpec,
    **options: Unpack[EnqueueOptions],
) -> int:
    """`enqueue` awaited, on an asyncio `AsyncConnection` or `AsyncSession` (or, as
    `enqueue` on an `Engine`, an `AsyncEngine`: committed before it returns).

    Args:
        conn: The app's `AsyncConnection`, or its `AsyncSession` (whose transaction it
            joins), or an `AsyncEngine`.
        spec: As for `enqueue`.
        options: As for `enqueue` (`EnqueueOptions`).

    Returns:
        The item's inbox id.

    Raises:
        StoreError: Whatever `enqueue` raises, for the same reasons (`InvalidValue` also for
            a `conn` of another type; `SchemaError`, `StoreUnavailable`).
    """
    ids = await enqueue_many_async(conn, [spec], **options)
    return ids[0]


async def enqueue_many_async(
    conn: AsyncConnection | AsyncSession | AsyncEngine,
    specs: Iterable[TaskSpec],
    **options: Unpack[EnqueueOptions],
) -> list[int]:
    """`enqueue_many` awaited: several specs (all or none) on an `AsyncConnection`,
    `AsyncSession` or `AsyncEngine`, as `enqueue_async` writes one.

    Args:
        conn: The app's asyncio connection or session, as for `enqueue_async`.
        specs: The tasks, in order.
        options: As for `enqueue_many`.

    Returns:
        Their inbox ids, in order.

    Raises:
        StoreError: Whatever `enqueue_many` raises (`InvalidValue` also for a `conn` of
            another type).
    """
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

    rows, settings, notify = _prepared(specs, **options)
    if isinstance(conn, AsyncEngine):
        async with conn.connect() as own:
            return await own.run_sync(lambda c: _standalone(c, rows, settings, notify=notify))
    if isinstance(conn, AsyncSession):
        conn = await conn.connection()
    if not isinstance(conn, AsyncConnection):
        raise InvalidValue(
            f"enqueue_many_async needs an AsyncConnection, AsyncSession or AsyncEngine, "
            f"not {type(conn).__name__}"
        )
    return await conn.run_sync(lambda c: _write_or_explain(c, rows, settings, notify=notify))
