"""A task spec as the columns of cronoq_tasks (and of cronoq_inbox), and back.

Decoding is on recovery's hot path: a stored spec is read positionally and built without
`TaskSpec.__post_init__` once the checks here pass; `StoredSpecs` lets a drained spec be written
again as the columns it was read from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter
from typing import Any, Final

from ..errors import CorruptValue, InvalidValue
from ..model import INT64_MAX, FixedStart, TaskSpec, TimeBase
from .building import builder
from .jsonparts import (
    decode_deps,
    decode_labels,
    decode_resources,
    decode_retry,
    decode_tags,
    encode_deps,
    encode_labels,
    encode_resources,
    encode_retry,
    encode_tags,
    priority_from,
)
from .values import (
    KEY_MAX,
    KIND_MAX,
    POOL_MAX,
    TENANT_MAX,
    bounded_texts,
    clean,
    expect,
    from_unix,
    to_unix,
)

_spec = builder(TaskSpec)
"""`TaskSpec(...)` without `__post_init__`: for values `spec_from_values` has checked."""

SPEC_COLUMNS: Final = (
    "pool",
    "kind",
    "priority",
    "key",
    "payload",
    "deadline_unix_ns",
    "fixed_at_unix_ns",
    "fixed_tolerance_ns",
    "fixed_on_miss",
    "duration_hint_ns",
    "timeout_ns",
    "retry",
    "deps",
    "resources",
    "tags",
    "labels",
    "tenant",
)
"""The columns `spec_columns` fills and `spec_from_columns` reads."""

LIVE_COLUMNS: Final = (
    "id",
    "seq",
    "arrival_unix_ns",
    "attempt",
    "status",
    "terminal",
    *SPEC_COLUMNS,
)
"""What `live_task_from_row` reads, in order."""


def _spec_dict() -> Callable[[Sequence[Any]], dict[str, Any]]:
    namespace: dict[str, Any] = {}
    items = ", ".join(f"{name!r}: values[{i}]" for i, name in enumerate(SPEC_COLUMNS))
    exec(f"def spec_dict(values):\n    return {{{items}}}\n", namespace)
    spec_dict: Callable[[Sequence[Any]], dict[str, Any]] = namespace["spec_dict"]
    return spec_dict


spec_dict: Final = _spec_dict()
"""The `SPEC_COLUMNS` dict of their values in that order: a dict display, generated, at half
the cost of `dict(zip(...))` (a drain makes one per item)."""


def spec_columns(base: TimeBase, spec: TaskSpec) -> dict[str, Any]:
    """The column values of `spec` (the keys of `SPEC_COLUMNS`).

    One call for the usual spec: its texts checked together (`_stored_as_is`, inline when
    they are short), the empty JSON parts and absent times written as constants, and only
    what holds something encoded by its own function (each a call: a submission's commit
    made eight here, where a batch-1 commit makes about 140 in all)."""
    pool, kind, key, tenant = spec.pool, spec.kind, spec.key, spec.tenant
    texts = f"{pool}{kind}{key or ''}{tenant or ''}"
    if not (len(texts) <= _TEXTS_SHORT and texts.isascii() and "\x00" not in texts) and (
        not _stored_as_is(pool, kind, key, tenant)
    ):
        pool, kind, key, tenant = bounded_texts("TaskSpec.", pool, kind, key, tenant)
    fixed, deadline = spec.fixed_start, spec.deadline
    retry, deps, resources, tags, labels = (
        spec.retry,
        spec.deps,
        spec.resources,
        spec.tags,
        spec.labels,
    )
    return {
        "pool": pool,
        "kind": kind,
        "priority": int(spec.priority),
        "key": key,
        "payload": spec.payload,
        "deadline_unix_ns": None
        if deadline is None
        else to_unix(base, deadline, "TaskSpec.deadline"),
        "fixed_at_unix_ns": None if fixed is None else to_unix(base, fixed.at, "FixedStart.at"),
        "fixed_tolerance_ns": None if fixed is None else fixed.tolerance_ns,
        "fixed_on_miss": None if fixed is None else fixed.on_miss,
        "duration_hint_ns": spec.duration_hint_ns,
        "timeout_ns": spec.timeout_ns,
        "retry": None if retry is None else encode_retry(retry),
        "deps": encode_deps(deps) if deps else "[]",
        "resources": encode_resources(resources) if resources else "{}",
        "tags": encode_tags(tags) if tags else "[]",
        "labels": encode_labels(labels) if labels else "{}",
        "tenant": tenant,
    }


def spec_values(base: TimeBase, spec: TaskSpec) -> tuple[Any, ...]:
    """`spec_columns` as a tuple of the values in `SPEC_COLUMNS`' order: what a batch of
    specs sent as columns (`enqueue_many`'s arrays) needs, without a dict per spec to build
    and read back. The same checks and encoders as `spec_columns`, in the same order (so
    the same error for the same spec); a property test holds the two equal."""
    pool, kind, key, tenant = spec.pool, spec.kind, spec.key, spec.tenant
    texts = f"{pool}{kind}{key or ''}{tenant or ''}"
    if not (len(texts) <= _TEXTS_SHORT and texts.isascii() and "\x00" not in texts) and (
        not _stored_as_is(pool, kind, key, tenant)
    ):
        pool, kind, key, tenant = bounded_texts("TaskSpec.", pool, kind, key, tenant)
    fixed, deadline, retry = spec.fixed_start, spec.deadline, spec.retry
    if fixed is None and deadline is None and retry is None:  # the usual spec: no calls
        fixed_values: tuple[Any, ...] = _NO_FIXED
        deadline_ns = retry_text = None
    else:
        deadline_ns = None if deadline is None else to_unix(base, deadline, "TaskSpec.deadline")
        fixed_values = (
            _NO_FIXED
            if fixed is None
            else (to_unix(base, fixed.at, "FixedStart.at"), fixed.tolerance_ns, fixed.on_miss)
        )
        retry_text = None if retry is None else encode_retry(retry)
    deps, resources, tags, labels = spec.deps, spec.resources, spec.tags, spec.labels
    return (
        pool,
        kind,
        int(spec.priority),
        key,
        spec.payload,
        deadline_ns,
        *fixed_values,
        spec.duration_hint_ns,
        spec.timeout_ns,
        retry_text,
        encode_deps(deps) if deps else "[]",
        encode_resources(resources) if resources else "{}",
        encode_tags(tags) if tags else "[]",
        encode_labels(labels) if labels else "{}",
        tenant,
    )


_NO_FIXED: Final = (None, None, None)
"""`fixed_at_unix_ns`, `fixed_tolerance_ns` and `fixed_on_miss` of a spec with no fixed start."""


_TEXTS_SHORT: Final = min(POOL_MAX, KIND_MAX, KEY_MAX, TENANT_MAX)
"""Texts this long together fit each one's limit: one length to check, not four."""


def _stored_as_is(pool: str, kind: str, key: str | None, tenant: str | None) -> bool:
    """Whether a spec's texts are stored as they are: ASCII without NUL (nothing to clean),
    each within its limit. One check of them all, where cleaning and bounding each is a call
    apiece; any other text takes `bounded`, which cleans it or says which is too long."""
    texts = f"{pool}{kind}{key or ''}{tenant or ''}"
    return (
        texts.isascii()
        and "\x00" not in texts
        and len(pool) <= POOL_MAX
        and len(kind) <= KIND_MAX
        and (key is None or len(key) <= KEY_MAX)
        and (tenant is None or len(tenant) <= TENANT_MAX)
    )


def _opt_nonneg(value: object) -> bool:
    return value is None or (type(value) is int and 0 <= value <= INT64_MAX)


def spec_from_columns(base: TimeBase, row: Mapping[Any, Any]) -> TaskSpec:
    """The spec stored in `row` (a mapping holding `SPEC_COLUMNS`); `CorruptValue` if damaged."""
    return spec_from_values(base, *_spec_values(row))


_spec_values: Final = itemgetter(*SPEC_COLUMNS)


def spec_from_values(
    base: TimeBase,
    pool: Any,
    kind: Any,
    stored_priority: Any,
    key: Any,
    payload: Any,
    deadline_unix_ns: Any,
    fixed_at_unix_ns: Any,
    fixed_tolerance_ns: Any,
    fixed_on_miss: Any,
    hint: Any,
    timeout: Any,
    stored_retry: Any,
    stored_deps: Any,
    stored_resources: Any,
    stored_tags: Any,
    stored_labels: Any,
    tenant: Any,
) -> TaskSpec:
    """The spec stored in the values of `SPEC_COLUMNS`, in that order; `CorruptValue` if
    damaged. Positional, so a recovery reads its rows as tuples, not by name.

    Built without `TaskSpec.__post_init__` once its scalar checks pass here: the containers
    come from this module's decoders, which checked every item and return exactly the types
    (tuple, dict, frozenset) `__post_init__` would normalise to, so its second walk and copies
    of them (a tenth of recovery) are skipped, as are a dict of the fields and a loop over it.
    """
    try:
        fixed_at = _stored_time("fixed_at_unix_ns", fixed_at_unix_ns)
        fixed = (
            None
            if fixed_at is None
            else FixedStart(
                at=from_unix(base, fixed_at),
                tolerance_ns=fixed_tolerance_ns,
                on_miss=fixed_on_miss,
            )
        )
        deadline = _stored_time("deadline_unix_ns", deadline_unix_ns)
        if deadline is not None:
            deadline = from_unix(base, deadline)
        retry = decode_retry(stored_retry)
        deps = decode_deps(stored_deps)
        resources = decode_resources(stored_resources)
        tags = decode_tags(stored_tags)
        labels = decode_labels(stored_labels)
        priority = priority_from(stored_priority)
        spec = _spec(
            payload=b"" if payload is None else stored_blob("payload", payload),
            kind=kind,
            pool=pool,
            priority=priority,
            key=key,
            deadline=deadline,
            fixed_start=fixed,
            duration_hint_ns=hint,
            timeout_ns=timeout,
            retry=retry,
            deps=deps,
            resources=resources,
            tags=tags,
            labels=labels,
            tenant=tenant,
        )
        if not (
            type(pool) is str
            and pool != ""
            and type(kind) is str
            and (key is None or (type(key) is str and key != ""))
            and (tenant is None or type(tenant) is str)
            and _opt_nonneg(hint)
            and _opt_nonneg(timeout)
        ):
            spec.__post_init__()  # the full checks: raises, naming the field
        return spec
    except InvalidValue as exc:
        raise CorruptValue(str(exc)) from exc
    except TypeError as exc:
        raise CorruptValue(f"task spec: malformed column ({exc})") from exc


_TEXT_LIMITS: Final = (
    ("pool", POOL_MAX),
    ("kind", KIND_MAX),
    ("key", KEY_MAX),
    ("tenant", TENANT_MAX),
)


class StoredSpecs:
    """Specs decoded from stored rows (the inbox's), with those rows' columns, so that a spec
    written again under the same base is copied, not encoded anew: `spec_columns` of a spec
    `spec_from_columns` returned under `base` gives back the columns it read. Keyed by the
    spec's identity, not its value; an entry holds its spec, so no other spec takes its id."""

    __slots__ = ("_base", "_by_id")

    def __init__(self, base: TimeBase) -> None:
        self._base = base
        self._by_id: dict[int, tuple[TaskSpec, dict[str, Any]]] = {}

    def add(self, spec: TaskSpec, columns: dict[str, Any]) -> None:
        """Remember `columns` (`SPEC_COLUMNS`, taken over) as what `spec` was decoded from,
        unless a text in them is not as `spec_columns` writes it (a hand-written row's)."""
        pool, kind, key, tenant = (
            columns["pool"],
            columns["kind"],
            columns["key"],
            columns["tenant"],
        )
        if not _stored_as_is(pool, kind, key, tenant):
            for name, limit in _TEXT_LIMITS:
                text = columns[name]
                if text is not None and (len(text) > limit or clean(text) != text):
                    return
        columns["payload"] = spec.payload  # the driver's type (memoryview, bytearray) not kept
        self._by_id[id(spec)] = (spec, columns)

    def columns(self, base: TimeBase, spec: TaskSpec) -> dict[str, Any]:
        """`spec_columns(base, spec)`: a copy of the stored columns where `spec` came from a
        row read under `base`, else encoded."""
        hit = self._by_id.get(id(spec))
        if hit is not None and hit[0] is spec and (base is self._base or base == self._base):
            return dict(hit[1])
        return spec_columns(base, spec)


def stored_blob(column: str, value: object) -> bytes:
    """A stored binary column's bytes; anything else is damage (`CorruptValue`): SQLite keeps
    any type in any column, and `bytes(5)` would read an integer as five zero bytes."""
    if type(value) is bytes:
        return value
    return bytes(expect(column, value, (bytes, bytearray, memoryview)))


def _stored_time(column: str, value: object) -> int | None:
    """A stored Unix time column: None or an int (anything else is damage)."""
    return None if value is None else expect(column, value, int)
