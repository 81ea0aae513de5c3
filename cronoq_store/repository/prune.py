"""Prune: finished tasks past retention deleted in bounded batches, sparing every task a live
task depends on. The caller commits each batch."""

from __future__ import annotations

from functools import cache
from typing import Any, Final

from sqlalchemy import (
    Boolean,
    ColumnElement,
    Connection,
    Delete,
    Select,
    TextClause,
    Update,
    bindparam,
    delete,
    func,
    literal,
    select,
    text,
    update,
)

from .. import codec, dialects
from ..errors import InvalidValue
from ..schema import task_deps, tasks

PRUNE_BATCH: Final = 1000
"""Rows deleted per statement by `prune`, unless its `batch_size` says otherwise."""


def check_batch(batch_size: object) -> int:
    """`batch_size` as a prune's batch, refused (`InvalidValue`) unless an int of at least 1:
    a batch of none would never end the loops that run until a batch comes back short."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool):
        raise InvalidValue(f"batch_size must be an int, not {type(batch_size).__name__}")
    if batch_size < 1:
        raise InvalidValue("batch_size must be at least 1")
    return batch_size


def finished_flag() -> ColumnElement[bool]:
    """`terminal` is true, in a form no dialect answers from an index: `(terminal, id)` holds
    every finished task, and a filter on it with a condition on the finished-time index is
    read from the latter alone. Given both, MariaDB intersected the two indexes (an "index
    merge" that reads every finished task's entry: 0.7 s per prune over 1,000,000 of them)
    and SQLite took the flag's. The flag is NOT NULL: the COALESCE changes no value."""
    return func.coalesce(tasks.c.terminal, literal(False, Boolean())) == True  # noqa: E712


def _prunable(*columns: Any) -> Select[Any]:
    """Finished tasks updated before `cutoff` that no live task depends on (by id or key).

    Anti-joins on the dependency indexes (a LEFT JOIN that finds no row), which MariaDB runs
    as one probe per candidate ("Not exists"), where it runs NOT EXISTS as a dependent
    subquery. Each miss is tested twice, as each server needs: MariaDB probes only for an IS
    NULL on a NOT NULL column (`task_id`), and PostgreSQL makes an anti-join only of an IS
    NULL on the join column; with neither it joined and sorted every prunable task per batch.
    A NULL key joins no row, so a keyless task needs no "key IS NULL OR". SQLite
    must not index `terminal`: it took `(terminal, id)` for the equality over the finished-time
    index, and sorted every finished task again for each batch.
    """
    by_id = task_deps.alias("by_id")
    by_key = task_deps.alias("by_key")
    joined = tasks.outerjoin(by_id, by_id.c.target_id == tasks.c.id).outerjoin(
        by_key, by_key.c.target_key == tasks.c.key
    )
    return (
        select(*columns)
        .select_from(joined)
        .where(
            dialects.unindexed(tasks.c.terminal) == True,  # noqa: E712
            tasks.c.finished_unix_ns < bindparam("cutoff"),
            by_id.c.target_id.is_(None),
            by_id.c.task_id.is_(None),
            by_key.c.target_key.is_(None),
            by_key.c.task_id.is_(None),
        )
    )


def _finished_time_index() -> str:
    """The name of the task table's index on `finished_unix_ns` (its naming convention's)."""
    for index in tasks.indexes:
        if [c.name for c in index.columns] == [tasks.c.finished_unix_ns.name]:
            return str(index.name)
    raise AssertionError("the task table has no finished-time index")  # pragma: no cover


@cache
def prunable_stmt() -> Select[Any]:
    """Up to `limit` prunable tasks, oldest first (what one `prune_stmt` deletes).

    MariaDB is held to the finished-time index (`dialects.force_index`, which only it renders):
    once a batch or two were deleted from a table that is mostly prunable (the first prune of
    a backlog; the benchmark's database of 10,000 old tasks), its recalculated statistics made
    it scan the whole table, or `(terminal, id)`, and sort every finished task, for each
    batch (`tests/recovery/test_prune_plan.py`); the range reads `limit` entries."""
    stmt = _prunable(tasks.c.id).order_by(tasks.c.finished_unix_ns).limit(bindparam("limit"))
    return dialects.force_index(stmt, tasks, _finished_time_index())


@cache
def prune_stmt(*, join: bool = False) -> Delete:
    """Delete one batch of prunable tasks in one statement.

    The dependency check is part of the DELETE itself, so a live task committed before the
    statement starts always spares its targets; selecting victims first and deleting them by
    id in a second statement would lose a dependency committed in between. The victims are a
    derived table so MySQL accepts LIMIT and the target table in the subquery.
    With `join` (where `dialects.delete_joins` says so) the victims are joined by primary key
    instead of tested with IN.
    """
    victims = prunable_stmt().subquery("victims")
    if join:
        return delete(tasks).where(tasks.c.id == victims.c.id)
    return delete(tasks).where(tasks.c.id.in_(select(victims.c.id)))


def prune_batch(conn: Connection, cutoff: int, limit: int = PRUNE_BATCH) -> int:
    """Delete one batch of prunable tasks; returns how many were deleted."""
    cutoff = codec.saturate(cutoff)
    stmt = prune_stmt(join=dialects.delete_joins(conn.dialect))
    deleted: int = conn.execute(stmt, {"cutoff": cutoff, "limit": limit}).rowcount
    return deleted


@cache
def unstamped_stmt() -> Select[Any]:
    """Up to `limit` finished tasks without a finish time: what a build older than revision
    0005 (release 0.1.0) leaves when it finishes a task on the newer schema, which it may
    (`cronoq_store.builds`). Read off the finished-time index's NULLs, which are the live
    tasks and these (never `(terminal, id)`, which holds every finished task: `finished_flag`)."""
    stmt = select(tasks.c.id).where(tasks.c.finished_unix_ns.is_(None), finished_flag())
    return stmt.limit(bindparam("limit"))


@cache
def stamp_stmt() -> Update:
    """Give the tasks `ids` their finish time, as revision 0005's backfill did: when they were
    last updated (re-checked here, so a task revived meanwhile stays live)."""
    return (
        update(tasks)
        .where(
            tasks.c.id.in_(bindparam("ids", expanding=True)),
            tasks.c.finished_unix_ns.is_(None),
            tasks.c.terminal == True,  # noqa: E712
        )
        .values(finished_unix_ns=tasks.c.updated_unix_ns)
    )


def stamp_batch(conn: Connection, limit: int = PRUNE_BATCH) -> int:
    """Stamp one batch of finished tasks that lack a finish time (`unstamped_stmt`), so prune
    and the status counts see them; how many were found."""
    ids = list(conn.execute(unstamped_stmt(), {"limit": limit}).scalars())
    if ids:
        conn.execute(stamp_stmt(), {"ids": ids})
    return len(ids)


INDEX_CLEANUP_SHARE: Final = 0.2
"""The share of the task table a prune must have deleted for its VACUUM to clean the indexes
too. Below it, the index pass (every index read whole) would cost more per pruned task than
the DELETEs themselves (at 1,000,000 rows about 0.1 us per task in the table against 5 us per
deleted task); above it, the pass adds at most a tenth."""


@cache
def table_rows_stmt() -> TextClause:
    """PostgreSQL's count of the task table's rows as of its last VACUUM or ANALYZE (-1 or 0:
    never counted); `:name` is the table's name, schema-qualified where one is mapped."""
    return text("SELECT reltuples FROM pg_class WHERE oid = to_regclass(:name)")


def vacuum(conn: Connection, deleted: int | None = None) -> None:
    """Reclaim the space of the pruned rows (outside a transaction: `dialects.Vacuum`).

    The heap pass reads only the pages with dead rows (the visibility map skips the rest);
    the index pass reads every index of the table whole, whatever was deleted: with 1,000,000
    old tasks 0.07-0.16 s beside 0.05 s of DELETEs for 10,000 pruned ones (and PostgreSQL
    skips it on its own only below 2% of the pages). So a prune of `deleted` tasks, less than
    `INDEX_CLEANUP_SHARE` of the table, frees the rows' space at once and leaves their index
    entries (and line pointers) to the next vacuum that cleans indexes: autovacuum, which
    counts them as dead rows and comes once they are 5% of the table (docs/tuning.md), or a
    larger prune. The cost per pruned task stays flat as history grows."""
    cleanup = True
    if deleted is not None:
        translate = conn.get_execution_options().get("schema_translate_map") or {}
        where = translate.get(None)
        prep = conn.dialect.identifier_preparer
        name = (
            prep.quote(tasks.name)
            if where is None
            else f"{prep.quote(where)}.{prep.quote(tasks.name)}"
        )
        rows = conn.execute(table_rows_stmt(), {"name": name}).scalar()
        cleanup = rows is None or rows <= 0 or deleted >= INDEX_CLEANUP_SHARE * float(rows)
    conn.execute(dialects.Vacuum(tasks, task_deps, index_cleanup=cleanup))
