"""Encoding of the domain model to column values and back.

Structured parts of a spec (retry, deps, resources, tags, labels, a recurring schedule) are
stored as compact JSON text, so the schema stays portable and no JSON function of any dialect is
needed; times are Unix nanoseconds and durations nanoseconds, as BIGINT. Strings are cleaned
(NUL and lone surrogates become U+FFFD) because no dialect stores both faithfully.

Encoding refuses what cannot be stored (`InvalidValue`, naming the field); decoding a damaged
value raises `CorruptValue`, which recovery catches to quarantine the row.

A module a role: `values` (texts and times), `jsonparts` (the JSON parts and the bounded
decoder), `building` (model objects built without re-checking), `columns` (a spec as columns),
`recurring` (a schedule as JSON), `rows` (whole rows as records). The names below are the ones
the rest of the package uses, as `codec.NAME`.
"""

from __future__ import annotations

from .building import inbox_item
from .columns import (
    LIVE_COLUMNS,
    SPEC_COLUMNS,
    StoredSpecs,
    spec_columns,
    spec_dict,
    spec_from_columns,
    spec_from_values,
    spec_values,
    stored_blob,
)
from .jsonparts import decode_deps, priority_from, retry_obj
from .recurring import decode_recurring, encode_recurring
from .rows import (
    finished_task_from_row,
    live_task_from_row,
    record_from,
    recurring_from_row,
)
from .values import (
    HOLDER_MAX,
    KEY_MAX,
    KIND_MAX,
    NAME_MAX,
    POOL_MAX,
    STATUS_MAX,
    TENANT_MAX,
    bounded,
    clean,
    clean_opt,
    from_unix,
    saturate,
    to_unix,
    to_unix_opt,
)

__all__ = [
    "HOLDER_MAX",
    "KEY_MAX",
    "KIND_MAX",
    "LIVE_COLUMNS",
    "NAME_MAX",
    "POOL_MAX",
    "SPEC_COLUMNS",
    "STATUS_MAX",
    "TENANT_MAX",
    "StoredSpecs",
    "bounded",
    "clean",
    "clean_opt",
    "decode_deps",
    "decode_recurring",
    "encode_recurring",
    "finished_task_from_row",
    "from_unix",
    "inbox_item",
    "live_task_from_row",
    "priority_from",
    "record_from",
    "recurring_from_row",
    "retry_obj",
    "saturate",
    "spec_columns",
    "spec_dict",
    "spec_from_columns",
    "spec_from_values",
    "spec_values",
    "stored_blob",
    "to_unix",
    "to_unix_opt",
]
