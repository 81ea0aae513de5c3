"""Database URLs: parsed, checked, advised on, and redacted: no password reaches a message."""

from __future__ import annotations

import re
from typing import Any, Final
from urllib.parse import parse_qsl

from sqlalchemy import URL, make_url
from sqlalchemy import exc as sa_exc

from ..errors import InvalidValue

SECRET_QUERY_KEYS: Final = frozenset({"password", "passwd", "pwd", "sslpassword"})
"""URL query options whose value is a password (psycopg and PyMySQL accept them)."""
_PASSWORD = re.compile(
    r"(?i)\b(password|passwd|pwd|sslpassword)\s*=\s*('[^']*'|\"[^\"]*\"|[^\s&;,)'\"]+)"
)
# Up to the LAST '@' of the URL's text: an unencoded '@' in a password must not cut it short.
_URL_PASSWORD = re.compile(r"(\w+(?:\+\w+)?://[^:/@\s]*:)\S*@")


def redact(text: str) -> str:
    """`text` with anything that looks like a password replaced by ***: the one place every
    printed URL and database message goes through.

    Args:
        text: A URL or a message that may hold one (`user:secret@host`, `password=secret`).

    Returns:
        The text with each such password replaced by `***`.
    """
    return _PASSWORD.sub(r"\1=***", _URL_PASSWORD.sub(r"\1***@", text))


def safe_url(url: URL) -> str:
    """`url` as it may be printed: its password and any password query option masked, and its
    query readable (`?host=db1:5432`, not SQLAlchemy's `db1%3A5432`; `_readable_query`)."""
    query = {k: ("***" if k.lower() in SECRET_QUERY_KEYS else v) for k, v in url.query.items()}
    text = url.set(query=query).render_as_string(hide_password=True)
    return redact(_readable_query(text.replace("%2A%2A%2A", "***")))


_QUERY_ESCAPES: Final = {"%3A": ":", "%5B": "[", "%5D": "]", "%2C": ",", "%2F": "/"}
"""What SQLAlchemy escapes in a query value that reads (and parses back) the same unescaped:
a host list's ports, IPv6 brackets, commas, socket directories."""


def _readable_query(text: str) -> str:
    """`text` with `_QUERY_ESCAPES` undone in its query part (only there: a user name or
    database name keeps its escapes, and no escaped '@', '&' or '=' is ever undone)."""
    head, mark, query = text.partition("?")
    if not mark:
        return text
    for escaped, plain in _QUERY_ESCAPES.items():
        query = query.replace(escaped, plain).replace(escaped.lower(), plain)
    return f"{head}?{query}"


def parse_url(text: str) -> URL:
    """A database URL, or `InvalidValue` naming what is wrong and never showing the password.

    A URL whose user or password holds an unencoded '@' is refused: SQLAlchemy would split it
    at the first one and hand the rest of the password to the driver as the host name, which
    then prints it in its error ("failed to resolve host 'ssW0rd@127.0.0.1'").
    """
    scheme, _, rest = text.partition("://")
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0] if "@" in rest else ""
    if authority.count("@") > 1 or (not authority and rest.split("?", 1)[0].count("@") > 1):
        raise InvalidValue(
            f"bad database URL {scheme}://...: more than one '@' before the host; "
            "a password (or user name) holding '@' must be percent-encoded, '@' as %40"
        )
    try:
        url = make_url(text)
    except (sa_exc.ArgumentError, ValueError) as exc:
        raise InvalidValue(redact(f"bad database URL: {exc}")) from exc
    if url.get_backend_name() not in {"sqlite", *_DRIVERS}:
        raise InvalidValue(
            f"bad database URL: {scheme}:// is not a database cronoq-store knows; {URL_FORMS}"
        )
    # SQLAlchemy drops an option with an empty value; `?prepare_threshold=` means None.
    query = text.partition("?")[2].partition("#")[0]
    blank = {k for k, v in parse_qsl(query, keep_blank_values=True) if not v}
    if PREPARE_THRESHOLD in blank and PREPARE_THRESHOLD not in url.query:
        url = url.update_query_dict({PREPARE_THRESHOLD: ""})
    return url


URL_FORMS: Final = (
    "write sqlite:///PATH (or a bare file path), postgresql+psycopg://USER:PASSWORD@HOST:PORT/DB "
    "or mysql+pymysql://USER:PASSWORD@HOST:PORT/DB"
)
"""The URL forms the store is tested with, for a message about a URL it cannot use."""


PREPARE_THRESHOLD: Final = "prepare_threshold"
"""psycopg's option: executions of a statement before it is prepared on the server (None:
never). Not a libpq option, so SQLAlchemy hands psycopg the URL's text as it is."""


