"""`cronoq-store web` at the HTTP level, on every dialect: each page, its filters and paging,
the security rules (token, headers, 405s, escaping, no password), and that it never writes.

The app is built as the command builds it (`cli.open_database` then `create_app`), on a database
holding a known set of tasks. On PostgreSQL the URL carries a password (the local server
trusts, so it is accepted and ignored), so every "no password" assertion is a real one there.
"""

from __future__ import annotations

import html
import os
import re
import socket
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from datetime import timedelta
from html.parser import HTMLParser
from pathlib import Path

import builders
import httpx
import pytest
from builders import BASE
from sqlalchemy import URL, create_engine, insert, select
from webserver import serve

from cronoq_store import (
    ByKey,
    Dep,
    RecurringNext,
    RecurringSpec,
    RecurringUpsert,
    SqlStore,
    StatusChanged,
    StoreConfig,
    Submitted,
    TaskId,
    TaskSpec,
    TaskStatus,
    enqueue,
    migrate,
)
from cronoq_store import cli as cli_module
from cronoq_store.schema import inbox_rejects, leader, tasks
from cronoq_store.testing.statements import after_statements
from cronoq_store.web import app as web_app
from cronoq_store.web import views

PASSWORD = "s3cr3t-pw"
EVIL = "<img src=x onerror=alert(1)>"
OLD = BASE  # November 2023: past any retention
TTL = timedelta(seconds=30)
CSP_SCRIPT = "script-src 'self'"


def url_with_password(db_url: URL) -> str:
    if db_url.get_backend_name() == "postgresql":
        db_url = db_url.set(password=PASSWORD)
    return db_url.render_as_string(hide_password=False)


def submit(i: int, pool: str = "a", **kw: object) -> Submitted:
    return builders.submit(i, bytes(range(i % 256)) * 2, pool=pool, **kw)


def moved(i: int, st: TaskStatus, message: str | None = None) -> StatusChanged:
    return builders.status(i, st, message, attempt=2, at=100)


@pytest.fixture
def store_config() -> StoreConfig:
    return StoreConfig(lease_ttl=TTL)


@pytest.fixture
def store(store: SqlStore, dialect: str) -> SqlStore:
    """A store that leads, holding: pool a: 1 succeeded (output "0123456789", kind "email",
    label, tag), 2 failed (key "k2", message EVIL), 3 queued (key "k3", depends on key "k2");
    pool b: 4 cancelled, 5 running (kind EVIL, key EVIL, tag and label EVIL); a schedule
    "nightly" whose last task is 1; one inbox item and one row set aside."""
    epoch = store.acquire_leadership()
    sched = RecurringSpec(
        name="nightly",
        template=TaskSpec(payload=b"t", pool="b"),
        cron="0 3 * * *",
        timezone="Europe/Paris",
    )
    store.commit(
        epoch,
        OLD,
        [
            submit(1, kind="email", labels={"team": "x"}, tags=frozenset({"urgent"})),
            submit(2, key="k2"),
            submit(4, pool="b"),
            moved(1, TaskStatus.SUCCEEDED),
            moved(2, TaskStatus.FAILED, EVIL),
            moved(4, TaskStatus.CANCELLED),
            submit(3, key="k3", deps=(Dep(target=ByKey(key="k2"), on="finish"),)),
            submit(5, pool="b", kind=EVIL, key=EVIL, labels={EVIL: EVIL}, tags={EVIL}),
            moved(5, TaskStatus.RUNNING, EVIL),
            RecurringUpsert(spec=sched),
            RecurringNext(name="nightly", next=10**9, last=TaskId(1)),
        ],
        outputs=[(TaskId(1), b"0123456789")],
    )
    with store.engine.begin() as conn:
        enqueue(conn, TaskSpec(payload=b"x", pool="c", kind="mail", key="in-1"))
        conn.execute(
            insert(inbox_rejects).values(
                inbox_id=99,
                enqueued_unix_ns=time.time_ns(),
                rejected_unix_ns=time.time_ns(),
                reason=f"bad spec {EVIL}",
                payload=b"\x00",
                fields="{}",
            )
        )
    return store


def make_client(db_url: URL, **options: object) -> Iterator[httpx.Client]:
    """A client of the app the command serves for `db_url` (a URL with a password)."""
    target = cli_module.Target(url=url_with_password(db_url), schema=None)
    with cli_module.open_database(target) as reader:
        app = web_app.create_app(reader.engine, **options)  # type: ignore[arg-type]
        with serve(app) as base, httpx.Client(base_url=base, timeout=30) as client:
            yield client


