"""The JSON parts of a spec (retry, deps, resources, tags, labels) and the bounded decoder.

Each encoder has a decoder that checks the shape strictly: a damaged value must never decode
into a different valid one. Stored JSON is bounded in length and depth (`JSON_MAX_CHARS`,
`JSON_MAX_DEPTH`) before any decoder sees it, so no stored value can take unbounded memory or
stack; `loads` and `loads_plain` are the only ways in.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from functools import lru_cache
from itertools import accumulate
from typing import Any, Final, get_args

from .. import jsontext
from ..errors import CorruptValue, InvalidValue
from ..jsontext import dumps, dumps_plain
from ..model import INT64_MAX, INT64_MIN, ById, ByKey, Dep, DepOn, Priority, RetryPolicy
from .building import slot_setter
from .values import KEY_MAX, bounded, clean, expect

JSON_MAX_CHARS: Final = 16 * 1024 * 1024
"""Longest JSON text stored or decoded (what every dialect's long text holds): a longer stored
value is damage, and decoding it could take any amount of memory."""
JSON_MAX_DEPTH: Final = 32
"""Deepest nesting of arrays and objects in stored JSON (what this module writes nests at most
four deep): deeper is damage, and decoding it recursively could exhaust the stack."""
SHALLOW: Final = 2 * JSON_MAX_DEPTH + 1
"""No valid JSON text this short nests deeper than `JSON_MAX_DEPTH` (each level takes two
brackets), nor is it too long: a decoder can take it as it is."""

_DEP_ON: Final = get_args(DepOn)

fast_loads = jsontext.fast_loads
"""For values of str, int and bool only (deps, resources, tags, labels): orjson if installed."""


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


def bounded_json(column: str, text: object) -> str:
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


def loads(column: str, text: object) -> Any:
    """Decode stored JSON, bounded: too long or too deep is `CorruptValue`, as is bad JSON."""
    text = bounded_json(column, text)
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


_new: Final = object.__new__
_set_by_id: Final = slot_setter(ById, "id")
_set_by_key: Final = slot_setter(ByKey, "key")
_set_dep_target: Final = slot_setter(Dep, "target")
_set_dep_on: Final = slot_setter(Dep, "on")
_ABSENT: Final = object()


def loads_plain(column: str, text: object) -> Any:
    """`loads` for the columns `jsontext.dumps_plain` writes, by orjson where installed.

    Whatever orjson refuses (or any text not a str) takes `loads`, which decides as it always
    did; where orjson accepts, it decodes as the standard library does, except for integers
    beyond 64 bits (a float, not an int), which no decoder of these columns accepts either way.
    """
    if fast_loads is not None:
        try:
            if type(text) is str and (
                len(text) <= SHALLOW
                or (
                    text.count("[") + text.count("{") <= JSON_MAX_DEPTH
                    and len(text) <= JSON_MAX_CHARS
                )
            ):
                return fast_loads(text)  # within every bound: no depth to measure
            return fast_loads(bounded_json(column, text))
        except ValueError:
            pass
    return loads(column, text)


def retry_obj(retry: RetryPolicy) -> dict[str, Any]:
    """A retry policy as its stored JSON object (and as operators are shown it)."""
    return {
        "max_attempts": retry.max_attempts,
        "initial_backoff_ns": retry.initial_backoff_ns,
        "max_backoff_ns": retry.max_backoff_ns,
        "multiplier": retry.multiplier,
        "jitter": retry.jitter,
    }


def retry_from(obj: object, column: str = "retry") -> RetryPolicy | None:
    if obj is None:
        return None
    fields: dict[str, Any] = expect(column, obj, dict)
    try:
        return RetryPolicy(**fields)
    except (TypeError, InvalidValue) as exc:
        raise CorruptValue(f"{column}: {exc}") from exc


def encode_retry(retry: RetryPolicy | None) -> str | None:
    return None if retry is None else dumps(retry_obj(retry))


def decode_retry(text: str | None) -> RetryPolicy | None:
    return None if text is None else retry_from(loads("retry", text))


def deps_list(deps: tuple[Dep, ...], field: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for dep in deps:
        target = dep.target
        if isinstance(target, ById):
            if not INT64_MIN <= target.id <= INT64_MAX:
                raise InvalidValue(f"{field} id {target.id} is outside the 64-bit range")
            out.append({"id": target.id, "on": dep.on})
        else:
            key = target.key
            if not (len(key) <= KEY_MAX and key.isascii() and "\x00" not in key):
                key = bounded(field + " key", key, KEY_MAX)  # cleaned, or refused
            out.append({"key": key, "on": dep.on})
    return out


def deps_from(obj: object, column: str = "deps") -> tuple[Dep, ...]:
    """Dependencies, checked here as `Dep`, `ById` and `ByKey` would check them.

    Each object is made by its slots' setters, inline: a recovery decodes a dependency or two
    per task, and a builder's call apiece was a tenth of it."""
    items: list[Any] = obj if type(obj) is list else expect(column, obj, list)
    deps = []
    for item in items:
        if type(item) is not dict:
            expect(column, item, dict)
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
    text = dumps_plain(deps_list(deps, "TaskSpec.deps"))
    return text if len(text) <= JSON_MAX_CHARS else check_json_size("TaskSpec.deps", text)


def decode_deps(text: str) -> tuple[Dep, ...]:
    return () if text == "[]" else deps_from(loads_plain("deps", text))


def str_map(column: str, obj: object, value_type: type) -> dict[str, Any]:
    mapping: dict[str, Any] = obj if type(obj) is dict else expect(column, obj, dict)
    for value in mapping.values():
        if type(value) is not value_type:  # exact: a bool is not an int here
            expect(column, value, value_type)
    return mapping


# Whether JSON text holds no NUL and no lone surrogate (its strings need no cleaning), checked
# inline by each encoder below (`text.isascii() and "\\u0000" not in text`): JSON escapes NUL
# as \u0000, and with ensure_ascii off a lone surrogate stays a raw character, so ASCII text
# without that escape is clean: one C-speed check instead of cleaning every string before
# encoding (a false alarm only takes the slow path), and no call of its own.


def encode_resources(resources: Mapping[str, int]) -> str:
    if not resources:
        return "{}"
    text = dumps_plain(resources)
    if not (text.isascii() and "\\u0000" not in text):  # clean (see above)
        text = dumps_plain({clean(k): v for k, v in resources.items()})
    return text if len(text) <= JSON_MAX_CHARS else check_json_size("TaskSpec.resources", text)


def decode_resources(text: str) -> dict[str, int]:
    if text == "{}":
        return {}
    resources = str_map("resources", loads_plain("resources", text), int)
    if any(v < 0 or v > INT64_MAX for v in resources.values()):
        raise CorruptValue("resources: units outside [0, 2**63 - 1]")
    return resources


def encode_tags(tags: frozenset[str]) -> str:
    if not tags:
        return "[]"
    text = dumps_plain(sorted(tags))
    if not (text.isascii() and "\\u0000" not in text):  # clean (see above)
        text = dumps_plain(sorted({clean(t) for t in tags}))
    return text if len(text) <= JSON_MAX_CHARS else check_json_size("TaskSpec.tags", text)


SHARED_TAGS_MAX: Final = 256
"""Tag and label sets stored as JSON text up to this long are decoded once (`decode_tags`,
`decode_labels`)."""


def decode_tags(text: str) -> frozenset[str]:
    """The stored tag set. Tasks mostly repeat a few tag sets, and a frozenset can be shared:
    short texts decode once (a cache of the last 4,096), saving a recovery the parse, the
    check and a tracked object per task."""
    if type(text) is str and len(text) <= SHARED_TAGS_MAX:
        return _shared_tags(text)
    return decode_tags_uncached(text)


def decode_tags_uncached(text: str) -> frozenset[str]:
    if text == "[]":
        return frozenset()
    items = expect("tags", loads_plain("tags", text), list)
    for t in items:
        if type(t) is not str:
            expect("tags", t, str)
    return frozenset(items)


_shared_tags = lru_cache(maxsize=4096)(decode_tags_uncached)


def encode_labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return "{}"
    text = dumps_plain(labels)
    if not (text.isascii() and "\\u0000" not in text):  # clean (see above)
        text = dumps_plain({clean(k): clean(v) for k, v in labels.items()})
    return text if len(text) <= JSON_MAX_CHARS else check_json_size("TaskSpec.labels", text)


def decode_labels(text: str) -> dict[str, str]:
    """The stored labels. Like tag sets, label sets repeat, so short texts decode once (as
    `decode_tags`); a dict cannot be shared, so each task gets its own copy, at a fifth of a
    parse and a check."""
    if type(text) is str and len(text) <= SHARED_TAGS_MAX:
        return dict(_shared_labels(text))
    return decode_labels_uncached(text)


def decode_labels_uncached(text: str) -> dict[str, str]:
    return {} if text == "{}" else str_map("labels", loads_plain("labels", text), str)


_shared_labels = lru_cache(maxsize=4096)(decode_labels_uncached)


_PRIORITIES: Final = {int(p): p for p in Priority}


def priority_from(index: object) -> Priority:
    """The stored priority; an unknown index (or a non-integer) reads as NORMAL."""
    if isinstance(index, int):
        return _PRIORITIES.get(index, Priority.NORMAL)
    return Priority.NORMAL
