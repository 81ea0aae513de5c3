"""The dashboard's ASGI app: Starlette routes over `views`, Jinja2 templates, and `Guard`.

Every page is a GET (HEAD too); the one other request is the login form's POST, which writes
nothing but a cookie. Each page reads in one read-only transaction on its own connection
(`Reader`); nothing here takes the lease or writes to the store.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any, Final, TypeVar
from urllib.parse import parse_qs

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape
from sqlalchemy import Connection, Engine
from sqlalchemy import exc as sa_exc
from starlette.applications import Starlette
from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import cli, dialects
from ..errors import StoreError
from ..model import INT64_MAX, INT64_MIN
from . import shield, views

T = TypeVar("T")

CSP: Final = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)
"""Only the package's own script and style run: no inline script, whatever a task holds."""
SECURITY_HEADERS: Final = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}
"""Sent with every response, errors and static files included."""
READ_METHODS: Final = frozenset({"GET", "HEAD"})
COOKIE: Final = "cronoq_web"
LOGIN_BODY_MAX: Final = 4096
STATIC: Final = Path(__file__).parent / "static"


def _same(given: str, expected: str) -> bool:
    """Constant-time comparison (the time taken says nothing about how much matched)."""
    return hmac.compare_digest(given.encode(), expected.encode())


