"""Property tests of the codec and the model's validation (no database)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cronoq_store import codec
from cronoq_store.codec import jsonparts
from cronoq_store.errors import CorruptValue, InvalidValue
from cronoq_store.model import (
    INT64_MAX,
    INT64_MIN,
    ById,
    ByKey,
    Dep,
    FixedStart,
    Priority,
    RecurringSpec,
    RetryPolicy,
    TaskSpec,
    TaskStatus,
    TimeBase,
)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Strings the store keeps faithfully: no NUL, no surrogates.
clean_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"))
any_text = st.text()
nonempty_clean = clean_text.filter(bool)

BASE_RANGE = 2**61
T_RANGE = 2**61  # |base| + |t| < 2**62: base + t always fits in int64
bases = st.builds(TimeBase, unix_ns=st.integers(-BASE_RANGE, BASE_RANGE))
times = st.integers(-T_RANGE, T_RANGE)
durations = st.integers(0, INT64_MAX)
int64s = st.integers(INT64_MIN, INT64_MAX)
ZONES = ("UTC", "Europe/Paris", "America/New_York", "Asia/Kolkata", "Australia/Lord_Howe")


@st.composite
def retries(draw: st.DrawFn) -> RetryPolicy:
    initial = draw(durations)
    return RetryPolicy(
        max_attempts=draw(st.integers(1, 2**31 - 1)),
        initial_backoff_ns=initial,
        max_backoff_ns=draw(st.integers(initial, INT64_MAX)),
        multiplier=draw(st.floats(1.0, 1e6, allow_nan=False)),
        jitter=draw(st.floats(0.0, 1.0)),
    )


fixed_starts = st.builds(
    FixedStart,
    at=times,
    tolerance_ns=durations,
    on_miss=st.sampled_from(["skip", "run", "fail"]),
)
refs = st.one_of(
    st.builds(ById, id=int64s),
    st.builds(ByKey, key=nonempty_clean.map(lambda s: s[: codec.KEY_MAX])),
)
deps = st.builds(Dep, target=refs, on=st.sampled_from(["success", "finish"]))


def specs(text: st.SearchStrategy[str] = clean_text) -> st.SearchStrategy[TaskSpec]:
    def short(limit: int) -> st.SearchStrategy[str]:
        return text.map(lambda s: s[:limit])

    return st.builds(
        TaskSpec,
        payload=st.binary(max_size=64),
        kind=short(codec.KIND_MAX),
        pool=short(codec.POOL_MAX).filter(bool),
        priority=st.sampled_from(Priority),
        key=st.none() | short(codec.KEY_MAX).filter(bool),
        deadline=st.none() | times,
        fixed_start=st.none() | fixed_starts,
        duration_hint_ns=st.none() | durations,
        timeout_ns=st.none() | durations,
        retry=st.none() | retries(),
        deps=st.lists(deps, max_size=4).map(tuple),
        resources=st.dictionaries(text, st.integers(0, INT64_MAX), max_size=4),
        tags=st.frozensets(text, max_size=4),
        labels=st.dictionaries(text, text, max_size=4),
        tenant=st.none() | short(codec.TENANT_MAX),
    )


@st.composite
def recurrings(draw: st.DrawFn) -> RecurringSpec:
    start = draw(st.none() | times)
    end = draw(st.none() | (times if start is None else st.integers(start, T_RANGE)))
    use_cron = draw(st.booleans())
    return RecurringSpec(
        name=draw(nonempty_clean),
        template=draw(specs()),
        cron=draw(st.sampled_from(["* * * * *", "0 */2 * * 1-5", "0 0 12 * * MON"]))
        if use_cron
        else None,
        interval_ns=None if use_cron else draw(st.integers(1, INT64_MAX)),
        timezone=draw(st.sampled_from(ZONES)),
        start=start,
        end=end,
        misfire=draw(st.sampled_from(["skip", "run_once", "run_all"])),
        overlap=draw(st.sampled_from(["allow", "skip"])),
    )


# Round trips.


@SETTINGS
@given(base=bases, spec=specs())
def test_spec_columns_round_trip(base: TimeBase, spec: TaskSpec) -> None:
    cols = codec.spec_columns(base, spec)
    assert set(cols) == set(codec.SPEC_COLUMNS)
    assert codec.spec_from_columns(base, cols) == spec


@SETTINGS
@given(base=st.builds(TimeBase, unix_ns=int64s), spec=specs(any_text))
def test_spec_values_are_spec_columns_in_order(base: TimeBase, spec: TaskSpec) -> None:
    """`spec_values` (enqueue_many's rows) is `spec_columns` as a tuple in `SPEC_COLUMNS`'
    order, and refuses what it refuses (a time out of range under a far base), alike."""
    try:
        columns = codec.spec_columns(base, spec)
    except InvalidValue as exc:
        message = str(exc)
    else:
        assert codec.spec_values(base, spec) == tuple(columns[n] for n in codec.SPEC_COLUMNS)
        return
    with pytest.raises(InvalidValue) as refused:
        codec.spec_values(base, spec)
    assert str(refused.value) == message


@pytest.mark.parametrize(
    "spec",
    [
        TaskSpec(payload=b"", pool="p" * (codec.POOL_MAX + 1)),
        TaskSpec(payload=b"", kind="é" * (codec.KIND_MAX + 1)),
        TaskSpec(payload=b"", key="k\x00" * codec.KEY_MAX),
        TaskSpec(payload=b"", tenant="t" * (codec.TENANT_MAX + 1)),
        TaskSpec(payload=b"", deadline=1),
        TaskSpec(payload=b"", fixed_start=FixedStart(at=1)),
        TaskSpec(payload=b"", deps=(Dep(target=ByKey(key="k" * (codec.KEY_MAX + 1))),)),
    ],
)
def test_spec_values_refuse_as_spec_columns_do(spec: TaskSpec) -> None:
    base = TimeBase(unix_ns=INT64_MAX)
    with pytest.raises(InvalidValue) as expected:
        codec.spec_columns(base, spec)
    with pytest.raises(InvalidValue) as refused:
        codec.spec_values(base, spec)
    assert str(refused.value) == str(expected.value)


@SETTINGS
@given(base=bases, r=recurrings())
def test_recurring_round_trip(base: TimeBase, r: RecurringSpec) -> None:
    text = codec.encode_recurring(base, r)
    assert codec.decode_recurring(base, r.name, text, r.template.payload) == r


@SETTINGS
@given(text=any_text)
def test_clean_properties(text: str) -> None:
    out = codec.clean(text)
    assert "\x00" not in out
    assert not any(0xD800 <= ord(c) <= 0xDFFF for c in out)
    assert len(out) == len(text)
    assert codec.clean(out) == out
    out.encode("utf-8")  # storable everywhere


@SETTINGS
@given(text=clean_text)
def test_clean_is_identity_on_clean_text(text: str) -> None:
    assert codec.clean(text) == text


@SETTINGS
@given(base=bases, spec=specs(any_text))
def test_unclean_strings_decode_cleaned(base: TimeBase, spec: TaskSpec) -> None:
    got = codec.spec_from_columns(base, codec.spec_columns(base, spec))
    c = codec.clean
    assert got.kind == c(spec.kind)
    assert got.pool == c(spec.pool)
    assert got.key == codec.clean_opt(spec.key)
    assert got.tenant == codec.clean_opt(spec.tenant)
    assert got.tags == frozenset(c(t) for t in spec.tags)
    assert got.labels == {c(k): c(v) for k, v in spec.labels.items()}
    assert got.resources == {c(k): v for k, v in spec.resources.items()}


@SETTINGS
@given(text=any_text)
def test_each_text_field_decodes_to_clean(text: str) -> None:
    base = TimeBase(unix_ns=0)
    spec = TaskSpec(
        payload=b"",
        kind=text[: codec.KIND_MAX],
        pool=text[: codec.POOL_MAX] or "p",
        key=text[: codec.KEY_MAX] or None,
        tags=frozenset({text}),
        labels={text: text},
        resources={text: 1},
        tenant=text[: codec.TENANT_MAX],
    )
    got = codec.spec_from_columns(base, codec.spec_columns(base, spec))
    assert got.kind == codec.clean(spec.kind)
    assert got.pool == codec.clean(spec.pool)
    assert got.key == codec.clean_opt(spec.key)
    assert got.tenant == codec.clean(spec.tenant or "")
    assert got.tags == {codec.clean(text)}
    assert got.labels == {codec.clean(text): codec.clean(text)}
    assert got.resources == {codec.clean(text): 1}


# Damaged values decode or raise CorruptValue, nothing else.

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | any_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4),
    max_leaves=12,
)
KEY_NAMES = st.sampled_from(
    [
        "id",
        "key",
        "on",
        "max_attempts",
        "initial_backoff_ns",
        "max_backoff_ns",
        "multiplier",
        "jitter",
        "cron",
        "interval_ns",
        "timezone",
        "start_unix_ns",
        "end_unix_ns",
        "misfire",
        "overlap",
        "template",
        "kind",
        "pool",
        "priority",
        "deadline_unix_ns",
        "fixed_start",
        "at_unix_ns",
        "tolerance_ns",
        "on_miss",
        "duration_hint_ns",
        "timeout_ns",
        "retry",
        "deps",
        "resources",
        "tags",
        "labels",
        "tenant",
    ]
)
shaped_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(["success", "finish", "skip", "UTC", "* * * * *", "x"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEY_NAMES, inner, max_size=8),
    max_leaves=20,
)


def _json_texts() -> st.SearchStrategy[Any]:
    return st.one_of(
        any_text,
        st.binary(max_size=16),
        st.none(),
        st.integers(),
        json_values.map(json.dumps),
        shaped_values.map(json.dumps),
    )


def _decodes_or_corrupt(fn: Any, *args: Any, again: Callable[[Any], Any]) -> bool:
    """`fn(*args)` is refused as `CorruptValue` (False), or returns a value the store could
    have written (True): encoding it and decoding that, `again(value)`, gives it back."""
    try:
        value = fn(*args)
    except CorruptValue:
        return False
    assert again(value) == value
    return True


_CODECS: tuple[tuple[Callable[[Any], Any], Callable[[Any], Any]], ...] = (
    (codec.decode_deps, jsonparts.encode_deps),
    (jsonparts.decode_retry, jsonparts.encode_retry),
    (jsonparts.decode_tags, jsonparts.encode_tags),
    (jsonparts.decode_labels, jsonparts.encode_labels),
    (jsonparts.decode_resources, jsonparts.encode_resources),
)
"""Each JSON column's decoder, and the encoder of what it returns."""


def _recurring_again(base: TimeBase, name: str) -> Callable[[RecurringSpec], RecurringSpec]:
    return lambda v: codec.decode_recurring(
        base, name, codec.encode_recurring(base, v), v.template.payload
    )


@SETTINGS
@given(text=_json_texts())
def test_damaged_json_columns(text: Any) -> None:
    for decode, encode in _CODECS:
        _decodes_or_corrupt(decode, text, again=lambda v, d=decode, e=encode: d(e(v)))
    base = TimeBase(unix_ns=0)
    again = _recurring_again(base, "n")
    _decodes_or_corrupt(codec.decode_recurring, base, "n", text, b"", again=again)


@SETTINGS
@given(r=recurrings(), data=st.data())
def test_damaged_recurring_from_valid(r: RecurringSpec, data: st.DataObject) -> None:
    """A valid encoding with one part replaced by garbage."""
    base = TimeBase(unix_ns=0)
    obj = json.loads(codec.encode_recurring(base, r))
    target = obj if data.draw(st.booleans()) else obj["template"]
    key = data.draw(st.sampled_from(sorted(target)))
    if data.draw(st.booleans()):
        del target[key]
    else:
        target[key] = data.draw(shaped_values)
    again = _recurring_again(base, r.name)
    _decodes_or_corrupt(codec.decode_recurring, base, r.name, json.dumps(obj), b"", again=again)


garbage_scalar = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | any_text | st.floats()


@SETTINGS
@given(spec=specs(), data=st.data())
def test_damaged_spec_columns(spec: TaskSpec, data: st.DataObject) -> None:
    base = TimeBase(unix_ns=0)
    row = codec.spec_columns(base, spec)
    for column in data.draw(st.lists(st.sampled_from(codec.SPEC_COLUMNS), max_size=4)):
        if column == "payload":
            row[column] = data.draw(st.none() | st.binary(max_size=8))
        elif column in ("retry", "deps", "resources", "tags", "labels"):
            row[column] = data.draw(_json_texts())
        else:
            row[column] = data.draw(garbage_scalar)
    again = lambda v: codec.spec_from_columns(base, codec.spec_columns(base, v))  # noqa: E731
    _decodes_or_corrupt(codec.spec_from_columns, base, row, again=again)


# Model validation: refused at construction, the message naming the field.

OK_SPEC = TaskSpec(payload=b"")


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: FixedStart(at=0, tolerance_ns=-1), "FixedStart.tolerance_ns"),
        (lambda: TaskSpec(payload=b"", duration_hint_ns=-1), "TaskSpec.duration_hint_ns"),
        (lambda: TaskSpec(payload=b"", timeout_ns=-5), "TaskSpec.timeout_ns"),
        (lambda: RetryPolicy(initial_backoff_ns=-1), "RetryPolicy.initial_backoff_ns"),
        (lambda: RetryPolicy(max_backoff_ns=-1), "RetryPolicy.max_backoff_ns"),
        (lambda: RetryPolicy(max_attempts=0), "RetryPolicy.max_attempts"),
        (lambda: RetryPolicy(multiplier=0.5), "RetryPolicy.multiplier"),
        (lambda: RetryPolicy(jitter=float("nan")), "RetryPolicy.jitter"),
        (lambda: FixedStart(at=0, on_miss="later"), "FixedStart.on_miss"),
        (
            lambda: RecurringSpec(name="n", template=OK_SPEC, cron="* * * * *", misfire="x"),
            "RecurringSpec.misfire",
        ),
        (
            lambda: RecurringSpec(name="n", template=OK_SPEC, cron="* * * * *", overlap="x"),
            "RecurringSpec.overlap",
        ),
        (lambda: Dep(target=ById(id=1), on="start"), "Dep.on"),
        (lambda: TaskSpec(payload=b"", priority=1), "TaskSpec.priority"),
        (lambda: Dep(target=1), "Dep.target"),
        (lambda: Dep(target="key"), "Dep.target"),
        (lambda: RecurringSpec(name="n", template=OK_SPEC, cron="* * * *"), "RecurringSpec.cron"),
        (
            lambda: RecurringSpec(name="n", template=OK_SPEC, cron="* * * * *", interval_ns=5),
            "RecurringSpec",
        ),
        (lambda: RecurringSpec(name="n", template=OK_SPEC), "RecurringSpec"),
        (
            lambda: RecurringSpec(name="n", template=OK_SPEC, interval_ns=0),
            "RecurringSpec.interval_ns",
        ),
        (
            lambda: RecurringSpec(name="n", template=OK_SPEC, interval_ns=1, timezone="Mars/Base"),
            "RecurringSpec.timezone",
        ),
        (
            lambda: RecurringSpec(name="n", template=OK_SPEC, interval_ns=1, timezone="../etc"),
            "RecurringSpec.timezone",
        ),
        (lambda: TimeBase(unix_ns=2**63), "TimeBase.unix_ns"),
        (lambda: TaskSpec(payload=b"", deadline=2**64), "TaskSpec.deadline"),
        (lambda: FixedStart(at=2**63), "FixedStart.at"),
        (lambda: ById(id=True), "ById.id"),
        (lambda: TaskSpec(payload=b"", timeout_ns=False), "TaskSpec.timeout_ns"),
        (lambda: RetryPolicy(max_attempts=True), "RetryPolicy.max_attempts"),
        (lambda: TaskSpec(payload=b"", resources={"cpu": True}), "TaskSpec.resources"),
        (lambda: TaskSpec(payload=b"", resources={"cpu": -1}), "TaskSpec.resources"),
        (lambda: RetryPolicy(jitter=True), "RetryPolicy.jitter"),
    ],
)
def test_invalid_values_refused(build: Any, field: str) -> None:
    with pytest.raises(InvalidValue, match=field.replace(".", r"\.").replace("[", r"\[")):
        build()