@pytest.fixture
def client(db_url: URL, store: SqlStore) -> Iterator[httpx.Client]:
    yield from make_client(db_url)


def get(client: httpx.Client, path: str, code: int = 200, **kw: object) -> httpx.Response:
    """GET `path`; check the status, the security headers, and that no password shows."""
    response = client.get(path, **kw)  # type: ignore[arg-type]
    assert response.status_code == code, (path, response.text[:2000])
    secured(response)
    return response


def secured(response: httpx.Response) -> None:
    csp = response.headers["content-security-policy"]
    assert CSP_SCRIPT in csp and "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert "default-src 'none'" in csp
    assert response.headers["x-content-type-options"] == "nosniff"
    assert PASSWORD not in response.text
    assert EVIL not in response.text  # task data is escaped wherever it shows


def cell(page: str, element_id: str) -> str:
    """The text inside the element with `element_id` (up to its closing tag), tags removed."""
    match = re.search(rf'id="{element_id}"[^>]*>(.*?)</(td|div|p|table|section)>', page, re.S)
    assert match, element_id
    return html.unescape(re.sub(r"<[^>]+>", " ", match.group(1)))


class _Table(HTMLParser):
    """The rows of the table with a given id, as lists of cell texts."""

    def __init__(self, element_id: str) -> None:
        super().__init__()
        self.element_id, self.inside, self.rows = element_id, False, []
        self.cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table" and ("id", self.element_id) in attrs:
            self.inside = True
        elif self.inside and tag == "tr":
            self.rows.append([])
        elif self.inside and tag in ("td", "th"):
            self.cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self.inside = False
        elif self.inside and tag in ("td", "th") and self.cell is not None:
            self.rows[-1].append(squash("".join(self.cell)))
            self.cell = None

    def handle_data(self, data: str) -> None:
        if self.cell is not None:
            self.cell.append(data)


def table(page: str, element_id: str) -> list[list[str]]:
    parser = _Table(element_id)
    parser.feed(page)
    assert parser.rows, f"no table {element_id!r}"
    return parser.rows


def squash(text: str) -> str:
    """Whitespace made single spaces, none before punctuation that followed a tag."""
    return re.sub(r" ([,;)])", r"\1", " ".join(text.split()))


def test_overview(client: httpx.Client, store: SqlStore, dialect: str) -> None:
    page = get(client, "/").text
    assert f"<code>{migrate.head_revision()}</code> (head)" in page
    lease = squash(cell(page, "lease"))
    assert f"epoch 1, held by {store.holder}, expires in" in lease, lease
    assert re.search(r"expires in \d+\.\d s", lease), lease
    assert 'data-expires-in="' in page
    assert table(page, "live") == [["pool", "queued", "running"], ["a", "1", ""], ["b", "", "1"]]
    assert 'href="/tasks?pool=b&amp;status=running"' in page
    finished = squash(cell(page, "finished"))
    assert finished.startswith("Finished 3 finished; 3 past the retention (3600 s)"), finished
    assert "1 waiting" in squash(cell(page, "inbox")) and "1 set aside" in cell(page, "inbox")
    assert "1 schedules" in squash(cell(page, "schedules"))
    if dialect == "postgresql":
        assert "primary" in cell(page, "server")
    else:
        assert 'id="server"' not in page
    part = get(client, "/overview.part").text
    assert "<html" not in part and 'id="lease"' in part and 'id="live"' in part


def test_overview_says_no_leader(db_url: URL, store: SqlStore) -> None:
    store.release_leadership()
    for client in make_client(db_url):
        assert "no leader" in squash(cell(get(client, "/").text, "lease"))
    with store.engine.begin() as conn:  # a lease whose holder stopped renewing a while ago
        conn.execute(leader.update().values(holder="gone", epoch=7, expires_unix_ns=1))
    for client in make_client(db_url):
        lease = squash(cell(get(client, "/").text, "lease"))
        assert lease.startswith("Lease no leader (epoch 7, gone, expired"), lease


def ids(page: str) -> list[int]:
    return [int(i) for i in re.findall(r'<a class="task" href="/tasks/(-?\d+)">', page)]


