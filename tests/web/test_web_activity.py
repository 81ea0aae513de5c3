"""The dashboard over time (issue 42), at the HTTP level on every dialect: the activity charts
(server-drawn SVG), the finished counts by status, and the task page's decoded JSON payload,
human durations, hidden unset fields and millisecond timestamps."""

from __future__ import annotations

import html
import json
import re
import time
from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy import URL
from test_web import EVIL, cell, get, make_client

from cronoq_store import (
    RetryPolicy,
    SqlStore,
    StatusChanged,
    Submitted,
    TaskId,
    TaskSpec,
    TaskStatus,
    TimeBase,
)
from cronoq_store.web import views

MINUTE = 60 * 10**9
FAR = 10**15  # ids far apart, as epoch-prefixed ids are: the id search must not walk them


@pytest.fixture
def activity(store: SqlStore) -> int:
    """Tasks around now: 2 submitted two days ago (outside both charts), 3 submitted 5 minutes
    ago of which 2 succeeded and 1 failed 2 minutes ago, and one submitted 3 hours ago still
    queued. Returns the current time (ns)."""
    now = time.time_ns()
    base = TimeBase(unix_ns=now)
    epoch = store.acquire_leadership()
    spec = TaskSpec(payload=b"x")

    def sub(i: int, at: int) -> Submitted:
        return Submitted(id=TaskId(i), seq=i, arrival=at, spec=spec)

    def done(i: int, st: TaskStatus, at: int) -> StatusChanged:
        return StatusChanged(id=TaskId(i), status=st, attempt=1, at=at)

    store.commit(
        epoch,
        base,
        [
            sub(1, -2 * 24 * 60 * MINUTE),
            sub(2, -2 * 24 * 60 * MINUTE + 1),
            sub(FAR, -180 * MINUTE),
            sub(2 * FAR, -5 * MINUTE),
            sub(2 * FAR + 1, -5 * MINUTE),
            sub(3 * FAR, -5 * MINUTE),
            done(2 * FAR, TaskStatus.SUCCEEDED, -2 * MINUTE),
            done(2 * FAR + 1, TaskStatus.SUCCEEDED, -2 * MINUTE),
            done(3 * FAR, TaskStatus.FAILED, -2 * MINUTE),
        ],
    )
    store.release_leadership()
    return now


@pytest.fixture
def client(db_url: URL, activity: int) -> Iterator[httpx.Client]:
    yield from make_client(db_url)


def test_the_overview_draws_the_last_hour_and_day(client: httpx.Client, activity: int) -> None:
    page = get(client, "/").text
    hour = re.search(r'<svg id="chart-hour".*?</svg>', page, re.S)
    day = re.search(r'<svg id="chart-day".*?</svg>', page, re.S)
    assert hour and day, page[:3000]
    for svg in (hour.group(0), day.group(0)):
        assert "<script" not in svg and "href" not in svg
        assert "<title>2 succeeded</title>" in svg and "<title>1 failed</title>" in svg
        assert "<polyline" in svg
    assert "(3 submitted, 3 finished)" in page  # the hour: the task 3 hours ago is not in it
    assert "4 submitted; finished: succeeded 2, failed 1" in page  # the day: it is
    assert "<script src=" not in page.split("<main>")[-1]  # nothing fetched for the charts
    assert "http" not in hour.group(0).replace("http://www.w3.org/2000/svg", "")
    finished = cell(page, "finished-hour")
    assert "succeeded 2" in " ".join(finished.split()) and "failed 1" in " ".join(finished.split())


def test_submissions_per_minute_find_the_window_by_id(store: SqlStore, activity: int) -> None:
    """The id search lands on the first task of the window across id gaps of 10**15, and
    the per-minute counts put each task in its minute."""
    with store.engine.connect() as conn:
        since = activity - 60 * MINUTE
        assert views.first_id_since(conn, since) == 2 * FAR
        assert views.first_id_since(conn, activity - 4 * 60 * MINUTE) == FAR
        assert views.first_id_since(conn, activity + MINUTE) is None
        day = views.activity(conn, minutes=views.DAY_MINUTES, now_ns=activity)
    submitted = day["submitted"]
    assert sum(submitted) == 4 and submitted[-6] + submitted[-5] == 3  # 5 minutes ago
    assert sum(day["finished"]["succeeded"]) == 2 and sum(day["finished"]["failed"]) == 1


def test_the_task_page_reads_for_people(db_url: URL, store: SqlStore) -> None:
    """JSON payloads decoded (escaped, cut with a way to see all), durations in units,
    unset fields hidden, times to the millisecond."""
    epoch = store.acquire_leadership()
    small = json.dumps({"order": 7, "note": EVIL}).encode()
    big = json.dumps({"lines": [f"line {i}" for i in range(400)]}).encode()
    base = TimeBase(unix_ns=time.time_ns())
    store.commit(
        epoch,
        base,
        [
            Submitted(id=TaskId(1), seq=1, arrival=0, spec=TaskSpec(payload=small, retry=RetryPolicy(), timeout_ns=90 * 10**9)),  # noqa: E501
            Submitted(id=TaskId(2), seq=2, arrival=0, spec=TaskSpec(payload=big)),
            Submitted(id=TaskId(3), seq=3, arrival=0, spec=TaskSpec(payload=b"\x00\xff binary")),
        ],
    )  # fmt: skip
    store.release_leadership()
    for client in make_client(db_url):
        one = get(client, "/tasks/1").text
        assert '"order": 7' in html.unescape(one) and "&lt;img src=x" in one  # decoded, escaped
        assert cell(one, "retry").strip() == "3 attempts, 1 s-60 s x2"
        assert cell(one, "timeout").strip() == "90 s"
        for unset in ("deadline", "fixed start", "dependencies", "tags", "labels", "output"):
            assert f"<th>{unset}</th>" not in one, unset
        times = re.findall(r"\d{4}-\d\d-\d\dT[\d:.]+Z", one)
        assert times and all(re.fullmatch(r".*:\d\d\.\d{3}Z", t) for t in times), times
        two = get(client, "/tasks/2").text
        assert 'id="payload-more"' in two and "show all (" in two
        assert '"line 399"' in html.unescape(two)
        shown = re.search(r'id="payload-json">(.*?)</pre>', two, re.S)
        assert shown and '"line 399"' not in html.unescape(
            shown.group(1)
        )  # cut, the rest behind "show all"
        three = get(client, "/tasks/3").text
        assert 'id="payload-json"' not in three and "00 ff 20 62" in three  # hex, as before


def test_durations_for_people() -> None:
    assert views.duration_text(1_000_000_000) == "1 s"
    assert views.duration_text(60 * 10**9) == "60 s"
    assert views.duration_text(250 * 10**6) == "250 ms"
    assert views.duration_text(300 * 10**9) == "5 min"
    assert views.duration_text(2 * 3600 * 10**9) == "2 h"
    assert views.duration_text(3 * 86400 * 10**9) == "3 d"
    assert views.ms("2026-12-02T15:11:51.639024Z") == "2026-12-02T15:11:51.639Z"
