"""A pipeline of statements on psycopg's libpq connection, without psycopg's pipeline API.

psycopg's `Connection.pipeline()` runs a cursor, a generator and a poll of the socket for
each statement: five `SELECT 1` cost 274-437 us of CPU in one of its pipelines on the CI VM,
against 28-30 us sent here on its `pgconn` (and 196-221 us sent one after another). A leader's
batch-1 commit on PostgreSQL is one such flight (`execution.Flight`), so that overhead was
most of its CPU.

What psycopg does per statement is done here once per flight: the parameters are dumped by
its `Transformer` (the types it would send), the results loaded by the same `Transformer`,
and errors raised as psycopg's exceptions. A statement with parameters is prepared on a
connection's first use of it where the store owns the connection (`prepare_on`), and goes
unnamed elsewhere (an app's engine, a transaction pooler). The SQL is psycopg's (`%(name)s`
or `%s` placeholders, `%%`; `%(name)b` sends one in binary, as psycopg does), as SQLAlchemy
compiles it for psycopg.
"""

from __future__ import annotations

import itertools
import re
import select
import weakref
from collections.abc import Sequence
from typing import Any, Final

from psycopg import errors, pq
from psycopg.adapt import PyFormat, Transformer

_PLACEHOLDER: Final = re.compile(r"%\((\w+)\)([sb])|%s|%%|%")
_BUSY: Final = 1  # PQflush: data is left to send
_NO_SUCH_STATEMENT: Final = "26000"  # invalid_sql_statement_name


class Unsupported(Exception):
    """A statement this module does not send (a placeholder other than %s and %(name)s)."""


class _Query:
    """A statement's SQL with `$n` placeholders, its parameters' names in that order (None
    for positional ones), and the format each is sent in (`%(name)b`: binary, as psycopg)."""

    __slots__ = ("formats", "names", "sql")

    def __init__(
        self, sql: bytes, names: tuple[str, ...] | None, binary: frozenset[str] = frozenset()
    ) -> None:
        self.sql = sql
        self.names = names
        self.formats = [PyFormat.BINARY if n in binary else PyFormat.AUTO for n in names or ()]


_QUERIES: dict[str, _Query] = {}
_QUERIES_MAX: Final = 1024


def _query(sql: str) -> _Query:
    hit = _QUERIES.get(sql)
    if hit is not None:
        return hit
    names: list[str] = []
    binary: set[str] = set()
    positional = 0

    def number(match: re.Match[str]) -> str:
        nonlocal positional
        text = match.group(0)
        if text == "%%":
            return "%"
        if text == "%":
            raise Unsupported(f"unexpected % in {sql!r}")
        if text == "%s":
            positional += 1
            return f"${positional}"
        name = match.group(1)
        if name not in names:
            names.append(name)
        if match.group(2) == "b":
            binary.add(name)
        return f"${names.index(name) + 1}"

    converted = _PLACEHOLDER.sub(number, sql)
    if names and positional:
        raise Unsupported(f"mixed placeholders in {sql!r}")
    if len(_QUERIES) >= _QUERIES_MAX:  # the store's statements are a few dozen
        _QUERIES.clear()
    hit = _QUERIES[sql] = _Query(
        converted.encode(), tuple(names) if names else None, frozenset(binary)
    )
    return hit


_PREPARING: weakref.WeakSet[Any] = weakref.WeakSet()
"""Connections whose statements are prepared (`prepare_on`); others send them unnamed."""
_PREPARED: weakref.WeakKeyDictionary[Any, dict[tuple[bytes, tuple[int, ...]], bytes]] = (
    weakref.WeakKeyDictionary()
)
"""Per psycopg connection: the statements prepared on it, by SQL and parameter types."""
_NAMES: weakref.WeakKeyDictionary[Any, itertools.count[int]] = weakref.WeakKeyDictionary()
"""Per psycopg connection: the number of its next statement's name. Never reused: a statement
forgotten here (its PREPARE skipped, or the server said one was lost) may still hold its name
on the server, so a name from the count of those remembered could be one in use."""


class Failed(Exception):
    """A flight's statement failed on the server: `index` says which, `error` is psycopg's."""

    def __init__(self, index: int, error: Exception) -> None:
        super().__init__(str(error))
        self.index = index
        self.error = error


class Answer:
    """A statement's answer as a statement hook sees it (`testing.statements`): what a
    cursor would show of it."""

    __slots__ = ("connection", "pgresult", "rowcount")

    def __init__(self, connection: Any, rowcount: int, pgresult: Any) -> None:
        self.connection = connection
        self.rowcount = rowcount
        self.pgresult = pgresult


