"""Statements compiled once: a Core statement becomes the driver's SQL, and a mapping of its
parameters the driver's, once per statement, dialect, schema and key set (`driver_sql`).

The store's statements then run on the DB-API cursor (`cursor.run`), past SQLAlchemy's
per-statement execution, a third of a small commit's CPU. Every compile cache of the
store keys on `compile_key`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from operator import itemgetter
from typing import Any

from sqlalchemy import Connection, Delete, Insert, Select, Update

from ..errors import StoreError

__all__ = [
    "COMPILED",
    "Params",
    "Statement",
    "compile_key",
    "driver_sql",
    "positional",
    "schema_key",
]


Statement = Insert | Update | Delete | Select[Any]
Params = Callable[[Mapping[str, Any]], Any]

COMPILED: dict[tuple[Any, ...], tuple[str, Params | None]] = {}
"""`driver_sql`'s cache, by `compile_key` (statement, key set, dialect, schema): read directly
by a caller that worked the dialect and schema out once for many statements
(`execution.Flight`)."""


def compile_key(conn: Connection, stmt: Any, variant: Hashable) -> tuple[Any, ...]:
    """What a statement's compiled form depends on: the statement (the object, not its id:
    a key must keep it alive), a `variant` of its parameters, the dialect and the schema."""
    translate = conn.get_execution_options().get("schema_translate_map")
    return (stmt, variant, conn.dialect, None if translate is None else schema_key(translate))


def schema_key(translate: Mapping[Any, Any]) -> tuple[Any, ...]:
    """A `schema_translate_map` as part of a compile cache's key."""
    return tuple(sorted(translate.items(), key=repr))


def driver_sql(
    conn: Connection, stmt: Statement, keys: tuple[str, ...]
) -> tuple[str, Params | None]:
    """The driver SQL of `stmt` for parameter `keys`, and how to turn a mapping of them into
    the driver's parameters (None: the mapping itself, for a named paramstyle).

    Compiled once per statement, dialect, schema and key set. Running it as driver SQL skips
    SQLAlchemy's per-row parameter processing; the bound types the store uses (int, str,
    bytes, bool, None) need no bind processing on any supported driver.
    """
    translate = conn.get_execution_options().get("schema_translate_map")
    schema = None if translate is None else schema_key(translate)
    cache_key = (stmt, keys, conn.dialect, schema)
    hit = COMPILED.get(cache_key)
    if hit is None:
        compiled = stmt.compile(
            dialect=conn.dialect,
            column_keys=list(keys),
            schema_translate_map=translate,
            render_schema_translate=translate is not None,
        )
        # Binds the statement fills itself: constants (`id == 1`) and values computed when
        # it runs (SQLite's `b_host_now`, a `callable_`).
        own = {
            name: bind
            for bind, name in compiled.bind_names.items()
            if name not in keys and (bind.callable is not None or not bind.required)
        }
        missing = sorted(set(compiled.bind_names.values()) - set(keys) - set(own))
        if missing:
            raise StoreError(f"statement needs values for {missing}")
        order = compiled.positiontup
        getter: Params | None = None
        if compiled.positional and order is not None:
            getter = positional(tuple(order))
        if own:
            getter = _filled(own, getter)
        hit = COMPILED[cache_key] = (str(compiled), getter)
    return hit


def _filled(own: Mapping[str, Any], then: Params | None) -> Params:
    """`then` applied to a mapping with the statement's own binds filled in (the mapping's
    values win). Built as dict displays, not `update` calls: SQLite's fence fills its
    `b_host_now` here on every commit."""

    fixed = {n: b.value for n, b in own.items() if b.callable is None}
    computed = tuple((n, b.callable) for n, b in own.items() if b.callable is not None)

    def params(row: Mapping[str, Any]) -> Any:
        full = {**fixed}
        for n, fn in computed:
            full[n] = fn()
        full = {**full, **row}
        return full if then is None else then(full)

    return params


def positional(order: Sequence[str]) -> Params:
    """The positional parameters of a mapping, in `order` (always a tuple)."""
    if len(order) > 1:
        return itemgetter(*order)
    if order:
        key = order[0]
        return lambda r: (r[key],)
    return lambda r: ()