def test_to_unix_out_of_range() -> None:
    with pytest.raises(InvalidValue, match=r"TaskSpec\.deadline"):
        codec.to_unix(TimeBase(unix_ns=INT64_MAX), 1, "TaskSpec.deadline")
    with pytest.raises(InvalidValue, match=r"FixedStart\.at"):
        codec.to_unix(TimeBase(unix_ns=INT64_MIN), -1, "FixedStart.at")
    assert codec.to_unix(TimeBase(unix_ns=INT64_MAX), 0) == INT64_MAX
    with pytest.raises(InvalidValue, match=r"TaskSpec\.deadline"):
        codec.spec_columns(TimeBase(unix_ns=INT64_MAX), TaskSpec(payload=b"", deadline=1))


def test_bounded_too_long() -> None:
    assert codec.bounded("TaskSpec.key", "é" * codec.KEY_MAX, codec.KEY_MAX) == "é" * 512
    with pytest.raises(InvalidValue, match=r"TaskSpec\.key"):
        codec.bounded("TaskSpec.key", "k" * (codec.KEY_MAX + 1), codec.KEY_MAX)
    with pytest.raises(InvalidValue, match=r"TaskSpec\.pool"):
        codec.spec_columns(TimeBase(unix_ns=0), TaskSpec(payload=b"", pool="p" * 129))


