"""A recurring schedule: its spec as one JSON text, the template's payload in its own column."""

from __future__ import annotations

from typing import Any

from ..errors import CorruptValue, InvalidValue
from ..jsontext import dumps
from ..model import FixedStart, RecurringSpec, TaskSpec, TimeBase
from .jsonparts import (
    check_json_size,
    deps_from,
    deps_list,
    loads,
    priority_from,
    retry_from,
    retry_obj,
    str_map,
)
from .values import (
    bounded_texts,
    clean,
    clean_opt,
    expect,
    from_unix,
    to_unix,
    to_unix_opt,
)


def _template_obj(base: TimeBase, spec: TaskSpec) -> dict[str, Any]:
    fixed = spec.fixed_start
    pool, kind, key, tenant = bounded_texts(
        "template ", spec.pool, spec.kind, spec.key, spec.tenant
    )
    return {
        "kind": kind,
        "pool": pool,
        "priority": int(spec.priority),
        "key": key,
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
        "deps": deps_list(spec.deps, "template deps"),
        "resources": {clean(k): v for k, v in spec.resources.items()},
        "tags": sorted({clean(t) for t in spec.tags}),
        "labels": {clean(k): clean(v) for k, v in spec.labels.items()},
        "tenant": tenant,
    }


def _template_from(base: TimeBase, obj: object, payload: bytes) -> TaskSpec:
    t = expect("recurring template", obj, dict)
    fixed = t.get("fixed_start")
    if fixed is not None:
        fixed = expect("recurring fixed_start", fixed, dict)
        fixed = FixedStart(
            at=from_unix(base, expect("recurring fixed_start", fixed["at_unix_ns"], int)),
            tolerance_ns=fixed["tolerance_ns"],
            on_miss=fixed["on_miss"],
        )
    deadline = t.get("deadline_unix_ns")
    if deadline is not None:
        deadline = from_unix(base, expect("recurring deadline", deadline, int))
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
        retry=retry_from(t["retry"], "recurring retry"),
        deps=deps_from(t["deps"], "recurring deps"),
        resources=str_map("recurring resources", t["resources"], int),
        tags=frozenset(expect("recurring tags", x, str) for x in expect("tags", t["tags"], list)),
        labels=str_map("recurring labels", t["labels"], str),
        tenant=t["tenant"],
    )


def encode_recurring(base: TimeBase, spec: RecurringSpec) -> str:
    """The JSON text of `spec` without the template's payload (stored in its own column)."""
    text: str = dumps(
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
    obj = expect("recurring spec", loads("recurring spec", text), dict)
    try:
        start, end = obj["start_unix_ns"], obj["end_unix_ns"]
        return RecurringSpec(
            name=name,
            template=_template_from(base, obj["template"], bytes(payload or b"")),
            cron=obj["cron"],
            interval_ns=obj["interval_ns"],
            timezone=obj["timezone"],
            start=None if start is None else from_unix(base, expect("start", start, int)),
            end=None if end is None else from_unix(base, expect("end", end, int)),
            misfire=obj["misfire"],
            overlap=obj["overlap"],
        )
    except (KeyError, TypeError) as exc:
        raise CorruptValue(f"recurring spec: missing or malformed {exc}") from exc
    except InvalidValue as exc:
        raise CorruptValue(f"recurring spec: {exc}") from exc
