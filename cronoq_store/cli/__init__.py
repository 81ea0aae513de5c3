"""The `cronoq-store` command: migrations, a look inside a database, and its upkeep.

The group and its options live here; each command group in a module of its own:
`migrations` (upgrade, downgrade, current, history), `status` (status, tasks, show, over the
read-only `cronoq_store.inspection`), `upkeep` (prune, lease release), `inbox` (enqueue,
inbox), `demo`; `bench` and `web` come from optional modules (`LAZY_COMMANDS`). Every command
opens the database through `target.open_database`. Scripts use `--json`; people get rich
tables.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any, Final

import click

from ..errors import StoreError
from .demo import demo_cmd
from .migrations import check, current, downgrade, history, known_revisions, upgrade
from .output import duration_option, parse_duration, schema_option, visible_streams
from .status import show, status, tasks_cmd
from .target import Target, failure, one_line, open_database, shown, shown_target
from .upkeep import lease_group, prune

__all__ = [
    "Target",
    "duration_option",
    "known_revisions",
    "main",
    "one_line",
    "open_database",
    "parse_duration",
    "shown",
]

DEFAULT_URL: Final = "cronoq.db"
"""Without --url or CRONOQ_DATABASE_URL: the embedded SQLite file in the current directory."""
LAZY_COMMANDS: Final = {
    "bench": "cronoq_store.bench:bench",
    "enqueue": "cronoq_store.cli.inbox:enqueue_cmd",
    "inbox": "cronoq_store.cli.inbox:inbox_cmd",
    "web": "cronoq_store.web:web_cmd",
}
"""Subcommands from optional modules, imported only when run (so `--help` stays fast)."""


def _load_lazy(target: str) -> click.Command | None:
    """The click command at "module:attribute", or None when the module is not installed.

    A module that is there but cannot be imported (an optional dependency missing) is a
    one-line error when its command is run, never a traceback.
    """
    module_name, attribute = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name == module_name:
            return None
        raise click.ClickException(f"{module_name} cannot be loaded: {exc}") from exc
    command = getattr(module, attribute, None)
    return command if isinstance(command, click.Command) else None


class CronoqGroup(click.Group):
    """A group that also offers `LAZY_COMMANDS` whose modules are present."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        names = set(super().list_commands(ctx))
        for name, target in LAZY_COMMANDS.items():
            if importlib.util.find_spec(target.split(":")[0]) is not None:
                names.add(name)
        return sorted(names)

    def main(self, *args: Any, **kwargs: Any) -> Any:
        """Run the command line with control characters shown, not sent, in everything it
        prints, error messages included (`output.visible_streams`)."""
        with visible_streams():
            return super().main(*args, **kwargs)

    def invoke(self, ctx: click.Context) -> Any:
        """Run the command; whatever escapes it becomes one line on stderr and status 1.

        Store errors are made one line where they happen (`_errors`); this catches the rest (a
        bug, a value no check foresaw), so no input ever prints a traceback. A closed pipe
        (`cronoq-store tasks | head`) is left to click, which exits quietly.
        """
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except BrokenPipeError:
            raise
        except StoreError as exc:
            raise failure(shown_target(ctx), exc) from exc
        except Exception as exc:
            if os.environ.get("CRONOQ_TRACEBACK"):
                raise
            raise click.ClickException(
                one_line(
                    f"internal error ({type(exc).__name__}: {exc}); "
                    "set CRONOQ_TRACEBACK=1 to see where"
                )
            ) from exc

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is None and cmd_name in LAZY_COMMANDS:
            command = _load_lazy(LAZY_COMMANDS[cmd_name])
        return command


@click.group(cls=CronoqGroup)
@click.version_option(package_name="cronoq-store", prog_name="cronoq-store")
@click.option(
    "--url",
    envvar="CRONOQ_DATABASE_URL",
    default=DEFAULT_URL,
    show_default=True,
    help="Database URL, or a SQLite file path (env CRONOQ_DATABASE_URL).",
)
@click.option(
    "--schema",
    envvar="CRONOQ_SCHEMA",
    default=None,
    callback=schema_option,
    help="PostgreSQL schema (or MySQL database) holding the tables (env CRONOQ_SCHEMA).",
)
@click.pass_context
def main(ctx: click.Context, url: str, schema: str | None) -> None:
    """cronoq-store: the durable state of the cronoq scheduler."""
    ctx.obj = Target(url=url, schema=schema or None)


for command in (
    upgrade,
    downgrade,
    current,
    history,
    check,
    status,
    tasks_cmd,
    show,
    prune,
    demo_cmd,
):
    main.add_command(command)
main.add_command(lease_group)
