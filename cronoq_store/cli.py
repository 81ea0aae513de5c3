"""The `cronoq-store` command: migrations, a look inside a database, and its upkeep.

Every command that needs the database opens it through `_database`: one engine per run, every
error made one line on stderr with exit status 1 (never a traceback), the engine disposed
afterwards, and no password in anything printed. Scripts use `--json`; people get rich tables.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import json
import os
import re
import shlex
import sqlite3
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final

import click
from alembic.script import ScriptDirectory
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text
from sqlalchemy import URL, Connection, Engine, create_engine, event, inspect
from sqlalchemy import exc as sa_exc
from sqlalchemy.pool import NullPool

from . import codec, dialects, inbox, lease, migrate, repository
from .errors import CorruptValue, InvalidValue, SchemaError, StoreError, StoreUnavailable
from .model import INT64_MAX, INT64_MIN, LostCommits, TaskStatus, TimeBase
from .schema import check_schema_name
from .store import SqlStore, StoreConfig, engine_for

DEFAULT_URL: Final = "cronoq.db"
"""Without --url or CRONOQ_DATABASE_URL: the embedded SQLite file in the current directory."""
DEMO_URL: Final = "cronoq-demo.db"
"""Where `demo` writes without --url: never DEFAULT_URL, which holds a user's real data once
they ran `upgrade` there."""
UNIX: Final = TimeBase(unix_ns=0)
"""Decodes stored times as Unix nanoseconds (the CLI has no engine time base)."""
COUNT_ALL: Final = 2**62
"""A LIMIT that never binds, to count what `repository.prunable_stmt` would delete."""
LAZY_COMMANDS: Final = {
    "bench": "cronoq_store.bench:bench",
    "enqueue": "cronoq_store.cli_inbox:enqueue_cmd",
    "inbox": "cronoq_store.cli_inbox:inbox_cmd",
    "web": "cronoq_store.web:web_cmd",
}
"""Subcommands from optional modules, imported only when run (so `--help` stays fast)."""


# Where the database is, and the one way every command opens it.


@dataclass(frozen=True, slots=True)
class Target:
    """The database the command line names (parsed only when a command needs it)."""

    url: str
    schema: str | None

    def parsed(self) -> URL:
        """The URL; a bare path means a SQLite file."""
        if "://" not in self.url:
            return URL.create("sqlite", database=self.url)
        try:
            return dialects.parse_url(self.url)
        except InvalidValue as exc:
            raise click.ClickException(str(exc)) from exc


def shown(url: URL) -> str:
    """`url` as it may be printed: never with its password (`dialects.safe_url`)."""
    return dialects.safe_url(url)


def shown_target(ctx: click.Context) -> str:
    """The command line's database as it may be printed ("?" if it cannot be parsed)."""
    target = ctx.find_object(Target)
    try:
        return shown(target.parsed()) if target is not None else "?"
    except click.ClickException:
        return "?"


def hint(target: Target, *command: str) -> str:
    """The command line to run next, in backquotes, as it can be pasted: the database named as
    it was given (a bare path as typed, a URL with its password masked) and the --schema."""
    url = target.url if "://" not in target.url else shown(target.parsed())
    schema = ["--schema", target.schema] if target.schema else []
    return "`" + shlex.join(["cronoq-store", "--url", url, *schema, *command]) + "`"


def _one_line(text: str) -> str:
    """Driver messages span lines ("... failed\\n\\tIs the server running?"): join them."""
    return dialects.redact("; ".join(part.strip() for part in text.splitlines() if part.strip()))


@contextlib.contextmanager
def _errors(where: str) -> Iterator[None]:
    """Turn every store and database error in the block into a one-line `click` error."""
    try:
        yield
    except BrokenPipeError:
        raise  # stdout closed by the reader (`| head`): click exits quietly
    except (sa_exc.SQLAlchemyError, OSError) as exc:
        raise _failure(where, dialects.translate(exc), exc) from exc
    except StoreError as exc:
        raise _failure(where, exc) from exc


def _failure(
    where: str, exc: StoreError, cause: BaseException | None = None
) -> click.ClickException:
    """One line; a connection's cause (`dialects.describe`) under one label on every dialect."""
    unavailable = isinstance(exc, StoreUnavailable) or dialects.describe(cause or exc) is not None
    what = "database unavailable" if unavailable else "failed"
    return click.ClickException(_one_line(f"{what} ({where}): {exc}"))


