"""The dashboard in a real headless Chromium (Debian's `chromium`, driven by Playwright; no
browser is downloaded): the overview counts the lease down and says "no leader" once it
expires, a failed task's link leads to its page, a hostile message stays text and raises no
dialog, and 250 tasks page through. SQLite only: the pages' SQL is tested on every dialect in
test_web.py; this is about what the browser does with them.

`scripts/browser setup` installs chromium (`make test` runs it). Without it, or without
Playwright, these tests skip on a laptop and fail under CI / CRONOQ_REQUIRE_DIALECTS.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from builders import BASE
from sqlalchemy import URL
from webserver import serve

from cronoq_store import (
    SqlStore,
    StatusChanged,
    StoreConfig,
    Submitted,
    TaskId,
    TaskSpec,
    TaskStatus,
    lease,
)
from cronoq_store import cli as cli_module
from cronoq_store.web.app import create_app

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("CRONOQ_CHROMIUM", "/usr/bin/chromium")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
"""The machine's launch flags for Chromium (with a new, empty user-data-dir each run)."""
EVIL = "<img src=x onerror=alert(1)>"
TTL = timedelta(seconds=4)


def _missing(why: str) -> None:
    if os.environ.get("CRONOQ_REQUIRE_DIALECTS") or os.environ.get("CI"):
        pytest.fail(f"{why}: run scripts/browser setup (make test does)", pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A Chromium context of its own (a new empty profile), closed after the module."""
    if not os.access(CHROMIUM, os.X_OK):
        _missing(f"no Chromium at {CHROMIUM}")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("Playwright is not installed (the dev extra has it)")
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            tmp_path_factory.mktemp("chromium-profile"),
            executable_path=CHROMIUM,
            headless=True,
            args=FLAGS,
        )
        try:
            yield context
        finally:
            context.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A new tab; any dialog it raises is recorded (and dismissed) in `page.dialogs`."""
    tab = browser.new_page()
    tab.dialogs = []

    def dialog(d: Any) -> None:
        tab.dialogs.append(d.message)
        d.dismiss()

    tab.on("dialog", dialog)
    tab.set_default_timeout(10_000)
    try:
        yield tab
    finally:
        tab.close()


@pytest.fixture
def db(tmp_path: Path) -> URL:
    return URL.create("sqlite", database=str(tmp_path / "web.db"))


@pytest.fixture
def site(db: URL) -> Iterator[tuple[str, SqlStore]]:
    """The dashboard (refreshing every second) over a store holding 250 tasks of pool "many"
    and a failed task with a hostile message, whose lease a leader "worker-1" took for 4 s
    and never renews (as if it died at once)."""
    config = StoreConfig(lease_ttl=TTL, lease_renew=timedelta(seconds=1))
    with SqlStore.open(db, config) as store:
        epoch = store.acquire_leadership()
        store.commit(
            epoch,
            BASE,
            [
                Submitted(id=TaskId(i), seq=i, arrival=i, spec=TaskSpec(payload=b"p", pool="many"))
                for i in range(1, 251)
            ]
            + [
                Submitted(
                    id=TaskId(300),
                    seq=300,
                    arrival=0,
                    spec=TaskSpec(payload=b"\x00<b>", pool="mail", key="welcome-7", kind="email"),
                ),
                StatusChanged(
                    id=TaskId(300), status=TaskStatus.FAILED, attempt=3, at=1, message=EVIL
                ),
            ],
        )
        store.release_leadership()
        with store.engine.begin() as conn:
            taken = lease.take(conn, holder="worker-1", ttl_ns=int(TTL.total_seconds() * 1e9))
            assert taken is not None
        target = cli_module.Target(url=str(db.database), schema=None)
        with (
            cli_module.open_database(target) as reader,
            serve(create_app(reader.engine, refresh_s=1.0)) as base,
        ):
            yield base, store


def countdown(page: Any) -> float:
    text = page.locator("#lease .countdown").inner_text()
    match = re.fullmatch(r"(\d+\.\d) s", text)
    assert match, text
    return float(match.group(1))


def test_overview_counts_the_lease_down_then_says_no_leader(
    page: Any, site: tuple[str, SqlStore]
) -> None:
    from playwright.sync_api import expect

    base, _store = site
    page.goto(base + "/")
    expect(page.locator("#lease .leader")).to_be_visible()
    expect(page.locator("#lease .no-leader")).to_be_hidden()
    first = countdown(page)
    assert 0 < first <= TTL.total_seconds()
    expect(page.locator("#lease .countdown")).not_to_have_text(f"{first:.1f} s")
    assert countdown(page) < first  # counting down, between the page's refreshes
    # The page refreshes itself in place (no reload): the marker the script sets appears.
    expect(page.locator("#overview[data-refreshed]")).to_have_count(1)
    assert page.evaluate("performance.getEntriesByType('navigation').length") == 1
    expect(page.locator("#lease .no-leader")).to_be_visible(timeout=15_000)
    expect(page.locator("#lease .no-leader")).to_have_css("color", "rgb(204, 0, 0)")
    expect(page.locator("#lease")).not_to_contain_text("held by", timeout=5_000)
    assert page.dialogs == []


def test_failed_task_link_and_a_hostile_message(page: Any, site: tuple[str, SqlStore]) -> None:
    from playwright.sync_api import expect

    base, _store = site
    page.goto(base + "/")
    page.locator("#finished a", has_text="failed").click()
    expect(page).to_have_url(base + "/tasks?status=failed")
    expect(page.locator("#tasks td.message")).to_have_text(EVIL)
    page.locator("a.task", has_text="300").click()
    expect(page).to_have_url(base + "/tasks/300")
    expect(page.locator("#status")).to_have_text("failed")
    expect(page.locator("#message")).to_have_text(EVIL)  # shown as text
    assert page.locator("img").count() == 0  # never made an element
    expect(page.locator("#payload code")).to_have_text("00 3c 62 3e")  # bytes as hex only
    page.wait_for_load_state("load")
    assert page.dialogs == []  # no alert(1)


def test_pages_through_250_tasks(page: Any, site: tuple[str, SqlStore]) -> None:
    base, _store = site
    page.goto(base + "/tasks?pool=many")
    seen: list[int] = []
    for _ in range(10):
        seen += [int(t) for t in page.locator("a.task").all_inner_texts()]
        older = page.locator("#older")
        if older.count() == 0:
            break
        older.click()
        page.wait_for_load_state()
    assert seen == list(range(250, 0, -1))  # five pages of 50, newest first, none twice


def test_screenshots_command(tmp_path: Path, browser: Any) -> None:
    """`scripts/dashboard-screenshots DIR` (the docs' pictures) writes both PNGs."""
    out = tmp_path / "shots"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "dashboard-screenshots"), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"CRONOQ_CHROMIUM": CHROMIUM},
    )
    assert done.returncode == 0, done.stderr
    for name in ("dashboard-overview.png", "dashboard-task.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
    assert shutil.which("chromium") or os.access(CHROMIUM, os.X_OK)
