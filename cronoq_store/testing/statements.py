"""Statements seen at the DB-API driver: what the store sends, on the path production runs.

A SQLAlchemy listener (`before_cursor_execute`) sees only what SQLAlchemy executes; the store
runs most statements on the DB-API cursor (`execution.run`) and PostgreSQL's inserts as COPY.
`after_statements` hooks the driver's own cursor class instead (sqlite3's connection
factory, psycopg's `cursor_factory`, PyMySQL's `cursorclass`, each subclassed, set through
SQLAlchemy's `do_connect` event), so the store's code runs unchanged and on its fast path.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Final

from sqlalchemy import Engine

from ..dialects import dialect_of

__all__ = ["CommitHook", "StatementHook", "after_commits", "after_statements"]

StatementHook = Callable[[Any, str], None]
"""Called with the driver cursor and the SQL, after a statement ran (not when it raised)."""
CommitHook = Callable[[Any], None]
"""Called with the driver connection, after a transaction on it committed."""


def after_statements(engine: Engine, hook: StatementHook) -> None:
    """Call `hook` after every `execute`, `executemany` and COPY on `engine`'s driver
    connections (each once: PyMySQL's executemany runs `execute` inside, which is not
    reported again; in psycopg's pipeline mode once the statement's answer is in), from the
    next connection the pool opens. The pool's idle connections are closed at once, so from
    now on every checkout gets a hooked one.

    Args:
        engine: A sync engine on sqlite3 (pysqlite), psycopg or PyMySQL.
        hook: Called as `hook(cursor, statement)` in the thread that ran the statement.

    Raises:
        ValueError: For another driver.
    """
    # One hooked class per engine, calling every hook in turn: a second subclass of the first
    # would override its methods by name, and the first hook would never hear a statement.
    hooks = _HOOKS.get(engine)
    if hooks is not None:
        hooks.append(hook)
        engine.dispose()
        return
    hooks = [hook]

    def every_hook(cursor: Any, statement: str) -> None:
        for each in tuple(hooks):
            each(cursor, statement)

    _install(engine, every_hook)
    _HOOKS[engine] = hooks


_HOOKS: Final[weakref.WeakKeyDictionary[Engine, list[StatementHook]]] = weakref.WeakKeyDictionary()
"""The hooks `after_statements` set on each engine."""


def _install(engine: Engine, hook: StatementHook) -> None:
    if not dialect_of(engine).hook_cursors(engine, lambda c: _hooked(c, hook)):
        raise ValueError(f"no statement hook for {engine.url.drivername}")
    engine.dispose()


def after_commits(engine: Engine, hook: CommitHook) -> None:
    """Call `hook` after every COMMIT on `engine`'s driver connections, from the next
    connection the pool opens: once the driver's `commit()` returned (SQLAlchemy's, or any
    other caller's), or once a COMMIT sent as a statement was answered (psycopg's flights,
    `cronoq_store.wire`, through `after_statements`). So a fault lands between a commit and
    whatever follows it, however the transaction was ended.

    Args:
        engine: A sync engine on sqlite3 (pysqlite), psycopg or PyMySQL.
        hook: Called as `hook(driver_connection)` in the thread that committed.

    Raises:
        ValueError: For another driver.
    """
    impl = dialect_of(engine)
    if not impl.hook_commits(engine, lambda c: _committing(c, hook)):
        raise ValueError(f"no commit hook for {engine.url.drivername}")
    if impl.pipelined:  # psycopg's flights send COMMIT as a statement

        def commit_statement(cursor: Any, statement: str) -> None:
            if statement.strip().upper() == "COMMIT":
                hook(cursor.connection)

        after_statements(engine, commit_statement)
    engine.dispose()


def _committing(base: type[Any], hook: CommitHook) -> type[Any]:
    """A subclass of the connection class `base` that reports each `commit()` to `hook`."""

    class Committing(base):  # type: ignore[misc]
        __slots__ = ()

        def commit(self) -> None:
            super().commit()
            hook(self)

    return Committing


_FAILED: Final = (7, 11)
"""libpq's PGRES_FATAL_ERROR and PGRES_PIPELINE_ABORTED (`psycopg.pq.ExecStatus`)."""
_INERROR: Final = 3
"""libpq's PQTRANS_INERROR (`psycopg.pq.TransactionStatus`): a statement failed."""


def _hooked(base: type[Any], hook: StatementHook) -> type[Any]:
    """A subclass of the cursor class `base` that reports its statements to `hook`."""

    class Hooked(base):  # type: ignore[misc]
        statement_hook = staticmethod(hook)
        """For statements sent without a cursor (`cronoq_store.wire`, psycopg's pipelines)."""
        _many = False
        _pending: str | None = None
        _pending_many = False

        def _ran(self, statement: Any) -> None:
            # In psycopg's pipeline mode `execute` only queues the statement: its answer (and
            # the locks it takes) exist once its results are read, or the cursor is closed.
            pgconn = getattr(getattr(self, "connection", None), "pgconn", None)
            if pgconn is not None and pgconn.pipeline_status:
                self._pending = str(statement)
                self._pending_many = self._many
            else:
                hook(self, str(statement))

        def _answered(self) -> None:
            if self._pending is None:
                return
            statement, self._pending = self._pending, None
            result = getattr(self, "pgresult", None)
            if result is not None:
                answered = result.status not in _FAILED
            else:  # a pipelined executemany keeps no result: it ran unless the flight failed
                status = self.connection.pgconn.transaction_status
                answered = self._pending_many and status != _INERROR
            if answered:
                hook(self, statement)

        def execute(self, statement: Any, *args: Any, **kwargs: Any) -> Any:
            result = super().execute(statement, *args, **kwargs)
            if not self._many:
                self._ran(statement)
            return result

        def executemany(self, statement: Any, *args: Any, **kwargs: Any) -> Any:
            self._many = True
            try:
                result = super().executemany(statement, *args, **kwargs)
                self._ran(statement)
            finally:
                self._many = False
            return result

        def fetchall(self) -> Any:
            rows = super().fetchall()
            self._answered()
            return rows

        def close(self) -> None:
            try:
                self._answered()
            finally:
                super().close()

        if hasattr(base, "copy"):  # psycopg

            @contextlib.contextmanager
            def copy(self, statement: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
                with super().copy(statement, *args, **kwargs) as copy:
                    yield copy
                hook(self, str(statement))

    return Hooked