def connect_options(url: URL) -> tuple[URL, dict[str, Any]]:
    """`url` without the driver options SQLAlchemy would pass on as text where the driver
    needs a number, and those options as the driver takes them (`connect_args`).

    Only psycopg's `prepare_threshold` is such an option (libpq's own take text): from a URL
    psycopg got '0' and failed at the first statement comparing it with a count
    (`TypeError`). `?prepare_threshold=0` is 0, `?prepare_threshold=` (or `none`) None.
    """
    if PREPARE_THRESHOLD not in url.query or url.get_driver_name() not in (
        "psycopg",
        "psycopg_async",
    ):
        return url, {}
    value = url.query[PREPARE_THRESHOLD]
    text = value if isinstance(value, str) else ",".join(value)
    threshold: int | None
    if text.strip().lower() in ("", "none"):
        threshold = None
    elif re.fullmatch(r"\s*\d+\s*", text):
        threshold = int(text)
    else:
        raise InvalidValue(
            f"bad database URL option prepare_threshold={text!r}: a whole number of executions "
            "before psycopg prepares a statement, or empty (or none) never to prepare"
        )
    return url.difference_update_query([PREPARE_THRESHOLD]), {PREPARE_THRESHOLD: threshold}


_HOST_WITH_PORT = re.compile(r"[^:,\[\]]+:\d+")


def check_url(url: URL) -> URL:
    """`url`, or `InvalidValue` for options that break the store or can never connect.

    `autocommit` in the URL: the store runs its own transactions, and psycopg reads any text
    (`autocommit=false` too) as true, so a commit's fence check and its writes would each
    commit on their own. PostgreSQL host lists: libpq reads `?host=a:5433,b:5434` as two host
    names with colons in them ("failed to resolve host 'b:5434'"), and a port list whose
    length fits neither one port nor one per host is refused at every connect: errors a
    leader would retry as unavailable forever.
    """
    if any(key.lower() == "autocommit" for key in url.query):
        raise InvalidValue(
            "bad database URL: leave autocommit out of it; the store begins and commits its "
            "own transactions (and psycopg reads autocommit=false as true)"
        )
    if url.get_backend_name() not in ("postgresql", "postgres"):
        return url
    hosts = url.query.get("host", ())
    hosts = (hosts,) if isinstance(hosts, str) else tuple(hosts)
    forms = (
        "one host= per server with its port (?host=h1:5432&host=h2:5432), or host and port "
        "lists (?host=h1,h2&port=5432,5432), with target_session_attrs=read-write"
    )
    for value in hosts:
        names = value.split(",")
        if len(names) > 1 and any(_HOST_WITH_PORT.fullmatch(n.strip()) for n in names):
            raise InvalidValue(
                f"bad database URL: host={value!r} puts ports inside a host list, which "
                f"libpq reads as host names; write {forms}"
            )
    port = url.query.get("port")
    if isinstance(port, str) and len(hosts) == 1:
        count, ports = len(hosts[0].split(",")), len(port.split(","))
        if ports not in (1, count):
            raise InvalidValue(f"bad database URL: {ports} ports for {count} hosts; write {forms}")
    return url


def require_database(url: URL, schema: str | None) -> URL:
    """`url`, or `InvalidValue` when it names no MySQL database and no `schema` names one.

    MySQL has no default database: a connection to `.../` has none selected, and Alembic's
    and SQLAlchemy's reflection then fail on an internal assertion (`AssertionError:`, no
    words). PostgreSQL falls back to the user's database, SQLite needs a file: only MySQL.
    """
    if url.get_backend_name() in ("mysql", "mariadb") and not url.database and not schema:
        raise InvalidValue(
            f"bad database URL {safe_url(url)}: no database name after the host; write "
            f"{safe_url(url.set(database='DB'))} (or name one with --schema, "
            "StoreConfig.schema)"
        )
    return url


_DRIVERS: Final = {
    "postgresql": ("postgresql+psycopg", "postgresql", "psycopg"),
    "postgres": ("postgresql+psycopg", "postgresql", "psycopg"),
    "mysql": ("mysql+pymysql", "mysql", "pymysql"),
    "mariadb": ("mysql+pymysql", "mysql", "pymysql"),
}
"""Backend name: the URL scheme to write, the extra that installs its driver, the driver."""


def url_advice(url: URL) -> str:
    """What to do about a URL whose dialect or driver cannot be loaded ("" if we know none):
    the extra to install and the URL form the store is tested with."""
    backend = url.get_backend_name()
    if backend not in _DRIVERS:
        return ""
    scheme, extra, driver = _DRIVERS[backend]
    form = safe_url(url.set(drivername=scheme))
    install = f"pip install 'cronoq-store[{extra}]'"
    if backend == "postgres":
        return (
            f"SQLAlchemy does not know postgres:// (it names the dialect postgresql): "
            f"write {form} ({install})"
        )
    try:
        named = url.get_driver_name()
    except sa_exc.SQLAlchemyError:
        return ""
    if named == driver:
        return f"its driver {driver} is not installed: {install}"
    return (
        f"{url.drivername}:// means the {named} driver, which cronoq-store "
        f"does not install: write {form} ({install})"
    )