class _Send:
    """One statement execution of a flight (an executemany is one per row)."""

    __slots__ = ("dumped", "formats", "index", "key", "many", "name", "prepare", "sql", "types")

    def __init__(self, index: int, many: bool, sql: bytes, dumped: Sequence[Any], tx: Any) -> None:
        self.index = index
        self.many = many
        self.sql = sql
        self.dumped = dumped
        self.types: tuple[int, ...] = tuple(tx.types)
        self.formats: list[Any] = list(tx.formats)
        self.key = (sql, self.types)
        self.name: bytes | None = None  # prepared statement to execute, if any
        self.prepare = False  # whether it is prepared in this flight


def prepare_on(conn: Any) -> None:
    """Prepare the statements `run` sends on psycopg connection `conn`, each on first use:
    for a connection no transaction pooler stands in front of (its next transaction may be
    another server connection's)."""
    _PREPARING.add(conn)


def run(
    conn: Any, statements: Sequence[tuple[str, Any, bool]], *, pipeline: bool = True
) -> list[tuple[int, list[Any]]]:
    """`_run`, and once more where the server had lost the statements prepared on `conn`
    (psycopg deallocates all of them after a ROLLBACK when it prepared any of its own) and
    the flight began its transaction: rolled back, it held nothing else."""
    try:
        return _run(conn, statements, pipeline=pipeline)
    except Failed as failed:
        lost = getattr(failed.error, "sqlstate", None) == _NO_SUCH_STATEMENT
        if not (lost and conn in _PREPARING and statements and statements[0][0] == "BEGIN"):
            raise
    conn.pgconn.send_query_params(b"ROLLBACK", None)
    _flush(conn.pgconn)
    _result(conn.pgconn)
    return _run(conn, statements, pipeline=pipeline)


def _run(
    conn: Any, statements: Sequence[tuple[str, Any, bool]], *, pipeline: bool
) -> list[tuple[int, list[Any]]]:
    """Send `statements` (SQL, parameters, whether an executemany) to psycopg connection
    `conn` in one pipeline and wait for every answer: each statement's rowcount (-1 where
    the server gives none) and rows. The server runs them in order and skips those after an
    error, which leaves as `Failed` once every answer is in. Anything else leaving (a lost
    connection, an interrupt) leaves the connection unusable: it is closed, for the pool to
    drop. Not `pipeline`: one statement, sent outside pipeline mode (its answer then arms
    the server's idle-in-transaction timer).

    Raises:
        Unsupported: Before anything is sent, for SQL this module does not convert.
        Failed: A statement's error (the first; the server skipped the rest).
        psycopg.OperationalError: The connection failed.
    """
    pgconn = conn.pgconn
    tx = Transformer(conn)
    prepared = _PREPARED.setdefault(conn, {}) if conn in _PREPARING else None
    sends: list[_Send] = []
    for index, (sql, params, many) in enumerate(statements):
        # Without parameters psycopg sends the SQL as it is (a `%%` stays); with any, even
        # none in an empty mapping, it converts it.
        query = _query(sql) if params is not None else _Query(sql.encode(), None)
        for row in params if many else [params]:
            values = _values(query, row)
            formats = query.formats or [PyFormat.AUTO] * len(values)
            dumped = tx.dump_sequence(values, formats)
            send = _Send(index, many, query.sql, dumped, tx)
            if prepared is not None and params is not None:  # BEGIN, COMMIT: nothing to plan
                send.name = prepared.get(send.key)
                if send.name is None:
                    number = next(_NAMES.setdefault(conn, itertools.count()))
                    send.name = prepared[send.key] = b"cronoq_%d" % number
                    send.prepare = True
            sends.append(send)
    if not pipeline and len(sends) != 1:
        raise Unsupported("outside a pipeline, one statement at a time")
    if pipeline:
        pgconn.enter_pipeline_mode()
    try:
        for send in sends:
            if send.prepare:
                pgconn.send_prepare(send.name, send.sql, send.types)
                if not pipeline:  # one command at a time: the PREPARE's answer first
                    _flush(pgconn)
                    _prepared_alone(conn, send, prepared)
                    send.prepare = False
            if send.name is not None:
                pgconn.send_query_prepared(send.name, send.dumped, send.formats)
            else:
                pgconn.send_query_params(send.sql, send.dumped, send.types, send.formats)
        if pipeline:
            pgconn.pipeline_sync()
        _flush(pgconn)
        answers, failed = _answers(conn, tx, statements, sends, prepared, synced=pipeline)
        if pipeline:
            pgconn.exit_pipeline_mode()
    except Failed:  # its answers all read: the connection is as usable as after any error
        raise
    except BaseException:
        # Answers left unread (a lost connection, an interrupt): nothing can use it now, and
        # closed, it is one the pool knows to drop.
        conn.close()
        raise
    if failed is not None:
        raise failed
    return answers


