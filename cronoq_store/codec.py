"""Encoding of the domain model to column values and back.

Structured parts of a spec (retry, deps, resources, tags, labels, a recurring schedule) are
stored as compact JSON text, so the schema stays portable and no JSON function of any dialect is
needed; times are Unix nanoseconds and durations nanoseconds, as BIGINT. Strings are cleaned
(NUL and lone surrogates become U+FFFD) because no dialect stores both faithfully.

Encoding refuses what cannot be stored (`InvalidValue`, naming the field); decoding a damaged
value raises `CorruptValue`, which recovery catches to quarantine the row.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from datetime import UTC, datetime, timedelta
from functools import lru_cache, wraps
from itertools import accumulate
from operator import itemgetter
from typing import Any, Final, TypeVar, get_args

from . import jsontext
from .errors import CorruptValue, InvalidValue
from .model import (
    INT64_MAX,
    INT64_MIN,
    ById,
    ByKey,
    Dep,
    DepOn,
    FixedStart,
    InboxItem,
    Priority,
    RecoveredRecurring,
    RecoveredTask,
    RecoveredTerminal,
    RecurringSpec,
    RetryPolicy,
    TaskId,
    TaskRecord,
    TaskSpec,
    TaskStatus,
    Time,
    TimeBase,
)

_T = TypeVar("_T")

KEY_MAX: Final = 512
"""Longest key, in characters (MySQL indexes at most 3072 bytes: 768 utf8mb4 characters)."""
POOL_MAX: Final = 128
KIND_MAX: Final = 255
TENANT_MAX: Final = 255
NAME_MAX: Final = 255
"""Longest recurring schedule name."""
HOLDER_MAX: Final = 128
STATUS_MAX: Final = 16
JSON_MAX_CHARS: Final = 16 * 1024 * 1024
"""Longest JSON text stored or decoded (what every dialect's long text holds): a longer stored
value is damage, and decoding it could take any amount of memory."""
JSON_MAX_DEPTH: Final = 32
"""Deepest nesting of arrays and objects in stored JSON (what this module writes nests at most
four deep): deeper is damage, and decoding it recursively could exhaust the stack."""
_SHALLOW: Final = 2 * JSON_MAX_DEPTH + 1
"""No valid JSON text this short nests deeper than `JSON_MAX_DEPTH` (each level takes two
brackets), nor is it too long: a decoder can take it as it is."""

_DEP_ON: Final = get_args(DepOn)

_UNCLEAN = re.compile("[\x00\ud800-\udfff]")
_dumps = jsontext.dumps
_dumps_plain = jsontext.dumps_plain
_fast_loads = jsontext.fast_loads
"""For values of str, int and bool only (deps, resources, tags, labels): orjson if installed."""


def clean(text: str) -> str:
    """`text` with NUL and lone surrogates replaced by U+FFFD."""
    if text.isascii() and "\x00" not in text:
        return text
    return _UNCLEAN.sub("\ufffd", text)


def clean_opt(text: str | None) -> str | None:
    return None if text is None else clean(text)


def bounded(field: str, text: str, limit: int) -> str:
    """`text` cleaned, refused if longer than `limit` characters (never truncated)."""
    text = clean(text)
    if len(text) > limit:
        raise InvalidValue(f"{field} is {len(text)} characters long; at most {limit} are stored")
    return text


def bounded_opt(field: str, text: str | None, limit: int) -> str | None:
    return None if text is None else bounded(field, text, limit)


def to_unix(base: TimeBase, t: Time, field: str = "time") -> int:
    """Unix nanoseconds of engine time `t`, refused when outside BIGINT."""
    unix = base.unix_ns + t
    if not INT64_MIN <= unix <= INT64_MAX:
        raise InvalidValue(f"{field} {t} is out of range with time base {base.unix_ns}")
    return unix


def to_unix_opt(base: TimeBase, t: Time | None, field: str = "time") -> int | None:
    return None if t is None else to_unix(base, t, field)


def saturate(value: int) -> int:
    """`value` clamped to the signed 64-bit range: an overflow stays at the bound, never wraps."""
    return INT64_MIN if value < INT64_MIN else INT64_MAX if value > INT64_MAX else value


def from_unix(base: TimeBase, unix_ns: int) -> Time:
    """Engine time of stored Unix nanoseconds, saturated to the 64-bit range.

    A time valid when committed stays valid under any later base: converting is arithmetic,
    never a reason to quarantine a row.
    """
    t = unix_ns - base.unix_ns
    return t if INT64_MIN <= t <= INT64_MAX else saturate(t)


# JSON parts. Each encoder has a decoder that checks the shape strictly: a damaged value must
# never decode into a different valid one.


_raw_decode = json.JSONDecoder().raw_decode
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_NESTING: Final = {"[": 1, "{": 1, "]": -1, "}": -1}


def json_depth(text: str) -> int:
    """How deep arrays and objects nest in JSON `text`, brackets inside strings aside.

    Regular expressions and `accumulate` do the scanning at C speed, without recursion, so any
    text is measured in bounded stack before a recursive decoder sees it.
    """
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    return max(accumulate(map(_NESTING.__getitem__, brackets)), default=0)


def check_json_size(field: str, text: str) -> str:
    """`text`, refused (`InvalidValue`) when longer than any stored JSON may be."""
    if len(text) > JSON_MAX_CHARS:
        raise InvalidValue(
            f"{field} encodes to {len(text)} characters of JSON; at most {JSON_MAX_CHARS} fit"
        )
    return text


def _bounded(column: str, text: object) -> str:
    """`text`, if it is stored JSON text within the bounds: too long or too deep is
    `CorruptValue` (every decoder checks here first, whichever library decodes)."""
    if not isinstance(text, str):
        raise CorruptValue(f"{column}: expected JSON text, got {type(text).__name__}")
    if len(text) > JSON_MAX_CHARS:
        raise CorruptValue(f"{column}: JSON of {len(text)} characters (at most {JSON_MAX_CHARS})")
    # Counting brackets is one C-speed pass; only text with many needs its depth measured.
    if text.count("[") + text.count("{") > JSON_MAX_DEPTH and json_depth(text) > JSON_MAX_DEPTH:
        raise CorruptValue(f"{column}: JSON nested deeper than {JSON_MAX_DEPTH} levels")
    return text


def _loads(column: str, text: object) -> Any:
    """Decode stored JSON, bounded: too long or too deep is `CorruptValue`, as is bad JSON."""
    text = _bounded(column, text)
    # What this module wrote has no surrounding whitespace: decode it without json.loads's
    # two whitespace scans; anything else takes the full path (and its errors).
    try:
        obj, end = _raw_decode(text)
        if end == len(text):
            return obj
    except (ValueError, RecursionError):
        pass
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise CorruptValue(f"{column}: invalid JSON ({exc})") from exc


def _builder(cls: type[_T]) -> Callable[..., _T]:
    """A keyword-only function building `cls` (a slotted dataclass) from every field's value,
    with no `__init__` or `__post_init__`: for values this module has already checked.

    Validating each of 100,000 recovered tasks a second time costs a large share of recovery,
    and so does `object.__setattr__` by name, field by field. The function is generated, as
    dataclasses generates `__init__`, and calls each slot's own setter.
    """
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    setters = {f"_set_{name}": _slot_setter(cls, name) for name in names}
    body = "".join(f"    _set_{name}(obj, {name})\n" for name in names)
    source = f"def build(*, {', '.join(names)}):\n    obj = _new(_cls)\n{body}    return obj\n"
    namespace: dict[str, Any] = {"_new": object.__new__, "_cls": cls, **setters}
    exec(source, namespace)
    build: Callable[..., _T] = namespace["build"]
    return build


def _slot_setter(cls: type, name: str) -> Callable[[Any, Any], None]:
    """The setter of slot `name` of `cls` (a frozen dataclass's own setattr refuses)."""
    setter: Callable[[Any, Any], None] = getattr(cls, name).__set__
    return setter


_new: Final = object.__new__
_set_by_id: Final = _slot_setter(ById, "id")
_set_by_key: Final = _slot_setter(ByKey, "key")
_set_dep_target: Final = _slot_setter(Dep, "target")
_set_dep_on: Final = _slot_setter(Dep, "on")
_spec = _builder(TaskSpec)
_recovered_task = _builder(RecoveredTask)
inbox_item: Final = _builder(InboxItem)
"""`InboxItem(...)` without dataclass's frozen `__init__` (a drain makes one per item; the
class has no checks to skip)."""
_ABSENT: Final = object()


def _loads_plain(column: str, text: object) -> Any:
    """`_loads` for the columns `jsontext.dumps_plain` writes, by orjson where installed.

    Whatever orjson refuses (or any text not a str) takes `_loads`, which decides as it always
    did; where orjson accepts, it decodes as the standard library does, except for integers
    beyond 64 bits (a float, not an int), which no decoder of these columns accepts either way.
    """
    if _fast_loads is not None:
        try:
            if type(text) is str and (
                len(text) <= _SHALLOW
                or (
                    text.count("[") + text.count("{") <= JSON_MAX_DEPTH
                    and len(text) <= JSON_MAX_CHARS
                )
            ):
                return _fast_loads(text)  # within every bound: no depth to measure
            return _fast_loads(_bounded(column, text))
        except ValueError:
            pass
    return _loads(column, text)


def _expect(column: str, value: object, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise CorruptValue(f"{column}: unexpected {type(value).__name__} in stored value")
    return value


def retry_obj(retry: RetryPolicy) -> dict[str, Any]:
    """A retry policy as its stored JSON object (and as operators are shown it)."""
    return {
        "max_attempts": retry.max_attempts,
        "initial_backoff_ns": retry.initial_backoff_ns,
        "max_backoff_ns": retry.max_backoff_ns,
        "multiplier": retry.multiplier,
        "jitter": retry.jitter,
    }


def _retry_from(obj: object, column: str = "retry") -> RetryPolicy | None:
    if obj is None:
        return None
    fields: dict[str, Any] = _expect(column, obj, dict)
    try:
        return RetryPolicy(**fields)
    except (TypeError, InvalidValue) as exc:
        raise CorruptValue(f"{column}: {exc}") from exc


def encode_retry(retry: RetryPolicy | None) -> str | None:
    return None if retry is None else _dumps(retry_obj(retry))


def decode_retry(text: str | None) -> RetryPolicy | None:
    return None if text is None else _retry_from(_loads("retry", text))


def _deps_list(deps: tuple[Dep, ...], field: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for dep in deps:
        target = dep.target
        if isinstance(target, ById):
            if not INT64_MIN <= target.id <= INT64_MAX:
                raise InvalidValue(f"{field} id {target.id} is outside the 64-bit range")
            out.append({"id": target.id, "on": dep.on})
        else:
            out.append({"key": bounded(field + " key", target.key, KEY_MAX), "on": dep.on})
    return out


def _deps_from(obj: object, column: str = "deps") -> tuple[Dep, ...]:
    """Dependencies, checked here as `Dep`, `ById` and `ByKey` would check them.

    Each object is made by its slots' setters, inline: a recovery decodes a dependency or two
    per task, and a builder's call apiece was a tenth of it."""
    items: list[Any] = obj if type(obj) is list else _expect(column, obj, list)
    deps = []
    for item in items:
        if type(item) is not dict:
            _expect(column, item, dict)
        on = item.get("on")
        if len(item) != 2 or on not in _DEP_ON:
            raise CorruptValue(f"{column}: a dependency needs id or key, and on ({_DEP_ON})")
        target: ById | ByKey
        task_id = item.get("id", _ABSENT)
        if task_id is not _ABSENT:
            if type(task_id) is not int or not INT64_MIN <= task_id <= INT64_MAX:
                raise CorruptValue(f"{column}: a dependency id must be a 64-bit int")
            target = _new(ById)
            _set_by_id(target, task_id)
        else:
            key = item.get("key")
            if type(key) is not str or not key:
                if "key" not in item:
                    raise CorruptValue(f"{column}: a dependency needs id or key, and on")
                raise CorruptValue(f"{column}: a dependency key must be a non-empty str")
            target = _new(ByKey)
            _set_by_key(target, key)
        dep = _new(Dep)
        _set_dep_target(dep, target)
        _set_dep_on(dep, on)
        deps.append(dep)
    return tuple(deps)


def encode_deps(deps: tuple[Dep, ...]) -> str:
    if not deps:
        return "[]"
    return check_json_size("TaskSpec.deps", _dumps_plain(_deps_list(deps, "TaskSpec.deps")))


def decode_deps(text: str) -> tuple[Dep, ...]:
    return () if text == "[]" else _deps_from(_loads_plain("deps", text))


def _str_map(column: str, obj: object, value_type: type) -> dict[str, Any]:
    mapping: dict[str, Any] = obj if type(obj) is dict else _expect(column, obj, dict)
    for value in mapping.values():
        if type(value) is not value_type:  # exact: a bool is not an int here
            _expect(column, value, value_type)
    return mapping


def _is_clean_json(text: str) -> bool:
    """Whether JSON text holds no NUL and no lone surrogate (its strings need no cleaning).

    JSON escapes NUL as \\u0000, and with ensure_ascii off a lone surrogate stays a raw
    character, so ASCII text without that escape is clean: one C-speed check instead of
    cleaning every string before encoding (a false alarm only takes the slow path).
    """
    return text.isascii() and "\\u0000" not in text


def encode_resources(resources: Mapping[str, int]) -> str:
    if not resources:
        return "{}"
    text = _dumps_plain(resources)
    if not _is_clean_json(text):
        text = _dumps_plain({clean(k): v for k, v in resources.items()})
    return check_json_size("TaskSpec.resources", text)


def decode_resources(text: str) -> dict[str, int]:
    if text == "{}":
        return {}
    resources = _str_map("resources", _loads_plain("resources", text), int)
    if any(v < 0 or v > INT64_MAX for v in resources.values()):
        raise CorruptValue("resources: units outside [0, 2**63 - 1]")
    return resources


def encode_tags(tags: frozenset[str]) -> str:
    if not tags:
        return "[]"
    text = _dumps_plain(sorted(tags))
    if not _is_clean_json(text):
        text = _dumps_plain(sorted({clean(t) for t in tags}))
    return check_json_size("TaskSpec.tags", text)


SHARED_TAGS_MAX: Final = 256
"""Tag and label sets stored as JSON text up to this long are decoded once (`decode_tags`,
`decode_labels`)."""


def decode_tags(text: str) -> frozenset[str]:
    """The stored tag set. Tasks mostly repeat a few tag sets, and a frozenset can be shared:
    short texts decode once (a cache of the last 4,096), saving a recovery the parse, the
    check and a tracked object per task."""
    if type(text) is str and len(text) <= SHARED_TAGS_MAX:
        return _shared_tags(text)
    return _decode_tags(text)


def _decode_tags(text: str) -> frozenset[str]:
    if text == "[]":
        return frozenset()
    items = _expect("tags", _loads_plain("tags", text), list)
    for t in items:
        if type(t) is not str:
            _expect("tags", t, str)
    return frozenset(items)


_shared_tags = lru_cache(maxsize=4096)(_decode_tags)


def encode_labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return "{}"
    text = _dumps_plain(labels)
    if not _is_clean_json(text):
        text = _dumps_plain({clean(k): clean(v) for k, v in labels.items()})
    return check_json_size("TaskSpec.labels", text)


def decode_labels(text: str) -> dict[str, str]:
    """The stored labels. Like tag sets, label sets repeat, so short texts decode once (as
    `decode_tags`); a dict cannot be shared, so each task gets its own copy, at a fifth of a
    parse and a check."""
    if type(text) is str and len(text) <= SHARED_TAGS_MAX:
        return dict(_shared_labels(text))
    return _decode_labels(text)


def _decode_labels(text: str) -> dict[str, str]:
    return {} if text == "{}" else _str_map("labels", _loads_plain("labels", text), str)


_shared_labels = lru_cache(maxsize=4096)(_decode_labels)


_PRIORITIES: Final = {int(p): p for p in Priority}


def priority_from(index: object) -> Priority:
    """The stored priority; an unknown index (or a non-integer) reads as NORMAL."""
    if isinstance(index, int):
        return _PRIORITIES.get(index, Priority.NORMAL)
    return Priority.NORMAL


# A task spec as the columns of cronoq_tasks.

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
    """The column values of `spec` (the keys of `SPEC_COLUMNS`)."""
    pool, kind, key, tenant = spec.pool, spec.kind, spec.key, spec.tenant
    if not _stored_as_is(pool, kind, key, tenant):
        pool = bounded("TaskSpec.pool", pool, POOL_MAX)
        kind = bounded("TaskSpec.kind", kind, KIND_MAX)
        key = bounded_opt("TaskSpec.key", key, KEY_MAX)
        tenant = bounded_opt("TaskSpec.tenant", tenant, TENANT_MAX)
    fixed = spec.fixed_start
    return {
        "pool": pool,
        "kind": kind,
        "priority": int(spec.priority),
        "key": key,
        "payload": spec.payload,
        "deadline_unix_ns": to_unix_opt(base, spec.deadline, "TaskSpec.deadline"),
        "fixed_at_unix_ns": None if fixed is None else to_unix(base, fixed.at, "FixedStart.at"),
        "fixed_tolerance_ns": None if fixed is None else fixed.tolerance_ns,
        "fixed_on_miss": None if fixed is None else fixed.on_miss,
        "duration_hint_ns": spec.duration_hint_ns,
        "timeout_ns": spec.timeout_ns,
        "retry": encode_retry(spec.retry),
        "deps": encode_deps(spec.deps),
        "resources": encode_resources(spec.resources),
        "tags": encode_tags(spec.tags),
        "labels": encode_labels(spec.labels),
        "tenant": tenant,
    }


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
    return bytes(_expect(column, value, (bytes, bytearray, memoryview)))


def _stored_time(column: str, value: object) -> int | None:
    """A stored Unix time column: None or an int (anything else is damage)."""
    return None if value is None else _expect(column, value, int)


# A recurring schedule: its spec as one JSON text, the template's payload in its own column.


def _template_obj(base: TimeBase, spec: TaskSpec) -> dict[str, Any]:
    fixed = spec.fixed_start
    return {
        "kind": bounded("template kind", spec.kind, KIND_MAX),
        "pool": bounded("template pool", spec.pool, POOL_MAX),
        "priority": int(spec.priority),
        "key": bounded_opt("template key", spec.key, KEY_MAX),
        "deadline_unix_ns": to_unix_opt(base, spec.deadline, "template deadline"),
        "fixed_start": None
        if fixed is None
        else {
            "at_unix_ns": to_unix(base, fixed.at, "template fixed_start"),
            "tolerance_ns": fixed.tolerance_ns,
            "on_miss": fixed.on_miss,
        },
        "duration_hint_ns": spec.duration_hint_ns,
        "timeout_ns": spec.timeout_ns,
        "retry": None if spec.retry is None else retry_obj(spec.retry),
        "deps": _deps_list(spec.deps, "template deps"),
        "resources": {clean(k): v for k, v in spec.resources.items()},
        "tags": sorted({clean(t) for t in spec.tags}),
        "labels": {clean(k): clean(v) for k, v in spec.labels.items()},
        "tenant": bounded_opt("template tenant", spec.tenant, TENANT_MAX),
    }


def _template_from(base: TimeBase, obj: object, payload: bytes) -> TaskSpec:
    t = _expect("recurring template", obj, dict)
    fixed = t.get("fixed_start")
    if fixed is not None:
        fixed = _expect("recurring fixed_start", fixed, dict)
        fixed = FixedStart(
            at=from_unix(base, _expect("recurring fixed_start", fixed["at_unix_ns"], int)),
            tolerance_ns=fixed["tolerance_ns"],
            on_miss=fixed["on_miss"],
        )
    deadline = t.get("deadline_unix_ns")
    if deadline is not None:
        deadline = from_unix(base, _expect("recurring deadline", deadline, int))
    return TaskSpec(
        payload=payload,
        kind=t["kind"],
        pool=t["pool"],
        priority=priority_from(t["priority"]),
        key=t["key"],
        deadline=deadline,
        fixed_start=fixed,
        duration_hint_ns=t["duration_hint_ns"],
        timeout_ns=t["timeout_ns"],
        retry=_retry_from(t["retry"], "recurring retry"),
        deps=_deps_from(t["deps"], "recurring deps"),
        resources=_str_map("recurring resources", t["resources"], int),
        tags=frozenset(_expect("recurring tags", x, str) for x in _expect("tags", t["tags"], list)),
        labels=_str_map("recurring labels", t["labels"], str),
        tenant=t["tenant"],
    )


def encode_recurring(base: TimeBase, spec: RecurringSpec) -> str:
    """The JSON text of `spec` without the template's payload (stored in its own column)."""
    text: str = _dumps(
        {
            "cron": clean_opt(spec.cron),
            "interval_ns": spec.interval_ns,
            "timezone": clean(spec.timezone),
            "start_unix_ns": to_unix_opt(base, spec.start, "RecurringSpec.start"),
            "end_unix_ns": to_unix_opt(base, spec.end, "RecurringSpec.end"),
            "misfire": spec.misfire,
            "overlap": spec.overlap,
            "template": _template_obj(base, spec.template),
        }
    )
    return check_json_size("RecurringSpec", text)


def decode_recurring(base: TimeBase, name: str, text: str, payload: bytes | None) -> RecurringSpec:
    """The schedule stored as `text` and `payload`; `CorruptValue` if damaged."""
    obj = _expect("recurring spec", _loads("recurring spec", text), dict)
    try:
        start, end = obj["start_unix_ns"], obj["end_unix_ns"]
        return RecurringSpec(
            name=name,
            template=_template_from(base, obj["template"], bytes(payload or b"")),
            cron=obj["cron"],
            interval_ns=obj["interval_ns"],
            timezone=obj["timezone"],
            start=None if start is None else from_unix(base, _expect("start", start, int)),
            end=None if end is None else from_unix(base, _expect("end", end, int)),
            misfire=obj["misfire"],
            overlap=obj["overlap"],
        )
    except (KeyError, TypeError) as exc:
        raise CorruptValue(f"recurring spec: missing or malformed {exc}") from exc
    except InvalidValue as exc:
        raise CorruptValue(f"recurring spec: {exc}") from exc


# Whole rows: every value a recovery reads passes through one of these decoders, so a stored
# value of any shape (text in an integer column on SQLite, an out-of-range flag, a status name
# this build does not know) is one `CorruptValue` for recovery to quarantine, never a crash.

_Row = TypeVar("_Row")
_R = TypeVar("_R")


def _row_decoder(
    what: str,
) -> Callable[[Callable[[TimeBase, _Row], _R]], Callable[[TimeBase, _Row], _R]]:
    """Turn any failure to decode a row into `CorruptValue` naming `what` was read. The
    wrapper takes the decoders' two arguments as they are: a recovery calls one per row."""

    def decorate(fn: Callable[[TimeBase, _Row], _R]) -> Callable[[TimeBase, _Row], _R]:
        @wraps(fn)
        def decode(base: TimeBase, row: _Row) -> _R:
            try:
                return fn(base, row)
            except CorruptValue:
                raise
            except (TypeError, ValueError, KeyError, OverflowError, RecursionError) as exc:
                raise CorruptValue(f"{what}: {type(exc).__name__}: {exc}") from exc

        return decode

    return decorate


def _int(column: str, value: object) -> int:
    """A stored integer column: exactly an int (SQLite stores any type in any column)."""
    if type(value) is not int:
        raise CorruptValue(f"{column}: expected an integer, got {type(value).__name__}")
    return value


_VALID_PAIRS: Final[dict[tuple[str, int], TaskStatus]] = {
    (s.value, int(s.is_terminal)): s for s in TaskStatus
}
"""Every valid (stored name, flag) pair: one dict lookup decides what a row as written holds
(True and 1 are the same key: PostgreSQL reads the flag as a bool)."""


_LIVE_PAIRS: Final = frozenset(pair for pair, s in _VALID_PAIRS.items() if not s.is_terminal)
"""The valid (stored name, flag) pairs of a live task."""


def status_pair(status: object, terminal: object) -> TaskStatus:
    """The status of a row whose `status` name and `terminal` flag (read as an integer) agree.

    The flag must be exactly 0 or 1 and say what the name says; anything else (a flag of 2,
    an unknown or empty name, a finished status on a live row or the reverse) is damage.
    """
    if isinstance(status, str) and isinstance(terminal, int):  # a bool is an int
        known_pair = _VALID_PAIRS.get((status, terminal))
        if known_pair is not None:
            return known_pair
    if type(terminal) not in (int, bool) or terminal not in (0, 1):
        raise CorruptValue(f"terminal: {terminal!r} is neither 0 nor 1")
    if not isinstance(status, str):
        raise CorruptValue(f"status: expected a name, got {type(status).__name__}")
    known = TaskStatus.from_name(status)
    if known is None:
        raise CorruptValue(f"status: unknown status {status!r}")
    if known.is_terminal != bool(terminal):
        state = "finished" if terminal else "live"
        raise CorruptValue(f"status: {known.value!r} on a {state} row (terminal = {terminal})")
    return known


@_row_decoder("live task row")
def live_task_from_row(base: TimeBase, row: Sequence[Any]) -> RecoveredTask:
    """A live task row: the values of `LIVE_COLUMNS`, in that order (a tuple is read faster
    than a mapping, and a recovery reads every live task); `CorruptValue` for any value that
    does not decode, or a row that is not a live task."""
    task_id, seq, arrival, attempt, status_name, terminal = row[:6]
    # The flag's type first: 0.0 equals 0 (and hashes alike), and is damage.
    if type(terminal) not in (int, bool) or (status_name, terminal) not in _LIVE_PAIRS:
        status = status_pair(status_name, terminal)
        raise CorruptValue(f"status: {status.value!r} is not live")
    return _recovered_task(  # every field is checked here: no __init__ to run
        id=_int("id", task_id),
        seq=_int("seq", seq),
        arrival=from_unix(base, _int("arrival_unix_ns", arrival)),
        spec=spec_from_values(base, *row[6:]),
        attempt=max(0, _int("attempt", attempt)),
    )


@_row_decoder("finished task row")
def finished_task_from_row(base: TimeBase, row: Mapping[Any, Any]) -> RecoveredTerminal:
    """A finished task row (id, key, status, terminal, updated_unix_ns); `CorruptValue` for any
    value that does not decode, or a row that is not a finished task."""
    status = status_pair(row["status"], row["terminal"])
    if not status.is_terminal:
        raise CorruptValue(f"status: {status.value!r} has not finished")
    key = row["key"]
    if key is not None and not isinstance(key, str):
        raise CorruptValue(f"key: expected text, got {type(key).__name__}")
    return RecoveredTerminal(
        id=TaskId(_int("id", row["id"])),
        key=key,
        status=status,
        at=from_unix(base, _int("updated_unix_ns", row["updated_unix_ns"])),
    )


@_row_decoder("recurring schedule row")
def recurring_from_row(base: TimeBase, row: Mapping[Any, Any]) -> RecoveredRecurring:
    """A schedule row (name, spec, template_payload, next_unix_ns, last_task_id);
    `CorruptValue` for any value that does not decode."""
    name = row["name"]
    if not isinstance(name, str):
        raise CorruptValue(f"name: expected text, got {type(name).__name__}")
    payload = row["template_payload"]
    if payload is not None and not isinstance(payload, bytes | bytearray | memoryview):
        raise CorruptValue(f"template_payload: expected bytes, got {type(payload).__name__}")
    next_unix, last = row["next_unix_ns"], row["last_task_id"]
    return RecoveredRecurring(
        spec=decode_recurring(base, name, row["spec"], None if payload is None else bytes(payload)),
        next=None if next_unix is None else from_unix(base, _int("next_unix_ns", next_unix)),
        last=None if last is None else TaskId(_int("last_task_id", last)),
    )


# A query's row as the record a caller gets (`repository.queries`).


def record_from(row: Mapping[Any, Any]) -> TaskRecord:
    """A query row as a `TaskRecord`."""
    updated = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(
        microseconds=max(0, row["updated_unix_ns"]) // 1000
    )
    return TaskRecord(
        id=TaskId(row["id"]),
        key=row["key"],
        pool=row["pool"],
        kind=row["kind"],
        priority=priority_from(row["priority"]),
        tenant=row["tenant"],
        status=TaskStatus.from_name(row["status"]),
        attempt=row["attempt"],
        message=row["message"],
        output=None if row["output"] is None else stored_blob("output", row["output"]),
        updated=updated,
    )