def test_tasks_filters(client: httpx.Client) -> None:
    assert ids(get(client, "/tasks").text) == [5, 4, 3, 2, 1]  # newest first
    assert ids(get(client, "/tasks?pool=a").text) == [3, 2, 1]
    assert ids(get(client, "/tasks?status=failed").text) == [2]
    assert ids(get(client, "/tasks?status=failed&pool=b").text) == []
    assert ids(get(client, "/tasks?kind=email").text) == [1]
    assert ids(get(client, "/tasks?key=k3").text) == [3]
    assert ids(get(client, "/tasks", params={"key": EVIL}).text) == [5]
    assert ids(get(client, "/tasks", params={"kind": EVIL, "pool": "b"}).text) == [5]
    assert ids(get(client, "/tasks?pool=&status=&before=").text) == [5, 4, 3, 2, 1]
    page = get(client, "/tasks?status=failed").text
    assert "<option selected>failed</option>" in page
    assert html.escape(EVIL) in page  # the failed task's message, as text
    assert "no tasks match" in get(client, "/tasks?pool=nope").text
    for bad, why in (
        ("status=done", "unknown status 'done'"),
        ("limit=0", "limit must be between 1 and 500"),
        ("limit=501", "limit must be between 1 and 500"),
        ("before=x", "before must be a whole number"),
        ("limit=1e3", "limit must be a whole number"),
    ):
        assert squash(cell(get(client, f"/tasks?{bad}", 400).text, "error")) == why


def test_tasks_paging(db_url: URL, store: SqlStore) -> None:
    epoch = store.acquire_leadership()
    store.commit(epoch, OLD, [submit(i, pool="many") for i in range(10, 260)])
    for client in make_client(db_url):
        seen: list[int] = []
        path = "/tasks?pool=many&limit=100"
        pages = 0
        while True:
            page = get(client, path).text
            pages += 1
            seen += ids(page)
            older = re.search(r'id="older" href="([^"]+)"', page)
            if older is None:
                break
            path = html.unescape(older.group(1))
            assert "pool=many" in path and "limit=100" in path  # filters carry over
            assert 'id="newest"' in get(client, path).text
        assert pages == 3
        assert seen == list(range(259, 9, -1))  # all 250, newest first, none twice
        # An exact multiple: the last full page offers no empty older page.
        assert 'id="older"' not in get(client, "/tasks?pool=many&limit=50&before=60").text


def test_task_page(client: httpx.Client) -> None:
    page = get(client, "/tasks/1").text
    assert squash(cell(page, "status")) == "succeeded"
    assert squash(cell(page, "output")) == "10 B 30 31 32 33 34 35 36 37 38 39"
    assert squash(cell(page, "payload")).startswith("2 B 00 00")
    assert squash(cell(page, "tags")) == "urgent" and squash(cell(page, "labels")) == "team = x"
    page = get(client, "/tasks/3").text
    assert 'href="/tasks?key=k2"' in page and "(on finish)" in page
    page = get(client, "/tasks/2").text
    assert cell(page, "message") == EVIL and html.escape(EVIL) in page
    big = get(client, "/tasks/5").text  # 10 bytes repeated: 20 bytes, no preview cut
    for where in ("key", "message", "tags", "labels"):
        assert EVIL in cell(big, where), where
    assert "<img" not in big
    for missing in ("99", "abc", str(2**63), "-1"):
        assert "no" in get(client, f"/tasks/{missing}", 404).text


def test_payload_preview_is_short_hex(db_url: URL, store: SqlStore) -> None:
    epoch = store.acquire_leadership()
    script = b"<script>alert(1)</script>" * 1000
    store.commit(
        epoch,
        OLD,
        [Submitted(id=TaskId(50), seq=50, arrival=0, spec=TaskSpec(payload=script))],
    )
    for client in make_client(db_url):
        page = get(client, "/tasks/50").text
        preview = squash(cell(page, "payload"))
        assert preview == "24.4 KiB " + script[:32].hex(" ") + " …", preview
        assert "<script>alert" not in page and "alert(1)" not in page


def test_schedules(client: httpx.Client) -> None:
    page = get(client, "/schedules").text
    assert table(page, "schedules")[1] == [
        "nightly",
        "0 3 * * *",
        "",
        "Europe/Paris",
        "b",
        "2023-11-14T22:13:21.000000Z",  # OLD + 1 s
        "1",
    ]
    assert 'href="/tasks/1"' in page


