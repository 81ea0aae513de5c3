"""The dashboard against hostile requests (`cronoq_store.web.shield`), on a real uvicorn
server and through raw sockets where a client library would not send what an attacker sends:
a forged Host (DNS rebinding), a login body of 1.5 GB declared or streamed, guessed tokens,
and a cookie that must die with its logout, its expiry or the server's restart.

The shield does not depend on the dialect: the app reads a SQLite file here.
"""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from webserver import serve

from cronoq_store import SqlStore
from cronoq_store import cli as cli_module
from cronoq_store.web import app as web_app
from cronoq_store.web import shield

TOKEN = "tok-" + "y" * 24


@pytest.fixture
def db(tmp_path: Path) -> cli_module.Target:
    path = tmp_path / "web.db"
    SqlStore.open(path).close()
    return cli_module.Target(url=str(path), schema=None)


def app_for(target: cli_module.Target, **options: object) -> Iterator[object]:
    with cli_module.open_database(target) as reader:
        yield web_app.create_app(reader.engine, **options)  # type: ignore[arg-type]


def raw(base: str, request: bytes, *, timeout: float = 30.0) -> bytes:
    """Send `request` as is on a new connection; everything the server answers until it
    closes the connection (or `timeout`)."""
    parts = urlsplit(base)
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


# Hosts: DNS rebinding.


def test_forged_host_is_refused_by_the_real_server(db: cli_module.Target) -> None:
    for app in app_for(db, allowed_hosts=["dash.example"]):
        with serve(app) as base:  # type: ignore[arg-type]
            port = urlsplit(base).port
            for host, code in (
                (b"evil.example", 421),
                (f"evil.example:{port}".encode(), 421),
                (b"127.0.0.1.evil.example", 421),
                (f"127.0.0.1:{port}".encode(), 200),
                (f"localhost:{port}".encode(), 200),
                (b"LOCALHOST.", 200),
                (b"dash.example", 200),
                (b"[::1]", 421),  # not the bound address
            ):
                answer = raw(
                    base, b"GET / HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close\r\n\r\n"
                )
                assert status_of(answer) == code, (host, answer[:300])
                if code == 421:
                    assert b"no leader" not in answer and b"<html" not in answer.lower()
                    assert b"content-security-policy" in answer.lower()
            # HTTP/1.0 without a Host header at all.
            assert status_of(raw(base, b"GET / HTTP/1.0\r\n\r\n")) == 400


def test_hosts_bound_to_every_address(db: cli_module.Target) -> None:
    """Bound to a wildcard, the server answers any IP address (a rebinding page always sends
    a name), and of names only localhost and the ones allowed."""
    for app in app_for(db, bound="0.0.0.0"):
        with serve(app) as base, httpx.Client(base_url=base, timeout=30) as client:  # type: ignore[arg-type]
            for host, code in (
                ("10.1.2.3:8426", 200),
                ("[fe80::1]:8426", 200),
                ("localhost", 200),
                ("attacker.example", 421),
            ):
                assert client.get("/", headers={"Host": host}).status_code == code, host


def test_bound_to_localhost_answers_its_addresses() -> None:
    hosts = shield.AllowedHosts(lambda *a: None, bound="localhost")  # type: ignore[arg-type]
    assert hosts.allows("127.0.0.1:8426") and hosts.allows("[::1]:8426")
    assert hosts.allows("localhost") and not hosts.allows("evil.example")
    assert not hosts.allows(None)


@pytest.mark.parametrize(
    ("header", "name"),
    [("LocalHost:80", "localhost"), ("[::1]:8426", "::1"), ("::1", "::1"), ("a.b.", "a.b")],
)
def test_host_name(header: str, name: str) -> None:
    assert shield.host_name(header) == name


# The login body.


def login_headers(port: int | None, extra: bytes) -> bytes:
    return (
        b"POST /login HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
        b"Content-Type: application/x-www-form-urlencoded\r\n" % (port or 0)
    ) + extra


def test_oversized_login_refused_before_its_body(db: cli_module.Target) -> None:
    """A declared 1.5 GB body is refused from its headers: not one byte of it is sent."""
    for app in app_for(db, token=TOKEN):
        with serve(app) as base:  # type: ignore[arg-type]
            port = urlsplit(base).port
            request = login_headers(port, b"Content-Length: 1500000000\r\n\r\n")
            answer = raw(base, request)
            assert status_of(answer) == 413, answer[:300]
            assert b"at most 4096 bytes" in answer


def stream_login(base: str, chunk: bytes, total: int) -> tuple[bytes, int]:
    """POST /login a chunked body of `total` bytes in `chunk`s, stopping once the server
    answered and closed the connection; what it answered, and how many bytes were sent."""
    parts = urlsplit(base)
    sent = 0
    answer = bytearray()
    done = threading.Event()
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(login_headers(parts.port, b"Transfer-Encoding: chunked\r\n\r\n"))

        def read() -> None:
            try:
                while data := sock.recv(65536):
                    answer.extend(data)
            except OSError:
                pass
            done.set()

        threading.Thread(target=read, daemon=True).start()
        try:
            while sent < total and not done.is_set():
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
        except OSError:
            pass  # the server closed the connection: what is wanted
        assert done.wait(30), "no answer within 30 s"
    return bytes(answer), sent


