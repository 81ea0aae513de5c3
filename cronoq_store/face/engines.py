"""The one engine factory of both faces (`SqlStore.open`, `AsyncSqlStore.open`): a URL or a
path made into an engine with the settings the store relies on (SQLite's file, pragmas and
busy timeout; the servers' connect options, socket tuning and idle pings)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import URL, Engine, event, make_url
from sqlalchemy import exc as sa_exc

from .. import dialects, execution
from ..config import StoreConfig
from ..errors import InvalidValue, StoreError

E = TypeVar("E")


def sqlite_path(path: str) -> Path:
    """Refuse what SQLite would not treat as a plain local file (memory, URIs)."""
    if not path or path.startswith(":") or path[:5].lower() == "file:":
        raise InvalidValue(
            f"invalid SQLite path {path!r}: use a plain file path on a local filesystem"
        )
    return Path(path)


def sqlite_file(url: URL) -> Path:
    """The file a SQLite URL names, refusing query options.

    pysqlite's `uri=true` hands the path and every other option to SQLite as a `file:` URI:
    SQLite would then open another file (`x.db?nolock=1`), in memory, or without the locking
    that fencing relies on, while the store checked and created `x.db`. No option is needed
    (the store sets timeouts and pragmas itself), so none is accepted.
    """
    if url.query:
        raise InvalidValue(
            f"SQLite URL options are not accepted ({', '.join(sorted(url.query))}): "
            "use a plain file path; the store sets what SQLite needs"
        )
    return sqlite_path(url.database or "")


def create_private(path: Path) -> None:
    """Create the database file 0600 if it does not exist; SQLite's -wal and -shm follow it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    except OSError as exc:
        raise StoreError(f"cannot create {path}: {exc.strerror}") from exc
    os.close(fd)


def driver_options(url: URL, config: StoreConfig) -> tuple[URL, dict[str, Any]]:
    """`url` and the `connect_args` of an engine the store creates for it (both faces).

    URL options the driver needs as numbers come out of the URL (`dialects.connect_options`);
    behind a transaction pooler psycopg prepares nothing: a statement prepared on one server
    connection is unknown to (or already exists on) the next.
    """
    url, connect_args = dialects.connect_options(url)
    if config.transaction_pooler and dialects.class_of(url).on_libpq(url):
        if connect_args.get(dialects.PREPARE_THRESHOLD) is not None:
            raise InvalidValue(
                "prepare_threshold in the URL contradicts StoreConfig(transaction_pooler=True), "
                "which prepares no statement: leave the option out"
            )
        connect_args[dialects.PREPARE_THRESHOLD] = None
    return url, connect_args


def _flights_prepare(config: StoreConfig, connect_args: Mapping[str, Any]) -> bool:
    """Whether the store's flights on a pipelined engine (sync psycopg: `dialects.dialect_of`)
    prepare their statements (`wire.prepare_on`): unless a transaction pooler stands in
    front, or the URL says to prepare nothing (`?prepare_threshold=`, as behind one)."""
    if config.transaction_pooler:
        return False
    return connect_args.get(dialects.PREPARE_THRESHOLD, 0) is not None


def target_url(target: str | os.PathLike[str] | URL, sqlite_driver: str) -> URL:
    """The URL `open` was given: a bare path means a SQLite file (with `sqlite_driver`)."""
    if isinstance(target, os.PathLike) or (isinstance(target, str) and "://" not in target):
        scheme = f"sqlite+{sqlite_driver}://"
        return make_url(scheme).set(database=str(sqlite_path(os.fspath(target))))
    return target if isinstance(target, URL) else dialects.parse_url(target)


def new_engine(
    url: URL,
    config: StoreConfig,
    create: Callable[..., E],
    sync: Callable[[E], Engine],
    *,
    read_only: bool = False,
    **sqlite_options: Any,
) -> E:
    """The engine `open` owns, on either face: made by `create` (`create_engine` or
    `create_async_engine`), its events set on `sync(engine)`, the engine that runs the
    statements. SQLite: the file created 0600, the pragmas, and a busy timeout no longer than a
    commit may take; on the servers a pooled connection is pinged only when it sat idle
    (`execution.ping_when_idle`). Its statement parameters are task data (payloads, labels),
    so `hide_parameters` keeps them out of SQLAlchemy's errors and logging. `read_only`
    (SQLite): the file is not created, and its connections cannot write nor take the write
    lock (`dialects.configure_sqlite`)."""
    dialects.check_url(url)
    dialects.require_database(url, config.schema)
    try:
        if not dialects.class_of(url).server:
            path = sqlite_file(url)  # refuses a path SQLite would not lock, before anything
            if not read_only:
                create_private(path)
            engine = create(
                url,
                pool_size=config.pool_size,
                max_overflow=0,
                hide_parameters=True,
                **sqlite_options,
            )
            dialects.configure_sqlite(
                sync(engine),
                full_sync=config.full_sync,
                busy_timeout=min(config.busy_timeout, config.commit_timeout),
                read_only=read_only,
            )
            return engine
        url, connect_args = driver_options(url, config)
        connect_args = dialects.net_options(url, connect_args)
        engine = create(
            url,
            pool_size=config.pool_size,
            hide_parameters=True,
            connect_args=connect_args,
            **dialects.pool_options(url),
            **dialects.class_of(url).engine_options(url),
        )
        dialects.dialect_of(sync(engine)).set_up_engine(sync(engine))
        if dialects.dialect_of(sync(engine)).pipelined and _flights_prepare(config, connect_args):
            from .. import wire  # psycopg's

            event.listen(sync(engine), "connect", lambda conn, _record: wire.prepare_on(conn))
    except sa_exc.InvalidRequestError as exc:  # a sync driver asyncio cannot drive
        raise StoreError(
            dialects.redact(f"{url.drivername!r} is not an async driver: {exc}")
        ) from exc
    except (sa_exc.ArgumentError, ImportError) as exc:
        # With advice, SQLAlchemy's own text ("Can't load plugin: ...") only adds noise.
        advice = dialects.url_advice(url)
        why = f"bad database URL: {advice}" if advice else f"bad database URL: {exc}"
        raise StoreError(dialects.redact(why)) from exc
    execution.ping_when_idle(sync(engine), execution.PING_IDLE)  # a server's (SQLite returned)
    whole = dialects.class_of(url).on_libpq(url)  # libpq: whole seconds
    execution.bound_connects(sync(engine), "connect_timeout", whole=whole)
    dialects.tune_sockets(sync(engine))
    dialects.reset_after_commit(sync(engine))
    return engine