def test_priority_from_index() -> None:
    assert Priority.from_index(99) is Priority.NORMAL
    assert Priority.from_index(-1) is Priority.NORMAL
    for p in Priority:
        assert Priority.from_index(int(p)) is p


def test_status_from_name() -> None:
    assert TaskStatus.from_name("nope") is None
    assert TaskStatus.from_name("QUEUED") is TaskStatus.QUEUED
    assert TaskStatus.from_name("queued") is TaskStatus.QUEUED
    for s in TaskStatus:
        assert TaskStatus.from_name(s.value) is s


def test_is_terminal() -> None:
    terminal = {"succeeded", "failed", "cancelled", "expired", "skipped"}
    for s in TaskStatus:
        assert s.is_terminal == (s.value in terminal), s


@pytest.mark.parametrize(
    ("template", "why"),
    [
        (TaskSpec(payload=b"", kind="k" * 256), "template kind is 256 characters long"),
        (TaskSpec(payload=b"", pool="p" * 129), "template pool is 129 characters long"),
        (TaskSpec(payload=b"", key="x" * 513), "template key is 513 characters long"),
        (TaskSpec(payload=b"", deadline=2**62), f"template deadline {2**62} is out"),
        (
            TaskSpec(payload=b"", fixed_start=FixedStart(at=2**62)),
            f"template fixed_start {2**62} is out",
        ),
    ],
    ids=["kind", "pool", "key", "deadline", "fixed_start"],
)
def test_a_schedule_template_that_cannot_be_stored_is_refused_naming_the_field(
    template: TaskSpec, why: str
) -> None:
    """Refused before any write, the message naming the template's field (docs/guarantees.md,
    "Bad values write nothing")."""
    spec = RecurringSpec(name="s", template=template, interval_ns=10**9)
    with pytest.raises(InvalidValue) as refused:
        codec.encode_recurring(TimeBase(unix_ns=2**62), spec)  # 2**62 later: out of range
    assert str(refused.value).startswith(why), refused.value