@contextlib.contextmanager
def _database(
    target: Target, *, write: bool = False, create: bool = False, need_schema: bool = True
) -> Iterator[SqlStore]:
    """The store at `target` for one command, disposed afterwards; errors become one line.

    A missing SQLite file is refused unless `create` (only `upgrade` creates one), so a typo in
    a path never leaves an empty database behind. With `need_schema` the database must stand
    at this build's head revision. Without `write`, a SQLite file is opened read-only and
    without the store's BEGIN IMMEDIATE, so looking at a busy database never holds up its
    leader's commits (WAL readers do not block the writer).
    """
    url = target.parsed()
    where = shown(url)
    config = StoreConfig(migrate=False, schema=target.schema, pool_size=2)
    reader: Engine | None = None
    if url.get_backend_name() == "sqlite":
        if target.schema:
            raise click.UsageError("--schema is for PostgreSQL and MySQL; SQLite has no schemas")
        path = url.database or ""
        plain = path and not path.startswith(":") and path[:5].lower() != "file:"
        if plain and not create and not Path(path).exists():  # SqlStore refuses the others
            raise click.ClickException(
                f"no SQLite database at {path}: {hint(target, 'upgrade')} creates one"
            )
        if plain and not write:
            reader = _sqlite_reader(url, config)
    with _errors(where):
        # The store's engine, without `SqlStore.open`'s checks: each command checks what it
        # needs itself (`current` must show a revision this build does not know).
        engine = reader or engine_for(url, config)
        try:
            store = SqlStore(engine, config)
            try:
                if target.schema and dialects.name(engine.dialect) == "mysql":
                    _mysql_database(engine, target, create=create)
                if need_schema:
                    _require_head(store, target)
                yield store
            finally:
                store.close()
        finally:
            engine.dispose()


def _mysql_database(engine: Engine, target: Target, *, create: bool) -> None:
    """MySQL's --schema is a database of its own: `upgrade` creates it (as PostgreSQL's first
    migration creates its schema); any other command names it and says what to do."""
    schema = target.schema or ""
    with engine.begin() as conn:
        if dialects.database_exists(conn, schema):
            return
        if not create:
            raise SchemaError(
                f"no database {schema!r} on this server (--schema): "
                f"{hint(target, 'upgrade')} creates it"
            )
        dialects.create_database(conn, schema)


def _sqlite_reader(url: URL, config: StoreConfig) -> Engine:
    """A SQLite engine that only reads: pysqlite's own transactions, `query_only` on."""
    engine = create_engine(
        url,
        connect_args={"timeout": config.busy_timeout.total_seconds()},
        poolclass=NullPool,
        hide_parameters=True,
    )

    @event.listens_for(engine, "connect")
    def _read_only(dbapi_connection: sqlite3.Connection, _record: object) -> None:
        dbapi_connection.execute("PRAGMA query_only = ON")

    return engine


def known_revisions() -> set[str]:
    """Every revision the packaged migrations know."""
    script = ScriptDirectory.from_config(migrate.alembic_config())
    return {rev.revision for rev in script.walk_revisions()}


def _unknown(rev: str) -> SchemaError:
    return SchemaError(
        f"the database is at schema revision {rev!r}, which this build of cronoq-store does not "
        f"know (its newest is {migrate.head_revision()!r}): the schema is newer than this "
        f"cronoq-store; upgrade cronoq-store"
    )


def _require_head(store: SqlStore, target: Target) -> None:
    """Refuse a database this build cannot read: not migrated, behind, or newer than it."""
    rev = migrate.current_revision(store.engine, schema=target.schema)
    head = migrate.head_revision()
    if rev == head:
        return
    if rev is None:
        raise SchemaError(f"{_where_tables(store.engine, target)}: run {hint(target, 'upgrade')}")
    if rev not in known_revisions():
        raise _unknown(rev)
    raise SchemaError(
        f"the database is at schema revision {rev!r}, behind this build's {head!r}: "
        f"run {hint(target, 'upgrade')}"
    )


def _where_tables(engine: Engine, target: Target) -> str:
    """What is missing where: the PostgreSQL schema itself, or cronoq's tables in it."""
    if dialects.name(engine.dialect) != "postgresql":
        return "no cronoq tables in this database"
    inspector = inspect(engine)
    if target.schema is None:
        return f"no cronoq tables in PostgreSQL schema {inspector.default_schema_name!r}"
    if not inspector.has_schema(target.schema):
        return f"no PostgreSQL schema {target.schema!r} in this database"
    return f"PostgreSQL schema {target.schema!r} has no cronoq tables"


# Formatting.


def _console(*, stderr: bool = False) -> Console:
    """A console on the current stdout (or stderr), without guessed highlighting.

    Piped into a file or another program, tables get 160 columns rather than rich's 80, so
    they are not squeezed (COLUMNS still wins).
    """
    stream = sys.stderr if stderr else sys.stdout
    wide = stream.isatty() or "COLUMNS" in os.environ
    return Console(stderr=stderr, highlight=False, width=None if wide else 160)


def print_table(console: Console, grid: Table) -> None:
    """`grid` without the spaces rich pads its last column with (lines end in text)."""
    with console.capture() as captured:
        console.print(grid)
    click.echo("\n".join(line.rstrip() for line in captured.get().splitlines()))


def _when(unix_ns: int | None) -> str | None:
    """Unix nanoseconds as ISO 8601 UTC (to the microsecond)."""
    if unix_ns is None:
        return None
    moment = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=unix_ns // 1000)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


