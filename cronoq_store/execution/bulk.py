"""Bulk work: IN lists in chunks (`run_in`), inserts of many rows (`insert_many`: COPY where
the database class `copies`, executemany elsewhere) and multi-row INSERT ... RETURNING
(`insert_returning`), each compiled once per dialect, schema and size (or key set)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import cache
from typing import Any, Final

from sqlalchemy import Connection, Delete, Insert, Select, Update, any_, bindparam
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.sql import operators
from sqlalchemy.sql.elements import BinaryExpression, BindParameter, ColumnElement
from sqlalchemy.sql.visitors import replacement_traverse

from .. import compat
from ..dialects.base import dialect_of
from ..dialects.compiled import Params, compile_key, driver_sql, positional
from ..dialects.cursor import Ran, counted, observed, run, run_many, run_stmt

__all__ = [
    "IN_CHUNK",
    "SMALL_IN",
    "VALUES_ROWS",
    "chunks",
    "in_as_any",
    "insert_many",
    "insert_returning",
    "run_in",
]


# IN lists and bulk inserts: the store's two shapes of bulk work, each compiled once per
# dialect, schema and size (or key set), and run as one statement per chunk.

IN_CHUNK: Final = 1000
"""Most values bound into one IN list."""


def chunks(values: Sequence[Any], size: int = IN_CHUNK) -> Iterator[Sequence[Any]]:
    """`values` in slices of at most `size`, each small enough for one IN list."""
    for start in range(0, len(values), size):
        yield values[start : start + size]


SMALL_IN: Final = 8
"""IN lists up to this long are compiled once per length, as the full chunk is."""
_FULL_IN: dict[tuple[Any, ...], tuple[str, tuple[str, ...] | None]] = {}
"""IN statements of a full chunk or a short list: SQL, and parameter names unless positional."""


def run_in(conn: Connection, stmt: Select[Any] | Update | Delete, ids: Sequence[Any]) -> Ran:
    """Run `stmt` (its one expanding parameter "ids" bound to `ids`).

    On psycopg the list is one array parameter (`in_as_any`). Elsewhere a full chunk (the
    usual case in large commits and in prune), and a short list (a small commit's), run a form
    compiled once with that many plain placeholders, instead of rendering the placeholders on
    every execution (a third of a batch-1 commit's statement overhead).
    """
    if dialect_of(conn).binds_arrays:
        return run_stmt(conn, in_as_any(stmt), {"ids": list(ids)})
    count = len(ids)
    if count != IN_CHUNK and not 0 < count <= SMALL_IN:
        return _expanded(conn, stmt, ids)
    translate = conn.get_execution_options().get("schema_translate_map")
    key = compile_key(conn, stmt, count)
    hit = _FULL_IN.get(key)
    if hit is None:
        compiled = stmt.compile(
            dialect=conn.dialect,
            schema_translate_map=translate,
            render_schema_translate=translate is not None,
        )
        state = compiled.construct_expanded_state({"ids": list(range(count))})
        names = tuple(state.positiontup or state.parameters)
        if len(names) != count:  # not a statement of one IN list
            return _expanded(conn, stmt, ids)
        hit = _FULL_IN[key] = (state.statement, None if compiled.positional else names)
    sql, names_or_none = hit
    if names_or_none is None:
        return run(conn, sql, tuple(ids))
    return run(conn, sql, dict(zip(names_or_none, ids, strict=True)))


@cache
def in_as_any(stmt: Select[Any] | Update | Delete) -> Select[Any] | Update | Delete:
    """`stmt` with its `IN (:ids)` (an expanding parameter) as `= ANY(:ids)`, one array."""

    def swap(element: Any, **kw: Any) -> Any:
        if (
            isinstance(element, BinaryExpression)
            and element.operator is operators.in_op
            and isinstance(element.right, BindParameter)
            and element.right.key == "ids"
        ):
            return element.left == any_(bindparam("ids", type_=ARRAY(element.left.type)))
        return None

    traversed: Any = stmt  # a statement is traversible; its stubs do not say so
    swapped: Select[Any] | Update | Delete = replacement_traverse(traversed, {}, swap)
    return swapped


def _expanded(conn: Connection, stmt: Select[Any] | Update | Delete, ids: Sequence[Any]) -> Ran:
    """`stmt` with its IN list rendered for `ids` by SQLAlchemy (any length)."""
    result = conn.execute(stmt, {"ids": list(ids)})
    return Ran(counted(result.rowcount), result.all() if result.returns_rows else [])


def _copy_sql(conn: Connection, stmt: Insert, columns: Sequence[str]) -> str:
    """`COPY table (columns) FROM STDIN` for `stmt`'s table on `conn`: in the schema the
    connection translates to, every name quoted by the dialect's own identifier preparer.

    The preparer escapes `%` as `%%` for a format paramstyle (psycopg's is pyformat), which the
    driver undoes only in a statement run with parameters; COPY runs without any.
    """
    prep = conn.dialect.identifier_preparer
    table = stmt.table
    translate = conn.get_execution_options().get("schema_translate_map") or {}
    schema = translate.get(table.schema, table.schema)
    target = prep.quote(table.name)
    if schema is not None:
        target = f"{prep.quote_schema(schema)}.{target}"
    names = ", ".join(prep.quote(c) for c in columns)
    sql = f"COPY {target} ({names}) FROM STDIN"
    if conn.dialect.paramstyle == "pyformat":
        sql = sql.replace("%%", "%")
    return sql


_COPY: dict[tuple[Any, ...], tuple[str, Callable[[Mapping[str, Any]], Any]]] = {}
"""COPY statements of a bulk insert, and each one's row getter (`_copy_form`)."""


def _copy_form(
    conn: Connection, stmt: Insert, keys: tuple[str, ...]
) -> tuple[str, Callable[[Mapping[str, Any]], Any]]:
    """The COPY statement for rows with `keys`, and how to turn a row into its values in
    column order: built once per statement, key set, dialect and schema."""
    cache_key = compile_key(conn, stmt, keys)
    hit = _COPY.get(cache_key)
    if hit is None:
        wanted = set(keys)
        columns = [c.name for c in stmt.table.c if c.name in wanted]
        hit = _COPY[cache_key] = (_copy_sql(conn, stmt, columns), positional(columns))
    return hit


def insert_many(conn: Connection, stmt: Insert, rows: Sequence[Mapping[str, Any]]) -> None:
    """Insert `rows`: COPY on psycopg, the driver's executemany elsewhere.

    psycopg's executemany still sends one INSERT per row (pipelined); COPY streams them in one
    statement: as cheap from two rows, two to three times faster for a batch of 1000. COPY
    reaches no statement listener, so an observed connection (`observed`) inserts
    with executemany, which they see.
    """
    impl = dialect_of(conn)
    if len(rows) < 2 or not impl.copies or observed(conn):
        run_many(conn, stmt, rows)
        return
    copy_sql, getter = _copy_form(conn, stmt, tuple(rows[0]))
    cursor: Any = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    try:
        impl.copy_rows(cursor, copy_sql, rows, getter)
    except conn.dialect.loaded_dbapi.Error as exc:
        raise compat.driver_error(conn, exc, copy_sql, cursor=cursor) from exc
    finally:
        cursor.close()


VALUES_ROWS: Final = 1000
"""Rows per statement of `insert_returning` (SQLAlchemy's "insertmanyvalues" page size)."""
_PLACEHOLDER: Final = re.compile(r"%\((\w+)\)s")
_VALUES: dict[tuple[Any, ...], tuple[str, str, str, Params] | None] = {}
"""Multi-row forms of INSERT ... RETURNING statements (`_values_form`); None where there is
none."""


@cache
def _returning(stmt: Insert, column: ColumnElement[Any]) -> Insert:
    """`stmt` returning `column`, one statement object each (compiled forms are cached by it)."""
    return stmt.returning(column)


def _values_form(
    conn: Connection, stmt: Insert, column: ColumnElement[Any], keys: tuple[str, ...]
) -> tuple[str, str, str, Params] | None:
    """`stmt` (an INSERT of one row) returning `column`, in three parts for rows with `keys`:
    the head up to VALUES, one row's VALUES group in `%s` placeholders, the RETURNING tail;
    and a row's values in the group's order. None unless the group holds exactly the rows'
    own parameters, as pyformat's `%(name)s` (PyMySQL's paramstyle).

    Taken from SQLAlchemy's compiled SQL: the INSERT must end with its group, and the same
    INSERT with RETURNING extend it (a quoted name holding " VALUES (" stays in the head).
    """
    cache_key = compile_key(conn, stmt, ("values", column, keys))
    if cache_key in _VALUES:
        return _VALUES[cache_key]
    form = None
    if conn.dialect.paramstyle == "pyformat":
        plain_sql, _ = driver_sql(conn, stmt, keys)
        full_sql, _ = driver_sql(conn, _returning(stmt, column), keys)
        head, found, group = plain_sql.rpartition(" VALUES (")
        names = _PLACEHOLDER.findall(group)
        if found and full_sql.startswith(plain_sql) and sorted(names) == sorted(keys):
            group = _PLACEHOLDER.sub("%s", f"({group}")
            form = (head + " VALUES ", group, full_sql[len(plain_sql) :], positional(names))
    _VALUES[cache_key] = form
    return form


def insert_returning(
    conn: Connection, stmt: Insert, column: ColumnElement[Any], rows: Sequence[Mapping[str, Any]]
) -> list[Any] | None:
    """`column` of each of `rows` (sharing one key set) inserted by `stmt`, an INSERT of one
    row, in the order the server returns them: one statement of a VALUES group per row, up to
    `VALUES_ROWS`, with RETURNING. None where it cannot be written so (nothing ran then).

    What the MySQL drivers' executemany does without RETURNING (and not with it), and
    SQLAlchemy's "insertmanyvalues" does at twice the CPU of a 100-row enqueue (its per-row
    parameter processing).
    """
    form = _values_form(conn, stmt, column, tuple(rows[0]))
    if form is None:
        return None
    head, group, tail, values = form
    returned: list[Any] = []
    for chunk in chunks(rows, VALUES_ROWS):
        sql = f"{head}{', '.join([group] * len(chunk))}{tail}"
        params = tuple(value for row in chunk for value in values(row))  # one set, not many
        returned.extend(row[0] for row in run(conn, sql, params).rows)
    return returned
