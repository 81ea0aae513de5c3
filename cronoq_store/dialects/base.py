"""One class per database, Alembic's `DefaultImpl` way: `DefaultImpl` says what every
database does, and each subclass (`SQLiteImpl`, `PostgresqlImpl`, `MySQLImpl`) overrides
what its database does differently. So a difference between databases is a method override,
never a test of a dialect or driver name in the code that uses it.

A subclass registers itself by its `name` (`dialects.name`: MariaDB is "mysql"); one
instance is made per SQLAlchemy dialect, that is once per engine, and kept
(`dialect_of`). What a subclass may depend on beyond its database (the driver, sync or
asyncio) it reads once, when it is made.

The public surface, all on `DefaultImpl`:
- `name`, `dialect`: which database, and SQLAlchemy's dialect of the engine;
- `server`, `creates_schemas`, `schema_is_database`, `builds_indexes_concurrently`,
  `storage_parameters`, `alters_online`, `gap_locks`, `sync_per_connection`,
  `galera_possible`: what the database is (class attributes, also read before an engine
  exists: `class_of(url)`);
- `short_lock_waits`: a migration's short bound on each lock wait of its session;
- `pipelined`, `copies`, `binds_arrays`: what the driver can do;
- `streaming_cursor`, `abandon`: cursors that hold a chunk of a result at a time;
- `copy_rows`: a bulk load (COPY), where `copies`; `built_arrays`: arrays sent as built;
- `interrupter`: how another thread stops the session's wait (the watchdog's);
- `acknowledged`, `durability_risks`: what an acknowledged commit means on the database, and
  the settings that can let a crash take it back (`unsafe_durability` judges them);
- `transient_codes`, `read_only_codes`, `disk_full_codes`: the server's error codes that
  `translation` reads;
- the inbox's: `notifies`, `listens` (NOTIFY and LISTEN), `binary_arrays`, `numbers_in_order`
  (how many rows are best inserted), `schema_word` (what a schema is called).
- the drivers' and the wire's: `async_driver`, `sync_drivers` (`aio.async_url`), `wire`,
  `default_port`, `plaintext_query` (the benchmark's latency proxy);
- `explain_json` (the planner's estimate), `analyze_sql`, `checkpoint_sql` (the benchmarks'
  upkeep) and `server_name` (labels).

A new difference between databases (LISTEN, say) goes here: the generic behaviour as an
attribute or method of `DefaultImpl`, documented, and an override in each database that
differs; its caller asks `dialect_of(conn)` and never tests a name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, ClassVar, Final, NamedTuple, TypeAlias

from sqlalchemy import URL, Connection, Engine, Select, Table, event
from sqlalchemy.engine.interfaces import Dialect

from .statements import name as dialect_name

__all__ = [
    "DefaultImpl",
    "Risk",
    "class_of",
    "connect_with",
    "dialect_of",
    "is_off",
    "is_on",
    "reclass_connections",
    "setting_is_on",
    "setting_of",
]


Rows: TypeAlias = Sequence[Mapping[str, Any]]
"""Rows to load (`DefaultImpl.copy_rows`), by column name."""
RowValues: TypeAlias = Callable[[Mapping[str, Any]], Any]
"""A row's values in a COPY statement's column order (`DefaultImpl.copy_rows`)."""


class Bounds(NamedTuple):
    """How long a transaction may wait (`dialects.bound`): `idle` inside it between statements,
    `timeout` on each statement, `lock` (with a `timeout`, shorter) for a lock; `idle_too`:
    False where the idle bound went already."""

    idle: timedelta | None
    timeout: timedelta | None
    lock: timedelta | None = None
    idle_too: bool = True


class Risk(NamedTuple):
    """A server setting whose value can let a crash take back an acknowledged commit
    (`DefaultImpl.durability_risks`)."""

    setting: str
    """Its name, as the server spells it."""
    unsafe: Callable[[str], bool]
    """Whether its value (as `setting_of` reads it: stripped, lower-cased) is unsafe."""
    why: str
    """What that risks, in a sentence."""
    given: str | None = None
    """A boolean setting that must be on for this one to matter (None: always matters)."""


class DefaultImpl:
    """What the store does on a database that no subclass speaks for: no pipeline, no COPY,
    IN lists as lists, results read through SQLAlchemy, and no way to interrupt a session.
    Subclasses override what their database does better."""

    name: ClassVar[str] = "default"
    """The database, as `dialects.name` says it: "sqlite", "postgresql" or "mysql"."""

    transient_codes: ClassVar[frozenset[Any]] = frozenset()
    """Error codes worth retrying (SQLite's primary codes, MySQL's numbers, PostgreSQL's
    SQLSTATEs and their classes)."""
    read_only_codes: ClassVar[frozenset[Any]] = frozenset()
    """Error codes of a server that refuses writes (not the primary now)."""
    disk_full_codes: ClassVar[frozenset[Any]] = frozenset()
    """Error codes of a server whose disk is full."""
    notifies: ClassVar[bool] = False
    """A transaction can notify listeners when it commits (PostgreSQL's `pg_notify`)."""
    schema_word: ClassVar[str | None] = None
    """What the database calls a schema, in messages ("PostgreSQL schema"); None: it has
    none (one file)."""

    server: ClassVar[bool] = True
    """A server's database: its connections can be lost, its settings are the server's. False
    for a file (SQLite), whose connection is never lost."""
    creates_schemas: ClassVar[bool] = False
    """A `--schema` is a namespace inside the database, which the store creates (PostgreSQL)."""
    schema_is_database: ClassVar[bool] = False
    """A `--schema` is a database of its own on the server (MySQL, MariaDB)."""
    builds_indexes_concurrently: ClassVar[bool] = False
    """Indexes are built without blocking writes (CREATE INDEX CONCURRENTLY), and a build that
    failed leaves an INVALID index behind, to look for (PostgreSQL)."""
    storage_parameters: ClassVar[bool] = False
    """Tables take storage parameters (`ALTER TABLE ... SET (fillfactor = ...)`: PostgreSQL)."""
    alters_online: ClassVar[bool] = False
    """ALTER TABLE takes `ALGORITHM=INSTANT|INPLACE, LOCK=NONE`, so an index or a column is
    added or dropped without blocking writes (MySQL, MariaDB)."""
    gap_locks: ClassVar[bool] = False
    """At the default isolation level an UPDATE also locks the index gaps it scans (InnoDB's
    REPEATABLE READ), where other sessions insert."""
    sync_per_connection: ClassVar[bool] = False
    """How durably a commit is written is each connection's own setting, not the database's
    (SQLite's `synchronous`): a reader's says nothing of the writer's."""
    galera_possible: ClassVar[bool] = False
    """The server may be a Galera cluster's node (MariaDB, MySQL): `galera.is_galera` asks."""
    ranges_by_subquery: ClassVar[bool] = True
    """A key compared with an uncorrelated scalar subquery (`id <= (SELECT max(...) ...)`)
    is scanned as a range of the index; False where the planner scans the whole index and
    tests each row (MariaDB: such a subquery is not a constant while it plans)."""

    index_hint: ClassVar[str | None] = None
    """How a statement holds the planner to one index of a table (`force_index`), `{index}`
    for its name, rendered after the table's; None: the planner chooses alone."""
    dialect_names: ClassVar[tuple[str, ...]] = ()
    """SQLAlchemy's names of the dialects this class serves, where a hint must name them."""

    _registry: ClassVar[dict[str, type[DefaultImpl]]] = {}

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        DefaultImpl._registry[cls.name] = cls

    def __init__(self, dialect: Dialect) -> None:
        self.dialect = dialect
        """SQLAlchemy's dialect of the engine this instance serves."""
        self.pipelined = False
        """Statements can be sent without waiting for each answer (`execution.Flight`)."""
        self.copies = False
        """Rows can be loaded with COPY FROM STDIN (`copy_rows`)."""
        self.binds_arrays = False
        """An IN list runs better as one array parameter (`execution.run_in`)."""
        self.listens = False
        """A connection can LISTEN and wait for notifications (`inbox.Listener`)."""
        self.binary_arrays = False
        """Arrays can be sent in binary (psycopg's `%(name)b`): the inbox's many rows go as
        one array per column."""
        self.may_batch = False
        """Its connections may send a flight as one packet: `batches` asks each one."""

    def batches(self, conn: Connection) -> bool:
        """Whether `conn` can send a flight's statements as one multi-statement packet
        (`send_batch`, `execution.Flight`): MariaDB's."""
        return False

    def send_batch(
        self, dbapi_connection: Any, queue: Sequence[Any], answers: list[Any], *, commit: bool
    ) -> None:
        """Send `queue` (sql, params, many) as one packet, and a COMMIT behind it if `commit`;
        append each one's (rowcount, rows) to `answers`, raising the driver's error of the
        first that failed."""
        raise NotImplementedError

    def ended_in_flight(self, dbapi_connection: Any) -> bool:
        """Whether the transaction on `dbapi_connection` ended with a COMMIT `send_batch`
        sent, nothing having run since."""
        return False

    def set_up_engine(self, engine: Engine) -> None:
        """What a server engine the store owns needs of this database's on its connections
        (`face.engines.new_engine`)."""

    def streaming_cursor(self, dbapi_connection: Any) -> Any | None:
        """A DB-API cursor of `dbapi_connection` that holds no more than a chunk of a result
        at a time (`execution.stream`); None where none is known (SQLAlchemy's result then)."""
        return None

    def abandon(self, cursor: Any) -> None:
        """Mark what `cursor` has left to read finished, its connection being lost: closing
        it must not read from the server."""

    def copy_rows(self, cursor: Any, sql: str, rows: Rows, values: RowValues) -> None:
        """Load `rows` with the COPY statement `sql` on the driver's `cursor`, each row as
        `values(row)` in the statement's column order. Only where `copies`; the caller owns
        the cursor (and closes it) and wraps the driver's errors."""
        raise NotImplementedError(f"no COPY on {self.name}")

    def built_arrays(
        self, driver_connection: Any, sql: str, params: Mapping[str, Any]
    ) -> Mapping[str, Any]:
        """`params` of the driver SQL `sql`, run on `driver_connection`, with the arrays this
        database's driver would dump element by element sent already built (PostgreSQL's
        binary arrays, `pgarrays`); here as they are. Only where nothing observes the
        connection: an observer sees the lists."""
        return params

    def numbers_in_order(self, driver_connection: Any) -> bool:
        """Whether the rows an executemany inserts now on `driver_connection` are numbered
        one after another (a single writer, in one transaction), so that their ids follow
        from the last one (the inbox's `enqueue_many`)."""
        return False

    def short_lock_waits(
        self, conn: Connection, *, ms: int, seconds: int
    ) -> Callable[[], object] | None:
        """Bound each lock wait of `conn`'s session: `ms` milliseconds where the server counts
        them, `seconds` where it counts whole ones. Returns how to put the session's own
        bound back, or None where nothing was bounded (a file's writer waits only for other
        writers, as its busy timeout says)."""
        return None

    def committer(self, dbapi_connection: Any) -> Callable[[], object]:
        """What commits the transaction open on `dbapi_connection` when the store ends it on
        the driver (`face.transactions`, a small commit's way): the DB-API `commit`."""
        return dbapi_connection.commit  # type: ignore[no-any-return]

    def interrupter(self, driver_connection: Any) -> Callable[[], None] | None:
        """How another thread stops whatever the session of `driver_connection` (a driver's
        connection) waits on (None: no way known), for an operation's deadline
        (`execution.Watchdog`). Safe to call from any thread, and it never blocks: no new
        connection to the server."""
        return None

    acknowledged: ClassVar[str] = "unknown for this dialect"
    """What an acknowledged commit means on this database when no setting read is unsafe
    (`durability.Durability.acknowledged`)."""

    @classmethod
    def engine_options(cls, url: URL) -> dict[str, Any]:
        """`create_engine` options of this database's for a server engine the store owns
        (`face.engines.new_engine`), known from `url` before the engine exists."""
        return {}

    @classmethod
    def on_libpq(cls, url: URL) -> bool:
        """Whether `url`'s driver is libpq's (psycopg): it prepares statements on its own (none
        behind a transaction pooler) and reads `connect_timeout` in whole seconds."""
        return False

    durability_risks: ClassVar[tuple[Risk, ...]] = ()
    """The settings that can let a crash take back an acknowledged commit on this database,
    each with the test of its value, in the order `unsafe_durability` reports them."""

    @classmethod
    def unsafe_durability(cls, settings: Mapping[str, Any]) -> list[tuple[str, str]]:
        """The settings among `settings` (the server's, by name, as
        `dialects.durability_settings` reads them) that let a crash take back an acknowledged
        commit, each as (its name, what it risks): the `durability_risks` their values fail.
        A setting missing or None is not known and makes nothing unsafe. No I/O:
        `durability.classify` calls it on any settings."""
        unsafe: list[tuple[str, str]] = []
        for risk in cls.durability_risks:
            value = setting_of(settings, risk.setting)
            if value is None or (risk.given and not setting_is_on(settings, risk.given)):
                continue
            if risk.unsafe(value):
                unsafe.append((risk.setting, risk.why))
        return unsafe

    def hook_cursors(self, engine: Engine, hooked: Callable[[type[Any]], type[Any]]) -> bool:
        """Make every connection `engine` opens from now on make its cursors of the class
        `hooked(C)`, C the driver's cursor class (`testing.statements`, which sees what the
        store sends on its own fast path). False: no way known for this driver (only sync
        pysqlite, psycopg and PyMySQL have one)."""
        return False

    def hook_commits(self, engine: Engine, committing: Callable[[type[Any]], type[Any]]) -> bool:
        """Make every connection `engine` opens from now on of the class `committing(C)`, C
        the driver's connection class (a subclass that reports its `commit()`). A COMMIT sent
        as a statement, where `pipelined`, is the caller's to watch. False: no way known."""
        return False

    def bounds_idle(self) -> bool:
        """Whether the server can end a session idle inside its transaction
        (`dialects.idle_bound_supported`); known once the engine has connected."""
        return False

    def bound(
        self, conn: Connection, bounds: Bounds, *, defer: bool
    ) -> tuple[Select[Any], dict[str, str]] | None:
        """`dialects.bound`'s work on this database: nothing where the server has no such
        bounds (a file waits only for other writers, and `busy_timeout` bounds that)."""
        return None

    async_driver: ClassVar[str | None] = None
    """The asyncio driver the store is tested with, which `aio.async_url` names when a URL
    names no driver or one of `sync_drivers` (None: no async driver known)."""
    sync_drivers: ClassVar[frozenset[str]] = frozenset()
    """Sync drivers whose URLs (query options included) `async_driver` also accepts."""
    wire: ClassVar[str | None] = None
    """The wire protocol whose client messages the latency proxy counts as round trips
    (`bench.proxy`: "postgresql", "mysql"); None: none it can read (a file has no wire)."""
    default_port: ClassVar[int | None] = None
    """The server's port when a URL names none (None: no server)."""
    plaintext_query: ClassVar[Mapping[str, str]] = {}
    """URL query options that keep the session's messages unencrypted, so that a proxy in
    front of the server can read them (`bench.proxy.proxied_url`)."""
    explain_json: ClassVar[str | None] = None
    """What precedes a SELECT to have the planner's plan of it as one JSON value, not run
    (`repository.operators.Explain`); None: the planner keeps no estimate of rows (SQLite)."""
    analyze_sql: ClassVar[str | None] = None
    """The statement, before a table's name, that refreshes the planner's statistics of the
    table as the server's own upkeep would (the benchmarks' `bench.history.analyze`); None:
    none kept unless asked (SQLite)."""
    checkpoint_sql: ClassVar[str | None] = None
    """The statement that writes out what the log holds to the data files (the benchmarks'
    `bench.history.checkpoint`); None: none the store sends."""

    def server_name(self) -> str:
        """The database's name as people know it, for labels ("mariadb" where MySQL's
        dialect speaks to MariaDB)."""
        return self.name


def class_of(where: str | URL) -> type[DefaultImpl]:
    """The class of the database that a URL, or a backend name ("sqlite", "postgresql",
    "mysql", "mariadb"), names: for what is known before an engine exists (its class
    attributes)."""
    backend = where.get_backend_name() if isinstance(where, URL) else where
    return DefaultImpl._registry.get("mysql" if backend == "mariadb" else backend, DefaultImpl)


def force_index(stmt: Select[Any], table: Table, index: str) -> Select[Any]:
    """`stmt` holding each planner that takes index hints (`DefaultImpl.index_hint`) to
    `index` of `table`; the SQL of the other databases is unchanged."""
    for cls in DefaultImpl._registry.values():
        if cls.index_hint is not None:
            for name in cls.dialect_names:
                stmt = stmt.with_hint(table, cls.index_hint.format(index=index), name)
    return stmt


_KEPT: Final = "_cronoq_impl"
"""The attribute of SQLAlchemy's dialect object (one per engine) that keeps its class's
instance: read with no call, it costs a commit nothing (a dictionary keyed by dialect cost two
calls a lookup, and a batch-1 commit makes two)."""


def dialect_of(where: Engine | Connection | Dialect) -> DefaultImpl:
    """The class of `where`'s database, made once per SQLAlchemy dialect (once per engine)
    and kept on it as long as that dialect is.

    Args:
        where: An engine, a connection, or SQLAlchemy's dialect of one.
    """
    try:
        impl: DefaultImpl = where.dialect._cronoq_impl  # type: ignore[union-attr]
    except AttributeError:
        return _made(where if isinstance(where, Dialect) else where.dialect)
    return impl


def _made(dialect: Dialect) -> DefaultImpl:
    """`dialect`'s instance, made on first use."""
    impl: DefaultImpl | None = getattr(dialect, _KEPT, None)
    if impl is None:
        cls = DefaultImpl._registry.get(dialect_name(dialect), DefaultImpl)
        impl = cls(dialect)
        setattr(dialect, _KEPT, impl)
    return impl


def connect_with(
    engine: Engine, arg: str, default: type[Any], subclass: Callable[[type[Any]], type[Any]]
) -> None:
    """Make `engine` connect with `arg` (a driver's connect() keyword naming a class) set to
    `subclass` of the class it names (or of `default`)."""

    @event.listens_for(engine, "do_connect")
    def _connect(_dialect: Any, _record: Any, _cargs: Any, cparams: dict[str, Any]) -> None:
        cparams[arg] = subclass(cparams.get(arg, default))


def reclass_connections(engine: Engine, subclass: Callable[[type[Any]], type[Any]]) -> None:
    """Make each new driver connection of `engine` an instance of `subclass` of its class,
    for drivers that take no connection class (the subclass adds no slots of its own, so its
    layout is the same)."""

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.__class__ = subclass(type(dbapi_connection))


def setting_of(settings: Mapping[str, Any], name: str) -> str | None:
    """The setting `name` as the server printed it, stripped and lower-cased (None: unknown)."""
    value = settings.get(name)
    return None if value is None else str(value).strip().lower()


def setting_is_on(settings: Mapping[str, Any], name: str) -> bool | None:
    """Whether the boolean setting `name` is on ("on", "1", "true", "yes"; None: unknown)."""
    value = setting_of(settings, name)
    return None if value is None else is_on(value)


def is_on(value: str) -> bool:
    """Whether a boolean setting's value (as `setting_of` reads it) is on."""
    return value in ("on", "1", "true", "yes")


def is_off(value: str) -> bool:
    """Whether a boolean setting's value (as `setting_of` reads it) is off."""
    return not is_on(value)
