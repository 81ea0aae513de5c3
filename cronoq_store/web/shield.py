"""The dashboard's defences against hostile requests, each apart from the pages it guards.

- `AllowedHosts`: only the Host names it serves get an answer (421 otherwise), so a web page
  that rebinds its own name to 127.0.0.1 (DNS rebinding) cannot read the dashboard through
  the operator's browser.
- `read_limited`: the login form's body, refused (413) from its Content-Length before any of
  it is read, and a chunked one as soon as it passes the limit.
- `Sessions`: the login cookie is a random session id the server keeps, with an expiry; a
  logout or a restart ends it (it is no function of the token).
- `Throttle`: a client that sent a wrong token waits (429) before it may try again, doubling
  with each wrong try, so the token cannot be guessed at the speed of the network.
"""

from __future__ import annotations

import ipaddress
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Final

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

LOOPBACK_NAMES: Final = frozenset({"localhost"})
"""Names answered whatever the bound address."""
LOCALHOST_ADDRESSES: Final = frozenset({"127.0.0.1", "::1"})
"""What `localhost` resolves to: answered too when the server is bound to that name."""
WILDCARDS: Final = frozenset({"0.0.0.0", "::"})
"""Bound to one of these, the server answers on every address of the machine."""
SESSION_TTL_S: Final = 12 * 3600.0
"""How long a login lasts (the cookie's Max-Age, and the server's own check)."""
MAX_SESSIONS: Final = 1024
"""Live sessions kept at most; past it the oldest is ended (only token holders add any)."""
BACKOFF_FIRST_S: Final = 0.5
"""The wait after a client's first wrong token; it doubles with each further one."""
BACKOFF_MAX_S: Final = 30.0
"""The longest wait between two tries of one client."""
MAX_CLIENTS: Final = 4096
"""Clients whose wrong tries are remembered at most (the oldest forgotten first)."""


def host_name(header: str) -> str:
    """The name of a Host header, without its port, lower case ("[::1]:8426" is "::1")."""
    value = header.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    if value.count(":") == 1:
        value = value.partition(":")[0]
    return value.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class AllowedHosts:
    """Answer only requests whose Host is one this server serves: the address it is bound to,
    `localhost`, and the `names` given (`--allowed-host`). Bound to a wildcard (0.0.0.0, ::)
    it also answers any IP address: a rebinding page always sends a name, never an address.
    Others get 421 Misdirected Request, a missing Host 400, before anything else runs."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        bound: str,
        names: Iterable[str] = (),
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.app = app
        self.headers = dict(headers or {})
        served = {host_name(bound)}
        if served & LOOPBACK_NAMES:  # bound to "localhost": reached by its addresses too
            served |= LOCALHOST_ADDRESSES
        self.names = frozenset({*served, *LOOPBACK_NAMES, *(host_name(n) for n in names)})
        self.any_ip = host_name(bound) in WILDCARDS

    def allows(self, header: str | None) -> bool:
        """Whether a request with this Host header is answered."""
        if header is None:
            return False
        name = host_name(header)
        return name in self.names or (self.any_ip and _is_ip(name))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = Headers(scope=scope).get("host")
        if self.allows(header):
            await self.app(scope, receive, send)
            return
        if header is None:
            response = PlainTextResponse(
                "400 Bad Request: a Host header is required\n", 400, headers=self.headers
            )
        else:
            response = PlainTextResponse(
                "421 Misdirected Request: this dashboard does not serve that host name "
                "(cronoq-store web --allowed-host NAME serves another)\n",
                421,
                headers=self.headers,
            )
        await response(scope, receive, send)


class BodyTooLarge(Exception):
    """A request body longer than the limit (`read_limited`)."""


async def read_limited(request: Request, limit: int) -> bytes:
    """The request's body, at most `limit` bytes: `BodyTooLarge` at once when Content-Length
    says more (nothing of it read), or as soon as a chunked body passes the limit (the rest
    never read: the server closes the connection after the answer)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise BodyTooLarge(declared)
        except ValueError as exc:
            raise BodyTooLarge(declared) from exc
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise BodyTooLarge(len(body))
    return bytes(body)


def too_large(limit: int) -> PlainTextResponse:
    """The answer to a body past `limit`: 413, and `Connection: close`, so the server closes
    the connection instead of reading (and discarding) the rest to keep it alive."""
    return PlainTextResponse(
        f"413 Content Too Large: a login form is at most {limit} bytes\n",
        413,
        headers={"Connection": "close"},
    )


class Sessions:
    """Logins, kept by the server: a cookie holds a random id, valid until it expires, its
    owner logs out, or the process ends (the ids live in its memory only)."""

    def __init__(
        self, *, ttl_s: float = SESSION_TTL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._live: OrderedDict[str, float] = OrderedDict()

    def issue(self) -> str:
        """A new session id (256 random bits) that `valid` accepts until `ttl_s` from now."""
        self._expire()
        while len(self._live) >= MAX_SESSIONS:
            self._live.popitem(last=False)
        sid = secrets.token_urlsafe(32)
        self._live[sid] = self._clock() + self.ttl_s
        return sid

    def valid(self, sid: str | None) -> bool:
        """Whether `sid` is a live session (compared as the dictionary compares: the id is
        256 random bits, so a lookup's timing cannot be walked to it)."""
        if not sid:
            return False
        expires = self._live.get(sid)
        if expires is None:
            return False
        if self._clock() >= expires:
            del self._live[sid]
            return False
        return True

    def revoke(self, sid: str | None) -> None:
        """End a session (logout); an unknown id is ignored."""
        if sid:
            self._live.pop(sid, None)

    def _expire(self) -> None:
        now = self._clock()
        for sid in [s for s, at in self._live.items() if at <= now]:
            del self._live[sid]


class Throttle:
    """Per-client backoff on wrong tokens: after a client's n-th wrong try in a row it may try
    again only `BACKOFF_FIRST_S * 2**(n-1)` seconds later (at most `BACKOFF_MAX_S`); a try
    before that is refused unchecked. A right token clears the client's count."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._clients: OrderedDict[str, tuple[int, float]] = OrderedDict()

    def wait_s(self, client: str) -> float:
        """Seconds `client` must still wait before its next try (0: it may try now)."""
        entry = self._clients.get(client)
        if entry is None:
            return 0.0
        return max(0.0, entry[1] - self._clock())

    def failed(self, client: str) -> float:
        """Note a wrong try by `client`; returns how long it must now wait."""
        count = self._clients.pop(client, (0, 0.0))[0] + 1
        delay: float = min(BACKOFF_FIRST_S * 2.0 ** min(count - 1, 32), BACKOFF_MAX_S)
        self._clients[client] = (count, self._clock() + delay)
        while len(self._clients) > MAX_CLIENTS:
            self._clients.popitem(last=False)
        return delay

    def succeeded(self, client: str) -> None:
        self._clients.pop(client, None)


def client_of(scope: Scope) -> str:
    """Who is throttled: the peer's address (behind a proxy, every client shares one)."""
    client = scope.get("client")
    return str(client[0]) if client else "?"


def too_many(wait_s: float) -> PlainTextResponse:
    """The answer to a try made before its client's wait ended."""
    seconds = max(1, int(wait_s + 0.999))
    return PlainTextResponse(
        f"429 Too Many Requests: wrong token; try again in {seconds} s\n",
        429,
        headers={"Retry-After": str(seconds)},
    )
