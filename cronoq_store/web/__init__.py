"""`cronoq-store web`: a read-only dashboard over the store (docs/dashboard.md).

This module holds only the command, so `cronoq-store --help` needs none of the `web` extra;
the app (`cronoq_store.web.app`) imports Starlette, Jinja2 and uvicorn when the command runs.
"""

from __future__ import annotations

import ipaddress
import socket
from datetime import timedelta
from typing import Final

import click

from .. import cli

DEFAULT_HOST: Final = "127.0.0.1"
DEFAULT_PORT: Final = 8426


def is_loopback(host: str) -> bool:
    """Whether `host` only accepts connections from this machine."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to any interface


@click.command("web")
@click.option("--host", default=DEFAULT_HOST, show_default=True, help="Address to listen on.")
@click.option(
    "--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True, help="Port."
)
@click.option(
    "--token",
    envvar="CRONOQ_WEB_TOKEN",
    default=None,
    help="Required on every page (bearer header or login form); needed to bind beyond "
    "loopback (env CRONOQ_WEB_TOKEN).",
)
@click.option(
    "--retention",
    default="1h",
    show_default=True,
    metavar="DURATION",
    callback=cli.duration_option,
    help="Finished tasks older than this count as the prune backlog.",
)
@click.option(
    "--refresh",
    type=click.FloatRange(0.5, 3600),
    default=3.0,
    show_default=True,
    help="Seconds between the overview's refreshes.",
)
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    metavar="NAME",
    help="Also answer requests for this Host name (repeatable); the --host address and "
    "localhost always are, any other name is refused (421: DNS rebinding).",
)
@click.pass_obj
def web_cmd(
    target: cli.Target,
    host: str,
    port: int,
    token: str | None,
    retention: timedelta,
    refresh: float,
    allowed_hosts: tuple[str, ...],
) -> None:
    """Serve a read-only dashboard of the database (overview, tasks, schedules, inbox).

    It never takes the lease and never writes. Binding anything but a loopback address
    needs --token.
    """
    token = token or None
    if token is None and not is_loopback(host):
        raise click.UsageError(
            f"--host {host} accepts connections from other machines: set --token (or "
            "CRONOQ_WEB_TOKEN), which every request must then carry"
        )
    try:
        import uvicorn

        from .app import create_app
    except ModuleNotFoundError as exc:
        raise click.ClickException(
            f"the dashboard needs the web extra ({exc.name} is missing): "
            "pip install 'cronoq-store[web]'"
        ) from exc
    with cli.open_database(target) as store:
        app = create_app(
            store.engine,
            schema=target.schema,
            token=token,
            retention=retention,
            refresh_s=refresh,
            database=cli.shown(target.parsed()),
            bound=host,
            allowed_hosts=allowed_hosts,
        )
        sock = listening_socket(host, port)
        port = sock.getsockname()[1]  # the one the system chose for --port 0
        where = f"[{host}]" if ":" in host else host
        click.echo(f"cronoq-store web: http://{where}:{port}/ (read-only; Ctrl-C stops it)")
        try:
            server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
            server.run(sockets=[sock])
        finally:
            sock.close()


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket listening on `host`:`port`, or one `click` error line (exit status 1).

    Bound here, before the banner, and handed to uvicorn: uvicorn binds only once it runs, so
    a port in use or a host that does not resolve came out after the banner as its own log
    line, with exit status 3.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise click.ClickException(f"cannot listen on --host {host}: {exc}") from exc
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn sets it
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise click.ClickException(
            f"cannot listen on {host} port {port}: {exc.strerror or exc}"
        ) from exc
    sock.set_inheritable(True)
    return sock