def _values(query: _Query, row: Any) -> list[Any]:
    if query.names is None:
        return list(row or ())
    return [row[name] for name in query.names]


def _answers(
    conn: Any,
    tx: Any,
    statements: Sequence[tuple[str, Any, bool]],
    sends: list[_Send],
    prepared: dict[tuple[bytes, tuple[int, ...]], bytes] | None,
    *,
    synced: bool,
) -> tuple[list[tuple[int, list[Any]]], Failed | None]:
    """Read the answers of what `run` sent, up to the pipeline's sync; each statement that
    ran is shown to the connection's statement hook, if it has one, once it is answered."""
    pgconn = conn.pgconn
    hook = getattr(conn.cursor_factory, "statement_hook", None)
    answers: list[tuple[int, list[Any]]] = [(-1, []) for _ in statements]
    failed: Failed | None = None
    for at, send in enumerate(sends):
        if send.prepare:
            result = _result(pgconn)
            if result.status != pq.ExecStatus.COMMAND_OK and prepared is not None:
                prepared.pop(send.key, None)  # not prepared: the next flight tries again
            if result.status == pq.ExecStatus.FATAL_ERROR and failed is None:
                failed = Failed(send.index, _error(conn, result))
        result = _result(pgconn)
        status = result.status
        if status == pq.ExecStatus.FATAL_ERROR:
            if failed is None:
                failed = Failed(send.index, _error(conn, result))
            continue
        if status == pq.ExecStatus.PIPELINE_ABORTED:
            continue
        tuples = result.command_tuples
        rowcount = -1 if tuples is None else int(tuples)
        rows: list[Any] = []
        if status == pq.ExecStatus.TUPLES_OK:
            tx.set_pgresult(result)
            rows = tx.load_rows(0, result.ntuples, tuple)
        before, earlier = answers[send.index]
        if send.many and before >= 0:  # an executemany's count is its rows' total
            rowcount = before + max(rowcount, 0)
        answers[send.index] = (rowcount, earlier + rows)
        last = at + 1 == len(sends) or sends[at + 1].index != send.index
        sql = statements[send.index][0]
        if hook is not None and last and sql != "BEGIN":  # a transaction's, not a statement
            hook(Answer(conn, rowcount, result), sql)
    while synced and _result(pgconn, closed=False).status != pq.ExecStatus.PIPELINE_SYNC:
        pass
    lost = failed is not None and getattr(failed.error, "sqlstate", None) == _NO_SUCH_STATEMENT
    if lost and prepared is not None:  # the server lost them (a DISCARD): prepare anew
        prepared.clear()
    return answers, failed


def _prepared_alone(
    conn: Any, send: _Send, prepared: dict[tuple[bytes, tuple[int, ...]], bytes] | None
) -> None:
    """Read the answer of `send`'s PREPARE, sent outside a pipeline; raise its error."""
    result = _result(conn.pgconn)
    if result.status != pq.ExecStatus.COMMAND_OK:
        if prepared is not None:
            prepared.pop(send.key, None)
        raise Failed(send.index, _error(conn, result))


def _result(pgconn: Any, *, closed: bool = True) -> Any:
    """The next result; for a statement's (`closed`), also the NULL that ends its results."""
    result = _next(pgconn)
    if result is None:
        message = (pgconn.error_message or b"").decode(errors="replace")
        raise errors.OperationalError(f"no answer in a pipeline: {message}")
    if closed and _next(pgconn) is not None:
        raise errors.InternalError("a pipelined statement gave more than one result")
    return result


def _next(pgconn: Any) -> Any:
    while pgconn.is_busy():
        select.select([pgconn.socket], [], [])
        pgconn.consume_input()
    return pgconn.get_result()


def _flush(pgconn: Any) -> None:
    """Send what libpq holds back (a nonblocking connection's output), reading meanwhile."""
    while pgconn.flush() == _BUSY:
        readable, _, _ = select.select([pgconn.socket], [pgconn.socket], [])
        if readable:
            pgconn.consume_input()


def _error(conn: Any, result: Any) -> Exception:
    """psycopg's exception for an error result, as its cursors raise it."""
    sqlstate = result.error_field(pq.DiagnosticField.SQLSTATE)
    cls = errors.lookup(sqlstate.decode()) if sqlstate else errors.DatabaseError
    message = (result.error_message or b"").decode(errors="replace").strip()
    error: Exception = cls(message, info=result, encoding=conn.info.encoding)
    return error
