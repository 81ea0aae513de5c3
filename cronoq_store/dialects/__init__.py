"""Every difference between SQLite, PostgreSQL and MariaDB/MySQL that the store must know.

Everything else is dialect-neutral Core. Keep this package small: when a difference can be
expressed portably, it does not belong here. Each database is one class (`base.DefaultImpl`
and its subclasses in `sqlite`, `postgresql`, `mysql`), chosen once per engine
(`dialect_of`): what a database does differently is a method override there. The other
rooms: `statements` (what each dialect writes its own way), `sessions` (what each session
is told), `sockets` (shutting a session's socket down), `pgarrays` (arrays in PostgreSQL's
binary format, built for sync psycopg), `locks` (the migration lock), `urls`
(parsing, checks, advice, redaction) and `translation` (errors in the store's terms).
Callers use the names here, as `dialects.X`.
"""

from __future__ import annotations

__all__ = [
    "DefaultImpl",
    "class_of",
    "configure_sqlite",
    "dialect_of",
    "redact",
    "translate",
]

from .base import Bounds as Bounds
from .base import DefaultImpl as DefaultImpl
from .base import class_of as class_of
from .base import dialect_of as dialect_of
from .base import force_index as force_index
from .cursor import LINE as LINE
from .cursor import STORE_BEGIN as STORE_BEGIN
from .cursor import Line as Line
from .cursor import line_of as line_of
from .locks import MIGRATION_LOCK_KEY as MIGRATION_LOCK_KEY
from .locks import MIGRATION_LOCK_NAME as MIGRATION_LOCK_NAME
from .locks import MIGRATION_LOCK_TIMEOUT_S as MIGRATION_LOCK_TIMEOUT_S
from .locks import migration_lock as migration_lock
from .mysql import FAILED_ERRNO as FAILED_ERRNO
from .mysql import FailsIfAny as FailsIfAny
from .mysql import FailsUnlessOne as FailsUnlessOne
from .mysql import MySQLImpl as MySQLImpl
from .mysql import OnlyIfCounted as OnlyIfCounted
from .postgresql import PostgresqlImpl as PostgresqlImpl
from .sessions import COMMITTED as COMMITTED
from .sessions import IDLE_INFO as IDLE_INFO
from .sessions import READ_ONLY as READ_ONLY
from .sessions import bound as bound
from .sessions import bound_idle as bound_idle
from .sessions import committed as committed
from .sessions import configure_sqlite as configure_sqlite
from .sessions import idle_bound_supported as idle_bound_supported
from .sessions import interrupter as interrupter
from .sessions import interrupter_of as interrupter_of
from .sessions import net_options as net_options
from .sessions import pool_options as pool_options
from .sessions import reset_after_commit as reset_after_commit
from .sessions import tune_sockets as tune_sockets
from .sqlite import SQLiteImpl as SQLiteImpl
from .statements import Vacuum as Vacuum
from .statements import create_database as create_database
from .statements import database_exists as database_exists
from .statements import database_size_stmt as database_size_stmt
from .statements import db_now_ns as db_now_ns
from .statements import delete_joins as delete_joins
from .statements import durability_settings as durability_settings
from .statements import host_now_ns as host_now_ns
from .statements import insert_ignoring as insert_ignoring
from .statements import mysql_collation as mysql_collation
from .statements import name as name
from .statements import read_only_sql as read_only_sql
from .statements import says_lastrowid as says_lastrowid
from .statements import server_role_stmt as server_role_stmt
from .statements import unindexed as unindexed
from .statements import vacuums as vacuums
from .translation import DISK_FULL as DISK_FULL
from .translation import describe as describe
from .translation import disk_full as disk_full
from .translation import hide_parameters as hide_parameters
from .translation import missing_table as missing_table
from .translation import read_only as read_only
from .translation import translate as translate
from .urls import PREPARE_THRESHOLD as PREPARE_THRESHOLD
from .urls import SECRET_QUERY_KEYS as SECRET_QUERY_KEYS
from .urls import URL_FORMS as URL_FORMS
from .urls import check_url as check_url
from .urls import connect_options as connect_options
from .urls import parse_url as parse_url
from .urls import redact as redact
from .urls import require_database as require_database
from .urls import safe_url as safe_url
from .urls import url_advice as url_advice