def test_streamed_login_stops_past_the_limit(db: cli_module.Target) -> None:
    """A chunked body is read only until it passes 4 KiB: the server answers 413 and closes
    the connection while the client still has almost all of its 1 GiB to send, and the
    process's peak memory does not grow by anything near what was offered."""
    total = 1 << 30
    chunk = b"token=" + b"x" * (64 * 1024 - 6)
    for app in app_for(db, token=TOKEN):
        with serve(app) as base:  # type: ignore[arg-type]
            peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
            answer, sent = stream_login(base, chunk, total)
            assert status_of(answer) == 413, answer[:300]
            grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
            print(f"streamed login: {sent / 2**20:.1f} MiB sent of 1024, peak grew {grown_mib} MiB")
            assert sent < 64 * 2**20, sent  # socket buffers hold a few MiB, no more
            assert grown_mib < 64


# Sessions and guessing.


def test_cookie_is_a_session_that_logout_and_restart_end(db: cli_module.Target) -> None:
    for app in app_for(db, token=TOKEN):
        with serve(app) as base, httpx.Client(base_url=base, timeout=30) as client:  # type: ignore[arg-type]
            first = client.post("/login", data={"token": TOKEN})
            assert first.status_code == 303
            cookie = first.cookies[web_app.COOKIE]
            assert TOKEN not in first.headers["set-cookie"]
            assert "max-age=43200" in first.headers["set-cookie"].lower()
            second = client.post("/login", data={"token": TOKEN}).cookies[web_app.COOKIE]
            assert cookie != second  # random per login: no function of the token
            with_cookie = {"Cookie": f"{web_app.COOKIE}={cookie}"}
            assert client.get("/", headers=with_cookie).status_code == 200
            client.get("/logout", headers=with_cookie)
            # The same value, replayed after its logout, opens nothing.
            assert client.get("/", headers=with_cookie).status_code == 401
            assert (
                client.get("/", headers={"Cookie": f"{web_app.COOKIE}={second}"}).status_code == 200
            )
    # A restart (a new app) knows no session of the old one.
    for app in app_for(db, token=TOKEN):
        with serve(app) as base:  # type: ignore[arg-type]
            got = httpx.get(f"{base}/", headers={"Cookie": f"{web_app.COOKIE}={second}"})
            assert got.status_code == 401


def test_sessions_expire() -> None:
    now = [1000.0]
    sessions = shield.Sessions(ttl_s=60, clock=lambda: now[0])
    sid = sessions.issue()
    assert sessions.valid(sid) and not sessions.valid(sid + "x") and not sessions.valid(None)
    now[0] += 59.9
    assert sessions.valid(sid)
    now[0] += 0.1
    assert not sessions.valid(sid)


def test_backoff_doubles_per_client_and_clears_on_success() -> None:
    now = [0.0]
    throttle = shield.Throttle(clock=lambda: now[0])
    waits = [throttle.failed("a") for _ in range(10)]
    assert waits[:4] == [0.5, 1.0, 2.0, 4.0] and waits[-1] == shield.BACKOFF_MAX_S
    assert throttle.wait_s("a") == shield.BACKOFF_MAX_S and throttle.wait_s("b") == 0
    now[0] += shield.BACKOFF_MAX_S
    assert throttle.wait_s("a") == 0
    throttle.succeeded("a")
    assert throttle.failed("a") == 0.5


def test_wrong_tokens_slow_the_client_down(
    db: cli_module.Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the real server: a wrong login makes even the right token wait (429, Retry-After),
    and after the wait the right one logs in. The backoff's clock is the test's, so a slow
    machine cannot let the wait run out between two requests."""
    now = [0.0]
    real = shield.Throttle
    monkeypatch.setattr(shield, "Throttle", lambda: real(clock=lambda: now[0]))
    for app in app_for(db, token=TOKEN):
        with serve(app) as base, httpx.Client(base_url=base, timeout=30) as client:  # type: ignore[arg-type]
            assert client.post("/login", data={"token": "guess-1"}).status_code == 401
            early = client.post("/login", data={"token": TOKEN})
            assert early.status_code == 429 and int(early.headers["retry-after"]) >= 1
            now[0] += shield.BACKOFF_FIRST_S
            assert client.post("/login", data={"token": TOKEN}).status_code == 303


def test_the_command_serves_allowed_hosts(tmp_path: Path, db: cli_module.Target) -> None:
    """`cronoq-store web --allowed-host`, the real command in a process of its own: its bound
    address and the name given are served, a forged Host is not."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    argv = [sys.executable, "-m", "cronoq_store.cli", "--url", db.url, "web", "--port", str(port),
            "--allowed-host", "dash.example"]  # fmt: skip
    log = tmp_path / "web.log"
    env = {k: v for k, v in os.environ.items() if k != "CRONOQ_WEB_TOKEN"}
    with log.open("wb") as out:
        server = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(base, timeout=5)
                break
            except httpx.TransportError:
                assert server.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "the dashboard did not come up in 30 s"
                time.sleep(0.1)
        for host, code in (("dash.example", 200), (f"127.0.0.1:{port}", 200),
                           ("rebound.example", 421)):  # fmt: skip
            assert httpx.get(base, headers={"Host": host}, timeout=30).status_code == code, host
    finally:
        server.terminate()
        server.wait(timeout=30)
