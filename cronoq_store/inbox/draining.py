"""The leader's side: read the oldest items, set aside the rows that do not decode."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    Connection,
)

from .. import codec, dialects, execution
from ..errors import CorruptValue, InvalidValue
from ..model import InboxItem, TimeBase
from .statements import (
    depth_stmt,
    first_id_stmt,
    oldest_stmt,
    reject_delete_stmt,
    reject_insert_stmt,
    rejects_count_stmt,
)

log = logging.getLogger("cronoq_store.inbox")  # the package's, as before its split


@dataclass(frozen=True, slots=True)
class Read:
    """One read of the inbox: the items, and the undecodable rows found (to move aside)."""

    items: list[InboxItem]
    bad: list[dict[str, Any]]
    """Undecodable rows, each with a "reason"."""
    last_id: int | None
    """The highest id looked at (items and bad rows alike)."""


def read(
    conn: Connection,
    *,
    base: TimeBase,
    limit: int,
    after: int | None,
    stored: codec.StoredSpecs | None = None,
    budget: int | None = None,
    max_payload: int | None = None,
) -> Read:
    """The oldest `limit` rows above `after` (as many as start within `budget` bytes of
    payload, when given: `oldest_stmt`), decoded under `base` (times shift from Unix); each
    spec's columns remembered in `stored`, for the commit that drains it. A row whose payload
    is longer than `max_payload` is bad (set aside, as an undecodable one): a commit would
    refuse its task, and every drain after it."""
    items: list[InboxItem] = []
    bad: list[dict[str, Any]] = []
    last: int | None = None
    params: dict[str, Any] = {"limit": limit}
    if after is not None:
        params["after"] = after
    if budget is not None:
        params["budget"] = budget
    stmt = oldest_stmt(
        after=after is not None,
        budget=budget is not None,
        ranged=dialects.dialect_of(conn).ranges_by_subquery,
    )
    rows = execution.run_stmt(conn, stmt, params).rows
    spec_dict, item = codec.spec_dict, codec.inbox_item
    # Plain tuples from the driver (SQLAlchemy's rows and psycopg's fetchone per row cost as
    # much as decoding the spec), the spec's columns made a dict once.
    with execution.collection_paused():  # what is decoded is kept: no garbage to find
        for inbox_id, enqueued, *values in rows:
            last = inbox_id
            columns = spec_dict(values)
            try:
                spec = codec.spec_from_values(base, *values)
                if max_payload is not None and len(spec.payload) > max_payload:
                    raise CorruptValue(
                        f"payload of {len(spec.payload)} bytes, over this store's "
                        f"StoreConfig.max_payload_bytes ({max_payload})"
                    )
            except CorruptValue as exc:
                row = {"id": inbox_id, "enqueued_unix_ns": enqueued, **columns, "reason": str(exc)}
                bad.append(row)
                continue
            if stored is not None:
                stored.add(spec, columns)
            items.append(item(inbox_id=inbox_id, spec=spec, enqueued_unix_ns=enqueued))
    return Read(items=items, bad=bad, last_id=last)


def _fields_json(row: Mapping[str, Any]) -> str:
    skip = {"id", "payload", "reason"}

    def plain(value: object) -> object:
        return bytes(value).hex() if isinstance(value, bytes | memoryview) else repr(value)

    return json.dumps({k: v for k, v in row.items() if k not in skip}, default=plain)


def set_aside(conn: Connection, *, bad: Sequence[Mapping[str, Any]], now_unix_ns: int) -> int:
    """Move undecodable rows to `cronoq_inbox_rejects`; returns how many this call moved."""
    moved = 0
    for row in bad:
        # Deleting first claims the row: of two readers at once, only one moves it.
        if conn.execute(reject_delete_stmt(), {"b_id": row["id"]}).rowcount != 1:
            continue
        payload = row.get("payload")
        conn.execute(
            reject_insert_stmt(),
            {
                "inbox_id": row["id"],
                "enqueued_unix_ns": row.get("enqueued_unix_ns"),
                "rejected_unix_ns": now_unix_ns,
                "reason": codec.clean(row["reason"]),
                "payload": None if payload is None else bytes(payload),
                "fields": codec.clean(_fields_json(row)),
            },
        )
        log.error(
            "inbox row %s set aside as undecodable: %s",
            row["id"],
            row["reason"],
            extra={"inbox_id": row["id"], "set_aside": 1},
        )
        moved += 1
    return moved


def has_items(conn: Connection) -> bool:
    """Whether the inbox holds an item (one index probe)."""
    return conn.execute(first_id_stmt()).first() is not None


def check_after(after: object) -> int | None:
    if after is not None and (not isinstance(after, int) or isinstance(after, bool)):
        raise InvalidValue(f"after must be an int, not {type(after).__name__}")
    return after


def check_limit(limit: object) -> int:
    if not isinstance(limit, int) or isinstance(limit, bool):
        raise InvalidValue(f"limit must be an int, not {type(limit).__name__}")
    if limit < 1:
        raise InvalidValue("limit must be at least 1")
    return min(limit, 2**31 - 1)


def depth(conn: Connection) -> dict[str, Any]:
    """The inbox's depth, the age (seconds) of its oldest item and how many rows were set aside."""
    items, oldest = conn.execute(depth_stmt()).one()
    rejects = conn.execute(rejects_count_stmt()).scalar_one()
    age = None if oldest is None else round(max(0, time.time_ns() - oldest) / 1e9, 3)
    return {"items": items, "oldest_age_s": age, "set_aside": rejects}