class Guard:
    """The layer inside the Host check (`shield.AllowedHosts`): security headers on every
    response, 405 for every method but GET and HEAD (the login POST aside), and the token
    check when a token is set (a live session's cookie, or the bearer token)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        token: str | None,
        templates: Environment,
        sessions: shield.Sessions | None = None,
        throttle: shield.Throttle | None = None,
    ) -> None:
        self.app = app
        self.token = token or None
        self.sessions = sessions or shield.Sessions()
        self.throttle = throttle or shield.Throttle()
        self.templates = templates

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_secured(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in SECURITY_HEADERS.items():
                    headers[name] = value
            await send(message)

        method, path = scope["method"], scope["path"]
        response: Response | None = None
        if method not in READ_METHODS and not (method == "POST" and path == "/login"):
            response = PlainTextResponse(
                "405 Method Not Allowed: this dashboard only reads\n",
                status_code=405,
                headers={"Allow": "GET, HEAD"},
            )
        elif self.token is not None and not self._public(path):
            response = self._refusal(scope)
        if response is not None:
            await response(scope, receive, send_secured)
            return
        await self.app(scope, receive, send_secured)

    @staticmethod
    def _public(path: str) -> bool:
        return path == "/login" or path.startswith("/static/")

    def _refusal(self, scope: Scope) -> Response | None:
        """None when the request may see the page: a live session's cookie, or the right
        bearer token (a wrong one counts against its client, as a wrong login does: a try
        within the client's wait is refused unchecked, 429)."""
        assert self.token is not None
        headers = Headers(scope=scope)
        if self.sessions.valid(session_id(headers)):
            return None
        scheme, _, given = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            client = shield.client_of(scope)
            if (wait := self.throttle.wait_s(client)) > 0:
                return shield.too_many(wait)
            if _same(given.strip(), self.token):
                self.throttle.succeeded(client)
                return None
            self.throttle.failed(client)
        page = self.templates.get_template("login.html").render(wrong=False)
        return HTMLResponse(page, status_code=401, headers={"WWW-Authenticate": "Bearer"})


def session_id(headers: Headers) -> str | None:
    """The session id the login cookie carries, if any (a malformed Cookie header: none)."""
    cookie = SimpleCookie()
    try:
        cookie.load(headers.get("cookie", ""))
    except Exception:
        return None
    morsel = cookie.get(COOKIE)
    return None if morsel is None else morsel.value


class Unavailable(Exception):
    """The database could not be read; the message is already free of passwords."""


class Reader:
    """Runs a page's reads in one read-only transaction on a connection of its own."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def read(self, fn: Callable[[Connection], T]) -> T:
        """`fn(conn)` in a read-only transaction, rolled back afterwards; database errors
        become `Unavailable` with a redacted one-line message."""
        try:
            with self.engine.connect() as conn:
                conn = conn.execution_options(**{dialects.READ_ONLY: True})
                sql = dialects.read_only_sql(conn.dialect)
                if sql is not None:
                    conn.exec_driver_sql(sql)
                try:
                    return fn(conn)
                finally:
                    conn.rollback()
        except (sa_exc.SQLAlchemyError, OSError) as exc:
            raise Unavailable(cli.one_line(str(dialects.translate(exc)))) from exc
        except StoreError as exc:
            raise Unavailable(cli.one_line(str(exc))) from exc


def _text(request: Request, name: str) -> str | None:
    value = request.query_params.get(name, "").strip()
    return value or None


def _task_filter(request: Request) -> views.TaskFilter | str:
    """The tasks page's filters from the address, or what is wrong with them."""
    status = _text(request, "status")
    if status is not None and status not in views.STATUSES:
        return f"unknown status {status!r}"
    numbers: dict[str, int | None] = {}
    for name in ("before", "limit"):
        raw = _text(request, name)
        try:
            numbers[name] = None if raw is None else int(raw)
        except ValueError:
            return f"{name} must be a whole number"
    limit = views.PAGE if numbers["limit"] is None else numbers["limit"]
    if not 1 <= limit <= views.PAGE_MAX:
        return f"limit must be between 1 and {views.PAGE_MAX}"
    before = numbers["before"]
    if before is not None:
        before = max(min(before, INT64_MAX), INT64_MIN)
    return views.TaskFilter(
        pool=_text(request, "pool"),
        status=status,
        kind=_text(request, "kind"),
        key=_text(request, "key"),
        before=before,
        limit=limit,
    )


def create_app(
    engine: Engine,
    *,
    schema: str | None = None,
    token: str | None = None,
    retention: timedelta = timedelta(hours=1),
    refresh_s: float = 3.0,
    database: str | None = None,
    bound: str = "127.0.0.1",
    allowed_hosts: Sequence[str] = (),
) -> ASGIApp:
    """The dashboard over the store behind `engine` (migrated, at head).

    `token`, when set, is required on every page (bearer header or the login form's cookie).
    `database` is how the database is named on the pages (never with a password; the
    engine's URL, redacted, by default). Only requests for the Host `bound` (the address
    served), `localhost` or one of `allowed_hosts` are answered (`shield.AllowedHosts`).
    """
    sessions = shield.Sessions()
    throttle = shield.Throttle()
    templates = Environment(
        loader=PackageLoader("cronoq_store.web", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        undefined=StrictUndefined,
    )
    reader = Reader(engine)
    shown = database if database is not None else dialects.safe_url(engine.url)
    common: dict[str, Any] = {
        "database": shown,
        "dialect": dialects.dialect_of(engine).name,
        "refresh_ms": int(refresh_s * 1000),
        "logout": token is not None,
    }

    def page(name: str, code: int = 200, **context: Any) -> HTMLResponse:
        body = templates.get_template(name).render(**common, **context)
        return HTMLResponse(body, status_code=code)

    def login_page(status: int, *, wrong: bool) -> HTMLResponse:
        body = templates.get_template("login.html").render(wrong=wrong)
        return HTMLResponse(body, status_code=status)

    def problem(status: int, message: str) -> HTMLResponse:
        return page("error.html", status, status=status, message=message)

    def overview_data(conn: Connection) -> dict[str, Any]:
        return views.overview(conn, schema=schema, retention=retention)

    def overview(request: Request) -> Response:
        # The charts first: the overview reads the server's role last (`views.overview`).
        a, o = reader.read(lambda conn: (views.activity_charts(conn), overview_data(conn)))
        return page("overview.html", o=o, a=a)

    def overview_part(request: Request) -> Response:
        return page("overview_part.html", o=reader.read(overview_data))

    def tasks(request: Request) -> Response:
        flt = _task_filter(request)
        if isinstance(flt, str):
            return problem(400, flt)
        data = reader.read(lambda conn: views.tasks_page(conn, flt))
        return page("tasks.html", f=flt, statuses=views.STATUSES, **data)

    def task(request: Request) -> Response:
        raw = request.path_params["task_id"]
        try:
            task_id = int(raw)
        except ValueError:
            return problem(404, "no such task")
        if not INT64_MIN <= task_id <= INT64_MAX:
            return problem(404, f"no task with id {task_id}")
        detail = reader.read(lambda conn: views.task_page(conn, task_id))
        if detail is None:
            return problem(404, f"no task with id {task_id}")
        return page("task.html", t=detail)

    def schedules(request: Request) -> Response:
        return page("schedules.html", schedules=reader.read(views.schedules))

    def inbox(request: Request) -> Response:
        return page("inbox.html", **reader.read(views.inbox_page))

    async def login(request: Request) -> Response:
        if token is None:
            return RedirectResponse("/", status_code=303)
        if request.method != "POST":
            return login_page(200, wrong=False)
        client = shield.client_of(request.scope)
        if (wait := throttle.wait_s(client)) > 0:
            return shield.too_many(wait)
        try:
            body = await shield.read_limited(request, LOGIN_BODY_MAX)
        except shield.BodyTooLarge:
            return shield.too_large(LOGIN_BODY_MAX)
        fields: Mapping[str, list[str]] = parse_qs(body.decode("utf-8", "replace"))
        given = (fields.get("token") or [""])[0]
        if not _same(given, token):
            throttle.failed(client)
            return login_page(401, wrong=True)
        throttle.succeeded(client)
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(
            COOKIE,
            sessions.issue(),
            max_age=int(sessions.ttl_s),
            httponly=True,
            samesite="strict",
            path="/",
        )
        return response

    def logout(request: Request) -> Response:
        sessions.revoke(session_id(request.headers))
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(COOKIE, path="/")
        return response

    async def unavailable(request: Request, exc: Exception) -> Response:
        return problem(503, f"database unavailable: {exc}")

    app = Starlette(
        routes=[
            Route("/", overview),
            Route("/overview.part", overview_part),
            Route("/tasks", tasks),
            Route("/tasks/{task_id}", task),
            Route("/schedules", schedules),
            Route("/inbox", inbox),
            Route("/login", login, methods=["GET", "POST"]),
            Route("/logout", logout),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ],
        exception_handlers={Unavailable: unavailable},
    )
    guarded = Guard(app, token=token, templates=templates, sessions=sessions, throttle=throttle)
    return shield.AllowedHosts(guarded, bound=bound, names=allowed_hosts, headers=SECURITY_HEADERS)
