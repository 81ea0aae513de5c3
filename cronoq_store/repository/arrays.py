"""New tasks as rows of arrays: PostgreSQL's `INSERT ... SELECT FROM unnest(...)`.

A pipelined commit cannot wait for a lookup of which ids are stored already, nor leave the
flight for a COPY, so its new tasks and their dependency rows go as one statement per
`ARRAY_ROWS` tasks, each column one array parameter in its text form, queued in the
commit's flight (`repository.commit.write`): a commit of any size is one round trip.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cache
from operator import itemgetter
from typing import Any, Final

from sqlalchemy import Column, Insert, String, Text, bindparam, exists, func, insert, select
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.types import TypeEngine

from .. import execution
from ..schema import task_deps, tasks

ARRAY_ROWS: Final = 1000
"""Most new tasks one array statement (`insert_arrays_stmt`) carries; more go as several in
the same flight, so a commit of any size is one round trip (issue 41; before, more were
looked up and went by COPY, on their own). Measured on PostgreSQL 15 with no latency, on
the bench's tasks (two dependencies each), arrays/COPY: 100 rows 1.7/2.1 ms of CPU and
8.5/10.7 ms a commit; 250 4.1/4.3 and 25/22 ms; 1000 16.8/16.3 and 78/65 ms. Through the
bench's proxy b1000 is 1 round trip against 5: 13.8 against 21.3 ms at 1 ms of RTT, 2.0
against 7.7 RTTs at 20 ms. 1000, not 250: one statement of 1000 rows cost 6.2 µs of
server CPU a task against 6.5 for four of 250 (the peers bench's tasks, no dependencies;
their hash join stays linear, `insert_arrays_stmt`)."""


DEP_COLUMNS: Final = ("task_id", "ordinal", "target_id", "target_key")


def insert_chunks(
    rows: Sequence[Mapping[str, Any]], deps: Sequence[Mapping[str, Any]], flight: execution.Flight
) -> None:
    """PostgreSQL: `rows` and their `deps` as array statements (`_insert_arrays`) of at most
    `ARRAY_ROWS` tasks each, every one with the dependency rows of its own tasks, all queued
    in the flight: no lookup and no COPY wait for an answer."""
    if len(rows) <= ARRAY_ROWS:
        _insert_arrays(rows, deps, flight)
        return
    by_task: dict[int, list[Mapping[str, Any]]] = {}
    for d in deps:
        by_task.setdefault(d["task_id"], []).append(d)
    for start in range(0, len(rows), ARRAY_ROWS):
        chunk = rows[start : start + ARRAY_ROWS]
        _insert_arrays(chunk, [d for r in chunk for d in by_task.get(r["id"], ())], flight)


def _insert_arrays(
    rows: Sequence[Mapping[str, Any]], deps: Sequence[Mapping[str, Any]], flight: execution.Flight
) -> None:
    """PostgreSQL: `rows` (new tasks, some perhaps stored already) and `deps` (the dependency
    rows of the live ones) in one statement of the flight, each column one array (in its
    text form: `array_text`), or one value where it is the same in every row (most are: a
    batch's pool, status and NULLs seldom differ). The rows are cut into columns in C
    (`itemgetter`, `zip`): per row and column, Python did a lookup (a 1000-row commit's
    27,000)."""
    keys = tuple(rows[0])
    params: dict[str, Any] = {}
    same: list[str] = []
    for key, values in zip(keys, _columns(rows, keys), strict=True):
        first = values[0]
        # The id is always an array: with nothing to unnest (one row), no row is selected.
        if values.count(first) == len(values) and key != "id":
            params[f"s_{key}"] = first
            same.append(key)
        else:
            params[f"a_{key}"] = array_text(values)
    if deps:
        columns = _columns(deps, DEP_COLUMNS)
        params.update({f"d_{k}": array_text(v) for k, v in zip(DEP_COLUMNS, columns, strict=True)})
    flight.add(insert_arrays_stmt(keys, frozenset(same), bool(deps)), params)


def _columns(rows: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> list[tuple[Any, ...]]:
    """The values of `rows` under each of `keys` (two or more), one tuple per key."""
    return list(zip(*map(itemgetter(*keys), rows), strict=True))


def array_text(values: Sequence[Any]) -> str:
    """PostgreSQL's text form of an array of `values` (int, bool, str, bytes or None), which
    the statement casts to its column's array type: psycopg dumps a list element by element
    in Python, a quoted one through a regex substitution per quote (JSON columns are full
    of them): twice a 100-row commit's CPU. Here an array of one type (ids, payloads, JSON
    texts) is joined in C, escaped as one string; a mixed one (NULLs among them) element by
    element, with a few string methods each."""
    kinds = set(map(type, values))
    if len(kinds) == 1:
        (kind,) = kinds
        if kind is int:
            return "{" + ",".join(map(str, values)) + "}"
        if kind is bytes:
            return '{"\\\\x' + '","\\\\x'.join(map(bytes.hex, values)) + '"}'
        if kind is str:
            # Escaping commutes with joining on a separator that needs none; NUL is one no
            # text value holds (the server refuses it: then element by element, below).
            joined = "\0".join(values)
            if joined.count("\0") == len(values) - 1:
                escaped = joined.replace("\\", "\\\\").replace('"', '\\"')
                return '{"' + escaped.replace("\0", '","') + '"}'
    return "{" + ",".join(map(_element_text, values)) + "}"


def _element_text(value: Any) -> str:
    """One element of `array_text`: quoted (with backslash escapes) unless a number or NULL."""
    if value is None:
        return "NULL"
    if value is True or value is False:
        return "t" if value else "f"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return '"\\\\x' + bytes(value).hex() + '"'
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _element_type(column: Column[Any]) -> TypeEngine[Any]:
    """A parameter's type for a value of `column`: text for a string (a cast to `varchar(n)`
    would cut a longer value, which the column refuses)."""
    return Text() if isinstance(column.type, String) else column.type


@cache
def insert_arrays_stmt(keys: tuple[str, ...], same: frozenset[str], with_deps: bool) -> Insert:
    """PostgreSQL: new task rows of the columns `keys`, one array per column (`a_{key}`,
    unnested; the id always) but those in `same` (one value for every row, `s_{key}`),
    except the rows whose id is stored already (NOT EXISTS, a probe of the primary key per
    row: a live key in use still refuses the row); `with_deps`, also the dependency rows
    (`d_{column}` arrays) of the tasks it did insert, selected from its RETURNING. So a
    replayed batch changes nothing, its dependency rows included, without a lookup first.

    Not ON CONFLICT DO NOTHING: its speculative insertion (a token per row, confirmed after
    its index entries) cost 6.3 µs of server CPU a task against 5.4 for the probe
    (PostgreSQL 15, 1000-row commits of the peers bench's tasks, 4 x 250 rows). It would
    also wait out another transaction inserting the same id, where this one fails on the
    key: only another leader could, and the fence lets one commit at a time."""
    columns = [c for c in tasks.c if c.name in keys]
    names = [c.name for c in columns]
    varying = [c for c in columns if c.name not in same]
    source = (
        func.unnest(*(bindparam(f"a_{c.name}", type_=ARRAY(_element_type(c))) for c in varying))
        .table_valued(*(c.name for c in varying))
        .render_derived(name="a")
    )
    values = [
        bindparam(f"s_{c.name}", type_=_element_type(c)) if c.name in same else source.c[c.name]
        for c in columns
    ]
    stored = tasks.alias("t")
    absent = ~exists().where(stored.c.id == source.c.id)
    new = insert(tasks).from_select(names, select(*values).select_from(source).where(absent))
    if not with_deps:
        return new
    inserted = new.returning(tasks.c.id).cte("new")
    dep_columns = [task_deps.c[n] for n in DEP_COLUMNS]
    dep_source = (
        func.unnest(*(bindparam(f"d_{c.name}", type_=ARRAY(_element_type(c))) for c in dep_columns))
        .table_valued(*DEP_COLUMNS)
        .render_derived(name="d")
    )
    rows = select(*(dep_source.c[n] for n in DEP_COLUMNS)).join_from(
        dep_source, inserted, inserted.c.id == dep_source.c.task_id
    )
    return insert(task_deps).from_select(list(DEP_COLUMNS), rows).add_cte(inserted)
