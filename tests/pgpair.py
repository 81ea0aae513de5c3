"""A PostgreSQL 15 primary and a streaming hot standby of our own, for replica and failover tests.

`PgPair` builds the pair with Debian's postgresql-common tools (`pg_createcluster`, `pg_ctl`,
`pg_basebackup -R`, `pg_dropcluster`) as two clusters beside the shared `main` one, which it
never touches: `{prefix}primary` and `{prefix}replica` (prefix `cq`, or `CRONOQ_PGPAIR_NAME`)
on 127.0.0.1 ports 5433 and 5434 (or `CRONOQ_PGPAIR_PORTS=P1,P2`). Trust authentication on
127.0.0.1 only, small buffers, `wal_level=replica`, `hot_standby=on`. Synchronous mode sets the
primary's `synchronous_standby_names='*'` with `synchronous_commit=on`; asynchronous mode
leaves it empty. The replica's own configuration never waits for a standby, so it takes writes
at once after a promotion.

A pair is cheap to rebuild (a tiny cluster's `pg_basebackup` takes a second or two; the whole
pair about six): `fresh(sync=...)` rebuilds it after a crash, a promotion or a stopped replica
and keeps it otherwise. The `pg_pair` fixture (tests/conftest.py) hands one out per session and
drops it at the end; `scripts/pg-pair clean` drops leftovers. Building needs root (or the
postgres user) and the PostgreSQL 15 server packages (`scripts/pg-pair setup` installs them).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

import psycopg

VERSION: Final = "15"
CONF_NAME: Final = "cronoq-pair.conf"
BOUND: Final = 30.0
"""Upper bound, seconds, for anything that takes a second or two (start, catch-up, promote)."""


class PgPairError(Exception):
    """The pair could not be built or did not reach the state asked for (with the logs' tail)."""


def _ports() -> tuple[int, int]:
    raw = os.environ.get("CRONOQ_PGPAIR_PORTS", "5433,5434")
    first, second = (int(p) for p in raw.split(","))
    return first, second


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _config(port: int, *, standby_names: str) -> str:
    return (
        "# cronoq-store's primary/replica test pair (tests/pgpair.py)\n"
        "listen_addresses = '127.0.0.1'\n"
        f"port = {port}\n"
        "shared_buffers = 16MB\n"
        "max_connections = 60\n"
        "ssl = off\n"
        "wal_level = replica\n"
        "max_wal_senders = 4\n"
        "wal_keep_size = 128MB\n"  # a stopped async replica catches up without a slot
        "hot_standby = on\n"
        f"synchronous_standby_names = '{standby_names}'\n"
        "synchronous_commit = on\n"
        "log_min_messages = warning\n"
    )


_HBA: Final = (
    "# cronoq-store's primary/replica test pair: trust on 127.0.0.1 only\n"
    "local   all          postgres                 peer\n"
    "host    all          all        127.0.0.1/32  trust\n"
    "host    replication  all        127.0.0.1/32  trust\n"
)


class PgPair:
    """A primary and a streaming replica of our own, built and broken on demand."""

    def __init__(self, prefix: str | None = None, ports: tuple[int, int] | None = None) -> None:
        self.prefix = prefix or os.environ.get("CRONOQ_PGPAIR_NAME", "cq")
        self.primary_name = f"{self.prefix}primary"
        self.replica_name = f"{self.prefix}replica"
        self.primary_port, self.replica_port = ports or _ports()
        self.sync: bool | None = None
        """The mode of the pair standing now; None when none stands."""
        self.intact = False
        """Whether the pair stands as built: no crash, stop or promotion since."""
        self.promoted_at: float | None = None
        """Wall-clock time the last promotion ended (the replica left recovery)."""

    # What the machine offers.

    @staticmethod
    def unavailable() -> str | None:
        """Why no pair can be built here (None: it can)."""
        for tool in ("pg_createcluster", "pg_ctlcluster", "pg_dropcluster", "pg_basebackup"):
            if shutil.which(tool) is None:
                return f"{tool} not found: run scripts/pg-pair setup (as root)"
        if not Path(f"/usr/lib/postgresql/{VERSION}/bin/postgres").exists():
            return f"the PostgreSQL {VERSION} server is not installed: run scripts/pg-pair setup"
        if os.geteuid() != 0 and _whoami() != "postgres":
            return "building clusters needs root or the postgres user"
        return None

    # URLs.

    def url(self, which: str, database: str = "postgres") -> str:
        """`which` = "primary", "replica" or "multi" (both hosts, read-write wanted)."""
        if which == "primary":
            return f"postgresql+psycopg://postgres@127.0.0.1:{self.primary_port}/{database}"
        if which == "replica":
            return f"postgresql+psycopg://postgres@127.0.0.1:{self.replica_port}/{database}"
        if which == "multi":
            return (
                f"postgresql+psycopg://postgres@/{database}"
                f"?host=127.0.0.1:{self.primary_port}&host=127.0.0.1:{self.replica_port}"
                "&target_session_attrs=read-write"
            )
        raise ValueError(f"which must be primary, replica or multi, not {which!r}")

    def primary_url(self, database: str = "postgres") -> str:
        return self.url("primary", database)

    def replica_url(self, database: str = "postgres") -> str:
        return self.url("replica", database)

    def multi_url(self, database: str = "postgres") -> str:
        return self.url("multi", database)

    # Building and tearing down.

    def fresh(self, *, sync: bool = True) -> PgPair:
        """The pair intact in the mode asked for: kept if it is, rebuilt otherwise."""
        if not (self.intact and self.sync == sync and self._running()):
            self.build(sync=sync)
        return self

    def build(self, *, sync: bool = True) -> None:
        """Drop whatever pair of ours stands and build a new one (replica streaming, and
        counted synchronous by the primary in sync mode)."""
        self.destroy()
        for port in (self.primary_port, self.replica_port):
            if _port_open(port):
                raise PgPairError(f"port {port} is taken by a server that is not ours")
            _remove_stale_socket_lock(port)
        self.sync = sync
        primary = self.primary_name
        replica = self.replica_name
        self._create(primary, self.primary_port, standby_names="*" if sync else "")
        self._ctl(primary, "start")
        self._create(replica, self.replica_port, standby_names="")
        data = self._data(replica)
        # The replica's data directory is the primary's, copied by the replication protocol;
        # -R writes standby.signal and primary_conninfo. Its configuration stays in /etc.
        self._as_postgres(["find", str(data), "-mindepth", "1", "-delete"])
        self._as_postgres(
            [
                "pg_basebackup",
                "-h", "127.0.0.1",
                "-p", str(self.primary_port),
                "-U", "postgres",
                "-D", str(data),
                "-R", "-X", "stream", "-c", "fast", "--no-sync",
            ]
        )  # fmt: skip
        self._ctl(replica, "start")
        self._wait(
            "the replica streams" + (" synchronously" if sync else ""),
            self._streaming,
        )
        self.intact = True

    def destroy(self) -> None:
        """Drop both clusters of ours (stopped first; a killed one's leftovers too)."""
        for name in (self.primary_name, self.replica_name):
            etc = Path(f"/etc/postgresql/{VERSION}/{name}")
            if not (etc.exists() or self._data(name).exists()):
                continue
            _run(["pg_ctlcluster", "--skip-systemctl-redirect", VERSION, name, "stop", "-m",
                  "immediate"], check=False)  # fmt: skip
            _run(["pg_dropcluster", "--stop", VERSION, name], check=False)
            shutil.rmtree(f"/etc/postgresql/{VERSION}/{name}", ignore_errors=True)
            shutil.rmtree(self._data(name), ignore_errors=True)
        self.sync = None
        self.intact = False

    # Breaking it.

    def crash_primary(self, *, kill: bool = False) -> None:
        """Crash the primary: `stop -m immediate` (no shutdown checkpoint, clients cut), or
        with `kill` a SIGKILL of the postmaster (its backends exit when they notice)."""
        self.intact = False
        if kill:
            pid = self.postmaster_pid(self.primary_name)
            os.kill(pid, signal.SIGKILL)
            closed = lambda: not _port_open(self.primary_port)  # noqa: E731
            self._wait("the killed primary's port closes", closed)
        else:
            self._ctl(self.primary_name, "stop", "-m", "immediate")

    def stop_replica(self) -> None:
        """Stop the replica (fast shutdown): an async primary goes on alone, a sync one waits."""
        self.intact = False
        self._ctl(self.replica_name, "stop", "-m", "fast")

    def start_replica(self) -> None:
        """Start the replica again (if it is down); it catches up from the primary's kept WAL."""
        if not _port_open(self.replica_port):
            self._ctl(self.replica_name, "start")

    def promote(self) -> float:
        """Promote the replica and wait until it takes writes; seconds that took."""
        self.intact = False
        started = time.monotonic()
        # The end of recovery is watched from a session already open on the replica, every
        # 2 ms: `promoted_at` is when it took writes, within a few ms (pg_ctl promote -w
        # polls every 100 ms).
        with self._connect(self.replica_port) as conn:
            self._ctl(self.replica_name, "promote", "-W")
            deadline = time.monotonic() + BOUND
            while True:
                row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
                if row is not None and row[0] is False:
                    self.promoted_at = time.time()
                    break
                if time.monotonic() > deadline:
                    raise PgPairError(f"the replica did not leave recovery\n{self.log_tail()}")
                time.sleep(0.002)
        self._wait("the promoted replica takes writes", self._replica_writable)
        return time.monotonic() - started

    def set_read_only(self, on: bool = True) -> None:
        """Make the primary refuse writes in every session (`default_transaction_read_only`,
        reloaded), as a primary being demoted does: its open connections stay up and fail
        each write with SQLSTATE 25006 from their next transaction on."""
        self.intact = False
        with self._connect(self.primary_port) as conn:
            value = "on" if on else "off"
            conn.execute(f"ALTER SYSTEM SET default_transaction_read_only = {value}")
            conn.execute("SELECT pg_reload_conf()")

    # Watching it.

    def create_database(self, name: str) -> str:
        """Create database `name` on the primary and wait until the replica has it; its name."""
        with self._connect(self.primary_port) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        self.wait_replayed()
        return name

    def wait_replayed(self, timeout: float = BOUND) -> None:
        """Wait until the replica has replayed the primary's current WAL position."""
        with self._connect(self.primary_port) as conn:
            row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        lsn = row[0]

        def replayed() -> bool:
            with self._connect(self.replica_port) as conn:
                got = conn.execute(
                    "SELECT pg_wal_lsn_diff(pg_last_wal_replay_lsn(), %s::pg_lsn) >= 0", (lsn,)
                ).fetchone()
            return bool(got and got[0])

        self._wait(f"the replica replays up to {lsn}", replayed, timeout)

    def is_in_recovery(self, which: str = "replica") -> bool:
        port = self.replica_port if which == "replica" else self.primary_port
        with self._connect(port) as conn:
            row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
        return bool(row and row[0])

    def postmaster_pid(self, name: str) -> int:
        text = (self._data(name) / "postmaster.pid").read_text()
        return int(text.splitlines()[0])

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of both clusters' logs, for a failure message."""
        parts = []
        for name in (self.primary_name, self.replica_name):
            path = Path(f"/var/log/postgresql/postgresql-{VERSION}-{name}.log")
            with contextlib.suppress(OSError):
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {path}\n" + "\n".join(tail))
        return "\n".join(parts)

    # Mechanics.

    def _data(self, name: str) -> Path:
        return Path(f"/var/lib/postgresql/{VERSION}/{name}")

    def _create(self, name: str, port: int, *, standby_names: str) -> None:
        _run(
            ["pg_createcluster", VERSION, name, "-p", str(port), "--start-conf=manual",
             "--", "--no-sync", "--auth-local=peer", "--auth-host=trust"]
        )  # fmt: skip
        etc = Path(f"/etc/postgresql/{VERSION}/{name}")
        (etc / "conf.d" / CONF_NAME).write_text(_config(port, standby_names=standby_names))
        (etc / "pg_hba.conf").write_text(_HBA)

    def _ctl(self, name: str, action: str, *args: str) -> None:
        """`pg_ctl ACTION` on cluster `name`, waiting for it to finish, as the postgres user.

        pg_ctl itself rather than `pg_ctlcluster`, which runs the same pg_ctl with the cluster's
        Debian configuration but adds two seconds to every start.
        """
        log = f"/var/log/postgresql/postgresql-{VERSION}-{name}.log"
        conf = f"/etc/postgresql/{VERSION}/{name}/postgresql.conf"
        argv = [f"/usr/lib/postgresql/{VERSION}/bin/pg_ctl", action, "-w", "-t", str(int(BOUND))]
        argv += ["-D", str(self._data(name)), *args]
        if action == "start":
            argv += ["-l", log, "-o", f"-c config_file={conf}"]
        try:
            self._as_postgres(argv)
        except PgPairError as exc:
            raise PgPairError(f"{exc}\n{self.log_tail()}") from None

    def _as_postgres(self, argv: list[str]) -> None:
        if os.geteuid() == 0:
            argv = ["runuser", "-u", "postgres", "--", *argv]
        _run(argv)

    def _connect(self, port: int) -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(
            host="127.0.0.1", port=port, user="postgres", dbname="postgres",
            autocommit=True, connect_timeout=3,
        )  # fmt: skip

    def _running(self) -> bool:
        return _port_open(self.primary_port) and _port_open(self.replica_port)

    def _streaming(self) -> bool:
        with self._connect(self.primary_port) as conn:
            rows = conn.execute("SELECT state, sync_state FROM pg_stat_replication").fetchall()
        want = "sync" if self.sync else "async"
        return any(state == "streaming" and mode == want for state, mode in rows)

    def _replica_writable(self) -> bool:
        try:
            with self._connect(self.replica_port) as conn:
                row = conn.execute(
                    "SELECT pg_is_in_recovery(), current_setting('transaction_read_only')"
                ).fetchone()
        except psycopg.OperationalError:
            return False
        return row is not None and row[0] is False and row[1] == "off"

    def _wait(self, what: str, ready: Callable[[], bool], timeout: float = BOUND) -> None:
        deadline = time.monotonic() + timeout
        pause = 0.01
        while True:
            try:
                if ready():
                    return
            except psycopg.OperationalError:
                pass
            if time.monotonic() > deadline:
                raise PgPairError(f"{what}: not within {timeout} s\n{self.log_tail()}")
            time.sleep(pause)
            pause = min(pause * 2, 0.1)


SOCKET_DIR: Final = Path("/var/run/postgresql")


def _alive(pid: int) -> bool:
    """Whether `pid` runs: not gone, and not a zombie (which `kill(pid, 0)` finds alive)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _remove_stale_socket_lock(port: int) -> None:
    """Remove the socket lock file a SIGKILLed postmaster left on `port`, once it is dead.

    PostgreSQL refuses to start while the PID in that file answers `kill(pid, 0)`, which a
    killed postmaster not yet reaped by its parent (init here, after pg_ctl exited) still
    does: a new cluster on the port then failed to start ("lock file ... already exists").
    """
    lock = SOCKET_DIR / f".s.PGSQL.{port}.lock"
    try:
        pid = int(lock.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    if not _alive(pid):
        for stale in (lock, SOCKET_DIR / f".s.PGSQL.{port}"):
            with contextlib.suppress(OSError):
                stale.unlink()


def _whoami() -> str:
    import pwd

    return pwd.getpwuid(os.geteuid()).pw_name


def _run(argv: list[str], *, check: bool = True) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    if check and done.returncode != 0:
        raise PgPairError(
            f"{' '.join(argv)} exited {done.returncode}: {(done.stderr or done.stdout).strip()}"
        )