def test_inbox(client: httpx.Client) -> None:
    page = get(client, "/inbox").text
    (_, item) = table(page, "items")
    assert item[2:] == ["mail", "c", "in-1"] and float(item[1]) < 60, item
    (_, reject) = table(page, "rejects")
    assert reject[0] == "99" and reject[3:] == ["1 B", f"bad spec {EVIL}"], reject


def test_inbox_page_reads_sizes_not_payloads(db_url: URL, store: SqlStore) -> None:
    """The inbox page shows each rejected row's payload size, which the database computes: a
    page of rejects (each up to `max_payload_bytes`) never carries their payloads."""
    statements: list[str] = []
    engine = create_engine(db_url)
    try:
        after_statements(engine, lambda _cursor, sql: statements.append(sql))
        with engine.connect() as conn:
            page = views.inbox_page(conn)
    finally:
        engine.dispose()
    assert [r["payload_size"] for r in page["rejects"]] == ["1 B"]
    rejects = [s for s in statements if inbox_rejects.name in s]
    assert rejects, statements
    for sql in rejects:
        assert "payload" not in re.sub(r"length\([^)]*\)( AS payload_size)?", "", sql), sql


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE"])
def test_only_get_and_head(client: httpx.Client, method: str) -> None:
    for path in ("/", "/tasks", "/tasks/1", "/schedules", "/inbox", "/static/dashboard.js", "/x"):
        response = client.request(method, path)
        assert response.status_code == 405, (method, path)
        assert response.headers["allow"] == "GET, HEAD"
        secured(response)
    head = client.head("/tasks")
    assert head.status_code == 200 and head.content == b""
    secured(head)


def test_every_response_is_secured(client: httpx.Client) -> None:
    for path, code in (
        ("/", 200),
        ("/overview.part", 200),
        ("/tasks/1", 200),
        ("/nope", 404),
        ("/tasks?limit=0", 400),
        ("/static/dashboard.css", 200),
        ("/static/dashboard.js", 200),
        ("/static/../app.py", 404),
    ):
        get(client, path, code)
    js = get(client, "/static/dashboard.js")
    assert js.headers["content-type"].startswith(("text/javascript", "application/javascript"))
    page = get(client, "/").text
    assert re.findall(r"<script[^>]*>", page) == ['<script src="/static/dashboard.js" defer>']
    assert not re.search(r"\son\w+=", page)  # no inline handlers either


def test_token(db_url: URL, store: SqlStore) -> None:
    token = "tok-" + "x" * 20
    for client in make_client(db_url, token=token):
        for path in ("/", "/overview.part", "/tasks", "/tasks/1", "/schedules", "/inbox"):
            page = get(client, path, 401).text
            assert 'name="token"' in page and 'type="password"' in page
            assert "held by" not in page and "k2" not in page
            get(client, path, 401, headers={"Authorization": f"Basic {token}"})
            # The cookie carries a session id, never the token itself.
            get(client, path, 401, headers={"Cookie": f"{web_app.COOKIE}={token}"})
            get(client, path, 200, headers={"Authorization": f"Bearer {token}"})
        # A wrong bearer token makes its client wait before the next try (test_web_shield).
        get(client, "/", 401, headers={"Authorization": f"Bearer {token}x"})
        get(client, "/", 429, headers={"Authorization": f"Bearer {token}"})
        wait_for_no_backoff(client)
        get(client, "/static/dashboard.css")  # public: the login page uses it
        assert 'id="wrong-token"' in client.post("/login", data={"token": "nope"}).text
        wait_for_no_backoff(client)
        assert client.post("/login", data={"token": "nope"}).status_code == 401
        assert not client.cookies
        wait_for_no_backoff(client)
        response = client.post("/login", data={"token": token})
        assert response.status_code == 303 and response.headers["location"] == "/"
        set_cookie = response.headers["set-cookie"].lower()
        assert "httponly" in set_cookie and "samesite=strict" in set_cookie
        assert token not in response.headers["set-cookie"]
        assert "held by" in get(client, "/").text  # the cookie now logs every page in
        assert get(client, "/logout", 200, follow_redirects=True).url.path == "/login"
        get(client, "/", 401)