def _ns_text(ns: int | None) -> str | None:
    """A duration in nanoseconds as "1.5 s"."""
    return None if ns is None else f"{ns / 1e9:g} s"


def _size_text(size: int | None) -> str:
    if size is None:
        return "-"
    if size < 1024:
        return f"{size} B"
    value = size / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _echo_json(data: object) -> None:
    click.echo(json.dumps(data, indent=2, ensure_ascii=False))


def _cells(*values: object) -> list[Text]:
    """Table cells as plain text: a pool named "[red]x" is shown, not taken for markup."""
    return [Text("" if v is None else str(v)) for v in values]


# Durations on the command line: 30s, 15m, 2h, 7d, 1w, or sums like 1h30m.

_DURATION: Final = re.compile(r"(\d+)([smhdw])")
_UNIT_S: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> timedelta:
    """A duration such as 30s, 15m, 2h, 7d, 1w or 1h30m; ValueError otherwise.

    Saturates at `timedelta.max` (about 2.7 million years): "older than 99999999999999999999d"
    means "older than anything", as the store's own bounds do.
    """
    compact = text.strip().lower().replace(" ", "")
    if not compact or _DURATION.sub("", compact):
        raise ValueError(f"{text!r} is not a duration like 30s, 15m, 2h or 7d")
    seconds = sum(int(n) * _UNIT_S[u] for n, u in _DURATION.findall(compact))
    return timedelta(seconds=seconds) if seconds < _MAX_S else timedelta.max


_MAX_S: Final = int(timedelta.max.total_seconds())


