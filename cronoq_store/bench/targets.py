"""Databases to run on: SQLite temp files, scratch server databases, or given URLs."""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Final

import click
from sqlalchemy import (
    URL,
    create_engine,
    func,
    make_url,
    select,
    text,
)
from sqlalchemy.engine.interfaces import Dialect

from .. import dialects
from ..schema import tasks
from .results import Target

SERVER_URLS: Final = {
    "postgresql": os.environ.get(
        "CRONOQ_BENCH_POSTGRESQL_URL",
        os.environ.get(
            "CRONOQ_TEST_POSTGRESQL_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
        ),
    ),
    "mysql": os.environ.get(
        "CRONOQ_BENCH_MYSQL_URL",
        os.environ.get("CRONOQ_TEST_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/"),
    ),
}
"""Servers on which `--dialect` creates (and afterwards drops) a scratch database."""


# Databases to run on: SQLite temp files, scratch server databases, or given URLs.


@contextlib.contextmanager
def scratch_database(server_url: str | URL) -> Iterator[URL]:
    """A new, uniquely named database on a server, dropped afterwards."""
    url = make_url(server_url)
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    name = f"cronoq_bench_{uuid.uuid4().hex[:12]}"
    mysql = dialects.dialect_of(admin).schema_is_database  # CREATE DATABASE's own options
    try:
        with admin.connect() as conn:
            conn.execute(text(f"CREATE DATABASE {name}" + (" CHARACTER SET utf8mb4" * mysql)))
        yield url.set(database=name)
    finally:
        with admin.connect() as conn:
            force = "" if mysql else " WITH (FORCE)"
            conn.execute(text(f"DROP DATABASE IF EXISTS {name}{force}"))
        admin.dispose()


@contextlib.contextmanager
def raw_database(target: Target) -> Iterator[URL]:
    """The raw side's own database: `target.raw_url`, or a scratch one beside the store's (a
    sibling SQLite file, or a new database on the same server), removed afterwards."""
    if target.raw_url is not None:
        yield target.raw_url
        return
    url = target.url
    if dialects.class_of(url).server:
        with scratch_database(url) as raw:
            yield raw
        return
    store = Path(url.database or "")
    path = store.with_name(f"{store.stem}-raw-{uuid.uuid4().hex[:8]}{store.suffix}")
    try:
        yield url.set(database=str(path))
    finally:
        for suffix in ("", "-wal", "-shm", "-journal"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)


def _sqlite_targets(path: str) -> list[Target]:
    url = make_url("sqlite://").set(database=path)
    return [Target(url=url, full_sync=True), Target(url=url, full_sync=False)]


def _check_empty(url: URL) -> None:
    """Refuse a database whose store holds tasks: the benchmark empties its tables."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            if engine.dialect.has_table(conn, tasks.name):
                count = conn.execute(select(func.count()).select_from(tasks)).scalar()
                if count:
                    raise click.ClickException(
                        f"{url.render_as_string(hide_password=True)} holds {count} tasks; "
                        "the benchmark needs a database without a store in use"
                    )
    finally:
        engine.dispose()


@contextlib.contextmanager
def resolve_targets(urls: Sequence[str], dialect_names: Sequence[str]) -> Iterator[list[Target]]:
    """The targets for the command line options (SQLite temp files by default)."""
    with contextlib.ExitStack() as stack:
        targets: list[Target] = []
        names = list(dialect_names)
        if "all" in names:
            names = ["sqlite", "postgresql", "mysql"]
        if not urls and not names:
            names = ["sqlite"]
        for name in dict.fromkeys(names):
            if not dialects.class_of(name).server:  # a file
                tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="cronoq-bench-"))
                targets += _sqlite_targets(str(Path(tmp) / "bench.db"))
            else:
                targets.append(Target(url=stack.enter_context(scratch_database(SERVER_URLS[name]))))
        for raw in urls:
            if "://" not in raw:
                targets += _sqlite_targets(raw)
                continue
            url = make_url(raw)
            _check_empty(url)
            if not dialects.class_of(url).server:
                targets += _sqlite_targets(url.database or "")
            else:
                targets.append(Target(url=url))
        yield targets


def server_label(dialect: Dialect) -> str:
    """The server a connected dialect speaks to and its version, as the figures are labelled:
    "postgresql 16.4", "mariadb 11.4.2" (MariaDB by its own name, which `dialects.name` gives
    as MySQL's)."""
    version = ".".join(str(v) for v in (dialect.server_version_info or ())[:3])
    name = "mariadb" if getattr(dialect, "is_mariadb", False) else dialects.name(dialect)
    return f"{name} {version}"