def wait_for_no_backoff(client: httpx.Client, bound_s: float = 60.0) -> None:
    """Wait out the client's login backoff (`shield.Throttle`), as its Retry-After says."""
    deadline = time.monotonic() + bound_s
    while True:
        probe = client.post("/login", content=b"x" * (web_app.LOGIN_BODY_MAX + 1))
        if probe.status_code != 429:  # past the wait: the oversized body is refused unchecked
            assert probe.status_code == 413, probe.text
            return
        assert time.monotonic() < deadline, "the backoff did not end"
        time.sleep(min(0.1, float(probe.headers["retry-after"])))


def test_no_password_on_error_pages(tmp_path: Path) -> None:
    for url in (
        f"postgresql+psycopg://app:{PASSWORD}@127.0.0.1:1/x",
        f"mysql+pymysql://app:{PASSWORD}@127.0.0.1:1/x",
    ):
        engine = create_engine(url)
        try:
            with (
                serve(web_app.create_app(engine)) as base,
                httpx.Client(base_url=base, timeout=30) as client,
            ):
                for path in ("/", "/tasks", "/tasks/1", "/schedules", "/inbox"):
                    page = get(client, path, 503).text
                    assert "database unavailable" in page
                    assert "app:***@127.0.0.1:1/x" in page  # the database is named, masked
        finally:
            engine.dispose()


def test_reads_only(db_url: URL, store: SqlStore) -> None:
    """The app's transactions cannot write, and serving every page changes nothing."""
    target = cli_module.Target(url=url_with_password(db_url), schema=None)
    before = snapshot(store)
    with cli_module.open_database(target) as reader_store:
        reader = web_app.Reader(reader_store.engine)
        with pytest.raises(web_app.Unavailable):
            reader.read(lambda conn: conn.execute(tasks.delete()))
        with pytest.raises(web_app.Unavailable):
            reader.read(lambda conn: conn.execute(leader.update().values(holder="me")))
    for client in make_client(db_url):
        for path in ("/", "/overview.part", "/tasks", "/tasks/2", "/schedules", "/inbox"):
            get(client, path)
    assert snapshot(store) == before


def snapshot(store: SqlStore) -> tuple[object, ...]:
    with store.engine.connect() as conn:
        return (
            conn.execute(select(leader)).all(),
            conn.execute(select(tasks.c.id, tasks.c.status).order_by(tasks.c.id)).all(),
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_command_needs_a_token_beyond_loopback(tmp_path: Path) -> None:
    """`cronoq-store web` itself: refuses a public address without a token, and serves with
    one, the token then required (the real command, in a process of its own)."""
    db = tmp_path / "web.db"
    cli = [sys.executable, "-m", "cronoq_store.cli", "--url", str(db)]
    env = {k: v for k, v in os.environ.items() if k != "CRONOQ_WEB_TOKEN"}
    subprocess.run([*cli, "upgrade"], check=True, capture_output=True, env=env)
    refused = subprocess.run(
        [*cli, "web", "--host", "0.0.0.0"], capture_output=True, text=True, env=env, timeout=60
    )
    assert refused.returncode == 2 and "set --token" in refused.stderr, refused.stderr
    port = free_port()
    log = tmp_path / "web.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            [*cli, "web", "--host", "0.0.0.0", "--port", str(port)],
            env=env | {"CRONOQ_WEB_TOKEN": "t0ken"},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                first = httpx.get(f"http://127.0.0.1:{port}/", timeout=5)
                break
            except httpx.TransportError:
                assert server.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "the dashboard did not come up in 30 s"
                time.sleep(0.1)
        assert first.status_code == 401
        ok = httpx.get(f"http://127.0.0.1:{port}/", headers={"Authorization": "Bearer t0ken"})
        assert ok.status_code == 200 and "no leader" in ok.text
        assert httpx.post(f"http://127.0.0.1:{port}/tasks").status_code == 405
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_wheel_ships_templates_and_static_files(dist: Path) -> None:
    """The wheel carries every template and static file (no front-end build step)."""
    root = Path(__file__).resolve().parents[2]
    (wheel,) = dist.glob("cronoq_store-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shipped = set(archive.namelist())
    web = root / "cronoq_store" / "web"
    wanted = {
        f"cronoq_store/web/{p.relative_to(web).as_posix()}"
        for folder in ("templates", "static")
        for p in (web / folder).iterdir()
    }
    assert len(wanted) >= 11 and wanted <= shipped, wanted - shipped
