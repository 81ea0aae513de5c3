"""`cronoq-store web`: a read-only dashboard over the store (docs/dashboard.md).

This module holds only the command, so `cronoq-store --help` needs none of the `web` extra;
the app (`cronoq_store.web.app`) imports Starlette, Jinja2 and uvicorn when the command runs.
"""

from __future__ import annotations

import ipaddress
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
        where = f"[{host}]" if ":" in host else host
        click.echo(f"cronoq-store web: http://{where}:{port}/ (read-only; Ctrl-C stops it)")
        uvicorn.run(app, host=host, port=port, log_level="warning")