def _schema_option(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Click callback: a schema name the store can use (StoreConfig's rule), or a usage error."""
    if not value:
        return None
    try:
        check_schema_name(value, "the schema")
    except InvalidValue as exc:
        raise click.BadParameter(str(exc), ctx, param) from exc
    return value


def _duration_option(ctx: click.Context, param: click.Parameter, value: str) -> timedelta:
    """Click callback: a duration option's text as a `timedelta`."""
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from exc


# The command group, with optional subcommands loaded on demand.


def _load_lazy(target: str) -> click.Command | None:
    """The click command at "module:attribute", or None when the module is not installed.

    A module that is there but cannot be imported (an optional dependency missing) is a
    one-line error when its command is run, never a traceback.
    """
    module_name, attribute = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name == module_name:
            return None
        raise click.ClickException(f"{module_name} cannot be loaded: {exc}") from exc
    command = getattr(module, attribute, None)
    return command if isinstance(command, click.Command) else None


class CronoqGroup(click.Group):
    """A group that also offers `LAZY_COMMANDS` whose modules are present."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        names = set(super().list_commands(ctx))
        for name, target in LAZY_COMMANDS.items():
            if importlib.util.find_spec(target.split(":")[0]) is not None:
                names.add(name)
        return sorted(names)

    def invoke(self, ctx: click.Context) -> Any:
        """Run the command; whatever escapes it becomes one line on stderr and status 1.

        Store errors are made one line where they happen (`_errors`); this catches the rest (a
        bug, a value no check foresaw), so no input ever prints a traceback. A closed pipe
        (`cronoq-store tasks | head`) is left to click, which exits quietly.
        """
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except BrokenPipeError:
            raise
        except StoreError as exc:
            raise _failure(shown_target(ctx), exc) from exc
        except Exception as exc:
            if os.environ.get("CRONOQ_TRACEBACK"):
                raise
            raise click.ClickException(
                _one_line(
                    f"internal error ({type(exc).__name__}: {exc}); "
                    "set CRONOQ_TRACEBACK=1 to see where"
                )
            ) from exc

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is None and cmd_name in LAZY_COMMANDS:
            command = _load_lazy(LAZY_COMMANDS[cmd_name])
        return command


@click.group(cls=CronoqGroup)
@click.version_option(package_name="cronoq-store", prog_name="cronoq-store")
@click.option(
    "--url",
    envvar="CRONOQ_DATABASE_URL",
    default=DEFAULT_URL,
    show_default=True,
    help="Database URL, or a SQLite file path (env CRONOQ_DATABASE_URL).",
)
@click.option(
    "--schema",
    envvar="CRONOQ_SCHEMA",
    default=None,
    callback=_schema_option,
    help="PostgreSQL schema (or MySQL database) holding the tables (env CRONOQ_SCHEMA).",
)
@click.pass_context
def main(ctx: click.Context, url: str, schema: str | None) -> None:
    """cronoq-store: the durable state of the cronoq scheduler."""
    ctx.obj = Target(url=url, schema=schema or None)


# Migrations.


@main.command()
@click.argument("revision", default="head")
@click.pass_obj
def upgrade(target: Target, revision: str) -> None:
    """Migrate the database to REVISION (default: head); safe to run from many hosts at once."""
    with _database(target, write=True, create=True, need_schema=False) as store:
        before = migrate.current_revision(store.engine, schema=target.schema)
        restored = migrate.upgrade(store.engine, revision, schema=target.schema)
        after = migrate.current_revision(store.engine, schema=target.schema)
    if before != after:
        click.echo(f"upgraded {before or 'none'} -> {after}")
    elif restored is None:
        click.echo(f"at {after or 'none'}: nothing to do")
    if restored is not None:
        click.echo(f"restored the missing leader row (free, epoch 0); next task id {restored}")


@main.command()
@click.argument("revision")
@click.option(
    "--yes-destroy-data",
    is_flag=True,
    help="Required: a downgrade drops tables and the tasks in them.",
)
@click.pass_obj
def downgrade(target: Target, revision: str, yes_destroy_data: bool) -> None:
    """Migrate the database down to REVISION ("base" drops every cronoq table)."""
    if not yes_destroy_data:
        raise click.UsageError(
            "a downgrade drops tables and the data in them: pass --yes-destroy-data to go ahead"
        )
    with _database(target, write=True, need_schema=False) as store:
        before = migrate.current_revision(store.engine, schema=target.schema)
        migrate.downgrade(store.engine, revision, schema=target.schema)
        after = migrate.current_revision(store.engine, schema=target.schema)
    click.echo(f"downgraded {before or 'none'} -> {after or 'none'}")


@main.command()
@click.option("--check", is_flag=True, help="Exit with status 1 unless at this build's head.")
@click.pass_obj
def current(target: Target, check: bool) -> None:
    """Print the database's schema revision ("none" before the first upgrade)."""
    with _database(target, need_schema=False) as store:
        rev = migrate.current_revision(store.engine, schema=target.schema)
    click.echo(rev or "none")
    if rev is not None and rev not in known_revisions():
        raise _failure(shown(target.parsed()), _unknown(rev))
    head = migrate.head_revision()
    if check and rev != head:
        raise click.ClickException(f"not at head {head!r}: run {hint(target, 'upgrade')}")


@main.command()
def history() -> None:
    """List the migrations this build ships, newest first (no database needed)."""
    script = ScriptDirectory.from_config(migrate.alembic_config())
    for rev in script.walk_revisions():
        down = rev.down_revision
        parent = "<base>" if down is None else ", ".join([down] if isinstance(down, str) else down)
        mark = " (head)" if rev.is_head else ""
        click.echo(f"{parent} -> {rev.revision}{mark}: {rev.doc}")


# Status.


def _lease_view(row: Any) -> dict[str, Any]:
    """The lease row as a dict: state free/held/expired, seconds left on the database clock."""
    left = (row.expires_unix_ns - row.now) / 1e9
    state = "free" if row.holder is None else ("held" if left > 0 else "expired")
    return {
        "state": state,
        "holder": row.holder,
        "epoch": row.epoch,
        "expires_in_s": None if row.holder is None else round(left, 3),
        "next_epoch": lease.next_epoch(row.epoch),
    }


def _lease_text(view: Mapping[str, Any]) -> str:
    if view["state"] == "free":
        return f"free (last epoch {view['epoch']}; the next leader takes {view['next_epoch']})"
    if view["state"] == "held":
        return (
            f"held by {view['holder']}, epoch {view['epoch']}, "
            f"expires in {view['expires_in_s']:.1f} s (database clock)"
        )
    return (
        f"expired {-view['expires_in_s']:.1f} s ago (holder {view['holder']}, epoch "
        f"{view['epoch']}): a standby may take over"
    )


def _server(conn: Connection) -> dict[str, Any] | None:
    """PostgreSQL: the role of the server reached and its synchronous replication, or None."""
    stmt = dialects.server_role_stmt(conn.dialect)
    if stmt is None:
        return None
    try:
        row = conn.execute(stmt).one()
    except sa_exc.DBAPIError:  # a courtesy, as the size: a locked-down server may refuse it
        conn.rollback()
        return None
    return {
        "role": "standby" if row.standby else "primary",
        "synchronous_standby_names": row.names,
        "synchronous_standbys_connected": int(row.connected),
        "synchronous_commit": row.commit,
    }


def _server_text(server: Mapping[str, Any]) -> str:
    if server["role"] == "standby":
        return "standby (read-only: a leader cannot commit here; reach the primary)"
    names, commit = server["synchronous_standby_names"], server["synchronous_commit"]
    if not names or commit in ("off", "local"):
        return (
            f"primary, no synchronous standby (synchronous_standby_names {names!r}, "
            f"synchronous_commit {commit}): a failover to an asynchronous replica can lose "
            "acknowledged commits"
        )
    return (
        f"primary, synchronous standbys {names!r} ({server['synchronous_standbys_connected']} "
        f"connected), synchronous_commit {commit}"
    )


def _prometheus(data: Mapping[str, Any]) -> str:
    """`status`'s figures in the Prometheus text exposition format (gauges, `cronoq_` names,
    units in the names, the schema revision as a label)."""
    out: list[str] = []

    def gauge(name: str, text: str, samples: list[tuple[dict[str, str], float]]) -> None:
        out.append(f"# HELP {name} {text}")
        out.append(f"# TYPE {name} gauge")
        for labels, value in samples:
            shown = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
            out.append(f"{name}{{{shown}}} {value:g}" if shown else f"{name} {value:g}")

    lease_view, waiting = data["lease"], data["inbox"]
    gauge(
        "cronoq_schema_info",
        "The schema revision of the database (label), and this build's head.",
        [({"revision": str(data["revision"]), "head": str(data["head"])}, 1)],
    )
    gauge(
        "cronoq_tasks",
        "Stored tasks by pool and status.",
        [({"pool": r["pool"], "status": r["status"]}, r["count"]) for r in data["tasks"]],
    )
    gauge("cronoq_inbox_items", "Items waiting in the inbox.", [({}, waiting["items"])])
    age = waiting["oldest_age_s"]
    gauge(
        "cronoq_inbox_oldest_age_seconds",
        "Age of the oldest item waiting in the inbox (0 when empty).",
        [({}, 0 if age is None else age)],
    )
    gauge(
        "cronoq_inbox_set_aside",
        "Inbox rows set aside as undecodable.",
        [({}, waiting["set_aside"])],
    )
    gauge("cronoq_lease_epoch", "The lease's fencing epoch.", [({}, lease_view["epoch"])])
    gauge(
        "cronoq_lease_held",
        "1 while a leader holds an unexpired lease, else 0.",
        [({}, 1 if lease_view["state"] == "held" else 0)],
    )
    left = lease_view["expires_in_s"]
    gauge(
        "cronoq_lease_expires_in_seconds",
        "Seconds until the lease expires, on the database's clock (negative: expired; 0: free).",
        [({}, 0 if left is None else left)],
    )
    gauge(
        "cronoq_prune_backlog_tasks",
        "Finished tasks last updated longer ago than the retention (what prune would delete).",
        [({}, data["prune_backlog"]["tasks"])],
    )
    if "lost_commits" in data:
        lost = data["lost_commits"]
        gauge(
            "cronoq_lost_commits",
            "Commits a leader found missing (an asynchronous failover); -1 when unknown.",
            [({"epoch": str(lost["epoch"])}, -1 if lost["commits"] is None else lost["commits"])],
        )
    return "\n".join(out) + "\n"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _lost_text(lost: LostCommits) -> str:
    count = "an unknown number of" if lost.commits is None else f"up to {lost.commits}"
    return (
        f"the leader of epoch {lost.epoch} found {count} acknowledged commits missing "
        f"({_when(lost.noticed_unix_ns)}); cleared by the next leader's first commit"
    )


def _schedule(name: str, spec_text: str, payload: bytes | None, nxt: int | None, last: Any) -> Any:
    """A stored schedule as a dict; an undecodable one says why instead of failing status."""
    out: dict[str, Any] = {"name": name, "next": _when(nxt), "last_task": last}
    try:
        spec = codec.decode_recurring(UNIX, name, spec_text, payload)
    except CorruptValue as exc:
        out["schedule"] = f"undecodable: {exc}"
        return out
    if spec.cron is not None:
        out["schedule"] = f"cron {spec.cron} ({spec.timezone})"
    else:
        out["schedule"] = f"every {_ns_text(spec.interval_ns)}"
    out["pool"] = spec.template.pool
    return out


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON, for scripts (--format json).")
@click.option(
    "--format",
    "form",
    type=click.Choice(["text", "json", "prometheus"]),
    default="text",
    show_default=True,
    help="prometheus: the text exposition format, for a textfile collector or a scrape job.",
)
@click.option(
    "--retention",
    metavar="DURATION",
    callback=_duration_option,
    default="1h",
    show_default=True,
    help="Finished tasks older than this count as prune backlog (StoreConfig.retention).",
)
@click.pass_obj
def status(target: Target, as_json: bool, form: str, retention: timedelta) -> None:
    """Schema revision, leader lease, task counts, schedules and database size."""
    form = "json" if as_json else form
    cutoff = codec.saturate(time.time_ns() - (retention // timedelta(microseconds=1)) * 1000)
    with _database(target) as store, store.engine.connect() as conn:
        revision = migrate.current_revision(conn, schema=target.schema)
        lease_view = _lease_view(lease.lease_view(conn))
        counts = [
            {"pool": r.pool, "status": r.status, "count": r.n}
            for r in conn.execute(repository.task_counts_stmt())
        ]
        schedules = [
            _schedule(r.name, r.spec, r.template_payload, r.next_unix_ns, r.last_task_id)
            for r in conn.execute(repository.recurring_stmt())
        ]
        try:
            size = conn.execute(dialects.database_size_stmt(conn.dialect, target.schema)).scalar()
        except sa_exc.DBAPIError:  # the size is a courtesy; a locked-down server may refuse it
            conn.rollback()
            size = None
        url = shown(store.engine.url)
        dialect = dialects.name(conn.dialect)
        waiting = inbox.depth(conn)
        server = _server(conn)
        lost = repository.lost_commits(conn)
        backlog = int(
            conn.execute(repository.prune_backlog_stmt(), {"cutoff": cutoff}).scalar_one()
        )
    size_bytes = None if size is None else int(size)
    data: dict[str, Any] = {
        "database": url,
        "dialect": dialect,
        "revision": revision,
        "head": migrate.head_revision(),
        "size_bytes": size_bytes,
        "lease": lease_view,
        "tasks": counts,
        "recurring": schedules,
        "inbox": waiting,
        "prune_backlog": {"tasks": backlog, "retention_s": retention.total_seconds()},
    }
    if server is not None:
        data["server"] = server
    if lost is not None:
        data["lost_commits"] = dataclasses.asdict(lost)
    if form == "json":
        _echo_json(data)
        return
    if form == "prometheus":
        click.echo(_prometheus(data), nl=False)
        return
    click.echo(f"database   {url} ({dialect})")
    click.echo(f"schema     {revision} (head)")
    click.echo(f"size       {_size_text(size_bytes)}")
    if server is not None:
        click.echo(f"server     {_server_text(server)}")
    click.echo(f"lease      {_lease_text(lease_view)}")
    if lost is not None:
        click.echo(f"lost       {_lost_text(lost)}")
    age = waiting["oldest_age_s"]
    click.echo(
        f"inbox      {waiting['items']} waiting"
        + ("" if age is None else f", oldest {age:g} s old")
        + f", {waiting['set_aside']} set aside"
    )
    console = _console()
    if counts:
        grid = Table(
            title="tasks", title_justify="left", box=box.SIMPLE, show_edge=False, pad_edge=False
        )
        for name in ("pool", "status", "count"):
            grid.add_column(name, justify="right" if name == "count" else "left")
        for c in counts:
            grid.add_row(*_cells(c["pool"], c["status"], c["count"]))
        print_table(console, grid)
    else:
        click.echo("tasks      none")
    if schedules:
        grid = Table(
            title="recurring", title_justify="left", box=box.SIMPLE, show_edge=False, pad_edge=False
        )
        for name in ("name", "schedule", "next", "last task"):
            grid.add_column(name)
        for s in schedules:
            grid.add_row(*_cells(s["name"], s["schedule"], s["next"], s["last_task"]))
        print_table(console, grid)
    else:
        click.echo("recurring  none")


# Tasks.

_STATUSES: Final = click.Choice([s.value for s in TaskStatus], case_sensitive=False)


def _task_dict(row: Any) -> dict[str, Any]:
    status = TaskStatus.from_name(row.status)
    return {
        "id": row.id,
        "key": row.key,
        "pool": row.pool,
        "kind": row.kind,
        "priority": codec.priority_from(row.priority).name.lower(),
        "tenant": row.tenant,
        "status": row.status,
        "terminal": None if status is None else status.is_terminal,
        "attempt": row.attempt,
        "updated": _when(row.updated_unix_ns),
        "message": row.message,
        "output_size": row.output_size,
    }


@main.command("tasks")
@click.option("--pool", "pools", multiple=True, help="Only this pool (repeatable).")
@click.option(
    "--status", "statuses", type=_STATUSES, multiple=True, help="Only this status (repeatable)."
)
@click.option("--key", default=None, help="Only tasks with this key.")
@click.option("--tenant", default=None, help="Only this tenant's tasks.")
@click.option("--after", type=int, default=None, help="Page on: only ids above this one.")
@click.option(
    "--limit", type=click.IntRange(1, 10_000), default=50, show_default=True, help="Page size."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON, for scripts.")
@click.pass_obj
def tasks_cmd(
    target: Target,
    pools: tuple[str, ...],
    statuses: tuple[str, ...],
    key: str | None,
    tenant: str | None,
    after: int | None,
    limit: int,
    as_json: bool,
) -> None:
    """List tasks, live and finished, in id order (page on with --after)."""
    if after is not None and after < INT64_MIN:
        after = None  # every id is above it
    stmt = repository.list_tasks_stmt(
        pools=pools,
        statuses=[s.lower() for s in statuses],
        key=key,
        tenant=tenant,
        after=None if after is None else min(after, INT64_MAX),
        limit=limit,
    )
    with _database(target) as store, store.engine.connect() as conn:
        rows = [_task_dict(r) for r in conn.execute(stmt)]
    next_after = rows[-1]["id"] if len(rows) == limit else None
    if as_json:
        _echo_json({"tasks": rows, "next_after": next_after})
        return
    if not rows:
        click.echo("no tasks match")
        return
    console = _console()
    grid = Table(box=box.SIMPLE, show_edge=False, pad_edge=False)
    for name in ("id", "key", "pool", "kind", "status", "attempt", "tenant", "updated"):
        grid.add_column(name, no_wrap=name in ("id", "status", "updated"), overflow="fold")
    for r in rows:
        grid.add_row(
            *_cells(
                r["id"],
                r["key"],
                r["pool"],
                r["kind"],
                r["status"],
                r["attempt"],
                r["tenant"],
                r["updated"],
            )
        )
    print_table(console, grid)
    if next_after is not None:
        click.echo(f"more: --after {next_after}")


def _task_detail(row: Any) -> dict[str, Any]:
    """One task row in full: its record and its decoded spec (or why it cannot be decoded)."""
    out = _task_dict(row)
    out["seq"] = row.seq
    out["arrival"] = _when(row.arrival_unix_ns)
    out["payload_size"] = len(row.payload)
    try:
        spec = codec.spec_from_columns(UNIX, row._mapping)
    except CorruptValue as exc:
        out["spec_error"] = str(exc)
        return out
    fixed = spec.fixed_start
    out["spec"] = {
        "deadline": _when(spec.deadline),
        "fixed_start": None
        if fixed is None
        else {"at": _when(fixed.at), "tolerance_ns": fixed.tolerance_ns, "on_miss": fixed.on_miss},
        "duration_hint_ns": spec.duration_hint_ns,
        "timeout_ns": spec.timeout_ns,
        "retry": None
        if spec.retry is None
        else {
            "max_attempts": spec.retry.max_attempts,
            "initial_backoff_ns": spec.retry.initial_backoff_ns,
            "max_backoff_ns": spec.retry.max_backoff_ns,
            "multiplier": spec.retry.multiplier,
            "jitter": spec.retry.jitter,
        },
        "deps": [
            {
                "id": getattr(d.target, "id", None),
                "key": getattr(d.target, "key", None),
                "on": d.on,
            }
            for d in spec.deps
        ],
        "resources": dict(spec.resources),
        "tags": sorted(spec.tags),
        "labels": dict(spec.labels),
    }
    return out


@main.command(context_settings={"ignore_unknown_options": True})  # `show -5`: an id
@click.argument("ref")
@click.option("--by-key", is_flag=True, help="REF is a key even if it looks like an id.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON, for scripts.")
@click.pass_obj
def show(target: Target, ref: str, by_key: bool, as_json: bool) -> None:
    """Show one task by ID, or the newest task with KEY."""
    task_id: int | None = None
    if not by_key and re.fullmatch(r"-?\d+", ref):
        task_id = int(ref)
        if not INT64_MIN <= task_id <= INT64_MAX:  # no task can have it
            raise click.ClickException(f"no task with id {task_id} (ids are 64-bit)")
    stmt = (
        repository.task_row_stmt(task_id=task_id)
        if task_id is not None
        else repository.task_row_stmt(key=ref)
    )
    with _database(target) as store, store.engine.connect() as conn:
        row = conn.execute(stmt).first()
        detail = None if row is None else _task_detail(row)
    if detail is None:
        raise click.ClickException(
            f"no task with id {task_id}" if task_id is not None else f"no task with key {ref!r}"
        )
    if as_json:
        _echo_json(detail)
        return
    row_payload: int | None = detail["payload_size"]
    row_output: int | None = detail["output_size"]
    lines: list[tuple[str, object]] = [
        ("id", detail["id"]),
        ("key", detail["key"]),
        ("status", detail["status"]),
        ("attempt", detail["attempt"]),
        ("message", detail["message"]),
        ("pool", detail["pool"]),
        ("kind", detail["kind"]),
        ("priority", detail["priority"]),
        ("tenant", detail["tenant"]),
        ("arrival", detail["arrival"]),
        ("updated", detail["updated"]),
        ("payload", _size_text(row_payload)),
        ("output", _size_text(row_output)),
    ]
    if "spec_error" in detail:
        lines.append(("spec", f"undecodable: {detail['spec_error']}"))
    else:
        spec = detail["spec"]
        lines += [
            (name, value if isinstance(value, str) else json.dumps(value))
            for name, value in spec.items()
            if value
        ]
    width = max(len(name) for name, _ in lines)
    for name, value in lines:
        click.echo(f"{name:<{width}}  {'-' if value is None else value}")


# Upkeep.


@main.command()
@click.option(
    "--older-than",
    required=True,
    metavar="DURATION",
    callback=_duration_option,
    help="Delete finished tasks last updated longer ago than this (30s, 15m, 2h, 7d).",
)
@click.option("--dry-run", is_flag=True, help="Only count what would be deleted.")
@click.option(
    "--batch-size",
    type=click.IntRange(1, 100_000),
    default=repository.PRUNE_BATCH,
    show_default=True,
    help="Rows deleted per transaction.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON, for scripts.")
@click.pass_obj
def prune(
    target: Target, older_than: timedelta, dry_run: bool, batch_size: int, as_json: bool
) -> None:
    """Delete old finished tasks that no live task depends on, in short transactions."""
    # Saturates at the Unix epoch, before which no task was updated (never at int64's 1677).
    cutoff = max(0, time.time_ns() - (older_than // timedelta(microseconds=1)) * 1000)
    with _database(target, write=True) as store:
        with store.engine.connect() as conn:
            total = int(
                conn.execute(
                    repository.prunable_count_stmt(), {"cutoff": cutoff, "limit": COUNT_ALL}
                ).scalar()
                or 0
            )
        deleted = 0
        if not dry_run and total:
            progress = Progress(
                TextColumn("pruning"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=_console(stderr=True),
            )
            with progress:
                bar = progress.add_task("prune", total=total)
                while True:
                    with store.engine.begin() as conn:
                        n = repository.prune_batch(conn, cutoff, batch_size)
                    deleted += n
                    progress.update(bar, advance=n, total=max(total, deleted))
                    if n < batch_size:
                        break
    if as_json:
        count = total if dry_run else deleted
        _echo_json({"dry_run": dry_run, "cutoff": _when(cutoff), "count": count})
    elif dry_run:
        click.echo(f"would delete {total} finished tasks updated before {_when(cutoff)}")
    else:
        click.echo(f"deleted {deleted} finished tasks updated before {_when(cutoff)}")


@main.group("lease")
def lease_group() -> None:
    """The leader lease (see `status` for who holds it)."""


@lease_group.command("release")
@click.option("--force", is_flag=True, help="Required: you know the holder is dead.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.pass_obj
def lease_release(target: Target, force: bool, yes: bool) -> None:
    """Free the lease of a dead leader, so a standby takes over now instead of after its TTL.

    Safe for writes even if the holder is alive after all: its next commit is fenced off and
    it steps down. Its in-flight work is not stopped, though.
    """
    if not force:
        raise click.UsageError(
            "releasing another instance's lease needs --force (and the holder must be dead)"
        )
    with _database(target, write=True) as store:
        with store.engine.connect() as conn:
            view = _lease_view(lease.lease_view(conn))
        if view["state"] == "free":
            click.echo("the lease is free: nothing to release")
            return
        click.echo(f"lease: {_lease_text(view)}")
        if not yes:
            click.confirm("Release it? Only do this if that process is dead", abort=True)
        with store.engine.begin() as conn:
            dialects.bound_idle(conn, store.config.lease_ttl)  # it touches the leader row
            released = conn.execute(lease.release_stmt(), {"b_holder": view["holder"]}).rowcount
    if released != 1:
        raise click.ClickException("the lease changed hands meanwhile: nothing released")
    click.echo(
        f"released the lease of {view['holder']} (epoch {view['epoch']}); "
        f"the next leader takes epoch {view['next_epoch']}"
    )


# Commands whose work lives elsewhere.


@main.command("demo")
@click.option(
    "--overwrite", is_flag=True, help="Replace an earlier demo's files (never another database)."
)
@click.option(
    "--ttl",
    type=click.FloatRange(min=0.1),
    default=1.0,
    show_default=True,
    help="Lease TTL in seconds of the demo's processes.",
)
@click.pass_context
def demo_cmd(ctx: click.Context, overwrite: bool, ttl: float) -> None:
    """Run the failover demo on a SQLite file of its own (--url, default ./cronoq-demo.db) and
    check it. Only a database an earlier demo made is ever overwritten.

    Exits with status 1 when the demo's own check fails.
    """
    target: Target = ctx.obj
    if ctx.parent is not None and ctx.parent.get_parameter_source("url") in (
        click.core.ParameterSource.DEFAULT,
        None,
    ):
        target = Target(url=DEMO_URL, schema=target.schema)
    url = target.parsed()
    if url.get_backend_name() != "sqlite" or not url.database:
        raise click.UsageError("demo runs on a SQLite file: pass --url PATH")
    try:
        demo = importlib.import_module("cronoq_store.demo")
    except ModuleNotFoundError as exc:
        if exc.name != "cronoq_store.demo":
            raise
        raise click.ClickException("this build of cronoq-store has no demo module") from exc
    with _errors(shown(url)):
        try:
            report = demo.run(Path(url.database), overwrite=overwrite, ttl=ttl)
        except FileExistsError as exc:  # the demo writes a workload of its own, never reuses
            if overwrite:
                raise click.ClickException(
                    f"{url.database} is not a database the demo made: it is never "
                    "overwritten; pass --url NEW_PATH"
                ) from exc
            raise click.ClickException(
                f"{url.database} exists: pass --overwrite (if an earlier demo made it), "
                "or --url NEW_PATH"
            ) from exc
    click.echo(demo.format_report(report))
    if not getattr(report, "ok", True):
        raise click.ClickException("the demo's check failed (see above)")


if __name__ == "__main__":
    sys.exit(main())
