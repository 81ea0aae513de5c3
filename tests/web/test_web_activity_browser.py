"""The dashboard's activity charts and task page in a real headless Chromium (issue 42): the
server-drawn SVG renders with its bars, no request leaves the dashboard's origin, the page
raises no CSP violation, and a long JSON payload's "show all" opens in place. SQLite only, as
test_web_browser.py (whose Chromium fixtures this uses)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import test_web_browser
from sqlalchemy import URL
from webserver import serve

from cronoq_store import (
    SqlStore,
    StatusChanged,
    Submitted,
    TaskId,
    TaskSpec,
    TaskStatus,
    TimeBase,
)
from cronoq_store import cli as cli_module
from cronoq_store.web.app import create_app

pytestmark = pytest.mark.browser
browser = test_web_browser.browser  # its Chromium and tab fixtures, used here by name
page = test_web_browser.page
MINUTE = 60 * 10**9


@pytest.fixture
def site(tmp_path: Path) -> Iterator[str]:
    """A store whose last hour holds 40 submissions and their finishes (every fifth failed),
    and a task with a long JSON payload."""
    db = URL.create("sqlite", database=str(tmp_path / "web.db"))
    base = TimeBase(unix_ns=time.time_ns())
    with SqlStore.open(db) as store:
        epoch = store.acquire_leadership()
        batch: list[Any] = []
        for i in range(1, 41):
            at = -(41 - i) * MINUTE
            batch.append(Submitted(id=TaskId(i), seq=i, arrival=at, spec=TaskSpec(payload=b"x")))
            st = TaskStatus.FAILED if i % 5 == 0 else TaskStatus.SUCCEEDED
            batch.append(StatusChanged(id=TaskId(i), status=st, attempt=1, at=at + 10**9))
        big = json.dumps({"rows": [{"n": i, "text": f"row {i}"} for i in range(300)]})
        batch.append(
            Submitted(id=TaskId(100), seq=100, arrival=0, spec=TaskSpec(payload=big.encode()))
        )
        store.commit(epoch, base, batch)
        store.release_leadership()
    target = cli_module.Target(url=str(db.database), schema=None)
    with cli_module.open_database(target) as reader, serve(create_app(reader.engine)) as url:
        yield url


def test_the_charts_render_in_chromium(page: Any, site: str) -> None:
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    console: list[str] = []
    page.on("console", lambda m: console.append(m.text))
    page.goto(site + "/")
    for chart in ("#chart-hour", "#chart-day"):
        box = page.locator(chart).bounding_box()
        assert box is not None and box["width"] > 300 and box["height"] > 80, (chart, box)
    bars = page.locator("#chart-hour rect")
    assert bars.count() == 40  # one bar per finished minute (each minute one task)
    heights = [float(bars.nth(i).get_attribute("height") or 0) for i in range(bars.count())]
    assert all(h > 0 for h in heights)
    failed = page.locator("#chart-hour rect.bar-failed")
    assert failed.count() == 8
    colour = failed.first.evaluate("e => getComputedStyle(e).fill")
    assert colour not in ("", "none", "rgb(0, 0, 0)"), colour  # the stylesheet's colour
    assert page.locator("#chart-hour polyline").count() == 1
    assert all(r.startswith(site) for r in requests), requests
    assert not [m for m in console if "Content Security Policy" in m], console
    assert "succeeded 32" in " ".join(page.locator("#finished-hour").inner_text().split())


def test_show_all_of_a_long_json_payload(page: Any, site: str) -> None:
    page.goto(site + "/tasks/100")
    assert '"row 299"' not in page.locator("#payload-json").inner_text()
    more = page.locator("#payload-more")
    assert not more.locator("pre").is_visible()
    more.locator("summary").click()
    assert more.locator("pre").is_visible()
    assert '"row 299"' in more.locator("pre").inner_text()
